"""The LSE merge (parallel/merge.py), without any mesh. The kernel contract itself, one
block pair on every backend, is in tests/contract/."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import helpers
import oracle
from ringflash.kernels import KernelSpec, XlaBlockSizes, xla
from ringflash.parallel import merge


def test_two_block_pairs_merge_into_full_attention():
  """Splitting the keys in two, running the kernel on each half and merging is exact."""
  q, k, v, _ = helpers.inputs(1, 1, 32, 64, 4, 1, 16, jnp.float32)
  pos = jnp.arange(64, dtype=jnp.int32)
  spec = KernelSpec(scale=0.25, causal=True, tiles=XlaBlockSizes(8, 8, 8, 8))
  q_pos = 32 + jnp.arange(32, dtype=jnp.int32)
  a = xla.forward(q, k[:, :32], v[:, :32], q_pos, pos[:32], None, None, spec)
  b = xla.forward(q, k[:, 32:], v[:, 32:], q_pos, pos[32:], None, None, spec)
  o, lse = merge(*a, *b)
  o_ref, lse_ref = oracle.attention(q, k, v, causal=True, scale=0.25, q_pos=q_pos,
                                    kv_pos=pos)
  assert helpers.max_err(o, o_ref) <= 1e-5 and helpers.max_err(lse, lse_ref) <= 1e-5


def test_merge_with_empty_sides_is_exact_and_nan_free():
  rng = np.random.default_rng(0)
  o_a = jnp.asarray(rng.normal(size=(1, 3, 2, 4)), jnp.float32)
  o_b = jnp.asarray(rng.normal(size=(1, 3, 2, 4)), jnp.float32)
  # rows: 0 both present, 1 only b, 2 neither (per head the same).
  lse_a = jnp.asarray([[[0.5, -jnp.inf, -jnp.inf]] * 2], jnp.float32)
  lse_b = jnp.asarray([[[1.5, 0.25, -jnp.inf]] * 2], jnp.float32)
  zero = jnp.zeros_like(o_a)
  o, lse = merge(o_a, lse_a, jnp.where(jnp.isfinite(lse_b).transpose(0, 2, 1)[..., None],
                                         o_b, zero), lse_b)
  w = 1.0 / (1.0 + np.exp(1.0))   # weight of a in row 0: e^0.5 / (e^0.5 + e^1.5)
  np.testing.assert_allclose(o[0, 0], w * o_a[0, 0] + (1 - w) * o_b[0, 0], rtol=1e-6)
  np.testing.assert_allclose(o[0, 1], o_b[0, 1], rtol=1e-6)
  assert np.all(np.asarray(o[0, 2]) == 0.0) and np.all(np.isneginf(np.asarray(lse[0, :, 2])))
  np.testing.assert_allclose(lse[0, 0, 0], np.logaddexp(0.5, 1.5), rtol=1e-6)

  def f(o_a, lse_a, o_b, lse_b):
    o, lse = merge(o_a, lse_a, o_b, lse_b)
    return jnp.sum(o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  grads = jax.grad(f, argnums=(0, 1, 2, 3))(o_a, lse_a, o_b, lse_b)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
