"""The kernel contract on one block pair, and the LSE merge, without any mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import oracle
from ringflash.kernels import KernelSpec, xla
from ringflash.parallel import merge


@pytest.mark.parametrize("q_start,k_start", [(64, 0), (0, 64), (32, 16)])
def test_forward_on_a_block_pair_at_global_positions(q_start, k_start):
  q, k, v, _ = helpers.inputs(0, 2, 32, 48, 4, 2, 32, jnp.float32)
  q_pos = q_start + jnp.arange(32, dtype=jnp.int32)
  k_pos = k_start + jnp.arange(48, dtype=jnp.int32)
  spec = KernelSpec(scale=0.2, causal=True, block_q=8, block_k=16)
  o, lse = jax.jit(xla.forward, static_argnums=7)(q, k, v, q_pos, k_pos, None, None, spec)
  o_ref, lse_ref = oracle.attention(q, k, v, causal=True, scale=0.2, q_pos=q_pos,
                                    kv_pos=k_pos)
  assert o.dtype == jnp.float32 and lse.shape == (2, 4, 32)
  assert helpers.max_err(o, o_ref) <= 1e-5
  assert helpers.max_err(lse, lse_ref) <= 1e-5


def test_two_block_pairs_merge_into_full_attention():
  """Splitting the keys in two, running the kernel on each half and merging is exact."""
  q, k, v, _ = helpers.inputs(1, 1, 32, 64, 4, 1, 16, jnp.float32)
  pos = jnp.arange(64, dtype=jnp.int32)
  spec = KernelSpec(scale=0.25, causal=True, block_q=8, block_k=8)
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


def test_backward_on_a_block_pair_matches_autodiff_of_the_oracle():
  """With the global out and lse of the full problem, two block pairs' gradients add up."""
  q, k, v, dout = helpers.inputs(2, 1, 32, 64, 4, 2, 16, jnp.float32)
  spec = KernelSpec(scale=0.25, causal=False, block_q=8, block_k=16)
  q_pos = jnp.arange(32, dtype=jnp.int32)
  pos = jnp.arange(64, dtype=jnp.int32)
  out, lse = oracle.attention(q, k, v, scale=0.25)
  parts = [xla.backward(q, k[:, s], v[:, s], out, lse, dout, q_pos, pos[s], None, None, spec)
           for s in (slice(0, 32), slice(32, 64))]
  dq = parts[0][0] + parts[1][0]
  dk = jnp.concatenate([parts[0][1], parts[1][1]], axis=1)
  dv = jnp.concatenate([parts[0][2], parts[1][2]], axis=1)
  _, vjp = jax.vjp(lambda q, k, v: oracle.attention(q, k, v, scale=0.25)[0], q, k, v)
  for got, want in zip((dq, dk, dv), vjp(dout)):
    assert helpers.max_err(got, want) <= 1e-4
