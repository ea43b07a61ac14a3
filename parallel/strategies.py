"""The strategies over a mesh, one entry point: attention_local(q, k, v, q_seg, kv_seg, spec)
runs per device inside shard_map, whichever strategy `spec` describes.

  ring       parallel/ring.py      K/V blocks travel around a ring, overlapped with kernels;
  allgather  parallel/allgather.py every device gathers all K/V, then one kernel call;
  ulysses    parallel/ulysses.py   all-to-all sequence <-> heads, one kernel on the whole
                                   sequence per device;
  hybrid     parallel/hybrid.py    Ulysses over one mesh axis, the ring over the others.

All take the same sequence-sharded inputs and give the same (out, lse), exact; each knows the
kernel contract only. The choice among them ("auto") is parallel/cost.py's.
"""

from __future__ import annotations

from ringflash.parallel.allgather import GatherSpec
from ringflash.parallel.allgather import allgather_attention_local
from ringflash.parallel.hybrid import HybridSpec
from ringflash.parallel.hybrid import hybrid_attention_local
from ringflash.parallel.plan import RingSpec
from ringflash.parallel.ring import ring_attention_local
from ringflash.parallel.ulysses import UlyssesSpec
from ringflash.parallel.ulysses import unsupported_heads
from ringflash.parallel.ulysses import ulysses_attention_local

STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")
WITHOUT_RING = ("allgather", "ulysses")     # bidirectional=True, a ring schedule, is refused
Spec = RingSpec | GatherSpec | UlyssesSpec | HybridSpec


def name_of(spec: Spec) -> str:
  """The strategy's name (one of STRATEGIES)."""
  return {RingSpec: "ring", GatherSpec: "allgather", UlyssesSpec: "ulysses",
          HybridSpec: "hybrid"}[type(spec)]


def kernel_spec(spec: Spec):
  """The kernel spec the strategy runs (its backend's, with resolved tiles)."""
  if isinstance(spec, RingSpec):
    return spec.kernel
  if isinstance(spec, HybridSpec):
    return spec.ring.kernel
  return spec.local.kernel


def backend_of(spec: Spec) -> str:
  if isinstance(spec, RingSpec):
    return spec.backend
  if isinstance(spec, HybridSpec):
    return spec.ring.backend
  return spec.local.backend


def unsupported(strategy: str, call, axes) -> str | None:
  """Why `strategy` cannot run a call (ringflash._validate.Call, as one device's heads see
  it: _validate.per_device) on the sequence axes (names and sizes, first major); None: it
  can."""
  if strategy in WITHOUT_RING and call.bidirectional:
    return f"bidirectional=True is a schedule of the ring; strategy {strategy!r} has no ring"
  if strategy == "hybrid":
    if len(axes.names) < 2:
      return ("strategy 'hybrid' needs axis_name to be a tuple of at least two mesh axes "
              "(the ring over the first ones, Ulysses over the last)")
    why = unsupported_heads(call.n, call.k, axes.sizes[-1], "hybrid")
  elif strategy == "ulysses":
    why = unsupported_heads(call.n, call.k, axes.size)
  else:
    return None
  shards = getattr(call, "head_shards", 1)
  if why is not None and shards > 1:
    why += (f" (the heads are split over {shards} devices of other mesh axes: N and K here "
            f"are each device's)")
  return why


def attention_local(q, k, v, q_seg, kv_seg, spec: Spec):
  """(out [B, T, N, Hv] in q's dtype, lse [B, N, T] float32) of this device's queries
  against every device's keys, by the strategy `spec` describes (inside shard_map)."""
  if isinstance(spec, RingSpec):
    return ring_attention_local(q, k, v, q_seg, kv_seg, ring=spec)
  if isinstance(spec, GatherSpec):
    return allgather_attention_local(q, k, v, q_seg, kv_seg, spec=spec)
  if isinstance(spec, UlyssesSpec):
    return ulysses_attention_local(q, k, v, q_seg, kv_seg, spec=spec)
  return hybrid_attention_local(q, k, v, q_seg, kv_seg, spec=spec)
