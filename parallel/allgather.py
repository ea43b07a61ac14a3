"""All-gather: every device gathers all keys and values, then attends its own queries once.

Worked example, zigzag layout, P = 4 devices, 16 tokens (4 per device, chunks of 2): device 1
holds queries 2 3 12 13. It all-gathers K/V over the axis, receiving the blocks of devices
0..3 in device order, so its key rows are the layout-ordered sequence
0 1 14 15 | 2 3 12 13 | 4 5 10 11 | 6 7 8 9 (parallel.plan.layout_positions, flattened);
a local copy puts them in natural order 0..15 (parallel.plan.to_natural), and it
attends its four queries to those 16 keys in one kernel call; with causal masking the
kernel skips the tiles after each query (positions decide, as in the ring, and each query
tile's keys are one contiguous range). zigzag gives
every device the same causal work here too. The backward gathers K/V again (they are not
kept: a residual of the whole sequence per device would cost what the strategy saves),
computes float32 dK/dV for every key and reduce-scatters them (a psum_scatter over the axis)
so each device ends with the gradients of its own keys, summed over all devices' queries;
the one cast to the input dtype comes after that sum.

Memory: the gathered K/V (and, in the backward, float32 dK/dV of the whole sequence) per
device; the transfers are one all-gather (and one reduce-scatter) instead of P - 1 ring hops,
done before the kernel rather than overlapped with it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ringflash.parallel import local
from ringflash.parallel import plan as ring_plan


class GatherSpec(local.MeshSpec):
  """Static part of the all-gather strategy (fields: local.MeshSpec)."""


def _gather(x, spec: GatherSpec):
  return None if x is None else lax.all_gather(x, spec.axis_name, axis=1, tiled=True)


def _positions(spec: GatherSpec, t: int, s: int):
  """This device's query positions [t], and every key's [s * P] (the gathered keys in
  natural order)."""
  q_pos = ring_plan.device_positions(spec.layout, lax.axis_index(spec.axis_name), spec.size, t)
  return q_pos, jnp.arange(s * spec.size, dtype=jnp.int32)


def _keys(x, spec: GatherSpec):
  """All devices' rows of x (K, V or their segment ids), in natural order: one key range per
  query tile for the kernel's tile skipping."""
  x = _gather(x, spec)
  return None if x is None else ring_plan.to_natural(x, spec.layout, spec.size, axis=1)


def _forward(q, k, v, q_seg, kv_seg, spec: GatherSpec):
  q_pos, k_pos = _positions(spec, q.shape[1], k.shape[1])
  return local.forward(q, _keys(k, spec), _keys(v, spec), q_pos, k_pos, q_seg,
                       _keys(kv_seg, spec), spec.local)


@functools.partial(jax.custom_vjp, nondiff_argnames=("spec",))
def allgather_attention_local(q, k, v, q_seg, kv_seg, spec: GatherSpec):
  """Exact attention of local queries against the keys of every device, by all-gather.

  Runs per device inside shard_map over `spec.axis_name`.

  Args:
    q: [B, T, N, H] this device's queries; k: [B, S, K, H], v: [B, S, K, Hv] its keys.
    q_seg: [B, T] int or None; kv_seg: [B, S] int or None.
    spec: GatherSpec.

  Returns:
    (out [B, T, N, Hv] in q's dtype, lse [B, N, T] float32).
  """
  return _forward(q, k, v, q_seg, kv_seg, spec)


def _fwd(q, k, v, q_seg, kv_seg, spec):
  out, lse = _forward(q, k, v, q_seg, kv_seg, spec)
  res = local.named_residuals(local.Residuals(q, k, v, out, lse, q_seg, kv_seg))
  return (res.out, res.lse), res


def _bwd(spec, res: local.Residuals, cotangents):
  dout, dlse = cotangents
  q_pos, k_pos = _positions(spec, res.q.shape[1], res.k.shape[1])
  dq, dk, dv = local.backward(res.q, _keys(res.k, spec), _keys(res.v, spec),
                              res.out, res.lse, dout, dlse, q_pos, k_pos, res.q_seg,
                              _keys(res.kv_seg, spec), spec.local)

  def home(g):           # each device keeps its own keys' rows, summed over all devices
    g = ring_plan.from_natural(g, spec.layout, spec.size, axis=1)   # layout order again
    return lax.psum_scatter(g, spec.axis_name, scatter_dimension=1, tiled=True)

  return (dq.astype(res.q.dtype), home(dk).astype(res.k.dtype),
          home(dv).astype(res.v.dtype), None, None)


allgather_attention_local.defvjp(_fwd, _bwd)
