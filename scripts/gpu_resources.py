"""Registers, spills and injected waits of the Mosaic GPU kernels, as ptxas reports them.

Compiles a small forward+backward (non-causal and causal, T=1024, H=128, bf16) with
Mosaic GPU's dumps on, then prints one line per kernel: registers, spill bytes, stack
frame, how many times ptxas injected a wait for products in flight ("C7519"), how many
times it serialized the wgmma pipeline ("C7510".."C7515", with the first reason at the end
of the line) and shared memory. Run from the repository root on a Hopper GPU:

  python3 scripts/gpu_resources.py [dump folder]

docs/GPU_NOTES.md (run 12) has what it printed for version 2.1 of the backward.
"""

import os
import pathlib
import re
import sys
import tempfile

_SERIALIZED = "wgmma.mma_async instructions are serialized"


def _serialized(text: str) -> tuple[int, str]:
  """How many ptxas lines say the wgmma pipeline was serialized, and the first one's reason."""
  lines = [line for line in text.splitlines() if _SERIALIZED in line]
  if not lines:
    return 0, ""
  reason = re.search(r"due to (.*) in the function", lines[0])
  reason = reason.group(1) if reason else lines[0].split(_SERIALIZED, 1)[1].strip()
  return len(lines), reason[:60]


def _report(folder: pathlib.Path) -> None:
  for ptxas in sorted(folder.glob("*.ptxas"), key=lambda p: int(p.stem.split("_")[-1])):
    text = ptxas.read_text()
    ptx = ptxas.with_suffix(".ptx")
    kind = ("backward" if ptx.exists() and "cp.reduce.async.bulk" in ptx.read_text()
            else "forward")
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    res = ptxas.with_suffix(".resources.txt")
    smem = re.search(r"smem_scratch_bytes=(\d+)", res.read_text()) if res.exists() else None
    serialized, reason = _serialized(text)
    print(f"{ptxas.stem:<10} {kind:<9} registers {regs.group(1) if regs else '?':>4}  "
          f"spill stores {spill.group(1) if spill else '?':>4} B  "
          f"loads {spill.group(2) if spill else '?':>4} B  "
          f"stack {stack.group(1) if stack else '?':>4} B  "
          f"injected waits {text.count('C7519'):>2}  "
          f"serialized {serialized:>2}  "
          f"smem {int(smem.group(1)) // 1024 if smem else '?'} KiB"
          + (f"  ({reason})" if serialized else ""))


def main(argv):
  folder = pathlib.Path(argv[1] if len(argv) > 1 else tempfile.mkdtemp(prefix="mosaic_dump_"))
  folder.mkdir(parents=True, exist_ok=True)
  # Read when a kernel is compiled: set before the first one.
  os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1",
                    MOSAIC_GPU_DUMP_TO=str(folder))
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top

  from ringflash.cli.bench import harness  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, (1, 1024, 4, 128), jnp.bfloat16) for key in keys)
  for causal in (False, True):
    fwd_bwd = harness.attention_fns("ringflash", causal, mesh)[1]
    jax.block_until_ready(fwd_bwd(q, k, v, do))
  print(f"dumps in {folder}")
  _report(folder)


if __name__ == "__main__":
  main(sys.argv)
