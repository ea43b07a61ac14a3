"""ringflash.flax_attention_fn inside flax.nnx.MultiHeadAttention.

The oracle is the same NNX module with flax's default attention_fn
(flax.nnx.dot_product_attention, dense, one device's view of the whole sequence) and flax's
own masks (nnx.make_causal_mask, nnx.make_attention_mask); both modules are built from the
same seed and hold the same parameters. Inputs are sequence-sharded over the 8 simulated
CPU devices ("sp" axis, 8 tokens per device).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import helpers
import ringflash

pytest.importorskip("flax", reason="needs flax: pip install 'ringflash[flax]'")
from flax import nnx  # noqa: E402  pylint: disable=g-import-not-at-top

B, T, F, N = 2, 64, 32, 4          # 8 devices: 8 tokens each; head dim F / N = 8
RTOL = 1e-4                         # fp32, relative to the magnitude of what is compared


class _Block(nnx.Module):
  """x [B, T, F] -> multi-head self-attention -> [B, T, F]."""

  def __init__(self, attention_fn, *, rngs, kv_heads=N, dropout_rate=0.0):
    self.attn = nnx.MultiHeadAttention(num_heads=N, in_features=F, qkv_features=F,
                                       num_kv_heads=kv_heads, dropout_rate=dropout_rate,
                                       decode=False, attention_fn=attention_fn, rngs=rngs)

  def __call__(self, x, **call_options):
    return self.attn(x, **call_options)


def _pair(attention_fn, kv_heads=N, dropout_rate=0.0):
  """(flax's default module, ours) with equal parameters."""
  ref, ours = (_Block(fn, rngs=nnx.Rngs(0), kv_heads=kv_heads, dropout_rate=dropout_rate)
               for fn in (nnx.dot_product_attention, attention_fn))
  nnx.update(ours, nnx.state(ref, nnx.Param))
  return ref, ours


def _x(mesh):
  x = jax.random.normal(jax.random.key(1), (B, T, F), jnp.float32)
  return jax.device_put(x, NamedSharding(mesh, P(None, "sp", None)))


def _close(got, want, scale=None):
  """Equal within RTOL of `scale` (default: the largest magnitude of `want`)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = np.abs(want).max() if scale is None else scale
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale)


def _loss(model, x, **call_options):
  """A scalar of every output element (with distinct weights), and the output."""
  y = model(x, **call_options)
  weights = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
  return jnp.sum(y * weights), y


@pytest.mark.parametrize("causal,kv_heads", [("option", N), (None, N), ("call", 2)])
def test_matches_default_attention(causal, kv_heads):
  """Output and the gradients w.r.t. every parameter and the input (nnx.jit of
  nnx.value_and_grad), and our output called eagerly, against flax's default attention with
  its causal mask; ours has is_causal as the option of flax_attention_fn or as
  MultiHeadAttention's call flag."""
  mesh = helpers.mesh_of(8)
  x = _x(mesh)
  fn = ringflash.flax_attention_fn(mesh=mesh, axis_name="sp", is_causal=causal == "option")
  ref, ours = _pair(fn, kv_heads=kv_heads)
  ref_call = {"mask": nnx.make_causal_mask(x[..., 0])} if causal else {}
  our_call = {"is_causal": True} if causal == "call" else {}

  def step(call):
    return nnx.jit(nnx.value_and_grad(lambda m, x: _loss(m, x, **call), argnums=(0, 1),
                                      has_aux=True))
  (want_loss, want), (want_dparams, want_dx) = step(ref_call)(ref, x)
  (got_loss, got), (got_dparams, got_dx) = step(our_call)(ours, x)
  assert got.shape == want.shape and got.dtype == want.dtype
  _close(got, want)
  _close(got_loss, want_loss)
  _close(got_dx, want_dx)
  # One scale for all parameters: the key bias's gradient is zero analytically (softmax
  # ignores a shift shared by a row's scores), both sides hold only its rounding noise.
  want_leaves, got_leaves = jax.tree.leaves(want_dparams), jax.tree.leaves(got_dparams)
  assert len(got_leaves) == len(want_leaves) == 8                 # q, k, v, out: w and b
  scale = max(float(np.abs(leaf).max()) for leaf in want_leaves)
  for got_leaf, want_leaf in zip(got_leaves, want_leaves):
    _close(got_leaf, want_leaf, scale)

  eager = ours(x, **our_call)                # outside jit: ring_attention's cached program
  assert eager.sharding.spec[1] == "sp", eager.sharding    # the output stays sharded
  _close(eager, want)


def test_window_option_matches_banded_mask():
  """local_window_size reaches ring_attention: a causal window of 11 keys (with 8 tokens per
  device it reaches into the blocks of the two previous devices) against flax with the
  same band as a dense mask."""
  mesh = helpers.mesh_of(8)
  x = _x(mesh)
  left = 10
  fn = ringflash.flax_attention_fn(mesh=mesh, is_causal=True, local_window_size=(left, 0))
  ref, ours = _pair(fn)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  band = nnx.make_attention_mask(pos, pos, lambda q, k: (k <= q) & (k >= q - left))
  _close(ours(x), ref(x, mask=band))


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_dtype_promotion_as_flax(dtype):
  """dtype as flax.nnx.dot_product_attention: q, k, v cast to `dtype`, or to their common
  type (here float32 from float32 and bfloat16 keys) when it is None."""
  mesh = helpers.mesh_of(8)
  q, k, v, _ = helpers.inputs(0, B, T, T, N, N, 8, jnp.float32)
  k = k.astype(jnp.bfloat16)
  fn = ringflash.flax_attention_fn(mesh=mesh, is_causal=True)
  want = nnx.dot_product_attention(q, k, v, dtype=dtype, is_causal=True)
  got = fn(q, k, v, dtype=dtype)
  assert got.dtype == want.dtype == (dtype or jnp.float32)
  if got.dtype == jnp.float32:
    _close(got, want)
  else:              # both in bfloat16 (8 bits of mantissa), ours accumulating in float32
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=3e-2 * float(np.abs(np.asarray(want, np.float32)).max()))


def test_dropout_off_when_deterministic():
  """dropout_rate > 0 is accepted when deterministic: the result is flax's without dropout."""
  mesh = helpers.mesh_of(8)
  x = _x(mesh)
  ref, ours = _pair(ringflash.flax_attention_fn(mesh=mesh), dropout_rate=0.1)
  _close(ours(x, deterministic=True), ref(x, deterministic=True))


@pytest.mark.parametrize("rate,deterministic", [(-0.5, False), (float("nan"), False),
                                                (1.0, True), (1.5, True)])
def test_a_dropout_rate_flax_refuses_is_refused(rate, deterministic):
  """flax refuses a dropout_rate outside [0, 1) with a ValueError; so do we (NaN with
  deterministic=False silently ran without the dropout asked for)."""
  fn = ringflash.flax_attention_fn(mesh=helpers.mesh_of(8))
  q = jnp.zeros((B, T, N, F // N))
  with pytest.raises(ValueError, match=r"dropout_rate must be in the range \[0, 1\)"):
    fn(q, q, q, dropout_rate=rate, deterministic=deterministic)
  with pytest.raises(ValueError, match=r"dropout_rate must be in the range \[0, 1\)"):
    nnx.dot_product_attention(q, q, q, dropout_rate=rate, deterministic=deterministic,
                              dropout_rng=jax.random.key(0))


@pytest.mark.parametrize("case", ["mask", "bias", "dropout", "sow_weights",
                                  "input_positions", "decode"])
def test_unsupported_arguments(case):
  """What ring attention cannot honour is refused with NotImplementedError naming it,
  before any work."""
  mesh = helpers.mesh_of(8)
  x = _x(mesh)
  fn = ringflash.flax_attention_fn(mesh=mesh, is_causal=True)
  q = jnp.zeros((B, T, N, F // N))
  if case == "mask":
    model = _Block(fn, rngs=nnx.Rngs(0))
    call = lambda: model(x, mask=nnx.make_causal_mask(x[..., 0]))  # noqa: E731
    match = r"dense attention mask.*is_causal=True, local_window_size"
  elif case == "bias":
    call = lambda: fn(q, q, q, bias=jnp.zeros((B, N, T, T)))  # noqa: E731
    match = "attention bias"
  elif case == "dropout":
    model = _Block(fn, rngs=nnx.Rngs(0, dropout=1), dropout_rate=0.1)
    call = lambda: model(x, deterministic=False)  # noqa: E731
    match = "dropout of the attention weights"
  elif case == "sow_weights":
    model = _Block(fn, rngs=nnx.Rngs(0))
    call = lambda: model(x, sow_weights=True)  # noqa: E731
    match = "sowing the attention weights"
  elif case == "input_positions":
    call = lambda: fn(q, q, q, input_positions=jnp.arange(T))  # noqa: E731
    match = "input_positions"
  else:
    model = nnx.MultiHeadAttention(num_heads=N, in_features=F, decode=True,
                                   attention_fn=fn, rngs=nnx.Rngs(0))
    model.init_cache((B, T, F))
    call = lambda: model(x[:, :1])  # noqa: E731
    match = "decode=True"
  with pytest.raises(NotImplementedError, match=match):
    call()


def test_bad_option():
  with pytest.raises(ValueError, match="is_causal must be a bool"):
    ringflash.flax_attention_fn(is_causal="false")
  # and where the layer passes it at call time ("false" is truthy: it ran causal)
  fn = ringflash.flax_attention_fn(mesh=helpers.mesh_of(2))
  q = jnp.zeros((1, 16, 2, 8))
  with pytest.raises(ValueError, match="is_causal must be a bool, got 'false'"):
    fn(q, q, q, is_causal="false")


def test_ringflash_imports_without_flax():
  """flax is optional: `import ringflash` works without it, flax_attention_fn says how to
  install it."""
  code = ("import sys; sys.modules['flax'] = None\n"      # `import flax` now fails
          "import ringflash\n"
          "try:\n"
          "  ringflash.flax_attention_fn()\n"
          "except ImportError as err:\n"
          "  assert 'ringflash[flax]' in str(err), err\n"
          "else:\n"
          "  raise SystemExit('no ImportError')\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                        text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr
