"""Reading compiled HLO text: computations, their callees, and whether each ring step's K/V
transfer is in flight while a kernel runs.

Used by `ringflash bench --mode=scaling` on real devices and by the compile tests (TPU,
deviceless). Only text is read, so the same functions serve every platform.
"""

from __future__ import annotations

import dataclasses
import re

# custom-call targets (and fused-kernel kinds) that run an attention kernel of ours:
# Mosaic TPU, Mosaic GPU (any version suffix) and Pallas Triton.
_KERNEL_MARKS = ('custom_call_target="tpu_custom_call"', 'custom_call_target="mosaic_gpu',
                 'custom_call_target="__gpu$xla.gpu.triton"', '"kind":"__triton')


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
  """({computation name: its instruction lines, in scheduled order}, the ENTRY's name)."""
  comps, name, entry = {}, None, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      name = head.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif line.startswith("}"):
      name = None
    elif name is not None and line.strip():
      comps[name].append(line)
  return comps, entry


def callees(lines) -> list[str]:
  """Names of the computations that these instruction lines call."""
  out = []
  for line in lines:
    for callee in re.findall(r"(?:calls|to_apply|body|condition|branch_computations|"
                             r"async_execution_thread_computations)="
                             r"(\{[^}]*\}|%?[\w.\-]+)", line):
      out += [c.strip().lstrip("%") for c in callee.strip("{}").split(",")]
  return out


def runs_kernel(comps: dict[str, list[str]], line: str, seen: set[str] | None = None) -> bool:
  """Whether an instruction line runs a kernel, directly or through what it calls."""
  if any(mark in line for mark in _KERNEL_MARKS):
    return True
  seen = set() if seen is None else seen
  for callee in callees([line]):
    if callee in seen or callee not in comps:
      continue
    seen.add(callee)
    if any(runs_kernel(comps, inner, seen) for inner in comps[callee]):
      return True
  return False


@dataclasses.dataclass(frozen=True)
class PermuteOverlap:
  """One collective-permute in a ring loop body, and whether its transfer spans a kernel.

  Attributes:
    body: the while body's computation name.
    start: the start instruction's name (the permute's, when synchronous).
    shape: the transferred array's type, e.g. "bf16[1,4096,8,128]".
    encloses_kernel: a kernel runs between the start and its done, in scheduled order.
  """

  body: str
  start: str
  shape: str
  encloses_kernel: bool


def permute_overlap(hlo: str) -> list[PermuteOverlap]:
  """Every collective-permute in a while body that also runs a kernel (the ring loops).

  A start and its done bracket the transfer in the compiled schedule; a kernel between them
  means the transfer runs while the kernel computes. A synchronous collective-permute (no
  start/done pair) spans nothing. Kernels are the custom calls of _KERNEL_MARKS: the xla
  backend's plain fusions are not counted, so its programs report no ring loop bodies.
  """
  comps, _ = computations(hlo)
  bodies = {m for lines in comps.values() for line in lines
            for m in re.findall(r"\bbody=%?([\w.\-]+)", line)}
  found = []
  for name in sorted(bodies & comps.keys()):
    lines = comps[name]
    kernel_at = [i for i, line in enumerate(lines) if runs_kernel(comps, line)]
    if not kernel_at:
      continue
    for i, line in enumerate(lines):
      sync = " collective-permute(" in line
      if not sync and " collective-permute-start(" not in line:
        continue
      start = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) =", line).group(1)
      shape = re.search(r"= \(?([a-z]\w*\[[\d,]*\])", line)
      done = i if sync else next(
          (j for j, other in enumerate(lines)
           if re.search(rf"collective-permute-done\(.*%{re.escape(start)}\)", other)),
          len(lines))
      found.append(PermuteOverlap(name, start, shape.group(1) if shape else "",
                                  any(i < k < done for k in kernel_at)))
  return found


def overlap_summary(found: list[PermuteOverlap]) -> str:
  """One line: how many ring-loop permutes span a kernel, e.g. "6 of 6 in 2 loop bodies"."""
  spanning = sum(p.encloses_kernel for p in found)
  bodies = len({p.body for p in found})
  return f"{spanning} of {len(found)} K/V permutes span a kernel, in {bodies} ring loop bodies"
