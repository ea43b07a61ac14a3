"""ring_attention against the fp32 dense oracle on simulated CPU meshes, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import helpers
import ringflash

BACKEND = "xla"

# (id, B, T, S, N, K, H, causal, segments, dtype, block_sizes)
CASES = [
    ("mha-fp32", 2, 128, 128, 4, 4, 64, False, None, jnp.float32, None),
    ("mha-causal-fp32-tiles", 2, 128, 128, 4, 4, 64, True, None, jnp.float32, (8, 8)),
    ("gqa-causal-seg-h128", 2, 128, 128, 4, 2, 128, True, "packed", jnp.float32, (8, 16)),
    ("mqa-seg-h48", 1, 128, 128, 4, 1, 48, False, "packed", jnp.float32, (16, 8)),
    ("mqa-causal-h80", 2, 128, 128, 4, 1, 80, True, None, jnp.float32, None),
    ("cross-causal-topleft", 1, 64, 128, 4, 2, 64, True, None, jnp.float32, (8, 8)),
    ("cross-seg-pair", 2, 64, 128, 4, 2, 64, False, "pair", jnp.float32, None),
    ("gqa-causal-bf16", 2, 256, 256, 4, 2, 64, True, None, jnp.bfloat16, (16, 16)),
    ("mha-seg-bf16-h128", 1, 256, 256, 4, 4, 128, False, "packed", jnp.bfloat16, None),
    ("gqa-causal-seg-fp16", 1, 128, 128, 4, 2, 64, True, "packed", jnp.float16, (8, 8)),
]


def _segments(kind, b, t, s):
  if kind is None:
    return None
  if kind == "packed":
    return helpers.packed_segments(b, t, seed=1)
  # A pair with different lengths: both sides hold docs 0..2 in order.
  return (helpers.packed_segments(b, t, seed=2), helpers.packed_segments(b, s, seed=3))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_oracle(case):
  _, b, t, s, n, k, h, causal, seg_kind, dtype, blocks = case
  q, key, v, dout = helpers.inputs(0, b, t, s, n, k, h, dtype)
  seg = _segments(seg_kind, b, t, s)
  bs = None if blocks is None else ringflash.BlockSizes(*blocks)
  got = helpers.ring_fwd_bwd(q, key, v, dout, mesh=helpers.mesh_of(8), causal=causal,
                             segment_ids=seg, block_sizes=bs, backend=BACKEND)
  ref = helpers.oracle_fwd_bwd(q, key, v, dout, causal=causal, segment_ids=seg)
  assert got[0].dtype == dtype and got[1].dtype == jnp.float32
  assert got[0].shape == q.shape and got[1].shape == (b, n, t)
  plain = None
  if dtype != jnp.float32:
    plain = helpers.oracle_fwd_bwd(q, key, v, dout, causal=causal, segment_ids=seg, upcast=False)
  helpers.check(got, ref, plain)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_error_does_not_grow_with_ring_size(dtype):
  b, t, n, k, h = 1, 256, 4, 2, 64
  q, key, v, dout = helpers.inputs(3, b, t, t, n, k, h, dtype)
  ref = helpers.oracle_fwd_bwd(q, key, v, dout, causal=True)
  errs = {}
  for ring in (1, 2, 4, 8):
    got = helpers.ring_fwd_bwd(q, key, v, dout, mesh=helpers.mesh_of(ring), causal=True,
                               block_sizes=ringflash.BlockSizes(32, 32), backend=BACKEND)
    errs[ring] = [helpers.max_err(g, r) for g, r in zip(got, ref)]
  for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
    one = errs[1][i]
    # Same tiles, different merge order: rounding may move by a few fp32 ulps (lse is fp32
    # for every input dtype), but must not grow with P.
    fp32_quantity = dtype == jnp.float32 or name == "lse"
    ulps = 32 * np.finfo(np.float32).eps * max(1.0, float(jnp.max(jnp.abs(ref[i]))))
    bound = max(1.5 * one, ulps if fp32_quantity else 0.0)
    for ring in (2, 4, 8):
      assert errs[ring][i] <= bound, (name, ring, errs[ring][i], one)


def test_rows_without_valid_key_give_zero_and_finite_zero_gradients():
  b, t, s, n, k, h = 1, 64, 64, 4, 2, 32
  q, key, v, dout = helpers.inputs(4, b, t, s, n, k, h, jnp.float32)
  # Query ids 0..3 by quarter; key ids 0..1 only: queries of ids 2, 3 have no key at all.
  q_ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), t // 4)[None]
  kv_ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), s // 2)[None]
  out, lse, dq, dk, dv = helpers.ring_fwd_bwd(
      q, key, v, dout, mesh=helpers.mesh_of(8), causal=True, segment_ids=(q_ids, kv_ids),
      block_sizes=ringflash.BlockSizes(8, 8), backend=BACKEND)
  empty = np.asarray(q_ids[0] >= 2)
  assert np.all(np.asarray(out)[0, empty] == 0.0)
  assert np.all(np.isneginf(np.asarray(lse)[0][:, empty]))
  for g in (out, dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(dq)[0, empty] == 0.0)
  ref = helpers.oracle_fwd_bwd(q, key, v, dout, causal=True, segment_ids=(q_ids, kv_ids))
  helpers.check((out, lse, dq, dk, dv), ref)


def test_nan_in_masked_positions_does_not_leak():
  b, t, n, k, h = 1, 128, 4, 2, 32
  q, key, v, dout = helpers.inputs(5, b, t, t, n, k, h, jnp.float32)
  # Documents interleave in runs of 5 tokens, so every tile mixes both documents.
  seg = ((jnp.arange(t) // 5) % 2).astype(jnp.int32)[None]
  bad = np.asarray(seg[0] == 1)
  poison = jnp.asarray(bad)[None, :, None, None]
  qn, kn, vn = (jnp.where(poison, jnp.nan, x) for x in (q, key, v))
  keep = jnp.asarray(~bad)[None, :, None, None]

  def masked_loss_grads(attn, q_, k_, v_):
    def loss(a, b_, c):
      return jnp.sum(jnp.where(keep, attn(a, b_, c) * dout, 0.0))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q_, k_, v_)

  mesh = helpers.mesh_of(8)
  ring = lambda a, b_, c: ringflash.ring_attention(
      a, b_, c, mesh=mesh, is_causal=True, segment_ids=seg, backend=BACKEND,
      block_sizes=ringflash.BlockSizes(8, 8))
  out = jax.jit(ring)(qn, kn, vn)
  assert np.all(np.isfinite(np.asarray(out)[0, ~bad]))
  val, grads = masked_loss_grads(ring, qn, kn, vn)
  ref_val, ref_grads = masked_loss_grads(
      lambda a, b_, c: helpers.oracle.attention(a, b_, c, causal=True, q_seg=seg, kv_seg=seg)[0],
      q, key, v)
  assert np.isfinite(float(val))
  assert abs(float(val) - float(ref_val)) <= 1e-3
  for g, r in zip(grads, ref_grads):
    g, r = np.asarray(g)[0, ~bad], np.asarray(r)[0, ~bad]
    assert np.all(np.isfinite(g))
    assert np.max(np.abs(g - r)) <= helpers.fp32_tol(r)


def test_jit_grad_compose_and_output_is_sequence_sharded():
  b, t, n, h = 1, 64, 2, 32
  q, key, v, _ = helpers.inputs(6, b, t, t, n, n, h, jnp.float32)
  mesh = helpers.mesh_of(8)

  def loss(q, k, v):
    return jnp.sum(ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=True) ** 2)

  g = jax.jit(jax.grad(loss))(q, key, v)
  g_ref = jax.grad(lambda q, k, v: jnp.sum(
      helpers.oracle.attention(q, k, v, causal=True)[0] ** 2))(q, key, v)
  assert helpers.max_err(g, g_ref) <= helpers.fp32_tol(g_ref)
  out = ringflash.ring_attention(q, key, v, mesh=mesh)
  assert isinstance(out.sharding, NamedSharding)
  assert out.sharding.spec[1] == "sp"
  assert out.sharding.shard_shape(out.shape) == (b, t // 8, n, h)


def test_default_mesh_and_scale():
  b, t, n, h = 1, 64, 2, 16
  q, key, v, _ = helpers.inputs(7, b, t, t, n, n, h, jnp.float32)
  out = ringflash.ring_attention(q, key, v, scale=0.3)      # mesh=None: all 8 devices
  ref, _ = helpers.oracle.attention(q, key, v, scale=0.3)
  assert helpers.max_err(out, ref) <= helpers.FP32_TOL
  assert out.sharding.shard_shape(out.shape)[1] == t // len(jax.devices())


@pytest.mark.parametrize("outer", ["data", "model"])
def test_other_mesh_axes_keep_their_sharding(outer):
  """Batch on a data axis or heads on a model axis stay there; nothing is all-gathered.

  Inside jit the inputs' sharding is visible on meshes with explicit axes."""
  devices = np.array(jax.devices()).reshape(2, 4)
  mesh = Mesh(devices, (outer, "sp"), axis_types=(AxisType.Explicit,) * 2)
  b, t, n, k, h = 2, 64, 4, 2, 32
  q, key, v, _ = helpers.inputs(8, b, t, t, n, k, h, jnp.float32)
  spec = P(outer, "sp") if outer == "data" else P(None, "sp", outer)
  ref, _ = helpers.oracle.attention(q, key, v, causal=True)
  host = (q, key, v)
  q, key, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in host)
  fn = jax.jit(lambda q, k, v: ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=True))
  out = fn(q, key, v)
  assert out.sharding.spec[:3] == tuple(spec) + (None,) * (3 - len(spec))
  assert helpers.max_err(out, ref) <= helpers.FP32_TOL
  text = fn.lower(q, key, v).compile().as_text()
  assert "all-gather" not in text and "all-to-all" not in text
  # Eagerly, on a mesh with Auto axes, the arrays' own NamedSharding is read.
  auto_mesh = Mesh(devices, (outer, "sp"))
  q, key, v = (jax.device_put(x, NamedSharding(auto_mesh, spec)) for x in host)
  out = ringflash.ring_attention(q, key, v, mesh=auto_mesh, is_causal=True)
  assert out.sharding.spec[:3] == tuple(spec) + (None,) * (3 - len(spec))
  assert helpers.max_err(out, ref) <= helpers.FP32_TOL


def test_ring_attention_sharded_inside_callers_shard_map():
  b, t, n, k, h = 1, 128, 4, 2, 32
  q, key, v, dout = helpers.inputs(9, b, t, t, n, k, h, jnp.float32)
  seg = helpers.packed_segments(b, t, seed=4)
  mesh = helpers.mesh_of(4, "ring")

  def local(q, k, v, seg):
    return ringflash.ring_attention_sharded(q, k, v, axis_name="ring", is_causal=True,
                                            segment_ids=seg, return_residual=True)

  fn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "ring"),) * 3 + (P(None, "ring"),),
                     out_specs=(P(None, "ring"), P(None, None, "ring")))
  (out, lse), vjp = jax.vjp(lambda a, b_, c: fn(a, b_, c, seg), q, key, v)
  grads = vjp((dout, jnp.zeros_like(lse)))
  ref = helpers.oracle_fwd_bwd(q, key, v, dout, causal=True, segment_ids=seg)
  helpers.check((out, lse) + tuple(grads), ref)


def test_lse_cotangent_flows():
  """With return_residual, gradients through lse are exact too."""
  b, t, n, k, h = 1, 64, 2, 1, 16
  q, key, v, _ = helpers.inputs(10, b, t, t, n, k, h, jnp.float32)
  mesh = helpers.mesh_of(4)

  def loss(attn):
    def f(q, k, v):
      out, lse = attn(q, k, v)
      return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), jnp.sin(lse), 0.0))
    return f

  got = jax.jit(jax.grad(loss(lambda q, k, v: ringflash.ring_attention(
      q, k, v, mesh=mesh, is_causal=True, return_residual=True)), argnums=(0, 1, 2)))(q, key, v)
  ref = jax.grad(loss(lambda q, k, v: helpers.oracle.attention(q, k, v, causal=True)),
                 argnums=(0, 1, 2))(q, key, v)
  for g, r in zip(got, ref):
    assert helpers.max_err(g, r) <= helpers.fp32_tol(r)
