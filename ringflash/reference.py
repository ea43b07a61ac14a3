"""The dense reference of `ringflash demo` and `ringflash check`: attention written from its
definition, in float32 at HIGHEST precision, sharing no code with the kernels or the ring.

(The test suite has its own, tests/oracle.py: the installed package does not ship tests/.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_attention(q, k, v, causal: bool, chunk: int):
  """Dense softmax attention in float32, a chunk of query rows at a time.

  q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] -> [B, T, N, Hv] in float32.

  Written from the definition (no tiling, no online softmax, no ring), so it shares nothing
  with the kernels; chunking only bounds memory: [B, N, chunk, S] scores at a time.
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  chunk = min(chunk, t)
  if t % chunk:
    raise ValueError(f"reference chunk {chunk} must divide the sequence length {t}")
  kf = jnp.repeat(k.astype(jnp.float32), n // kh, axis=2)
  vf = jnp.repeat(v.astype(jnp.float32), n // kh, axis=2)

  @jax.checkpoint
  def rows(start):
    qc = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1).astype(jnp.float32)
    logits = jnp.einsum("btnh,bsnh->bnts", qc, kf, precision="highest") / jnp.sqrt(h)
    if causal:
      visible = jnp.arange(s)[None, :] <= (start + jnp.arange(chunk))[:, None]
      logits = jnp.where(visible, logits, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), vf,
                      precision="highest")

  out = jax.lax.map(rows, jnp.arange(0, t, chunk))          # [T / chunk, B, chunk, N, Hv]
  return out.transpose(1, 0, 2, 3, 4).reshape(b, t, n, v.shape[-1])
