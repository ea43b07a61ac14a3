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


def loop_bodies(comps: dict[str, list[str]]) -> set[str]:
  """Names of the computations that are while-loop bodies."""
  return {m for lines in comps.values() for line in lines
          for m in re.findall(r"\bbody=%?([\w.\-]+)", line)}


def instruction_name(line: str) -> str | None:
  """The instruction's name: collective-permute-start.1 in
  `  %collective-permute-start.1 = (...) collective-permute-start(...)`."""
  found = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) =", line)
  return found.group(1) if found else None


def is_permute(line: str) -> bool:
  """A collective-permute, synchronous or the start of an asynchronous one."""
  return " collective-permute(" in line or " collective-permute-start(" in line


def transferred_shape(line: str) -> str:
  """The type a permute moves, e.g. "bf16[1,4096,8,128]": the first array type after " = ",
  which reads "bf16[...]{...}", "(bf16[...]{...}, ...)" or, on GPU, "((bf16[...]{...}), ...)"."""
  found = re.search(r"= \(*([a-z]\w*\[[\d,]*\])", line)
  return found.group(1) if found else ""


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
  """One collective-permute of a ring step, and whether its transfer spans a kernel.

  Attributes:
    body: the computation it is in (a while body, or the one a short loop was unrolled into).
    start: the start instruction's name (the permute's, when synchronous).
    shape: the transferred array's type, e.g. "bf16[1,4096,8,128]".
    encloses_kernel: a kernel runs between the start and its done, in scheduled order.
  """

  body: str
  start: str
  shape: str
  encloses_kernel: bool


def permute_overlap(hlo: str) -> list[PermuteOverlap]:
  """Every collective-permute in a computation that also runs a kernel (the ring's steps).

  The ring's steps are a while loop's body, or, where XLA unrolled a short loop (GPU, P=2),
  the enclosing computation itself. A start and its done bracket the transfer in the
  compiled schedule; a kernel between them (or a loop or call that runs one) means the
  transfer runs while the kernel computes. A synchronous collective-permute (no start/done
  pair) spans nothing. Kernels are the custom calls of _KERNEL_MARKS: the xla backend's plain
  fusions are not counted, so its programs report nothing.
  """
  comps, _ = computations(hlo)
  found = []
  for name in sorted(comps):
    lines = comps[name]
    permutes = [i for i, line in enumerate(lines) if is_permute(line)]
    if not permutes:
      continue
    kernel_at = [i for i, line in enumerate(lines) if runs_kernel(comps, line)]
    if not kernel_at:
      continue
    for i in permutes:
      line = lines[i]
      start = instruction_name(line)
      done = i if " collective-permute(" in line else next(
          (j for j, other in enumerate(lines)
           if re.search(rf"collective-permute-done\(.*%{re.escape(start)}\)", other)),
          len(lines))
      found.append(PermuteOverlap(name, start, transferred_shape(line),
                                  any(i < k < done for k in kernel_at)))
  return found


def overlap_summary(found: list[PermuteOverlap]) -> str:
  """One line, per transferred type: how many of its permutes span a kernel, e.g.
  "permutes spanning a kernel: bf16[1,16384,16,128] 4 of 4, s32[16384] 0 of 2"."""
  if not found:
    return "permutes spanning a kernel: none found"
  shapes = sorted({p.shape for p in found})
  parts = [f"{shape or '?'} {sum(p.encloses_kernel for p in found if p.shape == shape)} of "
           f"{sum(p.shape == shape for p in found)}" for shape in shapes]
  return "permutes spanning a kernel: " + ", ".join(parts)
