"""What is particular to the pallas_tpu backend, in Pallas interpret mode on CPU: the sliding
window through base.mask; soft-cap and a value head dim over several tiles; tile skipping (no
read of a tile without work) from per-tile ranges, which mark the tiles that
base.block_may_have_work marks, in metadata linear in the lengths; the fetch spans; the local
lengths a TPU cannot tile; the per-generation tiles. The contract cases run on it in
tests/contract/."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import oracle
import ringflash
from ringflash import _validate
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


def test_soft_cap_and_value_head_dim_over_several_tiles_match_the_oracle():
  """Soft-cap (scores cap * tanh(s / cap) before the mask; ds times 1 - (s / cap)^2) and a
  value head dim of its own (Hv 48 != H 32), GQA, causal with segment ids, 2 x 2 tiles:
  forward and backward (with an lse cotangent) against the oracle."""
  b, t, n, kh, h, hv, cap = 2, 64, 4, 2, 32, 48, 1.5
  q, key, _, _ = helpers.inputs(3, b, t, t, n, kh, h, jnp.float32)
  v = jax.random.normal(jax.random.key(4), (b, t, kh, hv), jnp.float32)
  dout = jax.random.normal(jax.random.key(5), (b, t, n, hv), jnp.float32)
  pos = jnp.arange(t, dtype=jnp.int32)
  seg = helpers.packed_segments(b, t, seed=2)
  spec = _spec(True, 32, 32, softcap=cap)

  def dense(q_, k_, v_):
    return oracle.attention(q_, k_, v_, causal=True, scale=0.125, q_seg=seg, kv_seg=seg,
                            softcap=cap)

  o, lse = pallas_tpu.forward(q, key, v, pos, pos, seg, seg, spec)
  ref_o, ref_lse = dense(q, key, v)
  assert o.shape == (b, t, n, hv)
  assert helpers.max_err(o, ref_o) <= helpers.fp32_tol(ref_o)
  assert helpers.max_err(lse, ref_lse) <= helpers.fp32_tol(ref_lse)
  dlse = jnp.where(jnp.isfinite(ref_lse), 0.3, 0.0)
  got = pallas_tpu.backward(q, key, v, ref_o, ref_lse, dout, pos, pos, seg, seg, spec, dlse)

  def loss(q_, k_, v_):
    o_, l_ = dense(q_, k_, v_)
    return jnp.sum(o_ * dout) + jnp.sum(jnp.where(jnp.isfinite(l_), l_, 0.0) * dlse)

  want = jax.grad(loss, argnums=(0, 1, 2))(q, key, v)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.shape == w.shape, name
    assert helpers.max_err(g, w) <= helpers.fp32_tol(w), name


def _old_flags(q_pos, k_pos, q_seg, k_seg, spec, bq, bk):
  """The per-tile flags [Bf, nq, nk] of earlier versions, tile by tile:
  base.block_may_have_work on each tile (per batch row with segment ids)."""
  nq, nk = q_pos.shape[0] // bq, k_pos.shape[0] // bk
  rows = 1 if q_seg is None else q_seg.shape[0]
  out = np.zeros((rows, nq, nk), bool)
  for r in range(rows):
    for i in range(nq):
      for j in range(nk):
        qs = None if q_seg is None else q_seg[r:r + 1, i * bq:(i + 1) * bq]
        ks = None if k_seg is None else k_seg[r:r + 1, j * bk:(j + 1) * bk]
        out[r, i, j] = bool(base.block_may_have_work(
            q_pos[i * bq:(i + 1) * bq], k_pos[j * bk:(j + 1) * bk], spec, qs, ks))
  return out


_PAD_Q, _PAD_K = np.iinfo(np.int32).max, np.iinfo(np.int32).min   # ringflash/_inputs.py


@pytest.mark.parametrize("causal,window,layout,ids", [
    (True, None, "contiguous", None),
    (False, (20, 5), "contiguous", None),
    (True, None, "striped", None),
    (True, (30, 0), "zigzag", None),
    (False, None, "contiguous", "packed"),
    (True, None, "contiguous", "lengths"),
    (True, None, "contiguous", "interleaved"),
], ids=["causal", "window", "striped", "zigzag-window", "documents", "lengths", "interleaved"])
def test_tile_ranges_mark_exactly_the_tiles_of_the_per_tile_flags(causal, window, layout, ids):
  """The test the kernels evaluate on per-tile ranges (SMEM) marks the same tiles as the
  per-tile flags of earlier versions, for every kind of mask, the padding ids of sequence
  lengths (PAD_Q, PAD_K) included."""
  t, s, bq, bk, b = 128, 192, 16, 32, 2
  q_pos = {"contiguous": np.arange(t) + 64, "striped": np.arange(t) * 4 + 1,
           "zigzag": np.concatenate([np.arange(64), np.arange(448, 512)])}[layout]
  k_pos = {"contiguous": np.arange(s), "striped": np.arange(s) * 4 + 2,
           "zigzag": np.concatenate([np.arange(96), np.arange(416, 512)])}[layout]
  q_pos, k_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)
  q_seg = k_seg = None
  if ids == "packed":
    q_seg, k_seg = helpers.packed_segments(b, t, seed=1), helpers.packed_segments(b, s, seed=2)
  elif ids == "lengths":
    q_seg = jnp.where(jnp.arange(t)[None] < jnp.array([[70], [128]]), 0, _PAD_Q)
    k_seg = jnp.where(jnp.arange(s)[None] < jnp.array([[40], [150]]), 0, _PAD_K)
  elif ids == "interleaved":
    q_seg = jnp.broadcast_to((jnp.arange(t) // 40) % 2, (b, t))
    k_seg = jnp.broadcast_to((jnp.arange(s) // 70) % 3, (b, s))
  if q_seg is not None:
    q_seg, k_seg = q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)
  tiling = pallas_tpu._Tiling(nq=t // bq, nk=s // bk, bsz=b, segments=q_seg is not None,
                              causal=causal, window=window, reduce_q=False)
  bounds = pallas_tpu._bounds(q_pos, k_pos, q_seg, k_seg, bq, bk)
  got = np.broadcast_to(np.asarray(pallas_tpu._tile_work(tiling, bounds)),
                        (tiling.bf, t // bq, s // bk))
  want = _old_flags(q_pos, k_pos, q_seg, k_seg, _spec(causal, bq, bk, window=window), bq, bk)
  np.testing.assert_array_equal(got, want)
  assert 0 < want.sum() < want.size          # some tiles skipped, some not
  # Both sides above share base.ranges_may_have_work; the tiles that hold a valid pair, from
  # the mask's definition (oracle.py's), written out here: none may be skipped, and where
  # every tile's positions are a run (contiguous and zigzag tiles) and no ids are given,
  # the range test is exact, so nothing else is computed.
  qp, kp = np.asarray(q_pos)[:, None], np.asarray(k_pos)[None, :]
  valid = np.ones((t, s), bool)
  if causal:
    valid &= kp <= qp
  if window is not None:
    valid &= (kp >= qp - window[0]) & (kp <= qp + window[1])
  valid = valid[None]
  if q_seg is not None:
    valid = valid & (np.asarray(q_seg)[:, :, None] == np.asarray(k_seg)[:, None, :])
  truth = valid.reshape(-1, t // bq, bq, s // bk, bk).any(axis=(2, 4))
  assert np.all(got[truth]), "a tile that holds a valid pair is skipped"
  if layout != "striped" and q_seg is None:
    np.testing.assert_array_equal(got, truth)


def test_tiles_without_work_are_neither_read_nor_computed():
  # Causal, queries at positions 0..127, keys 0..255: key tile 1 (positions 128..255) has no
  # valid pair for any query. NaN there would poison o (p @ v, 0 * NaN = NaN) and dq if the
  # tile were computed; skipped, results equal the oracle on the clean half.
  q, key, v, dout = helpers.inputs(0, 1, 128, 256, 2, 2, 128, jnp.float32)
  key = key.at[:, 128:].set(jnp.nan)
  v = v.at[:, 128:].set(jnp.nan)
  q_pos, k_pos = jnp.arange(128, dtype=jnp.int32), jnp.arange(256, dtype=jnp.int32)
  spec = _spec(True, 64, 128)
  tiling = pallas_tpu._Tiling(nq=2, nk=2, bsz=1, segments=False, causal=True, window=None,
                              reduce_q=False)
  bounds = pallas_tpu._bounds(q_pos, k_pos, None, None, 64, 128)
  np.testing.assert_array_equal(np.asarray(pallas_tpu._tile_work(tiling, bounds)),
                                [[[1, 0], [1, 0]]])
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


def test_spans_fetch_the_first_working_tile_early_and_keep_the_last():
  """Per row of tiles the reduced operand holds clamp(step, first, last): before the first
  working tile its block (fetched early), after the last the last (no DMA), a row without
  work block 0; a gap between working tiles is fetched (not computed). Per batch row with
  segment ids."""
  # 6 key tiles of 8 keys, tile j holding id j; 3 query tiles of 8 rows per batch row.
  k_seg = jnp.broadcast_to(jnp.repeat(jnp.arange(6, dtype=jnp.int32), 8), (2, 48))
  q_seg = jnp.asarray([[1] * 4 + [2] * 4 + [5] * 8 + [9] * 8,
                       [0] * 8 + [3] * 8 + [4, 5] * 4], jnp.int32)
  q_pos, k_pos = jnp.arange(24, dtype=jnp.int32), jnp.arange(48, dtype=jnp.int32)
  tiling = pallas_tpu._Tiling(nq=3, nk=6, bsz=2, segments=True, causal=False, window=None,
                              reduce_q=False)
  bounds = pallas_tpu._bounds(q_pos, k_pos, q_seg, k_seg, 8, 8)
  work = np.asarray(pallas_tpu._tile_work(tiling, bounds)).astype(int)
  np.testing.assert_array_equal(work[0], [[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1],
                                          [0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(work[1], [[1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0],
                                          [0, 0, 0, 0, 1, 1]])
  span = pallas_tpu._spans(tiling, bounds)
  held = [[int(tiling.fetch(span, r, i, j)) for j in range(6)] for r in (0, 1)
          for i in range(3)]
  assert held == [[1, 1, 2, 2, 2, 2], [5] * 6, [0] * 6,
                  [0] * 6, [3] * 6, [4, 4, 4, 4, 4, 5]]
  # Ids 1 and 5 in one query tile: key tiles 1 and 5 work, 2..4 are a gap.
  gap = q_seg.at[0, 0:8].set(jnp.asarray([1, 5] * 4, jnp.int32))
  bounds = pallas_tpu._bounds(q_pos, k_pos, gap, k_seg, 8, 8)
  span = pallas_tpu._spans(tiling, bounds)
  assert [int(tiling.fetch(span, 0, 0, j)) for j in range(6)] == [1, 1, 2, 3, 4, 5]


def test_tile_metadata_grows_linearly_with_the_lengths():
  """Per-tile ranges and per-row spans of a causal call: 4 times the bytes at 4 times the
  length, 48 KiB at a million tokens per device, where the per-tile flags of earlier
  versions (two int32 [T / bq, S / bk] arrays, prefetched into the 1 MiB of SMEM) took
  32 MiB."""
  bq = bk = 512
  sizes = []
  for length in (2**18, 2**20):
    pos = jax.ShapeDtypeStruct((length,), jnp.int32)
    tiling = pallas_tpu._Tiling(nq=length // bq, nk=length // bk, bsz=1, segments=False,
                                causal=True, window=None, reduce_q=False)
    bounds = jax.eval_shape(lambda p: pallas_tpu._bounds(p, p, None, None, bq, bk), pos)
    span = jax.eval_shape(lambda b, tiling=tiling: pallas_tpu._spans(tiling, b), bounds)
    sizes.append(4 * (bounds.size + span.size))
  assert sizes[1] == 4 * sizes[0]
  assert sizes[1] <= 48 * 2**10


def test_local_lengths_a_tpu_cannot_tile_are_refused_before_mosaic():
  """A local length of 125 (1000 tokens striped over 8 chips) once reached Mosaic and died
  in the in-tile mask ("Invalid vector register cast"); on TPU it is refused with the
  reason, and "auto" takes the xla backend. Interpret mode still runs it."""
  def problem(length, platform):
    return base.Problem(q_len=length, kv_len=length, head_dim=128, kv_heads=2, group=4,
                        dtype=jnp.dtype(jnp.bfloat16), platform=platform,
                        device_kind="TPU v5" if platform == "tpu" else "")
  assert "multiples of 8" in pallas_tpu.unsupported(problem(125, "tpu"))
  assert pallas_tpu.unsupported(problem(120, "tpu")) is None
  assert pallas_tpu.unsupported(problem(125, "cpu")) is None
  tiles = pallas_tpu.resolve_tiles(None, problem(120, "tpu"))
  assert (tiles.block_q, tiles.block_k) == (120, 120)


@pytest.mark.parametrize("kind,dtype,expected", [
    ("TPU v5", jnp.bfloat16, (256, 512)),
    ("TPU v6 lite", jnp.bfloat16, (256, 1024)),
    ("TPU v4", jnp.bfloat16, (128, 256)),
    ("cpu", jnp.float32, (512, 512)),
])
def test_default_block_sizes_per_generation(kind, dtype, expected):
  got = _resolve(None, 16384, 16384, head_dim=128, kv_heads=4, group=4, dtype=dtype,
                 device_kind=kind)
  assert got == expected


@pytest.mark.parametrize("kind", ["TPU v4", "TPU v5p", "TPU v6e"])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 2, 16), (64, 5, 4), (32, 4, 8),
                                                     (128, 8, 4), (256, 1, 32), (192, 16, 2)])
def test_default_tiles_fit_vmem_with_the_kv_heads_of_a_block(kind, head_dim, kv_heads, group):
  """The default tiles fit the generation's budget for the kv heads a block really holds
  (the fewest multiple of 8 dividing K, else all K: second-minor block dims must be multiples
  of 8 or whole), not for one."""
  bq, bk = _resolve(None, 16384, 16384, head_dim=head_dim, kv_heads=kv_heads, group=group,
                    dtype=jnp.bfloat16, device_kind=kind)
  hk = pallas_tpu._heads_per_block(kv_heads)
  assert hk == (8 if kv_heads % 8 == 0 else kv_heads)
  budget = pallas_tpu._BUDGET * pallas_tpu._generation(kind)[2]
  assert pallas_tpu._vmem_estimate(bq, bk, group, hk, head_dim, 2) <= budget, (bq, bk)
  assert bq >= 16 and bk >= 128


def test_key_tiles_go_below_128_where_a_block_of_kv_heads_needs_it():
  """GPT-2 XL on v4 (25 heads of 64, MHA, bf16): no multiple of 8 divides K, so a block
  holds all 25 kv heads, and at the smallest tiles the default stopped at (16 x 128) the
  estimate passed v4's budget (15.8 of 9.6 MiB) and Mosaic ran out of VMEM in the dK/dV
  kernel (16.09 of 16 MiB). Key tiles now go below 128; where even the smallest tiles
  cannot fit the VMEM, the backend says so and "auto" takes xla."""
  def problem(kv_heads, head_dim, dtype):
    return base.Problem(q_len=1024, kv_len=1024, head_dim=head_dim, kv_heads=kv_heads,
                        group=1, dtype=jnp.dtype(dtype), platform="tpu",
                        device_kind="TPU v4")
  gpt2 = problem(25, 64, jnp.bfloat16)
  tiles = pallas_tpu.resolve_tiles(None, gpt2)
  assert (tiles.block_q, tiles.block_k, tiles.block_k_dkv) == (16, 64, 64)
  budget = pallas_tpu._BUDGET * pallas_tpu._generation("TPU v4")[2]
  assert pallas_tpu._vmem_estimate(16, 64, 1, 25, 64, 2) <= budget
  assert pallas_tpu.unsupported(gpt2) is None
  huge = problem(255, 256, jnp.float32)       # 255 kv heads of 256 in every block
  reason = pallas_tpu.unsupported(huge)
  assert reason is not None and ("blocks of 255 kv heads" in reason and
                                 "MiB of VMEM even at 8 x 8 tiles, of the 16 MiB" in reason)
  assert _validate.resolve_backend("auto", huge) == "xla"
  with pytest.raises(NotImplementedError, match="blocks of 255 kv heads"):
    _validate.resolve_backend(BACKEND, huge)


def test_block_sizes_follow_tpu_tiling():
  resolve = _resolve
  kw = dict(head_dim=128, kv_heads=4, group=4, dtype=jnp.bfloat16,
            device_kind="TPU v5 lite")
  assert resolve(None, 96, 64, **kw) == (96, 64)     # whole short lengths
  assert resolve(None, 16 * 8193, 16 * 8193, **kw)[1] == 16 * 3   # no 128-multiple divides
  # ... and a user may give what the default would take there (it asked for multiples of 128)
  assert resolve(ringflash.TpuBlockSizes(32, 16), 256, 16 * 8193, **kw) == (32, 16)
  with pytest.raises(ValueError, match="block_sizes.block_k=24 .* multiple of 16"):
    resolve(ringflash.TpuBlockSizes(32, 24), 256, 16 * 8193, **kw)   # bf16: 16 sublanes
  assert resolve(ringflash.TpuBlockSizes(32, 128), 256, 256, **kw) == (32, 128)
  # block_q given alone: block_k is the default's divisor of the KEY length (384 keys
  # against 256 queries: no 256-row tile)
  assert resolve(ringflash.TpuBlockSizes(32), 256, 384, **kw) == (32, 384)
  # below the lanes too, where 128 divides the length: the default goes there when VMEM asks
  assert resolve(ringflash.TpuBlockSizes(32, 64), 256, 256, **kw) == (32, 64)
  with pytest.raises(ValueError, match="block_sizes.block_k=24 .* multiple of 16"):
    resolve(ringflash.TpuBlockSizes(32, 24), 256, 384, **kw)
  with pytest.raises(ValueError, match="block_sizes.block_q"):
    resolve(ringflash.TpuBlockSizes(24, 128), 256, 256, **kw)         # bf16 packs 16 rows
  with pytest.raises(ValueError, match="block_sizes.block_q"):
    resolve(ringflash.TpuBlockSizes(96, 128), 256, 256, **kw)         # does not divide
  # 520 = 8 x 65: no 16-row tile divides it, so the default takes 104 (8-row multiples);
  # the user may give that back, and 104 stays refused where 16 divides the length
  default = resolve(None, 520, 520, **kw)
  assert default == (104, 104)
  assert resolve(ringflash.TpuBlockSizes(*default), 520, 520, **kw) == default
  with pytest.raises(ValueError, match="block_sizes.block_q=104 .* multiple of 16"):
    resolve(ringflash.TpuBlockSizes(104, 128), 1664, 256, **kw)
  with pytest.raises(ValueError, match="block_sizes"):
    ringflash.ring_attention(*helpers.inputs(0, 1, 256, 256, 2, 2, 128, jnp.float32)[:3],
                             mesh=helpers.mesh_of(2), backend=BACKEND,
                             block_sizes=ringflash.TpuBlockSizes(block_k=96))


def test_a_grid_past_mosaics_step_bound_is_not_implemented():
  """Mosaic TPU counts a kernel call's grid steps in int32: 2^27 rows a device in tiles of
  512 are 2^18 x 2^18 steps, which libtpu's compiler refused with a RET_CHECK. Refused by
  name while tracing; a grid at the bound's side of it traces."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("sp",))
  seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sp"))

  def lower(rows, **options):
    args = [jax.ShapeDtypeStruct((1, 2 * rows, 1, 8), jnp.bfloat16, sharding=seq)] * 3
    return jax.jit(lambda q, k, v: ringflash.ring_attention(
        q, k, v, mesh=mesh, backend=BACKEND, **options)).lower(*args)

  with pytest.raises(NotImplementedError, match=(
      "backend 'pallas_tpu' runs a kernel call of 134217728 query and 134217728 key rows as a "
      "grid of 1 x 1 x 262144 x 262144 = 68719476736 steps")):
    lower(2**27)
  lower(2**20 + 2**19)      # 3072 x 3072 tiles of 512
