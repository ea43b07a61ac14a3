"""The pallas_tpu backend in Pallas interpret mode on CPU: kernels against the xla backend and
the fp32 oracle, and ring_attention(backend="pallas_tpu") on simulated meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import oracle
import ringflash
from ringflash.kernels import base
from ringflash.kernels import pallas_tpu
from ringflash.kernels import xla

BACKEND = "pallas_tpu"
def _spec(causal, bq, bk, **extra):
  return base.KernelSpec(scale=0.125, causal=causal, block_q=bq, block_k=bk, interpret=True,
                         **extra)


# ---------------------------------------------------------------------------------------------
# Kernel level: one block pair, against the xla backend (same contract) and the oracle.

# (id, B, T, S, N, K, H, causal, q_offset, segments, bq, bk)
KERNEL_CASES = [
    # GQA (G = 2), H = 64: both kv heads share one 128-lane block (hk = 2).
    ("gqa-causal-h64", 1, 256, 256, 4, 2, 64, True, 0, False, 64, 128),
    # Queries placed before part of the keys: rows 0..99 see no key at all (lse = -inf).
    ("causal-dead-rows", 1, 256, 256, 4, 2, 128, True, -100, False, 128, 128),
    # Per-row segment ids; batch rows with different documents skip different tiles.
    ("mha-seg-b2", 2, 256, 256, 2, 2, 128, False, 0, True, 64, 128),
    # MQA (G = 4 stacked into one [4 * bq, H] operand), T != S.
    ("mqa-cross", 1, 128, 256, 4, 1, 128, True, 64, False, 64, 128),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_matches_xla_and_oracle(case):
  _, b, t, s, n, k, h, causal, off, seg, bq, bk = case
  q, key, v, dout = helpers.inputs(0, b, t, s, n, k, h, jnp.float32)
  q_pos = jnp.arange(t, dtype=jnp.int32) + off
  k_pos = jnp.arange(s, dtype=jnp.int32)
  q_seg = k_seg = None
  if seg:
    q_seg = helpers.packed_segments(b, t, seed=4)
    k_seg = helpers.packed_segments(b, s, seed=4) if s != t else q_seg
  spec = _spec(causal, bq, bk)
  o, lse = pallas_tpu.forward(q, key, v, q_pos, k_pos, q_seg, k_seg, spec)
  o_x, lse_x = xla.forward(q, key, v, q_pos, k_pos, q_seg, k_seg, spec)
  ref_o, ref_lse = oracle.attention(q, key, v, causal=causal, scale=0.125, q_seg=q_seg,
                                    kv_seg=k_seg, q_pos=q_pos, kv_pos=k_pos)
  assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
  assert o.shape == q.shape and lse.shape == (b, n, t)
  for got, ref in ((o, o_x), (lse, lse_x), (o, ref_o), (lse, ref_lse)):
    assert helpers.max_err(got, ref) <= helpers.fp32_tol(ref)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  if off < 0:
    assert bool(jnp.all(jnp.isneginf(lse[:, :, :100]))) and bool(jnp.all(o[:, :100] == 0))

  # Backward from the global out and lse, with an lse cotangent (finite where lse is).
  dlse = jnp.where(jnp.isfinite(ref_lse), 0.3, 0.0)
  out = ref_o
  grads = pallas_tpu.backward(q, key, v, out, ref_lse, dout, q_pos, k_pos, q_seg, k_seg, spec,
                              dlse=dlse)
  grads_x = xla.backward(q, key, v, out, ref_lse, dout, q_pos, k_pos, q_seg, k_seg, spec,
                         dlse=dlse)

  def loss(q_, k_, v_):
    o_, l_ = oracle.attention(q_, k_, v_, causal=causal, scale=0.125, q_seg=q_seg,
                              kv_seg=k_seg, q_pos=q_pos, kv_pos=k_pos)
    return jnp.sum(o_ * dout) + jnp.sum(jnp.where(jnp.isfinite(l_), l_, 0.0) * dlse)

  grads_ref = jax.grad(loss, argnums=(0, 1, 2))(q, key, v)
  for name, got, gx, ref in zip(("dq", "dk", "dv"), grads, grads_x, grads_ref):
    assert got.dtype == jnp.float32 and got.shape == ref.shape, name
    assert bool(jnp.all(jnp.isfinite(got))), name
    assert helpers.max_err(got, gx) <= helpers.fp32_tol(gx), name
    assert helpers.max_err(got, ref) <= helpers.fp32_tol(ref), name
  if off < 0:
    assert bool(jnp.all(grads[0][:, :100] == 0))


def test_kernel_sliding_window_reaches_the_kernel_through_base_mask():
  q, key, v, dout = helpers.inputs(0, 1, 256, 256, 2, 1, 128, jnp.float32)
  pos = jnp.arange(256, dtype=jnp.int32)
  spec = _spec(True, 64, 128, window=(40, 0))
  o, lse = pallas_tpu.forward(q, key, v, pos, pos, None, None, spec)
  ref_o, ref_lse = oracle.attention(q, key, v, causal=True, scale=0.125, window=(40, 0))
  assert helpers.max_err(o, ref_o) <= helpers.fp32_tol(ref_o)
  assert helpers.max_err(lse, ref_lse) <= helpers.fp32_tol(ref_lse)
  dq, dk, dv = pallas_tpu.backward(q, key, v, ref_o, ref_lse, dout, pos, pos, None, None, spec)
  gx = xla.backward(q, key, v, ref_o, ref_lse, dout, pos, pos, None, None, spec)
  for got, ref in zip((dq, dk, dv), gx):
    assert helpers.max_err(got, ref) <= helpers.fp32_tol(ref)


def test_tiles_without_work_are_neither_read_nor_computed():
  # Causal, queries at positions 0..127, keys 0..255: key tile 1 (positions 128..255) has no
  # valid pair for any query. NaN there would poison o (p @ v, 0 * NaN = NaN) and dq if the
  # tile were computed; skipped, results equal the oracle on the clean half.
  q, key, v, dout = helpers.inputs(0, 1, 128, 256, 2, 2, 128, jnp.float32)
  key = key.at[:, 128:].set(jnp.nan)
  v = v.at[:, 128:].set(jnp.nan)
  q_pos, k_pos = jnp.arange(128, dtype=jnp.int32), jnp.arange(256, dtype=jnp.int32)
  spec = _spec(True, 64, 128)
  flags = pallas_tpu._tile_flags(q_pos, k_pos, None, None, spec, 64, 128)
  np.testing.assert_array_equal(np.asarray(flags), [[[1, 0], [1, 0]]])
  o, lse = pallas_tpu.forward(q, key, v, q_pos, k_pos, None, None, spec)
  ref_o, ref_lse = oracle.attention(q, key[:, :128], v[:, :128], causal=True, scale=0.125)
  assert helpers.max_err(o, ref_o) <= helpers.fp32_tol(ref_o)
  assert helpers.max_err(lse, ref_lse) <= helpers.fp32_tol(ref_lse)
  dq, dk, dv = pallas_tpu.backward(q, key, v, ref_o, ref_lse, dout, q_pos, k_pos, None, None,
                                   spec)
  assert bool(jnp.all(jnp.isfinite(dq)))
  assert bool(jnp.all(dk[:, 128:] == 0)) and bool(jnp.all(dv[:, 128:] == 0))
  _, vjp = jax.vjp(lambda a, b_, c: oracle.attention(a, b_, c, causal=True, scale=0.125)[0],
                   q, key[:, :128], v[:, :128])
  ref_dq, ref_dk, _ = vjp(dout)
  assert helpers.max_err(dq, ref_dq) <= helpers.fp32_tol(ref_dq)
  assert helpers.max_err(dk[:, :128], ref_dk) <= helpers.fp32_tol(ref_dk)


def test_fetch_index_revisits_the_last_working_block():
  flags = jnp.array([[[0, 1, 1, 0, 0, 1], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(pallas_tpu._fetch_index(flags)),
                                [[[1, 1, 2, 2, 2, 5], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]])


@pytest.mark.parametrize("kind,dtype,expected", [
    ("TPU v5", jnp.bfloat16, (512, 512)),
    ("TPU v6 lite", jnp.bfloat16, (512, 1024)),
    ("TPU v4", jnp.bfloat16, (256, 512)),
    ("cpu", jnp.float32, (512, 512)),
])
def test_default_block_sizes_per_generation(kind, dtype, expected):
  got = pallas_tpu.resolve_block_sizes(base.BlockSizes(), 16384, 16384, head_dim=128,
                                       kv_heads=4, group=4, dtype=dtype, device_kind=kind)
  assert got == expected


@pytest.mark.parametrize("kind", ["TPU v4", "TPU v5p", "TPU v6e"])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 2, 16), (64, 5, 4), (32, 4, 8),
                                                     (128, 3, 8), (256, 1, 32)])
def test_default_tiles_fit_vmem_with_the_kv_heads_of_a_block(kind, head_dim, kv_heads, group):
  """The default tiles fit the generation's budget for the kv heads a block really holds
  (H = 64: two; K = 5 at H = 64: all five), not for one. v4, H = 64, K = 5 once got tiles
  estimated at 16 MiB against a 14 MiB budget."""
  bq, bk = pallas_tpu.resolve_block_sizes(base.BlockSizes(), 16384, 16384, head_dim=head_dim,
                                          kv_heads=kv_heads, group=group, dtype=jnp.bfloat16,
                                          device_kind=kind)
  hk = pallas_tpu._heads_per_block(kv_heads, head_dim)
  assert hk == (kv_heads if head_dim == 64 and kv_heads % 2 else max(1, 128 // head_dim))
  budget = pallas_tpu._generation(kind)[2]
  assert pallas_tpu._vmem_estimate(bq, bk, group, hk, head_dim, 2) <= budget, (bq, bk)


def test_block_sizes_follow_tpu_tiling():
  resolve = pallas_tpu.resolve_block_sizes
  kw = dict(head_dim=128, kv_heads=4, group=4, dtype=jnp.bfloat16,
            device_kind="TPU v5 lite")
  assert resolve(base.BlockSizes(), 96, 64, **kw) == (96, 64)     # whole short lengths
  assert resolve(base.BlockSizes(32, 128), 256, 256, **kw) == (32, 128)
  with pytest.raises(ValueError, match="block_sizes.block_k"):
    resolve(base.BlockSizes(32, 64), 256, 256, **kw)                # not a lane multiple
  with pytest.raises(ValueError, match="block_sizes.block_q"):
    resolve(base.BlockSizes(24, 128), 256, 256, **kw)               # bf16 packs 16 rows
  with pytest.raises(ValueError, match="block_sizes.block_q"):
    resolve(base.BlockSizes(96, 128), 256, 256, **kw)               # does not divide
  with pytest.raises(ValueError, match="block_sizes"):
    ringflash.ring_attention(*helpers.inputs(0, 1, 256, 256, 2, 2, 128, jnp.float32)[:3],
                             mesh=helpers.mesh_of(2), backend=BACKEND,
                             block_sizes=ringflash.BlockSizes(block_k=96))


# ---------------------------------------------------------------------------------------------
# Through the ring: ring_attention(backend="pallas_tpu") on simulated CPU meshes.

# (id, ring, B, T, N, K, H, causal, segments, dtype, block_sizes)
RING_CASES = [
    ("gqa-causal-fp32-r2", 2, 1, 256, 4, 2, 64, True, None, jnp.float32, (64, 128)),
    ("mqa-seg-fp32-r4", 4, 1, 256, 4, 1, 128, False, "packed", jnp.float32, None),
    ("gqa-causal-seg-bf16-r2", 2, 1, 256, 4, 2, 128, True, "packed", jnp.bfloat16, (64, 128)),
    # Query ids 0..2 against key ids 1..3 in another order: rows of document 0 see no key.
    ("mha-pair-dead-rows-fp32-r2", 2, 1, 256, 2, 2, 128, False, "pair", jnp.float32, None),
]


def _segments(kind, b, t):
  if kind is None:
    return None
  if kind == "packed":
    return helpers.packed_segments(b, t, seed=1)
  return (helpers.packed_segments(b, t, seed=2), helpers.packed_segments(b, t, seed=3) + 1)


@pytest.mark.parametrize("case", RING_CASES, ids=[c[0] for c in RING_CASES])
def test_ring_matches_oracle(case):
  _, ring, b, t, n, k, h, causal, seg_kind, dtype, bs = case
  q, key, v, dout = helpers.inputs(0, b, t, t, n, k, h, dtype)
  seg = _segments(seg_kind, b, t)
  block_sizes = None if bs is None else ringflash.BlockSizes(*bs)
  got = helpers.ring_fwd_bwd(q, key, v, dout, mesh=helpers.mesh_of(ring), causal=causal,
                             segment_ids=seg, block_sizes=block_sizes, backend=BACKEND)
  ref = helpers.oracle_fwd_bwd(q, key, v, dout, causal=causal, segment_ids=seg)
  plain = None
  if dtype != jnp.float32:
    plain = helpers.oracle_fwd_bwd(q, key, v, dout, causal=causal, segment_ids=seg,
                                   upcast=False)
  assert got[0].dtype == dtype
  helpers.check(got, ref, plain)
  if seg_kind == "pair":
    dead = seg[0][0] == 0                                 # query ids absent from the keys
    assert bool(jnp.any(dead))
    assert bool(jnp.all(got[0][0][dead] == 0)) and bool(jnp.all(jnp.isneginf(got[1][0][:, dead])))
    assert bool(jnp.all(got[2][0][dead] == 0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_ring_error_does_not_grow_with_ring_size(dtype):
  q, key, v, dout = helpers.inputs(3, 1, 256, 256, 4, 2, 128, dtype)
  ref = helpers.oracle_fwd_bwd(q, key, v, dout, causal=True)
  plain = None if dtype == jnp.float32 else helpers.oracle_fwd_bwd(q, key, v, dout, causal=True,
                                                                   upcast=False)
  errs = {}
  for ring in (1, 4):
    got = helpers.ring_fwd_bwd(q, key, v, dout, mesh=helpers.mesh_of(ring), causal=True,
                               backend=BACKEND)
    helpers.check(got, ref, plain)
    errs[ring] = [helpers.max_err(g, r) for g, r in zip(got, ref)]
  for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
    # As in test_ring: the merge order changes rounding by a few fp32 ulps (lse is fp32 for
    # every input dtype), but the error must not grow with P.
    fp32_quantity = dtype == jnp.float32 or name == "lse"
    ulps = 32 * np.finfo(np.float32).eps * max(1.0, float(jnp.max(jnp.abs(ref[i]))))
    bound = max(1.5 * errs[1][i], ulps if fp32_quantity else 0.0)
    assert errs[4][i] <= bound, (name, errs[4][i], errs[1][i])


@pytest.mark.slow
def test_ring_of_eight_matches_oracle():
  q, key, v, dout = helpers.inputs(5, 1, 1024, 1024, 4, 1, 128, jnp.float32)
  got = helpers.ring_fwd_bwd(q, key, v, dout, mesh=helpers.mesh_of(8), causal=True,
                             backend=BACKEND)
  helpers.check(got, helpers.oracle_fwd_bwd(q, key, v, dout, causal=True))
