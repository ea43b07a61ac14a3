"""Hybrid: Ulysses over one mesh axis, the ring over the others.

The sequence is sharded over the product of the axes (first major). An all-to-all over the
last axis (the Ulysses axis, U devices, e.g. the GPUs of a host or a TPU slice's ICI axis)
turns its sequence shards into head shards; the ring then runs over the remaining axes (R
members, e.g. across hosts, or DCN) on the gathered runs, with N / U query heads each.

Worked example, axes ("ring", "u") of sizes R = 2 and U = 2, contiguous, 16 tokens: device
(r, u) holds positions 4 (2r + u) ... 4 (2r + u) + 3. After the all-to-all over "u", device
(r, u) holds positions 8r ... 8r + 7 (the runs of (r, 0) and (r, 1), in that order) of half
the heads; ring member r holds those positions (parallel.plan.layout_positions with
group = U), and the ring over "ring" brings it member 1 - r's positions at step 1. With the
zigzag layout over the R * U devices the runs are not contiguous in position, which the ring
handles as any layout: its plan and kernels read each tile's position range.
"""

from __future__ import annotations

import dataclasses

from jax import lax

from ringflash.parallel import plan as ring_plan
from ringflash.parallel import ring
from ringflash.parallel import ulysses


@dataclasses.dataclass(frozen=True)
class HybridSpec:
  """Static part of the hybrid strategy: the ring over `ring.axis_name` (group = the Ulysses
  axis size) and the all-to-all over `ulysses_axis` (`ulysses_size` devices)."""

  ring: ring_plan.RingSpec
  ulysses_axis: str
  ulysses_size: int


def hybrid_attention_local(q, k, v, q_seg, kv_seg, spec: HybridSpec):
  """Exact attention of local queries against every device's keys: all-to-all over the
  Ulysses axis, then the ring over the others, then back.

  Args:
    q: [B, T, N, H] this device's queries; k: [B, S, K, H], v: [B, S, K, Hv].
    q_seg: [B, T] int or None; kv_seg: [B, S] int or None.
    spec: HybridSpec.

  Returns:
    (out [B, T, N, Hv] in q's dtype, lse [B, N, T] float32).
  """
  axis, size = spec.ulysses_axis, spec.ulysses_size
  kh = k.shape[2]
  qh = ulysses.to_heads(q, axis)
  k_h, v_h = (ulysses.to_heads(ulysses.repeat_kv(x, kh, size), axis) for x in (k, v))

  def gathered(x):
    return None if x is None else lax.all_gather(x, axis, axis=1, tiled=True)

  out, lse = ring.ring_attention_local(qh, k_h, v_h, gathered(q_seg), gathered(kv_seg),
                                       ring=spec.ring)
  return (ulysses.to_sequence(out, axis),
          ulysses.to_sequence(lse, axis, seq_axis=2, head_axis=1))
