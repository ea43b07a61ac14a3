"""What the TPU compiler says about memory, for `ringflash plan`: its out-of-memory errors
(which memory, needed and available bytes) and, from its buffer-assignment dump, what the
temporaries are at their peak against the step's unavoidable arrays."""

from __future__ import annotations

import dataclasses
import math
import os
import re


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
  """What the TPU compiler said when a program did not fit one of the chip's memories.

  Attributes:
    memory: "HBM", "VMEM" or "SMEM".
    needed: bytes the program needs (None when the message did not say).
    available: bytes the memory has (None when the message did not say).
  """

  memory: str
  needed: int | None
  available: int | None

  def __str__(self) -> str:
    if self.needed is None or self.available is None:
      return f"{self.memory} needs more than it has"
    return f"{self.memory} needs {_size(self.needed)} of {_size(self.available)} available"


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)i?B?"
_MEMORIES = ("hbm", "vmem", "smem")
# The compiler's wording, one pattern per form of its message: (memory, needed, available).
_OOM_FORMS = (
    # "Ran out of memory in memory space smem. Used 1.13M of 1.00M smem." (also vmem, hbm)
    re.compile(rf"Ran out of memory in memory space (\w+)\. Used {_SIZE} of {_SIZE}"),
    # "Ran out of memory on HBM, the total memory required for HLO temporaries (124.91G)
    # exceeds available HBM (95.73G)."
    re.compile(rf"Ran out of memory on (\w+)\b.*?\({_SIZE}\) exceeds available \w+ "
               rf"\({_SIZE}\)", re.S),
)
_OOM_NAME = re.compile(r"Ran out of memory (?:in memory space|on) (\w+)")


def parse_out_of_memory(message: str) -> OutOfMemory | None:
  """The memory and sizes of the TPU compiler's out-of-memory error; None if `message` is
  not one. Sizes are XLA's (K = 1024 bytes): "Used 1.13M of 1.00M smem" -> SMEM, 1184891,
  1048576 bytes."""
  for form in _OOM_FORMS:
    match = form.search(message)
    if match and match[1].lower() in _MEMORIES:
      need = float(match[2]) * _UNITS[match[3]]
      have = float(match[4]) * _UNITS[match[5]]
      return OutOfMemory(match[1].upper(), round(need), round(have))
  match = _OOM_NAME.search(message)
  if match and match[1].lower() in _MEMORIES:
    return OutOfMemory(match[1].upper(), None, None)
  return None


def _size(n: float) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


# ---------------------------------------------------------------------------------------------
# What the temporaries are: the buffers live at their peak.

_HLO_TYPES = {"bfloat16": ("bf16", 2), "float16": ("f16", 2), "float32": ("f32", 4)}


@dataclasses.dataclass(frozen=True)
class Shapes:
  """Per-device sizes of the step's arrays, to name buffers and count the unavoidable ones:
  batch B, tokens T per chip (S = T), heads N, kv_heads K, head_dim H, the input dtype's
  name, train (forward + backward) or forward only."""

  batch: int
  tokens: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str
  train: bool

  def unavoidable(self) -> int:
    """Bytes of the step's unavoidable arrays on one device: q, k, v, out, lse, and in
    training dout, dq, dk, dv (input dtype) and the fp32 accumulators of dq, dk and dv; in the
    forward the fp32 accumulator of out. With float32 inputs the accumulators are out and
    the gradients themselves, counted once."""
    b, t, n, k, h = self.batch, self.tokens, self.heads, self.kv_heads, self.head_dim
    isz = _HLO_TYPES[self.dtype][1]
    qo, kv, lse = b * t * n * h, 2 * b * t * k * h, 4 * b * n * t
    acc = 0 if isz == 4 else 4                                 # bytes of a separate fp32 copy
    inputs = (2 * qo + kv) * isz + lse                         # q, k, v, out, lse
    if not self.train:
      return inputs + acc * qo                                 # + fp32 accumulator of out
    return inputs + (2 * qo + kv) * isz + acc * (qo + kv)      # + dout, grads, fp32 acc

  def role(self, dtype: str, elements: int) -> str:
    """What a buffer of this dtype and size holds, by its size; every role of that size,
    when several have it (with N = K, dq is as large as dk)."""
    b, t, n, k, h = self.batch, self.tokens, self.heads, self.kv_heads, self.head_dim
    own = _HLO_TYPES[self.dtype][0]
    train = self.train
    roles = (   # (elements, as fp32 (None: none in a forward), in the input dtype)
        (b * t * n * h, ("o or dq" if train else "o") + ", fp32: accumulator, or one hop's "
         "kernel output", "q, out, dout (or their copies)" if train else "q, out"),
        (2 * b * t * k * h, "dK/dV, fp32: accumulator, in flight" if train else None,
         "K/V: held, in flight"),
        (b * t * k * h, "dk or dv, fp32" if train else None, "k or v"),
        (b * n * t, f"row statistics ({'lse, D' if train else 'lse'}), fp32",
         "row statistics" if own != "f32" else None),
    )
    found = []
    if dtype == own:        # float32 inputs: either role
      found += [f"{other} ({dtype})" for size, _, other in roles if size == elements and other]
    if dtype == "f32":
      found += [fp32 for size, fp32, _ in roles if size == elements and fp32]
    return "; or ".join(found) if found else "other"


@dataclasses.dataclass(frozen=True)
class Buffer:
  """A temporary: its HLO value (ringflash_bwd_dq.11, collective-permute-start.2{1}), type
  (f32[1,131072,32,128]) and bytes as allocated (tiles padded)."""

  name: str
  type: str
  size: int


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """The temporaries at their peak: bytes of their allocation (buffers of different lifetimes
  packed into it, at least the peak), bytes live at the peak of the schedule, those buffers
  (largest first), and (role, bytes, count, names) of them grouped by what they hold."""

  allocated: int
  peak: int
  live: tuple[Buffer, ...]
  groups: tuple[tuple[str, int, int, tuple[str, ...]], ...]


_VALUE = re.compile(r"\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): "
                    r"(\w+)(\[[\d,]*\])")
_RANGE = re.compile(r"\s*(\S+):(\d+)-(\d+)\s*$")


def read_breakdown(dump_dir: str, shapes: Shapes) -> Breakdown | None:
  """The buffers live at the peak of the temporaries, from the compiler's dump (its
  after-optimizations buffer assignment and live ranges); None if the dump is not there or
  not in the form this reads.

  The temporaries are the largest "preallocated-temp" allocation of the default memory; its
  values, each live over an interval of the flattened schedule, are summed at every point,
  and those live where the sum is largest are the peak's.
  """
  names = os.listdir(dump_dir)
  assignment = [n for n in names if n.endswith("after_optimizations-buffer-assignment.txt")]
  ranges_file = [n for n in names if n.endswith("after_optimizations-live-range.txt")]
  if len(assignment) != 1 or len(ranges_file) != 1:
    return None
  allocs, current = {}, None
  with open(os.path.join(dump_dir, assignment[0])) as f:
    for line in f:
      head = re.match(r"allocation (\d+): size (\d+), (.*)", line)
      if head:
        current = int(head[1])
        temp = "preallocated-temp" in head[3] and "color" not in head[3]
        allocs[current] = (int(head[2]), temp, [])
        continue
      value = _VALUE.match(line)
      if value and current is not None:
        name = value[1] if "{" in value[1] else value[1] + "{}"
        allocs[current][2].append(Buffer(name, value[3] + value[4], int(value[2])))
      elif line.startswith("Used values") or line.startswith("Total bytes"):
        break
  temps = [a for a in allocs.values() if a[1]]
  if not temps:
    return None
  allocated, _, values = max(temps, key=lambda a: a[0])
  ranges, inside = {}, False
  with open(os.path.join(dump_dir, ranges_file[0])) as f:
    for line in f:
      if "BufferLiveRange" in line:
        inside = True
      elif inside and (found := _RANGE.match(line)):
        ranges[found[1]] = (int(found[2]), int(found[3]))
  spans = [(ranges[v.name], v) for v in values if v.name in ranges and v.size > 0]
  if not spans:
    return None
  events = sorted([(a, v.size) for (a, _), v in spans] + [(b + 1, -v.size) for (_, b), v in
                                                          spans])
  live = peak = 0
  at = events[0][0]
  for time, delta in events:
    live += delta
    if live > peak:
      peak, at = live, time
  held = sorted((v for (a, b), v in spans if a <= at <= b), key=lambda v: -v.size)
  groups = {}
  for v in held:
    dtype, dims = v.type.split("[")
    elements = math.prod(int(d) for d in dims.rstrip("]").split(",") if d)
    role = shapes.role(dtype, elements)
    size, count, members = groups.get(role, (0, 0, ()))
    groups[role] = (size + v.size, count + 1, members + (v.name.replace("{}", ""),))
  ordered = sorted(((r,) + g for r, g in groups.items()), key=lambda g: -g[1])
  return Breakdown(allocated, peak, tuple(held), tuple(ordered))
