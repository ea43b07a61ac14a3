"""The LSE merge (parallel/merge.py) and the sinks (ringflash/_inputs.add_sinks), without
any mesh. The kernel contract itself, one block pair on every backend, is in
tests/contract/."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import helpers
import oracle
from ringflash import _inputs
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


def test_merge_is_exact_where_the_sides_lie_past_exps_range_apart():
  """Two sides whose lse differ by more than exp's range (88) either way, and by little:
  the merged row is the larger side's (the other's weight underflows to 0 exactly), never
  inf or NaN, forward and backward, against the formula in float64. (A merge that shifts by
  one side's lse instead of the larger overflows there.)"""
  rng = np.random.default_rng(1)
  o_a, o_b = (jnp.asarray(rng.normal(size=(1, 4, 1, 3)), jnp.float32) for _ in range(2))
  lse_a = jnp.asarray([[[0.0, 200.0, -150.0, 3.0]]], jnp.float32)
  lse_b = jnp.asarray([[[200.0, 0.0, 40.0, 2.5]]], jnp.float32)
  o, lse = merge(o_a, lse_a, o_b, lse_b)
  a, b = np.asarray(lse_a, np.float64)[0, 0], np.asarray(lse_b, np.float64)[0, 0]
  total = np.logaddexp(a, b)
  w_a, w_b = np.exp(a - total), np.exp(b - total)
  want = (np.asarray(o_a, np.float64)[0, :, 0] * w_a[:, None]
          + np.asarray(o_b, np.float64)[0, :, 0] * w_b[:, None])
  np.testing.assert_allclose(np.asarray(o)[0, :, 0], want, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(lse)[0, 0], total, rtol=1e-6)

  def f(o_a, lse_a, o_b, lse_b):
    o, lse = merge(o_a, lse_a, o_b, lse_b)
    return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.cos(lse))

  grads = jax.grad(f, argnums=(0, 1, 2, 3))(o_a, lse_a, o_b, lse_b)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  # d o / d o_a is the weight of a: 1 or 0 where the sides lie far apart
  do = np.cos(want)
  np.testing.assert_allclose(np.asarray(grads[0])[0, :, 0], do * w_a[:, None], atol=1e-6)
  np.testing.assert_allclose(np.asarray(grads[2])[0, :, 0], do * w_b[:, None], atol=1e-6)


def _sinks_by_autodiff(out, lse, sinks):
  """add_sinks' formula, differentiated by JAX (the reference for its written-out VJP)."""
  sink = sinks[None, :, None]
  total = jnp.logaddexp(lse, sink)
  return out * jnp.exp(lse - total).transpose(0, 2, 1)[..., None], total


def test_sinks_gradient_is_the_formulas_for_every_cotangent():
  """add_sinks' derivative against JAX's of lse' = logaddexp(lse, sink), out' = out exp(lse -
  lse'), for cotangents of both out' and lse' (the contract's cases send zeros for lse');
  rows without a key (lse = -inf) keep 0 and -inf and pass nothing back."""
  keys = jax.random.split(jax.random.key(3), 5)
  b, t, n, hv = 2, 6, 3, 4
  out = jax.random.normal(keys[0], (b, t, n, hv), jnp.float32)
  lse = 2.0 * jax.random.normal(keys[1], (b, n, t), jnp.float32)
  sinks = jax.random.normal(keys[2], (n,), jnp.float32)
  g_out = jax.random.normal(keys[3], (b, t, n, hv), jnp.float32)
  g_lse = jax.random.normal(keys[4], (b, n, t), jnp.float32)
  got_val, got_vjp = jax.vjp(_inputs.add_sinks, out, lse, sinks)
  want_val, want_vjp = jax.vjp(_sinks_by_autodiff, out, lse, sinks)
  for g, w in zip(got_val + got_vjp((g_out, g_lse)), want_val + want_vjp((g_out, g_lse))):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6)
  empty = lse.at[0, 1, 2].set(-jnp.inf)
  zeroed = out.at[0, 2, 1].set(0.0)
  (o, l), vjp = jax.vjp(_inputs.add_sinks, zeroed, empty, sinks)
  assert np.all(np.asarray(o)[0, 2, 1] == 0.0) and np.isneginf(np.asarray(l)[0, 1, 2])
  d_out, d_lse, d_sinks = vjp((g_out, g_lse))
  assert np.all(np.asarray(d_out)[0, 2, 1] == 0.0) and np.asarray(d_lse)[0, 1, 2] == 0.0
  # The sinks' gradient: the formula's over the other rows (that row's lse' is -inf whatever
  # the sink, so its cotangent does not reach the sink).
  _, ref_vjp = jax.vjp(_sinks_by_autodiff, zeroed, empty.at[0, 1, 2].set(-1e30), sinks)
  want = ref_vjp((g_out, g_lse.at[0, 1, 2].set(0.0)))[2]
  np.testing.assert_allclose(np.asarray(d_sinks), np.asarray(want), rtol=2e-6, atol=2e-6)


def test_sinks_gradient_keeps_its_digits_when_the_sink_is_small():
  """Rows whose lse is far above the sink (the sink's share 1 - w = exp(sink - lse') below
  float32's epsilon): the sink's gradient, sum of g_lse' (1 - w) - (g_out . out) w (1 - w),
  against the same formula in float64, to 1e-5 relative. Computed as 1 - w in float32 it
  loses every digit (and its sign)."""
  keys = jax.random.split(jax.random.key(5), 4)
  b, t, n, hv = 2, 64, 2, 8
  out = jax.random.normal(keys[0], (b, t, n, hv), jnp.float32)
  lse = 20.0 + 4.0 * jax.random.uniform(keys[1], (b, n, t), jnp.float32)
  sinks = jnp.array([0.0, 3.0], jnp.float32)
  g_out = jax.random.normal(keys[2], (b, t, n, hv), jnp.float32)
  g_lse = jax.random.normal(keys[3], (b, n, t), jnp.float32)
  _, vjp = jax.vjp(_inputs.add_sinks, out, lse, sinks)
  got = np.asarray(vjp((g_out, g_lse))[2], np.float64)
  lse64 = np.asarray(lse, np.float64)
  sink64 = np.asarray(sinks, np.float64)[None, :, None]
  total = np.logaddexp(lse64, sink64)
  w, rest = np.exp(lse64 - total), np.exp(sink64 - total)
  d_weight = np.einsum("btnh,btnh->bnt", np.asarray(g_out, np.float64),
                       np.asarray(out, np.float64))
  want = np.sum(np.asarray(g_lse, np.float64) * rest - d_weight * w * rest, axis=(0, 2))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def test_sinks_keep_the_nonfinite_rule():
  """A row whose lse is NaN (it saw a NaN) stays NaN forward. Backward, a zero cotangent on
  it carries nothing back (finite gradients for a loss that ignores it); a nonzero one
  carries NaN into that row's gradients and the sinks'."""
  out = jnp.ones((1, 4, 2, 3), jnp.float32).at[0, 1, 0].set(jnp.nan)
  lse = jnp.zeros((1, 2, 4), jnp.float32).at[0, 0, 1].set(jnp.nan)
  sinks = jnp.array([0.5, -0.5], jnp.float32)
  (o, l), vjp = jax.vjp(_inputs.add_sinks, out, lse, sinks)
  assert np.all(np.isnan(np.asarray(o)[0, 1, 0])) and np.isnan(np.asarray(l)[0, 0, 1])
  assert np.all(np.isfinite(np.asarray(o)[0, [0, 2, 3]]))
  g_out = jnp.ones_like(out).at[0, 1, 0].set(0.0)
  grads = vjp((g_out, jnp.zeros_like(lse).at[0, 1, 3].set(1.0)))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
  d_out, d_lse, d_sinks = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))
  assert np.all(np.isnan(np.asarray(d_out)[0, 1, 0])) and np.isnan(np.asarray(d_lse)[0, 0, 1])
  assert np.isnan(np.asarray(d_sinks)[0]) and np.isfinite(np.asarray(d_sinks)[1])


def test_an_infinite_sink_is_nan_in_every_row_with_a_key_forward_and_backward():
  """A sink of +inf is a non-finite logit every row with a key sees: its rows are NaN forward
  (out and lse), as a softmax over the scores and the sink gives, and backward (the formulas
  alone gave an output of 0 whose gradients were NaN). Rows without a key stay 0 / -inf; a
  sink of -inf is no sink; a zero cotangent still carries nothing back."""
  out = jnp.ones((1, 3, 2, 2), jnp.float32)
  lse = jnp.zeros((1, 2, 3), jnp.float32).at[0, 0, 2].set(-jnp.inf)
  sinks = jnp.array([jnp.inf, -jnp.inf], jnp.float32)
  (o, l), vjp = jax.vjp(_inputs.add_sinks, out, lse, sinks)
  o, l = np.asarray(o), np.asarray(l)
  assert np.all(np.isnan(o[0, :2, 0])) and np.all(np.isnan(l[0, 0, :2]))
  assert np.all(o[0, 2, 0] == 0) and l[0, 0, 2] == -np.inf
  np.testing.assert_array_equal(o[0, :, 1], np.asarray(out)[0, :, 1])    # -inf: no sink
  np.testing.assert_array_equal(l[0, 1], np.asarray(lse)[0, 1])
  d_out, d_lse, d_sinks = vjp((jnp.ones_like(out), jnp.ones_like(lse)))
  assert np.all(np.isnan(np.asarray(d_out)[0, :2, 0])) and np.isnan(np.asarray(d_sinks)[0])
  assert np.all(np.isnan(np.asarray(d_lse)[0, 0, :2]))
  assert np.all(np.isfinite(np.asarray(d_out)[0, :, 1])) and np.asarray(d_sinks)[1] == 0
  quiet = vjp((jnp.zeros_like(out).at[0, :, 1].set(1.0), jnp.zeros_like(lse)))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in quiet)
