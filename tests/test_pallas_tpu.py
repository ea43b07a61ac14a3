"""What is particular to the pallas_tpu backend, in Pallas interpret mode on CPU: the sliding
window through base.mask, tile skipping (no read of a tile without work), the fetch index,
and the per-generation tiles. The contract cases run on it in tests/contract/."""

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
  tiles = ringflash.TpuBlockSizes(bq, bk, bq, bk, bq, bk)
  return base.KernelSpec(scale=0.125, causal=causal, tiles=tiles, interpret=True, **extra)


def _resolve(given, q_len, kv_len, *, head_dim, kv_heads, group, dtype, device_kind):
  """(block_q, block_k) that pallas_tpu resolves for these facts."""
  problem = base.Problem(q_len=q_len, kv_len=kv_len, head_dim=head_dim, kv_heads=kv_heads,
                         group=group, dtype=jnp.dtype(dtype),
                         platform="cpu" if device_kind == "cpu" else "tpu",
                         device_kind=device_kind)
  tiles = pallas_tpu.resolve_tiles(given, problem)
  return tiles.block_q, tiles.block_k


def test_kernel_sliding_window_reaches_the_kernel_through_base_mask():
  q, key, v, dout = helpers.inputs(0, 1, 256, 256, 2, 1, 128, jnp.float32)
  pos = jnp.arange(256, dtype=jnp.int32)
  spec = _spec(True, 64, 128, window=(40, 0))
  o, lse = pallas_tpu.forward(q, key, v, pos, pos, None, None, spec)
  ref_o, ref_lse = oracle.attention(q, key, v, causal=True, scale=0.125, window=(40, 0))
  assert helpers.max_err(o, ref_o) <= helpers.fp32_tol(ref_o)
  assert helpers.max_err(lse, ref_lse) <= helpers.fp32_tol(ref_lse)
  dq, dk, dv = pallas_tpu.backward(q, key, v, ref_o, ref_lse, dout, pos, pos, None, None, spec)
  xla_spec = base.KernelSpec(scale=0.125, causal=True, tiles=ringflash.XlaBlockSizes(
      64, 128, 64, 128), window=(40, 0))
  gx = xla.backward(q, key, v, ref_o, ref_lse, dout, pos, pos, None, None, xla_spec)
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
  got = _resolve(None, 16384, 16384, head_dim=128,
                                       kv_heads=4, group=4, dtype=dtype, device_kind=kind)
  assert got == expected


@pytest.mark.parametrize("kind", ["TPU v4", "TPU v5p", "TPU v6e"])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 2, 16), (64, 5, 4), (32, 4, 8),
                                                     (128, 3, 8), (256, 1, 32)])
def test_default_tiles_fit_vmem_with_the_kv_heads_of_a_block(kind, head_dim, kv_heads, group):
  """The default tiles fit the generation's budget for the kv heads a block really holds
  (H = 64: two; K = 5 at H = 64: all five), not for one. v4, H = 64, K = 5 once got tiles
  estimated at 16 MiB against a 14 MiB budget."""
  bq, bk = _resolve(None, 16384, 16384, head_dim=head_dim,
                                          kv_heads=kv_heads, group=group, dtype=jnp.bfloat16,
                                          device_kind=kind)
  hk = pallas_tpu._heads_per_block(kv_heads, head_dim)
  assert hk == (kv_heads if head_dim == 64 and kv_heads % 2 else max(1, 128 // head_dim))
  budget = pallas_tpu._generation(kind)[2]
  assert pallas_tpu._vmem_estimate(bq, bk, group, hk, head_dim, 2) <= budget, (bq, bk)


def test_block_sizes_follow_tpu_tiling():
  resolve = _resolve
  kw = dict(head_dim=128, kv_heads=4, group=4, dtype=jnp.bfloat16,
            device_kind="TPU v5 lite")
  assert resolve(None, 96, 64, **kw) == (96, 64)     # whole short lengths
  assert resolve(ringflash.TpuBlockSizes(32, 128), 256, 256, **kw) == (32, 128)
  with pytest.raises(ValueError, match="block_sizes.block_k"):
    resolve(ringflash.TpuBlockSizes(32, 64), 256, 256, **kw)          # not a lane multiple
  with pytest.raises(ValueError, match="block_sizes.block_q"):
    resolve(ringflash.TpuBlockSizes(24, 128), 256, 256, **kw)         # bf16 packs 16 rows
  with pytest.raises(ValueError, match="block_sizes.block_q"):
    resolve(ringflash.TpuBlockSizes(96, 128), 256, 256, **kw)         # does not divide
  with pytest.raises(ValueError, match="block_sizes"):
    ringflash.ring_attention(*helpers.inputs(0, 1, 256, 256, 2, 2, 128, jnp.float32)[:3],
                             mesh=helpers.mesh_of(2), backend=BACKEND,
                             block_sizes=ringflash.TpuBlockSizes(block_k=96))
