#!/usr/bin/env bash
# Several versions of the Pallas GPU kernels measured in one device call, on the card.
#
# The card gets a copy of the working tree, not of git, so the versions travel as files in
# an untracked folder (default try/): fwd_NAME.py replaces kernels/pallas_gpu.py and
# bwd_NAME.py kernels/pallas_gpu_mosaic_bwd.py; NAME "main" is the working tree's own file.
#   git show next/fwd-overlap:kernels/pallas_gpu.py > try/fwd_ovl.py
# Each argument is WHAT/FWD:BWD, WHAT a set of letters: s screen (scripts/gpu_screen.py;
# a failing screen skips the rest for that pair), b bench (the six rows of the kernels
# table), r ptxas resources (scripts/gpu_resources.py). Example, from the repository root:
#   bash scripts/gpu_variants.sh sbr/ovl:main b/main:main
# Results go under $OUT (the device call's output folder), one file per step. The
# working tree's kernel files are put back at the end.
set -u
dir=${VARIANTS_DIR:-try}
out=${OUT:-variants_out}
mkdir -p "$out"
pip install -q --no-deps --no-build-isolation -e . > "$out/pip.txt" 2>&1
export JAX_PLATFORMS=cuda PYTHONPATH=$PWD
orig=$(mktemp -d)
cp kernels/pallas_gpu.py "$orig/fwd_main.py"
cp kernels/pallas_gpu_mosaic_bwd.py "$orig/bwd_main.py"
pick() { if [ "$2" = main ]; then echo "$orig/$1_main.py"; else echo "$dir/$1_$2.py"; fi; }
start=$(date +%s)
for arg in "$@"; do
  what=${arg%%/*}; pair=${arg#*/}; f=${pair%:*}; b=${pair#*:}; tag=${f}_${b}
  cp "$(pick fwd "$f")" kernels/pallas_gpu.py
  cp "$(pick bwd "$b")" kernels/pallas_gpu_mosaic_bwd.py
  echo "== $what $f:$b at $(( $(date +%s) - start )) s"
  if [[ $what == *s* ]]; then
    setsid timeout -s KILL 120 python3 scripts/gpu_screen.py > "$out/screen_$tag.txt" 2>&1
    rc=$?
    grep "^T=\|SCREEN\|Error" "$out/screen_$tag.txt" | tail -6
    [ $rc = 0 ] || continue
  fi
  if [[ $what == *b* ]]; then
    setsid timeout -s KILL 200 python3 -m ringflash.cli bench --seq_lens=16384,65536 \
      --gqa_seq_lens=16384 --impls=ringflash,cudnn --warmup=2 --iters=10 \
      --out="$out/bench_$tag" > "$out/bench_$tag.txt" 2>&1
    grep "^T=" "$out/bench_$tag.txt"
  fi
  if [[ $what == *r* ]]; then
    setsid timeout -s KILL 90 python3 scripts/gpu_resources.py > "$out/resources_$tag.txt" 2>&1
    grep "registers" "$out/resources_$tag.txt"
  fi
done
cp "$orig/fwd_main.py" kernels/pallas_gpu.py
cp "$orig/bwd_main.py" kernels/pallas_gpu_mosaic_bwd.py
echo "== done at $(( $(date +%s) - start )) s"
