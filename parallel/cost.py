"""The cost model that `strategy="auto"` chooses by: time and memory of each strategy.

One module, every constant here with where it comes from. A strategy's time on P devices is
estimated for a training step (forward + backward, the main use; the choice for a forward
alone is the same in every measured row) from:

  work       FLOPs of the attention, the FlashAttention convention: 2 B N T S (H + Hv) f
             forward, 3.5x that for forward + backward; f the fraction of (query, key)
             pairs that are valid (1/2 causal, window / S for a window, 1 otherwise);
  kernels    rate R of the per-device kernel on long calls, times the efficiency
             e(L) = L / (L + L0) of a call whose key range is L tokens: short calls (a ring
             hop at 8k tokens per device) run further from peak than one call over the whole
             sequence (Ulysses); plus T0 per kernel call (launch, pipeline fill);
  transfers  bytes over a per-device bandwidth: the ring's per-step K/V (and dK/dV, float32,
             in the backward) overlap the step's kernel, so a step costs the larger of the
             two; the ring runs the steps of its plan (fewer than P where a window stops it,
             none moving anything at one step); all-to-alls (Ulysses) and all-gathers
             (all-gather) are not overlapped;
  memory     the arrays each strategy holds per device beyond the common ones (q, k, v, out,
             their gradients): the ring's two K/V blocks in flight and float32 accumulators,
             the all-gather's whole-sequence K/V (and float32 dK/dV), Ulysses' head-sharded
             copies. A strategy that does not fit the device's memory (its allocator's
             limit where the device gives one, device_memory; else the generation's
             figure below) is not chosen.

Calibration (PLATFORMS below):
  gpu (H200): R = 540 TFLOP/s forward+backward on long calls (ANCHORS: our kernel 0.92-0.97
    of cuDNN's 545-567); L0 = 2800 tokens from the device-steps-only ring at P = 4, causal,
    zigzag: 0.87 of one call at 16k tokens per device, 0.71 at 8k (ANCHORS, "Where the
    ring's forward loses"); T0 = 15 us per call; ring transfers at 150 GB/s per direction
    (a ppermute between two H200s, GPU_NOTES runs 20-29: a 64 MiB K/V block in ~0.4 ms);
    all-to-all and all-gather at 130 GB/s per device (the Ulysses + cuDNN baseline on 4
    H200s at 16k tokens, MHA, non-causal: 0.95 forward+backward, so ~3 ms for 384 MiB
    moved); the merges at 4 TB/s. With these, the model gives the ANCHORS rows (P = 4,
    forward+backward) ring 0.84 / 0.71 / 0.56 for 16k full / 16k causal / 8k causal
    (measured 0.82 / 0.73 / 0.49) and Ulysses 0.91 / 0.84 (plain Ulysses + cuDNN measured
    0.95 / 0.91 with cuDNN's kernel, about 5% faster than ours forward+backward).
  tpu: R = 0.6 x the chip's peak (ANCHORS' TPU table), L0 = 2048, T0 = 5 us; ICI at the
    table's one-way link bandwidth for the ring, half that for all-to-all and all-gather.
  cpu (simulated devices): no meaningful figures. The estimates are printed (R = 0.05
    TFLOP/s, 10 GB/s) but "auto" takes the ring on CPU devices whenever it runs the call: a
    CPU mesh is a simulation of the accelerator mesh, and the ring is what runs on every
    mesh shape; the other strategies are chosen there by name.
"""

from __future__ import annotations

import dataclasses

import numpy as np

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Platform:
  """Rates of one kind of device (see the module docstring for their sources)."""

  rate: float              # FLOP/s of the kernel, forward + backward, long calls
  l0: float                # tokens: e(L) = L / (L + l0)
  t0: float                # seconds per kernel call
  ring_bw: float           # bytes/s per direction between ring neighbours
  collective_bw: float     # bytes/s per device for all-to-all and all-gather
  memory: float            # bytes per device
  hbm_bw: float            # bytes/s of device memory (the ring's per-hop merges)


PLATFORMS = {
    "gpu": Platform(rate=540e12, l0=2800, t0=15e-6, ring_bw=150e9, collective_bw=130e9,
                    memory=139 * GIB, hbm_bw=4.0e12),
    "tpu v5p": Platform(rate=0.6 * 459e12, l0=2048, t0=5e-6, ring_bw=90e9,
                        collective_bw=45e9, memory=95 * GIB, hbm_bw=2.77e12),
    "tpu v5e": Platform(rate=0.6 * 197e12, l0=2048, t0=5e-6, ring_bw=45e9,
                        collective_bw=22e9, memory=16e9, hbm_bw=0.82e12),
    "tpu v6e": Platform(rate=0.6 * 918e12, l0=2048, t0=5e-6, ring_bw=90e9,
                        collective_bw=45e9, memory=32e9, hbm_bw=1.64e12),
    "tpu v4": Platform(rate=0.6 * 275e12, l0=2048, t0=5e-6, ring_bw=45e9,
                       collective_bw=22e9, memory=32 * GIB, hbm_bw=1.2e12),
    "cpu": Platform(rate=0.05e12, l0=256, t0=50e-6, ring_bw=10e9, collective_bw=10e9,
                    memory=float("inf"), hbm_bw=20e9),
}


def platform_of(platform: str, device_kind: str = "", num_cores: int | None = None
                ) -> Platform:
  """The Platform of a device: GPUs share the H200's figures; TPUs by generation. A v4
  device of one TensorCore (num_cores 1: how libtpu lists a v4 chip without megacore, as
  two devices; the deviceless topologies of `ringflash plan` do) holds half the chip: half
  its memory, rate and bandwidths."""
  if platform in ("gpu", "cuda"):
    return PLATFORMS["gpu"]
  if platform == "tpu":
    kind = device_kind.lower()
    for name in ("v5p", "v5e", "v6e", "v4"):
      if name in kind or (name == "v5e" and "lite" in kind and "v5" in kind) or (
          name == "v6e" and "v6" in kind):
        plat = PLATFORMS[f"tpu {name}"]
        if name == "v4" and num_cores == 1:
          plat = dataclasses.replace(
              plat, rate=plat.rate / 2, ring_bw=plat.ring_bw / 2, memory=plat.memory / 2,
              collective_bw=plat.collective_bw / 2, hbm_bw=plat.hbm_bw / 2)
        return plat
    return PLATFORMS["tpu v5p"]
  return PLATFORMS["cpu"]


def device_memory(device) -> float | None:
  """The bytes a device's allocator may hand out (memory_stats' bytes_limit: on a GPU, the
  card's memory times XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default), or None where the
  device does not say (CPU devices; the deviceless TPU devices of `ringflash plan`, whose
  generation's figure stands). The GPU figure of PLATFORMS is an H200's 139 GiB, which an
  80 GiB H100 does not have."""
  stats_of = getattr(device, "memory_stats", None)
  try:
    stats = stats_of() if stats_of is not None else None
  except Exception:  # pylint: disable=broad-except  # not addressable: deviceless
    return None
  limit = (stats or {}).get("bytes_limit")
  return float(limit) if limit else None


@dataclasses.dataclass(frozen=True)
class Estimate:
  """One strategy's estimate: seconds of a forward + backward step, bytes per device beyond
  the common arrays, and why not, if it cannot run."""

  strategy: str
  seconds: float | None
  extra_bytes: float | None
  fits: bool = True
  reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Choice:
  """The chosen strategy and every alternative's estimate (ringflash.explain prints it)."""

  strategy: str
  estimates: tuple[Estimate, ...]
  common_bytes: float
  backend: str | None = None
  tiles: object = None

  def __str__(self):
    lines = [f"strategy: {self.strategy}" + (f", backend {self.backend}, tiles {self.tiles}"
                                              if self.backend else "")
             + f" (estimates: forward+backward; memory per device beyond the common "
             f"{self.common_bytes / GIB:.2f} GiB)"]
    for e in self.estimates:
      if e.reason is not None:
        lines.append(f"  {e.strategy:<10} not possible: {e.reason}")
      else:
        mark = "*" if e.strategy == self.strategy else " "
        lines.append(f"{mark} {e.strategy:<10} {1e3 * e.seconds:10.3f} ms  "
                     f"+{e.extra_bytes / GIB:8.2f} GiB{'' if e.fits else '  (does not fit)'}")
    return "\n".join(lines)


def _valid_fraction(call) -> float:
  f = 0.5 if call.is_causal else 1.0
  if call.window is not None:
    f = min(f, (call.window[0] + call.window[1] + 1) / max(call.s, 1))
  return f


def estimate(strategy: str, call, axes, plat: Platform) -> Estimate:
  """Seconds of a forward + backward step and extra bytes per device of `strategy`."""
  p = axes.size
  e = np.dtype(call.dtype).itemsize
  b, t, s, n, k, h, hv = call.batch, call.t, call.s, call.n, call.k, call.h, call.hv
  lt, ls = t / p, s / p
  f = _valid_fraction(call)
  flops = 3.5 * 2 * b * n * t * s * (h + hv) * f / p   # per device

  causal_share = 0.5 if call.is_causal else 1.0
  reach = None if call.window is None else call.window[0] + call.window[1] + 1

  def kernel_time(key_range: float, calls: int, share: float = 1.0) -> float:
    # A call's efficiency follows the keys each query row really meets (half the range with
    # a causal mask): a causal ring hop is shorter work than a non-causal one. With a window,
    # at most its reach, in a ring hop as in one call over the whole sequence.
    met = key_range * causal_share if reach is None else min(key_range * causal_share, reach)
    eff = met / (met + plat.l0)
    return share * flops / (plat.rate * eff) + calls * plat.t0

  def ring_steps(members: int, rows: float, keys: float, heads: int, kv_heads: int,
                 steps: int | None = None) -> float:
    # Each step: a kernel on one member's keys, the merge of its (o, lse) into float32
    # accumulators (forward) or the float32 dQ, dK, dV sums (backward); forward moves K/V,
    # backward K/V and the float32 dK/dV; a step costs the larger of kernel and transfer.
    # `steps`: the hops the ring runs (a window truncates it, _ring_steps); the work is the
    # same, spread over them, and a ring of one step moves nothing.
    steps = members if steps is None else steps
    moves = 1.0 if steps > 1 else 0.0
    block = b * keys * kv_heads * (h + hv) * e
    merge = b * rows * heads * hv * 16 / plat.hbm_bw
    sums = (b * rows * heads * h * 8 + b * keys * kv_heads * (h + hv) * 8) / plat.hbm_bw
    step_fwd = max(kernel_time(keys, 1, 1 / 3.5 / steps) + merge,
                   moves * block / plat.ring_bw)
    step_bwd = max(kernel_time(keys, 1, 2.5 / 3.5 / steps) + sums,
                   moves * block * (1 + 4 / e) / plat.ring_bw)
    return steps * (step_fwd + step_bwd)

  kv_block = b * ls * k * (h + hv) * e                       # one device's K and V
  if strategy == "ring":
    seconds = (ring_steps(p, lt, ls, n, k, _ring_steps(call, p)) if p > 1
               else kernel_time(s, 2))
    extra = 2 * kv_block + b * lt * n * (hv + h) * 4 + 2 * kv_block * 4 / e
  elif strategy == "allgather":
    gather = kv_block * (p - 1) / plat.collective_bw
    seconds = kernel_time(s, 2) + 2 * gather + gather * 4 / e   # gather twice, scatter f32
    extra = p * kv_block + p * kv_block * 4 / e
  elif strategy in ("ulysses", "hybrid"):
    u = p if strategy == "ulysses" else axes.sizes[-1]
    rep = max(u // k, 1)
    # forward: q, k, v in and out back; backward: dout in, dq, dk, dv back: the same bytes
    moved = b * lt * (n * h + n * hv + rep * k * (h + hv)) * e * (u - 1) / u
    a2a = 2 * moved / plat.collective_bw
    if strategy == "ulysses":
      seconds = kernel_time(s, 2) + a2a
    else:
      r = p // u
      seconds = ring_steps(r, lt * u, ls * u, n // u, max(k // u, 1)) + a2a
    extra = 2 * b * lt * (n * h + n * hv + rep * k * (h + hv)) * e
  else:
    raise ValueError(f"unknown strategy {strategy!r}")
  return Estimate(strategy, seconds, extra)


def _ring_steps(call, p: int) -> int:
  """The steps of the ring's plan (parallel/plan.py) for this call on P devices: all P
  without a window; with one, as many as the window reaches (the contiguous layout), which
  a ring charged with P steps of transfers made look slower than it is. The plan is taken
  with a tile per zigzag chunk (or K/V half, bidirectional), coarser than the kernels', so
  it keeps every hop theirs keeps."""
  if call.window is None:
    return p
  from ringflash.parallel import plan  # pylint: disable=g-import-not-at-top
  unit = 2 if call.layout == "zigzag" or call.bidirectional else 1
  lt, ls = (-(-length // (p * unit)) * unit for length in (call.t, call.s))
  return plan.plan_ring(call.layout, p, lt, ls, lt // unit, ls // unit, call.is_causal,
                        call.window, call.bidirectional).steps


def common_bytes(call, axes) -> float:
  """Per device: q, k, v, out, dout and the gradients in the input dtype, lse in float32."""
  e = np.dtype(call.dtype).itemsize
  lt, ls = call.t / axes.size, call.s / axes.size
  b, n, k, h, hv = call.batch, call.n, call.k, call.h, call.hv
  return b * (2 * lt * n * h + 2 * ls * k * (h + hv) + 2 * lt * n * hv) * e + 4 * b * n * lt


def choose(call, axes, *, platform: str, device=None) -> Choice:
  """The fastest strategy that runs the call and fits in memory, with every estimate.

  Candidates: ring, allgather, ulysses, and hybrid when the sequence is sharded over two or
  more mesh axes. Ties (within 1%) go to the ring, which needs nothing of the head count.
  """
  from ringflash.parallel import strategies  # pylint: disable=g-import-not-at-top
  plat = platform_of(platform, getattr(device, "device_kind", "") or "",
                     getattr(device, "num_cores", None))
  if platform != "cpu" and (limit := device_memory(device)) is not None:
    plat = dataclasses.replace(plat, memory=limit)
  names = ["ring", "allgather", "ulysses"] + (["hybrid"] if len(axes.names) > 1 else [])
  base_bytes = common_bytes(call, axes)
  out = []
  for name in names:
    why = strategies.unsupported(name, call, axes)
    if why is not None:
      out.append(Estimate(name, None, None, fits=False, reason=why))
      continue
    est = estimate(name, call, axes, plat)
    fits = base_bytes + est.extra_bytes <= plat.memory
    out.append(dataclasses.replace(est, fits=fits))
  ok = [e for e in out if e.reason is None and e.fits] or [e for e in out if e.reason is None]
  if platform == "cpu" and any(e.strategy == "ring" for e in ok):
    return Choice("ring", tuple(out), base_bytes)
  best = min(e.seconds for e in ok)
  pick = next(e for e in ok if e.seconds <= best * 1.01 and e.strategy == "ring") if any(
      e.strategy == "ring" and e.seconds <= best * 1.01 for e in ok) else min(
          ok, key=lambda e: e.seconds)
  return Choice(pick.strategy, tuple(out), base_bytes)

