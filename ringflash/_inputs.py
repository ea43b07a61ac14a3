"""The user's arrays as the strategies take them, and the results back.

The public API accepts [..., T, N, H] with no, one or several leading batch dims, sequence
lengths per batch row, lengths that do not divide by the ring, and attention sinks. The
strategies take one canonical form: [B, T, N, H] with T divisible as the layout needs, and
masks as positions plus segment ids. This module maps one onto the other:

- leading dims are flattened into B (none: B = 1) and restored at the end;
- a sequence that does not fit the layout on the ring, or the backend's tiles, is padded
  (each device's share rounded up, _validate.local_lengths) and the output trimmed: a
  contiguous one at its end; a zigzag or striped one by a gather (padded_rows) into the
  layout of the padded length, whose positions past the user's length are the padding, and
  the output gathered back into the user's order (ringflash.to_layout's for that length);
- lengths and padding become segment ids (padding alone not where a causal mask hides it:
  _validate.padding_needs_ids): a query row at or past its length gets the id PAD_Q and a
  key at or past it PAD_K (kernels/base.py); no real id equals either, so such a key is
  never seen and such a row sees nothing (output 0, lse -inf). Example, T = 6, length 4, no
  segment ids: query ids 0 0 0 0 PAD_Q PAD_Q, key ids 0 0 0 0 PAD_K PAD_K. PAD_Q is the
  largest int32 and PAD_K the smallest, so the kernels' range test
  (base.block_may_have_work) skips a whole tile or ring hop of padding: [PAD_K, PAD_K]
  meets no query range, [PAD_Q, PAD_Q] no key range;
- sinks join each row's softmax once, after the strategy: lse' = logaddexp(lse, sink) and
  out' = out * exp(lse - lse'), rows without a key staying 0 with lse -inf. Its derivative
  is written out (_sink_rescale) so that a zero cotangent carries nothing back, also through
  a row that saw a NaN: a loss that ignores such rows gets finite gradients, as without
  sinks. The sink's gradient is summed over batch and rows here, over devices by JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ringflash import _mesh
from ringflash import _validate
from ringflash.kernels import base
from ringflash.parallel import local
from ringflash.parallel import plan


def _rows(x, lead, order=None):
  """x [*lead, *rest] -> [B, *rest] (B = prod(lead), 1 when there is no batch dim); order:
  the leading dims' order of flattening (_mesh.lead_order), None for their own."""
  if order is not None:
    x = jnp.transpose(x, order + tuple(range(len(lead), x.ndim)))
  return x.reshape((int(np.prod(lead, dtype=np.int64)) if lead else 1,) + x.shape[len(lead):])


def _explicit_mesh(x):
  """The mesh x is typed on where it has Explicit axes (there JAX checks each op's result
  sharding), else None."""
  mesh = getattr(jax.typeof(x).sharding, "mesh", None)
  if getattr(mesh, "empty", True) or not any(
      t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return None
  return mesh


def _spec_on(x, mesh, rank):
  """x's partition spec entries, `rank` of them, where it is typed on `mesh`'s axes; all
  None (replicated) where it is typed on no mesh or another."""
  sharding = jax.typeof(x).sharding
  if getattr(getattr(sharding, "mesh", None), "axis_names", None) != mesh.axis_names:
    return (None,) * rank
  return (tuple(sharding.spec) + (None,) * rank)[:rank]


def _resharded(x, mesh, spec):
  """x resharded to `spec` on `mesh`, where its spec differs."""
  if _spec_on(x, mesh, x.ndim) == tuple(spec):
    return x
  return _mesh.reshard(x, NamedSharding(mesh, P(*spec)))


def _rows_like(x, lead, order, like):
  """_rows(x, lead, order), its batch sharded as `like`'s (the query's rows) where x is typed
  on a mesh with Explicit axes. There a reshape that merges dims sharded otherwise than the
  query's (keys sharded over "data" on B2 where the query is not, say) is refused by JAX;
  given the query's batch sharding as its out_sharding it runs (resharding where it must),
  and the strategy gets every input's rows sharded alike. x's other dims keep their axes,
  less those the batch takes."""
  mesh = _explicit_mesh(x)
  if len(lead) < 2 or mesh is None:
    return _rows(x, lead, order)
  # A query on no mesh (a NumPy array) has its rows replicated: so have x's.
  batch = _spec_on(like, mesh, 1)[0]
  taken = {batch} if isinstance(batch, str) else set(batch or ())

  def kept(entry):
    axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in taken)
    return None if not axes else axes[0] if len(axes) == 1 else axes

  rest = _spec_on(x, mesh, x.ndim)
  if order is not None:
    x = jnp.transpose(x, order + tuple(range(len(lead), x.ndim)))
  shape = (int(np.prod(lead, dtype=np.int64)),) + x.shape[len(lead):]
  spec = P(batch, *(kept(e) for e in rest[len(lead):]))
  return jax.lax.reshape(x, shape, out_sharding=NamedSharding(mesh, spec))


def _unrows(x, lead, order=None):
  """_rows undone: [B, *rest] -> [*lead, *rest]."""
  if order is None:
    return x.reshape(lead + x.shape[1:])
  x = x.reshape(tuple(lead[i] for i in order) + x.shape[1:])
  return jnp.transpose(x, tuple(np.argsort(order)) + tuple(range(len(lead), x.ndim)))


def _pad(x, length: int, axis: int = 1):
  extra = length - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def padded_rows(layout: str, ring_size: int, length: int, positions):
  """Where the rows of a layout-ordered sequence of `length` tokens go when it is padded.

  positions: [L] the natural position of each row the strategy runs (the layout of the
  padded length L, positions >= length padding). Returns (rows [L], back [length]), int32:
  x.take(rows, mode="fill") is the padded sequence (rows == length for padding: the fill),
  and padded.take(back) the user's rows again, in ringflash.to_layout's order for `length`
  (parallel.plan.layout_order).
  """
  user = plan.layout_order(layout, ring_size, length)
  row_of = np.argsort(user)                    # row_of[t]: the user's row holding position t
  rows = np.where(positions < length, row_of[np.minimum(positions, length - 1)], length)
  back = np.argsort(positions)[user]
  return rows.astype(np.int32), back.astype(np.int32)


def _take(x, rows, axis: int):
  return jnp.take(x, jnp.asarray(rows), axis=axis, mode="fill", fill_value=0)


def _whole_along(x, axis: int):
  """x unsharded along `axis` where it is typed sharded along it on Explicit axes: JAX
  refuses a gather along a sharded dim there (the sequence of a zigzag or striped layout
  padded here, its inputs sequence-sharded). The strategy's shard_map lays it out again."""
  mesh = _explicit_mesh(x)
  if mesh is None:
    return x
  spec = _spec_on(x, mesh, x.ndim)
  return _resharded(x, mesh, spec[:axis] + (None,) + spec[axis + 1:])


def regather(x, rows, back, axis: int = 1):
  """x.take(rows, axis) with 0 where rows is out of range, for `rows` that take each row of
  x once (padded_rows' gathers, either way round: rows / back into the padded sequence,
  back / rows out of it); `back` takes them back: back[r] is where row r of x went.

  Its derivative is that gather back (a row's cotangent is the one of the slot it went to)
  rather than JAX's transpose of a gather, a scatter-add, which costs as much as a quarter
  of the attention's own backward on the H200 at T = 16k. Integer arrays (segment ids) take
  the plain gather.
  """
  # Before the custom VJP, so that the gather's cotangent has the type of its x.
  x = _whole_along(x, axis)
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return _take(x, rows, axis)

  @jax.custom_vjp
  def gather(x):
    return _take(x, rows, axis)

  def forward(x):
    return _take(x, rows, axis), None

  def backward(_, g):
    return (_take(g, back, axis),)

  gather.defvjp(forward, backward)
  return gather(x)


def _fit(x, length: int, rows, axis: int = 1):
  """x padded at its end to `length` along `axis`, or its rows gathered by `rows` = (rows,
  back) of padded_rows (fill 0)."""
  if rows is None:
    return _pad(x, length, axis)
  return regather(x, *rows, axis=axis)


def canonical(call: _validate.Call, query, key, value, segment_ids, q_lengths, kv_lengths, *,
              t_len: int, s_len: int, q_pos=None, k_pos=None, q_rows=None, k_rows=None,
              lead_order=None):
  """(q [B, T', N, H], k [B, S', K, H], v [B, S', K, Hv], q_seg [B, T'] | None,
  kv_seg [B, S'] | None) of a checked call.

  t_len, s_len: the lengths T', S' the strategy runs: ring_attention pads a contiguous
  sequence to them (rows at natural positions >= call.t, call.s are padding);
  ring_attention_sharded passes its local lengths. q_pos [T'], k_pos [S']: the natural
  positions of the rows (the layout's; per device under ring_attention_sharded); default
  0..T'-1 and 0..S'-1. q_rows, k_rows: padded_rows' (rows, back) pairs, where a zigzag or
  striped sequence is padded (None: padding at the end, or none). lead_order: the order
  of flattening the leading dims (_mesh.lead_order; finish puts them back).
  """

  rows = _rows(query, call.lead, lead_order)

  def flat(x):
    return _rows_like(x, call.lead, lead_order, rows)

  q, k, v = (_fit(x, n, r) for x, n, r in ((rows, t_len, q_rows),
                                           (flat(key), s_len, k_rows),
                                           (flat(value), s_len, k_rows)))
  if call.sinks and call.softcap is None:
    # The rule: a row whose query holds a NaN or Inf is non-finite. A -Inf against keys
    # positive in its component gives only scores of -inf, which the kernels cannot tell
    # from scores below float32's range (overflowed_rows), and a sink would then take the
    # row's weight: a finite answer. Under a cap the strategies' guard_q does it.
    q = base.nan_query_rows(q)
  if not (call.masked_by_ids or _validate.padding_needs_ids(call, t_len, s_len)):
    return q, k, v, None, None, None
  b = q.shape[0]
  bad = None
  if call.segments:
    q_ids, kv_ids = (segment_ids if isinstance(segment_ids, (tuple, list))
                     else (segment_ids, segment_ids))
    # Typed like the rows (inside shard_map: varying over every axis q varies over), so that
    # ring_attention_sharded can reduce it over the whole ring.
    bad = base.match_vma(_outside_int32(flat(jnp.asarray(q_ids)))
                         | _outside_int32(flat(jnp.asarray(kv_ids))), rows)
    q_ids = _as_rows(_fit(flat(jnp.asarray(q_ids, jnp.int32)), t_len, q_rows), q)
    kv_ids = _as_rows(_fit(flat(jnp.asarray(kv_ids, jnp.int32)), s_len, k_rows), k)
  else:
    q_ids = jnp.zeros((b, t_len), jnp.int32)
    kv_ids = jnp.zeros((b, s_len), jnp.int32)
  q_pos = jnp.arange(t_len, dtype=jnp.int32) if q_pos is None else q_pos
  k_pos = jnp.arange(s_len, dtype=jnp.int32) if k_pos is None else k_pos
  q_ok = jnp.broadcast_to(q_pos < call.t if t_len > call.t else True, (b, t_len))
  k_ok = jnp.broadcast_to(k_pos < call.s if s_len > call.s else True, (b, s_len))
  if q_lengths is not None:
    q_len = _as_rows(flat(jnp.asarray(_validate.int32_clipped(q_lengths))), q)
    q_ok = q_ok & (q_pos[None, :] < q_len[:, None])
  if kv_lengths is not None:
    kv_len = _as_rows(flat(jnp.asarray(_validate.int32_clipped(kv_lengths))), k)
    k_ok = k_ok & (k_pos[None, :] < kv_len[:, None])
  # Inside a caller's shard_map, ids made from replicated lengths alone vary over no mesh
  # axis: typed like the rows they mask, so that the ring can carry them with K and V.
  return (q, k, v, base.match_vma(jnp.where(q_ok, q_ids, base.PAD_Q).astype(jnp.int32), q),
          base.match_vma(jnp.where(k_ok, kv_ids, base.PAD_K).astype(jnp.int32), k), bad)


def _outside_int32(ids):
  """[B] bool: whether any of a batch row's segment ids ([B, L], any integer dtype) lies at
  int32's ends (the padding ids) or past them (it would wrap on conversion, onto another
  segment or the padding). check_segment_values refuses such ids where it can read them;
  traced ones reach here, and finish makes their batch row NaN rather than an answer for
  segments the caller did not give."""
  info = jnp.iinfo(ids.dtype)
  bad = jnp.zeros(ids.shape, bool)
  if info.max >= _validate.INT32_MAX:
    bad = bad | (ids >= _validate.INT32_MAX)
  if info.min <= _validate.INT32_MIN:
    bad = bad | (ids <= _validate.INT32_MIN)
  return jnp.any(bad, axis=-1)


def add_sinks(out, lse, sinks):
  """Each row's softmax with its head's sink logit in the denominator (no value):
  lse' = logaddexp(lse, sink), out' = out * exp(lse - lse'); rows without a key keep
  out = 0 and lse = -inf; NaN stays NaN.

  Args:
    out [B, T, N, Hv] (any float dtype; computed in float32, returned in out's dtype),
    lse [B, N, T] float32, sinks [N].
  """
  sink = jnp.asarray(sinks, jnp.float32)[None, :, None]                  # [1, N, 1]
  # Inside a caller's shard_map the rows vary over mesh axes that a replicated sink does not:
  # typed as varying like them, its cotangent is summed over those devices by JAX.
  sink = base.match_vma(_heads_like(sink, lse), lse)
  scaled, total = _sink_rescale(out.astype(jnp.float32), lse, sink)
  return scaled.astype(out.dtype), total


def _heads_like(sink, lse):
  """sink [1, N, 1] sharded over the heads as lse [B, N, T] is, where sink is typed on a mesh
  with Explicit axes: sinks sharded otherwise (over "data", FSDP-style) met lse in a result
  JAX refuses (an axis twice) or gave a cotangent of another type. The reshard's own
  transpose gives the sinks' gradient their sharding back."""
  mesh = _explicit_mesh(sink)
  if mesh is None:
    return sink
  return _resharded(sink, mesh, (None, _spec_on(lse, mesh, 2)[1], None))


def _as_rows(x, rows):
  """Segment ids [B, L] or lengths [B] sharded as the leading dims of rows [B, L, ...],
  where x is typed on a mesh with Explicit axes: ids sharded along the sequence over an
  axis that shards the lengths' batch met them in a mask JAX refuses (an axis twice)."""
  mesh = _explicit_mesh(x)
  if mesh is None:
    return x
  return _resharded(x, mesh, _spec_on(rows, mesh, x.ndim))


def _sink_weight(lse, sink):
  """(w = exp(lse - lse'), 1 - w = exp(sink - lse'), lse') per row [B, N, T]: w = 0,
  1 - w = 1 and lse' = -inf for a row without a key; all NaN for a row whose lse is NaN.
  1 - w is evaluated as its own exponential: as 1 - w it would lose every digit when the
  sink's share is below float32's epsilon, and with them the sink's gradient.
  A sink of +inf is a non-finite logit that every row with a key sees: all three NaN there,
  as a softmax over the scores and the sink gives (exp(inf - inf)); the formulas alone
  would give w = 0, an output of 0 whose gradient is NaN."""
  none = lse == -jnp.inf
  lse_safe = jnp.where(none, 0.0, lse)
  total = jnp.where(none, -jnp.inf, jnp.logaddexp(lse_safe, sink))
  total_safe = jnp.where(none, 0.0, total)
  weight = jnp.where(none, 0.0, jnp.exp(lse_safe - total_safe))
  rest = jnp.where(none, 1.0, jnp.exp(sink - total_safe))
  infinite = (sink == jnp.inf) & ~none
  weight, rest, total = (jnp.where(infinite, jnp.nan, x) for x in (weight, rest, total))
  return weight, rest, total


def _times(g, x):
  """g * x, except 0 where the cotangent g is 0 and x is not finite: a row whose output the
  loss ignores carries nothing back, even when it saw a NaN (the non-finite rule;
  kernels/base.guard_backward reads such a row as silent). Where x is finite the product
  stays, so its derivative with respect to g is x, also at g = 0."""
  return jnp.where((g == 0) & ~jnp.isfinite(x), 0.0, g * x)


@jax.custom_vjp
def _sink_rescale(out, lse, sink):
  return _sink_rescale_fwd(out, lse, sink)[0]


def _sink_rescale_fwd(out, lse, sink):
  weight, rest, total = _sink_weight(lse, sink)
  return (out * weight.transpose(0, 2, 1)[..., None], total), (out, lse, weight, rest, sink)


def _sink_rescale_bwd(res, cts):
  # With w = exp(lse - lse') and lse' = logaddexp(lse, sink): dw/dlse = w (1 - w),
  # dw/dsink = -w (1 - w), dlse'/dlse = w, dlse'/dsink = 1 - w; rows without a key depend
  # on nothing.
  out, lse, weight, rest, sink = res
  g_out, g_total = cts
  live = lse != -jnp.inf
  d_out = _times(g_out, weight.transpose(0, 2, 1)[..., None])
  d_weight = jnp.sum(_times(g_out, out), axis=-1).transpose(0, 2, 1)       # [B, N, T]
  slope = weight * rest
  d_lse = jnp.where(live, _times(d_weight, slope) + _times(g_total, weight), 0.0)
  d_sink = jnp.where(live, _times(g_total, rest) - _times(d_weight, slope), 0.0)
  return d_out, d_lse, _typed_like(jnp.sum(d_sink, axis=(0, 2), keepdims=True), sink)


def _typed_like(x, ref):
  """x with ref's sharding type. On a mesh with Explicit axes a cotangent must have its
  primal's type: the sink's gradient, summed over rows, keeps the heads' sharding of lse
  (heads sharded over a model axis), while the sink itself may be replicated."""
  want, have = jax.typeof(ref).sharding, jax.typeof(x).sharding
  if getattr(want, "spec", None) == getattr(have, "spec", None):
    return x
  if getattr(getattr(want, "mesh", None), "empty", False):
    # ref is typed on no mesh (a replicated sink under jit, without jax.set_mesh): replicated
    # on x's mesh is its type there (resharding to a mesh of no axes is refused)
    if getattr(getattr(have, "mesh", None), "empty", True):
      return x
    want = NamedSharding(have.mesh, P(*(None,) * x.ndim))
  return _mesh.reshard(x, want)


_sink_rescale.defvjp(_sink_rescale_fwd, _sink_rescale_bwd)


def overflowed_rows(out, lse):
  """Rows whose every valid score lay below float32's range made NaN, out and lse.

  Finite inputs whose scaled products overflow float32 give scores of -inf, as masked pairs
  do; the kernels mark a row that met valid keys but only such scores with lse = LOWEST
  (kernels/base.py), and the merges and sinks keep it there only where nothing else in the
  row's softmax is representable. float32 has no answer for such a row (exactly, a one-hot
  on the largest true score): it becomes NaN, as a softmax over scores of -inf makes it,
  instead of a silently wrong 0. NaN is added, so the cotangents pass as they are: the backward
  (base.guard_backward) makes the row's gradients NaN where the loss reads it.

  Args:
    out [B, T, N, Hv], lse [B, N, T] float32 (after sinks).
  """
  return nan_where(out, lse, lse == base.LOWEST)


def nan_where(out, lse, rows):
  """out [B, T, N, Hv] and lse [B, N, T] with NaN added where `rows` (bool, broadcast to
  lse's [B, N, T]) holds."""
  nan = jnp.broadcast_to(jnp.where(rows, jnp.nan, 0.0).astype(jnp.float32), lse.shape)
  return out + nan.transpose(0, 2, 1)[..., None].astype(out.dtype), lse + nan


def finish(call: _validate.Call, out, lse, sinks, rows=None, lead_order=None, bad_ids=None):
  """The strategy's (out [B, T', N, Hv], lse [B, N, T']) in the user's shapes: sinks added,
  padding trimmed (rows: padded_rows' (rows, back) of the queries, where a zigzag or striped
  sequence was padded), leading dims restored (in the order canonical took, lead_order);
  (out, lse) or out alone as return_residual says. bad_ids: [B] bool or None, canonical's
  batch rows with segment ids outside int32 (every device's, under ring_attention_sharded):
  NaN throughout."""
  # Named as the strategies' residuals (parallel/local.RESIDUAL_NAMES): where a policy of
  # jax.checkpoint saves them, a rematerialized backward rebuilds what follows from these
  # (sinks, trimming: elementwise and local) without running the strategy again, the
  # collectives that bring its output back to the sequence's layout included.
  out, lse = local.named_output(out, lse)
  if sinks is not None:
    out, lse = add_sinks(out, lse, sinks)
  out, lse = overflowed_rows(out, lse)
  if bad_ids is not None:
    out, lse = nan_where(out, lse, bad_ids[:, None, None])
  if rows is None:
    out, lse = out[:, :call.t], lse[:, :, :call.t]
  else:
    taken, back = rows
    out, lse = (regather(x, back, taken, axis=a) for x, a in ((out, 1), (lse, 2)))
  out, lse = (_unrows(x, call.lead, lead_order) for x in (out, lse))
  return (out, lse) if call.return_residual else out
