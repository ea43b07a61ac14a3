"""XLA compiler options that ringflash's programs want, per platform (public).

GPU_XLA_OPTIONS: XLA's GPU scheduler keeps at most
`xla_gpu_experimental_parallel_collective_overlap_limit` collectives in flight at once
(default 1). A backward ring step has two: the next K/V block goes on while the last step's
dK/dV accumulator travels (from P = 3 on). Pass these options to
`jax.jit(f).lower(...).compile(compiler_options=GPU_XLA_OPTIONS)`, or put them in XLA_FLAGS
(`xla_flags(GPU_XLA_OPTIONS)`); `ringflash launch local --platform=gpu` does the latter.
"""

from __future__ import annotations

GPU_XLA_OPTIONS = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}


def xla_flags(options: dict, existing: str = "") -> str:
  """`existing` XLA_FLAGS with `--name=value` appended for each option it does not set."""
  parts = existing.split()
  for name, value in options.items():
    if not any(p.lstrip("-").split("=")[0] == name for p in parts):
      parts.append(f"--{name}={value}")
  return " ".join(parts)
