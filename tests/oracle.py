"""The independent reference: dense masked attention in float32 at HIGHEST precision.

Written directly from the definition (repeat K/V per query head, full [T, S] scores, one
softmax), sharing no code with ringflash. Rows with no valid key give 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q, k, v, *, causal=False, scale=None, q_seg=None, kv_seg=None, upcast=True,
              window=None, q_pos=None, kv_pos=None, softcap=None, sinks=None,
              q_lengths=None, kv_lengths=None):
  """Dense attention. q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] -> (out [B, T, N, Hv],
  lse [B, N, T]).

  window: None, int w or (left, right): query i sees keys j with i - left <= j <= i + right.
  q_pos [T], kv_pos [S]: the positions of the rows (default 0..T-1, 0..S-1), for inputs
  given in a permuted order; masks and lengths apply to positions.

  softcap: scores become softcap * tanh(scores / softcap), before the mask.
  sinks [N]: a logit per query head in every row's softmax denominator, with no value; lse
  then includes it. q_lengths, kv_lengths [B]: keys at or past a sequence's length are
  masked; query rows at or past it have no key (output 0).

  upcast=True computes in float32 at HIGHEST precision (the oracle); upcast=False computes in
  the inputs' dtype (the "plain bf16 implementation" of the bf16 error criterion).

  Inputs must be finite: a non-finite value would reach rows that do not see it (0 * NaN in
  the product with V). The non-finite tests compare the rows a bad value cannot reach with
  this oracle on the clean inputs.
  """
  if upcast:
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  t, n, h = q.shape[1], q.shape[2], q.shape[3]
  s, kh = k.shape[1], k.shape[2]
  scale = 1.0 / (h ** 0.5) if scale is None else scale
  k = jnp.repeat(k, n // kh, axis=2)
  v = jnp.repeat(v, n // kh, axis=2)
  prec = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=prec) * jnp.asarray(scale, q.dtype)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  valid = jnp.ones((1, 1, t, s), bool)
  i = jnp.arange(t) if q_pos is None else jnp.asarray(q_pos)
  j = jnp.arange(s) if kv_pos is None else jnp.asarray(kv_pos)
  if causal:
    valid = valid & (j[None, :] <= i[:, None])[None, None]
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    valid = valid & ((i[:, None] - j[None, :] <= left) & (j[None, :] - i[:, None] <= right))[
        None, None]
  if q_seg is not None:
    valid = valid & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  if kv_lengths is not None:     # by position, as the library counts them in any layout
    valid = valid & (j[None, :] < jnp.asarray(kv_lengths)[:, None])[:, None, None]
  if q_lengths is not None:
    valid = valid & (i[None, :] < jnp.asarray(q_lengths)[:, None])[:, None, :, None]
  logits = jnp.where(valid, logits, -jnp.inf)
  row_ok = valid.any(axis=-1)                                   # [B|1, 1, T]
  m = jnp.where(row_ok, logits.max(axis=-1), 0.0)
  if sinks is not None:
    sink = jnp.asarray(sinks, logits.dtype)[None, :, None]     # [1, N, 1]
    m = jnp.where(row_ok, jnp.maximum(m, sink), 0.0)
  m = jax.lax.stop_gradient(m)         # any shift gives the same softmax
  p = jnp.where(valid, jnp.exp(logits - m[..., None]), 0.0)
  denom = p.sum(axis=-1)
  if sinks is not None:
    denom = denom + jnp.where(row_ok, jnp.exp(sink - m), 0.0)
  safe = jnp.where(row_ok, denom, 1.0)
  w = p / safe[..., None]
  out = jnp.einsum("bnts,bsnh->btnh", w.astype(v.dtype), v, precision=prec)
  lse = jnp.where(row_ok, m + jnp.log(safe), -jnp.inf)
  return out, jnp.broadcast_to(lse, (q.shape[0], n, t)).astype(jnp.float32)
