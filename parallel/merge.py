"""Merging partial attention results through their log-sum-exp (fp32, -inf safe)."""

from __future__ import annotations

import jax.numpy as jnp


def merge(o_a, lse_a, o_b, lse_b):
  """Combines attention over two disjoint key sets into attention over their union.

  lse = logaddexp(lse_a, lse_b); o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse).
  A side with lse = -inf (no valid key) has weight exactly 0; both -inf gives o = 0 and
  lse = -inf. Every exp and log sees a finite argument, so neither the value nor its
  gradient can be NaN (double `where`: the unused branch is also kept finite).

  Args:
    o_a, o_b: [B, T, N, H] float32, each normalized over its own keys.
    lse_a, lse_b: [B, N, T] float32.

  Returns:
    (o [B, T, N, H] float32, lse [B, N, T] float32).
  """
  hi = jnp.maximum(lse_a, lse_b)
  alive = jnp.isfinite(hi)
  hi_safe = jnp.where(alive, hi, 0.0)
  # exp(-inf - finite) = 0 exactly; arguments are never NaN because hi_safe is finite.
  e_a = jnp.exp(jnp.where(alive, lse_a, -jnp.inf) - hi_safe)
  e_b = jnp.exp(jnp.where(alive, lse_b, -jnp.inf) - hi_safe)
  total = e_a + e_b                                     # >= 1 where alive, 0 elsewhere
  total_safe = jnp.where(alive, total, 1.0)
  lse = jnp.where(alive, hi_safe + jnp.log(total_safe), -jnp.inf)
  w_a = jnp.where(alive, e_a / total_safe, 0.0)
  w_b = jnp.where(alive, e_b / total_safe, 0.0)

  def rows(w):                                          # [B, N, T] -> [B, T, N, 1]
    return w.transpose(0, 2, 1)[..., None]

  return o_a * rows(w_a) + o_b * rows(w_b), lse
