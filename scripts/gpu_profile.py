"""One forward+backward of ringflash's kernels and of cuDNN, between cudaProfilerStart/Stop,
for Nsight Compute on one GPU (B=1, N=K=16, H=128, bf16). Run from the repository root:

  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --profile-from-start off \\
      -k "regex:cudnn|mosaic" --launch-count 8 \\
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
      python3 scripts/gpu_profile.py [T] [causal]

The kernel filter keeps the attention kernels (ours are named entry_mosaic_gpu_kernel);
a run without it failed on one of XLA's small kernels.

Without XLA_PYTHON_CLIENT_PREALLOCATE=false, ncu saves and restores the memory JAX
preallocates (about 100 GB on an H200) around every kernel replay and does not finish.
docs/GPU_NOTES.md (run 11) has what it printed on the H200. For where each instruction
stalls, collect --section SourceCounters instead and read the result with
scripts/gpu_stalls.py (its docstring has the commands; run 17 of the notes, what it showed).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ringflash.cli.bench import harness


def _profiler():
  try:
    import cupy  # pylint: disable=g-import-not-at-top
    return cupy.cuda.runtime.profilerStart, cupy.cuda.runtime.profilerStop
  except ImportError:
    from cuda.bindings import runtime  # pylint: disable=g-import-not-at-top
    return runtime.cudaProfilerStart, runtime.cudaProfilerStop


def main(argv):
  t = int(argv[1]) if len(argv) > 1 else 16384
  causal = len(argv) > 2 and argv[2] == "causal"
  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, (1, t, 16, 128), jnp.bfloat16) for key in keys)
  fns = [harness.attention_fns(impl, causal, mesh)[1] for impl in ("ringflash", "cudnn")]
  for f in fns:                                     # compile and warm up outside the range
    for _ in range(2):
      jax.block_until_ready(f(q, k, v, do))
  start, stop = _profiler()
  start()
  for f in fns:
    jax.block_until_ready(f(q, k, v, do))
  stop()


if __name__ == "__main__":
  main(sys.argv)
