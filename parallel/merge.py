"""Merging partial attention results through their log-sum-exp (fp32, -inf safe)."""

from __future__ import annotations

import jax.numpy as jnp


def merge(o_a, lse_a, o_b, lse_b):
  """Combines attention over two disjoint key sets into attention over their union.

  lse = logaddexp(lse_a, lse_b); o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse).
  A side with lse = -inf (no valid key) has weight exactly 0; both -inf gives o = 0 and
  lse = -inf, with finite gradients (double `where`: the unused branch is kept finite). A
  NaN (or +inf) statistic of either side makes the row NaN: a row that saw a non-finite
  value stays non-finite (kernels/base.py, the non-finite rule); only -inf means "no key".

  Args:
    o_a, o_b: [B, T, N, Hv] float32, each normalized over its own keys.
    lse_a, lse_b: [B, N, T] float32.

  Returns:
    (o [B, T, N, Hv] float32, lse [B, N, T] float32).
  """
  none = (lse_a == -jnp.inf) & (lse_b == -jnp.inf)
  hi = jnp.maximum(lse_a, lse_b)                        # NaN if either side is NaN
  hi_safe = jnp.where(none, 0.0, hi)
  # exp(-inf - finite) = 0 exactly; a NaN side gives NaN weights, as it must.
  e_a = jnp.exp(jnp.where(none, -jnp.inf, lse_a) - hi_safe)
  e_b = jnp.exp(jnp.where(none, -jnp.inf, lse_b) - hi_safe)
  total = e_a + e_b                                     # >= 1 on rows with a key
  total_safe = jnp.where(none, 1.0, total)
  lse = jnp.where(none, -jnp.inf, hi_safe + jnp.log(total_safe))
  w_a = jnp.where(none, 0.0, e_a / total_safe)
  w_b = jnp.where(none, 0.0, e_b / total_safe)

  def rows(w):                                          # [B, N, T] -> [B, T, N, 1]
    return w.transpose(0, 2, 1)[..., None]

  return o_a * rows(w_a) + o_b * rows(w_b), lse
