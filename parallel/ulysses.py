"""Ulysses: an all-to-all turns sequence shards into head shards, one kernel attends the whole
sequence per device, an all-to-all turns the result back.

Worked example, contiguous layout, P = 4 devices, 1024 tokens, N = 16 query heads, K = 4 kv
heads: device 2 holds positions 512..767 of all heads. The all-to-all over the axis splits
the heads in 4 and gathers the sequence: device 2 then holds query heads 8..11 of all 1024
positions (rows in layout order: device 0's rows, then device 1's, ...) and kv head 2 (query
head n uses kv head n // 4). It attends those heads over the whole sequence in one kernel
call (parallel.local.attend), and a second all-to-all returns positions 512..767 of all 16
heads. lse [B, N, T] goes back the same way. With the zigzag or striped layout the gathered
rows are in layout order; they are put in natural order before the kernel and back after
it (parallel.plan.to_natural: static slices and reshapes, a copy of O(T N H / P)), so
that each query tile's keys are one contiguous range and a causal kernel skips every tile
past the diagonal.

Fewer kv heads than devices (K < P, P % K == 0): each kv head is repeated P / K times before
the all-to-all, so that each device receives the one its query heads use. K = 1, P = 4: kv
head 0 is sent to all four devices; device d attends query heads 4d..4d+3 against it. Their
gradients are summed back over the copies in float32, then cast once (repeat_kv).

Needs N % P == 0 (each device a whole number of query heads) and K % P == 0 or P % K == 0.
The gradients follow the all-to-alls back (their transpose is an all-to-all).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ringflash.parallel import local
from ringflash.parallel import plan as ring_plan


class UlyssesSpec(local.MeshSpec):
  """Static part of the Ulysses strategy (fields: local.MeshSpec)."""


def unsupported_heads(n: int, k: int, size: int, strategy: str = "ulysses") -> str | None:
  """Why heads do not divide over `size` devices (None: they do); `strategy` names the
  caller's ("hybrid": Ulysses over the last axis of axis_name)."""
  where = ("its axis" if strategy == "ulysses" else
           "the last axis of axis_name, where it runs Ulysses")
  if n % size:
    return (f"strategy {strategy!r} shards the N={n} query heads over the {size} devices of "
            f"{where}: N must be a multiple of {size}")
  if k % size and size % k:
    return (f"strategy {strategy!r} shards the K={k} kv heads over the {size} devices of "
            f"{where}: K must be a multiple or a divisor of {size}")
  return None


def to_heads(x, axis_name, seq_axis: int = 1, head_axis: int = 2):
  """[.., T_local, H_all, ..] -> [.., T_local * P, H_all / P, ..]: sequence in, heads out."""
  return lax.all_to_all(x, axis_name, split_axis=head_axis, concat_axis=seq_axis, tiled=True)


def to_sequence(x, axis_name, seq_axis: int = 1, head_axis: int = 2):
  """to_heads' inverse: [.., T, H / P, ..] -> [.., T / P, H, ..]."""
  return lax.all_to_all(x, axis_name, split_axis=seq_axis, concat_axis=head_axis, tiled=True)


def repeat_kv(x, k: int, size: int):
  """K < P: each kv head repeated P / K times (in place), so the all-to-all hands each
  device the kv head its query heads use. The gradient sums the copies in float32 and casts
  once (jnp.repeat's own transpose added them in x's dtype: P / K roundings in bfloat16)."""
  return x if k % size == 0 else _repeat_heads(x, size // k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _repeat_heads(x, times: int):
  return jnp.repeat(x, times, axis=2)


def _repeat_heads_fwd(x, times):
  return _repeat_heads(x, times), None


def _repeat_heads_bwd(times, _, g):                  # g has x's dtype, as the copies have
  b, s, heads, h = g.shape
  summed = g.astype(jnp.float32).reshape(b, s, heads // times, times, h).sum(axis=3)
  return (summed.astype(g.dtype),)


_repeat_heads.defvjp(_repeat_heads_fwd, _repeat_heads_bwd)


def ulysses_attention_local(q, k, v, q_seg, kv_seg, spec: UlyssesSpec, positions=None):
  """Exact attention of local queries against the keys of every device, by all-to-all.

  Runs per device inside shard_map over `spec.axis_name`; differentiable (the all-to-alls
  transpose to all-to-alls, parallel.local.attend has its own backward).

  Args:
    q: [B, T, N, H] this device's queries; k: [B, S, K, H], v: [B, S, K, Hv].
    q_seg: [B, T] int or None; kv_seg: [B, S] int or None.
    spec: UlyssesSpec.
    positions: None, or a function (length) -> [length * P] int32 positions of the gathered
      sequence (the hybrid strategy's); default the layout's.

  Returns:
    (out [B, T, N, Hv] in q's dtype, lse [B, N, T] float32).
  """
  p, axis = spec.size, spec.axis_name
  kh = k.shape[2]
  qh = to_heads(q, axis)
  kh_, vh = (to_heads(repeat_kv(x, kh, p), axis) for x in (k, v))

  def gathered(x):
    return None if x is None else lax.all_gather(x, axis, axis=1, tiled=True)

  q_seg, kv_seg = gathered(q_seg), gathered(kv_seg)
  t, s = qh.shape[1], kh_.shape[1]
  if positions is not None:
    q_pos, k_pos = positions(q.shape[1]), positions(k.shape[1])
  elif spec.layout == "contiguous":
    q_pos, k_pos = jnp.arange(t, dtype=jnp.int32), jnp.arange(s, dtype=jnp.int32)
  else:
    # The gathered rows are in layout order; the kernel runs them in natural order (one
    # contiguous key range per query tile), and the results go back to layout order.
    def natural(x):
      return None if x is None else ring_plan.to_natural(x, spec.layout, p, axis=1)

    qh, kh_, vh, q_seg, kv_seg = (natural(x) for x in (qh, kh_, vh, q_seg, kv_seg))
    q_pos, k_pos = jnp.arange(t, dtype=jnp.int32), jnp.arange(s, dtype=jnp.int32)
    out, lse = local.attend(qh, kh_, vh, q_pos, k_pos, q_seg, kv_seg, spec.local)
    out = ring_plan.from_natural(out, spec.layout, p, axis=1)
    lse = ring_plan.from_natural(lse, spec.layout, p, axis=2)
    return to_sequence(out, axis), to_sequence(lse, axis, seq_axis=2, head_axis=1)
  out, lse = local.attend(qh, kh_, vh, q_pos, k_pos, q_seg, kv_seg, spec.local)
  return to_sequence(out, axis), to_sequence(lse, axis, seq_axis=2, head_axis=1)
