"""Conformance of the pallas_gpu backend against the fp32 oracle (tests/oracle.py).

The Mosaic GPU kernels need a Hopper GPU to run: with the installed jax they cannot run in
interpret mode on CPU (the HLO interpreter rejects run_scoped over the warpgroup axis, and
jax 0.12's Mosaic GPU interpreter interprets neither pl.run_state over a WGMMA accumulator nor
a store into one: docs/GPU_NOTES.md "Mosaic GPU's interpreter"). So the numerical cases run only where a GPU of compute
capability >= 9.0 is present (JAX_PLATFORMS=cuda). On CPU: the tile plan, what the backend
accepts and which kernel takes which head dims, the Triton backward kernels (Pallas interpret
mode; with soft-cap, Hv != H and padded head dims), the lowering of both Mosaic GPU kernels
for CUDA, alone and inside shard_map as the ring calls them, which runs Mosaic GPU's layout
inference and shared-memory budget check on this machine, and the lowering of the Triton
backward for an H200 at the head dims it takes (power-of-two blocks after padding).

bf16 criterion: error vs the fp32 oracle <= 2x the error of plain bf16 dense attention
(3x for gradients); max absolute error over all elements.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import ringflash
from ringflash.kernels import base
from ringflash.kernels import pallas_gpu
from ringflash.kernels import pallas_gpu_common as common
from ringflash.kernels import pallas_gpu_mosaic_bwd
from ringflash.kernels import pallas_gpu_triton_bwd
import helpers
import oracle


needs_hopper = pytest.mark.skipif(not helpers.hopper_devices(),
                                  reason="needs a GPU of compute capability >= 9.0")


def _segments(b, t, s, with_empty):
  """Packed documents of three per batch row, cut at other places in row 0 (halves, then
  quarters) than in the others (thirds), so that each row has its own tile plan: row 0
  skips tile pairs and runs unmasked ones that row 1 needs masked (a kernel reading row 0's
  plan for every row gets row 1 wrong). with_empty gives query rows an id no key has (rows
  with no key)."""
  q_ids = np.zeros((b, t), np.int32)
  kv_ids = np.zeros((b, s), np.int32)
  for ids, n in ((q_ids, t), (kv_ids, s)):
    ids[0, n // 2:] = 1
    ids[0, 3 * n // 4:] = 2
    ids[1:, n // 3:] = 1
    ids[1:, 2 * n // 3:] = 2
  if with_empty:
    q_ids[:, t - t // 8:] = 7
  return jnp.asarray(q_ids), jnp.asarray(kv_ids)


def _max_err(x, ref):
  return float(jnp.max(jnp.abs(x.astype(jnp.float32) - ref.astype(jnp.float32))))


# ----------------------------------------------------------------------------- CPU: plan


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("causal,segs,window", [(True, False, None), (False, True, None),
                                                (True, True, None), (False, False, (100, 30)),
                                                (True, True, (200, 0))])
def test_tile_plan_is_conservative(causal, segs, window, transposed):
  """The forward's plan (per query tile, over key tiles of 128) and, transposed, the Mosaic
  backward's (per key tile of 64, over query tiles of 64) skip only tiles with no valid pair
  and run unmasked only over tiles whose every pair is valid."""
  t = s = 512
  b_ = pallas_gpu_mosaic_bwd.BLOCK
  bq, bk = (b_, b_) if transposed else (64, 128)
  rng = np.random.default_rng(0)
  # zigzag-like positions: two chunks per device, sorted within each
  q_pos = jnp.asarray(np.concatenate([np.arange(0, 256), np.arange(768, 1024)]), jnp.int32)
  k_pos = jnp.asarray(np.concatenate([np.arange(256, 512), np.arange(512, 768)]), jnp.int32)
  q_seg = k_seg = None
  if segs:
    q_seg = jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1), jnp.int32)
    k_seg = jnp.asarray(np.sort(rng.integers(0, 4, (2, s)), axis=1), jnp.int32)
  spec = base.KernelSpec(scale=1.0, causal=causal, tiles=ringflash.GpuBlockSizes(bq, bk, 2),
                         window=window)
  work, full = common.tile_flags(q_pos, k_pos, q_seg, k_seg, spec, bq, bk)
  valid = np.asarray(base.mask(q_pos, k_pos, q_seg, k_seg, spec))         # [B|1, T, S]
  tiles = valid.reshape(valid.shape[0], t // bq, bq, s // bk, bk)
  any_valid = tiles.any(axis=(2, 4))
  all_valid = tiles.all(axis=(2, 4))
  if transposed:  # rows: key tiles; as pallas_gpu_mosaic_bwd.backward builds its plan
    work, full = jnp.swapaxes(work, -1, -2), jnp.swapaxes(full, -1, -2)
    any_valid, all_valid = np.swapaxes(any_valid, -1, -2), np.swapaxes(all_valid, -1, -2)
  plan = np.asarray(common.tile_plan(work, full))
  nb = max(plan.shape[0], any_valid.shape[0])
  for bi in range(nb):
    p = plan[min(bi, plan.shape[0] - 1)]
    for i in range(p.shape[0]):
      u_lo, lo, flo, fhi, hi, u_hi = p[i, :6]
      assert u_lo <= lo <= flo <= fhi <= hi <= u_hi
      j_valid = np.nonzero(any_valid[min(bi, any_valid.shape[0] - 1), i])[0]
      assert all(lo <= j < hi for j in j_valid), (bi, i, p[i], j_valid)
      for j in range(flo, fhi):
        assert all_valid[min(bi, all_valid.shape[0] - 1), i, j], (bi, i, j, p[i])
      # the two query tiles of one CUDA block share the union range
      other = p[i ^ 1]
      assert (u_lo, u_hi) == (other[0], other[5])


# ----------------------------------------------------------------------------- CPU: bwd


def _inputs(seed, b, t, s, n, kh, h, hv, dtype=jnp.bfloat16):
  """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] and dout [B, T, N, Hv], O(1) values."""
  q, k, v, do = helpers.inputs(seed, b, t, s, n, kh, h, dtype)
  if hv != h:
    kv, kd = jax.random.split(jax.random.key(seed + 100))
    v = jax.random.normal(kv, (b, s, kh, hv), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (b, t, n, hv), jnp.float32).astype(dtype)
  return q, k, v, do


INTERPRET_CASES = [
    # causal, segs, n, kh, window, h, hv, softcap, through the backend (padding) or with
    # the dk, dv kernel's tiles keys first (True) or transposed (False)
    (True, False, 4, 2, None, 64, 64, None, True),
    (False, True, 2, 1, (20, 5), 64, 64, None, False),
    (True, True, 4, 2, None, 64, 128, 2.0, True),        # soft-cap, Hv > H, empty rows
    (True, True, 4, 2, None, 64, 128, 2.0, False),
    pytest.param(False, False, 2, 1, (30, 10), 80, 48, 3.0, "backend",   # 64 + 16 / 32 + 16
                 marks=pytest.mark.slow),
    (True, True, 4, 2, None, 192, 128, 5.0, "backend"),  # MLA: pieces 128 + 64 / 128
    (False, False, 2, 2, None, 72, 160, None, "backend"),     # 64 + 16 (padded) / 128 + 32
]


def _check_kernel_grads(got, dense, q, k, v, do):
  """A backward kernel's float32 (dq, dk, dv) against the oracle's (dense(True, q, k, v)):
  finite, the inputs' shapes, within 3x a dense bf16 implementation's error
  (dense(False, ...))."""
  _, vjp32 = jax.vjp(lambda *a: dense(True, *a), q, k, v)
  want = vjp32(do.astype(jnp.float32))
  _, vjp16 = jax.vjp(lambda *a: dense(False, *a), q, k, v)
  plain = vjp16(do)
  for name, g, w, p in zip(("dq", "dk", "dv"), got, want, plain):
    assert g.dtype == jnp.float32 and g.shape == w.shape, name
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert _max_err(g, w) <= 3 * _max_err(p, w), (name, _max_err(g, w), _max_err(p, w))


@pytest.mark.parametrize("causal,segs,n,kh,window,h,hv,softcap,path", INTERPRET_CASES)
def test_backward_kernels_interpret(causal, segs, n, kh, window, h, hv, softcap, path):
  """The Triton backward kernels in interpret mode, from the oracle's out and lse: called
  directly with the dk, dv kernel's tiles keys first or transposed (`path` True / False),
  or through pallas_gpu.backward ("backend"), which takes the head dims as column pieces
  (triton_dims), pads them to the pieces' sum and cuts the gradients back. With segments,
  two batch rows, each with its own tile plan (_segments)."""
  b, t = (2 if segs else 1), 128
  q, k, v, do = _inputs(1, b, t, t, n, kh, h, hv)
  q_seg, kv_seg = _segments(b, t, t, with_empty=True) if segs else (None, None)
  pos = jnp.arange(t, dtype=jnp.int32)
  spec = base.KernelSpec(scale=h ** -0.5, causal=causal,
                         tiles=ringflash.GpuBlockSizes(64, 64, 2), interpret=True, window=window,
                         softcap=softcap)

  def dense(upcast, q, k, v):
    return oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg,
                            upcast=upcast, window=window, softcap=softcap)[0]

  out, lse = oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg,
                              window=window, softcap=softcap)
  if path == "backend":
    kernel = pallas_gpu.backward
  else:
    kernel = functools.partial(pallas_gpu_triton_bwd.backward, keys_major=path)
  got = kernel(q, k, v, out.astype(q.dtype), lse, do, pos, pos, q_seg, kv_seg, spec)
  _check_kernel_grads(got, dense, q, k, v, do)
  if segs:  # rows with no valid key: zero dq
    assert float(jnp.abs(got[0][:, t - t // 8:]).max()) == 0.0


@pytest.mark.parametrize("causal,segs,q_off", [(True, False, 10), (False, True, 0)])
def test_backward_pads_lengths_the_tiles_do_not_divide(causal, segs, q_off):
  """pallas_gpu.backward at T = 72, S = 100 (the Triton backward, interpreted): rows up to
  whole tiles of 64 whose ids see nothing, and the padded rows' gradients cut off, so dq,
  dk, dv have the inputs' rows and meet the oracle's (3x a dense bf16 implementation's
  error); queries at positions q_off.. against keys 0..99 (causal: a query sees the keys up
  to its position: keys 82..99 no query sees get zero dk, dv)."""
  b, t, s, n, kh, h = 2, 72, 100, 4, 2, 64
  q, k, v, do = _inputs(3, b, t, s, n, kh, h, h)
  q_seg, kv_seg = _segments(b, t, s, with_empty=True) if segs else (None, None)
  q_pos = jnp.arange(t, dtype=jnp.int32) + q_off
  k_pos = jnp.arange(s, dtype=jnp.int32)
  spec = base.KernelSpec(scale=h ** -0.5, causal=causal,
                         tiles=ringflash.GpuBlockSizes(64, 64, 2), interpret=True)

  def dense(upcast, q, k, v):
    return oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg, q_pos=q_pos,
                            kv_pos=k_pos, upcast=upcast)[0]

  out, lse = oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg, q_pos=q_pos,
                              kv_pos=k_pos)
  got = pallas_gpu.backward(q, k, v, out.astype(q.dtype), lse, do, q_pos, k_pos, q_seg, kv_seg,
                            spec)
  _check_kernel_grads(got, dense, q, k, v, do)
  if causal:                                      # keys past every query: zero dk, dv
    assert float(jnp.abs(got[1][:, t + q_off:]).max()) == 0.0
    assert float(jnp.abs(got[2][:, t + q_off:]).max()) == 0.0


@pytest.mark.parametrize("row", [80, 20])
def test_backward_interpret_nan_row_reaches_only_the_keys_it_sees(row):
  """The non-finite rule in the Triton backward (interpret, MLA pieces 128 + 64 / 128,
  causal): a row that saw a NaN carries it in its lse (base.guard_backward); its gradients
  and those of the keys it sees (j <= row) become NaN, every other gradient is what it is
  without the NaN, bit for bit. Row 80 sees key tile 0 through the unmasked run of full
  tiles and keys 64..80 through the masked diagonal tile; row 20 only the diagonal tile."""
  b, t, n, kh, h, hv = 1, 128, 4, 2, 192, 128
  q, k, v, do = _inputs(4, b, t, t, n, kh, h, hv)
  pos = jnp.arange(t, dtype=jnp.int32)
  spec = base.KernelSpec(scale=h ** -0.5, causal=True, tiles=ringflash.GpuBlockSizes(64, 64, 2),
                         interpret=True)
  out, lse = oracle.attention(q, k, v, causal=True)
  out = out.astype(q.dtype)
  clean = pallas_gpu.backward(q, k, v, out, lse, do, pos, pos, None, None, spec)
  head = 1                                           # query head 1: kv head 0 (G = 2)
  got = pallas_gpu.backward(q, k, v, out, lse.at[0, head, row].set(jnp.nan), do, pos, pos,
                            None, None, spec)
  dq, dk, dv = (np.asarray(x) for x in got)
  dq0, dk0, dv0 = (np.asarray(x) for x in clean)
  assert np.isnan(dq[0, row, head]).all()
  dq_nan = np.zeros(dq.shape, bool)
  dq_nan[0, row, head] = True
  np.testing.assert_array_equal(dq[~dq_nan], dq0[~dq_nan])
  for g, g0 in ((dk, dk0), (dv, dv0)):
    assert np.isnan(g[0, :row + 1, 0]).all()
    seen = np.zeros(g.shape, bool)
    seen[0, :row + 1, 0] = True
    np.testing.assert_array_equal(g[~seen], g0[~seen])


def _float16_large(seed, b, t, n, kh, h, hv):
  """float16 q, k x 0.01, v x 3000 and dout x 30: ds = p (dp - D) reaches about 1e6, past
  float16's 65504, while every gradient stays far inside float16's range."""
  q, k, v, do = _inputs(seed, b, t, t, n, kh, h, hv, jnp.float32)
  return tuple((x * f).astype(jnp.float16)
               for x, f in ((q, 0.01), (k, 0.01), (v, 3000.0), (do, 30.0)))


def _causal_backward_and_oracle(q, k, v, do, interpret, dlse=None):
  """(dq, dk, dv) of the backend's causal backward (tiles of 64, from the oracle's out and
  lse) and the fp32 oracle's gradients for the same cotangents."""
  t, h = q.shape[1], q.shape[-1]
  pos = jnp.arange(t, dtype=jnp.int32)
  spec = base.KernelSpec(scale=h ** -0.5, causal=True,
                         tiles=ringflash.GpuBlockSizes(64, 64, 2), interpret=interpret)
  out, lse = oracle.attention(q, k, v, causal=True)
  got = pallas_gpu.backward(q, k, v, out.astype(q.dtype), lse, do, pos, pos, None, None, spec,
                            dlse=dlse)
  _, vjp = jax.vjp(lambda *a: oracle.attention(*a, causal=True), q, k, v)
  want = vjp((do.astype(jnp.float32), jnp.zeros_like(lse) if dlse is None else dlse))
  return got, want


@pytest.mark.parametrize("h,hv,lse_cotangent,kernel", [
    (64, 64, False, "triton"), (192, 128, True, "triton"),
    pytest.param(128, 128, True, "mosaic", marks=needs_hopper),
    pytest.param(192, 128, False, "wide", marks=needs_hopper)])
def test_float16_backward_keeps_the_range_of_float16(h, hv, lse_cotangent, kernel):
  """The backend's float16 backward where ds passes 65504 (the Triton kernels interpreted on
  CPU; the fused and the wide Mosaic kernels on a Hopper GPU): the kernels multiply ds in
  float16, so pallas_gpu.backward scales it by a power of two per kv head into range and
  divides dq and dk back (_float16_ds_range). The gradients are finite and within 4 float16
  epsilons (2^-10) of their largest against the fp32 oracle, also with a cotangent of lse
  (return_residual), which enters D."""
  b, n, kh = 1, 4, 2
  interpret = kernel == "triton"
  t = 128 if interpret else 256
  assert pallas_gpu.backward_kernel(h, hv, t, interpret) == kernel
  q, k, v, do = _float16_large(7, b, t, n, kh, h, hv)
  dlse = (jax.random.normal(jax.random.key(8), (b, n, t), jnp.float32) * 3e4
          if lse_cotangent else None)
  got, want = _causal_backward_and_oracle(q, k, v, do, interpret, dlse)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert bool(jnp.all(jnp.isfinite(g))), f"{name}: float16 overflowed"
    bound = 4 * 2.0 ** -10 * float(jnp.max(jnp.abs(w.astype(jnp.float32))))
    assert _max_err(g, w) <= bound, (name, _max_err(g, w), bound)


@pytest.mark.parametrize("h,kernel", [
    (64, "triton"), pytest.param(128, "mosaic", marks=needs_hopper),
    pytest.param(192, "wide", marks=needs_hopper)])
def test_float16_backward_scales_each_kv_head_by_its_own_group(h, kernel):
  """GQA, float16, ds past 65504 in one kv head's group only: kv head 1's values x 3000 and
  the cotangent of query head 2 (kv head 1's group of heads 2, 3) x 30; kv head 0 and its
  query heads 0, 1 ordinary. Each kv head's bound reads its own query heads' cotangents and
  D, so the range scale gamma is 1 for kv head 0 (an interleaved grouping, heads 0 and 2,
  would charge it with head 2's cotangent) and below 1 for kv head 1. dq of each query head
  is divided by its own kv head's gamma (heads 2, 3 by gamma[1]; divided by gamma[0] = 1,
  their dq would come out times gamma[1], finite and wrong). Every gradient is finite and,
  head by head, within 4 float16 epsilons of that head's largest against the fp32 oracle."""
  b, t, n, kh, hv = 1, 256, 4, 2, h
  interpret = kernel == "triton"
  if interpret:
    t = 128
  assert pallas_gpu.backward_kernel(h, hv, t, interpret) == kernel
  q, k, v, do = _inputs(11, b, t, t, n, kh, h, hv, jnp.float32)
  v = v.at[:, :, 1].multiply(3000.0)
  do = do.at[:, :, 2].multiply(30.0)
  q, k, v, do = (x.astype(jnp.float16) for x in (q * 0.01, k * 0.01, v, do))
  out, _ = oracle.attention(q, k, v, causal=True)
  gamma, _, _ = pallas_gpu._float16_ds_range(v, out.astype(q.dtype), do, None, h ** -0.5)
  gamma = np.asarray(gamma)
  assert gamma[0, 0] == 1.0 and gamma[0, 1] <= 2.0 ** -4, gamma
  got, want = _causal_backward_and_oracle(q, k, v, do, interpret)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert bool(jnp.all(jnp.isfinite(g))), f"{name}: float16 overflowed"
    for head in range(g.shape[2]):
      gh, wh = g[:, :, head], w[:, :, head]
      bound = 4 * 2.0 ** -10 * float(jnp.max(jnp.abs(wh.astype(jnp.float32))))
      assert _max_err(gh, wh) <= bound, (name, head, _max_err(gh, wh), bound)


def test_float16_ds_range_leaves_ordinary_inputs_alone_and_skips_non_finite():
  """gamma is 1 where ds cannot leave float16's range (O(1) inputs: v reaches the kernels
  unchanged, and D is rowsum(dout out)), a power of two per kv head otherwise, chosen from
  the finite values only: a NaN value in one key leaves the scale of the other keys'
  gradients as it was. Every check is made in numpy on the host: on a GPU, XLA's division
  and logarithm are approximations, and its reductions fuse in their own order."""
  b, t, n, kh, h = 2, 64, 4, 2, 64
  _, _, v, do = _inputs(3, b, t, t, n, kh, h, h, jnp.float16)
  out = (do.astype(jnp.float32) * 0.5).astype(jnp.float16)
  gamma, v1, d1 = pallas_gpu._float16_ds_range(v, out, do, None, h ** -0.5)
  np.testing.assert_array_equal(np.asarray(gamma), 1.0)
  np.testing.assert_array_equal(np.asarray(v1), np.asarray(v))
  terms = np.asarray(do, np.float64) * np.asarray(out, np.float64)       # [B, T, N, H]
  want = terms.sum(-1).transpose(0, 2, 1)
  # float32 sums of h terms in any order: within h 2^-24 of the sum of their sizes
  slack = h * 2.0 ** -24 * np.abs(terms).sum(-1).transpose(0, 2, 1)
  assert np.all(np.abs(np.asarray(d1, np.float64) - want) <= slack)
  big_v = (v.astype(jnp.float32) * 3000).astype(jnp.float16)
  big_v = big_v.at[1, 5:, 0].multiply(0.001)           # batch 1, kv head 0: small again
  big_do = (do.astype(jnp.float32) * 30).astype(jnp.float16)
  gamma, v2, _ = pallas_gpu._float16_ds_range(big_v, out, big_do, None, h ** -0.5)
  g = np.asarray(gamma, np.float64)
  mantissa, _ = np.frexp(g)
  assert np.all(g <= 2.0 ** -3) and np.all(mantissa == 0.5), g   # powers of two
  with_nan, _, _ = pallas_gpu._float16_ds_range(big_v.at[0, 3, 1, 0].set(jnp.nan), out,
                                                   big_do, None, h ** -0.5)
  np.testing.assert_array_equal(np.asarray(with_nan, np.float64), g)
  # v2 = v gamma exactly where v gamma stays in float16's normal range
  v2, big_v = np.asarray(v2, np.float64), np.asarray(big_v, np.float64)
  normal = np.abs(v2) >= 2.0 ** -14
  np.testing.assert_array_equal(v2[normal], (big_v * g[:, None, :, None])[normal])


# ----------------------------------------------------------------------------- CPU: lowering


def _problem(t, s, h, kh, group, hv=None, softcap=None, dtype=jnp.bfloat16):
  return base.Problem(q_len=t, kv_len=s, head_dim=h, kv_heads=kh, group=group,
                      dtype=jnp.dtype(dtype), platform="gpu", device_kind="NVIDIA H200",
                      compute_capability="9.0", head_dim_v=hv, softcap=softcap)


def _lower_for_cuda(fn, *shapes):
  """Lowers fn for CUDA on this machine: Pallas -> Mosaic GPU, with its layout inference."""
  return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


LOWER_CASES = [
    # which, causal, segs, window, n, kh, h, hv, t, softcap
    ("forward", True, False, None, 4, 2, 128, 128, 512, None),
    # the overlap schedule (plain, H = Hv = 128) with segments and a window, and alone
    ("forward", False, True, (40, 20), 4, 1, 128, 128, 256, None),
    ("forward", False, False, None, 2, 2, 128, 128, 256, None),
    ("forward", False, True, (40, 20), 4, 1, 64, 64, 256, None),
    ("forward", True, False, None, 2, 2, 256, 256, 256, None),
    ("backward", False, False, None, 4, 4, 128, 128, 512, None),
    ("backward", True, True, None, 8, 2, 128, 128, 512, None),
    ("backward", False, False, (40, 20), 2, 1, 128, 128, 256, None),
    ("backward", True, True, None, 4, 1, 64, 64, 256, None),
    # soft-cap
    ("forward", True, True, None, 4, 2, 128, 128, 512, 30.0),
    ("backward", True, True, None, 4, 2, 128, 128, 512, 30.0),
    ("backward", False, False, None, 2, 1, 64, 64, 256, 2.0),
    # value head dims: MLA's 192 / 128 (forward native; its backward is Triton's, below),
    # 128 / 64 and 64 / 128
    ("forward", True, False, None, 4, 1, 192, 128, 512, None),
    ("forward", False, False, None, 4, 2, 128, 64, 256, 5.0),
    ("backward", False, False, None, 4, 2, 128, 64, 256, None),
    ("forward", True, False, None, 2, 2, 64, 128, 256, None),
    ("backward", True, False, None, 2, 2, 64, 128, 256, 5.0),
    # head dims padded to 128 (forward and fused backward)
    ("forward", True, False, None, 4, 2, 96, 96, 256, None),
    ("backward", True, False, None, 4, 2, 80, 80, 256, None),
    ("backward", False, True, None, 2, 1, 112, 48, 256, 3.0),
    # the wide backward: 256 / 256, MLA's 192 / 128, 176 / 120 padded to 192 / 128, 64 / 256
    ("backward", True, True, None, 4, 2, 256, 256, 256, 30.0),
    ("backward", False, False, (40, 20), 4, 1, 192, 128, 256, None),
    ("backward", True, False, None, 2, 2, 176, 120, 256, 5.0),
    ("backward", False, True, None, 2, 1, 64, 256, 256, None),
    # lengths no tile divides: the forward's keys padded to its 128-key tiles, the
    # backward's to 128 for the fused and the wide kernels (not 64 for the Triton one)
    ("forward", False, True, None, 4, 2, 128, 128, 200, None),
    ("backward", True, False, None, 4, 2, 128, 128, 320, None),
    ("backward", False, True, (40, 20), 4, 1, 192, 128, 320, 30.0),
]


def test_forward_schedule_choice():
  """The overlap schedule where it was measured faster (plain, H = Hv = 128) and its extra V
  slot fits shared memory; the ping-pong everywhere else."""
  from ringflash.kernels import pallas_gpu_mosaic_fwd as fwd
  choose = lambda h, hv, stages=2, softcap=None: fwd.overlap_schedule(
      h, hv, 64, 128, stages, 2, softcap)
  assert choose(128, 128)
  assert not choose(128, 128, softcap=30.0)
  assert not choose(64, 64) and not choose(192, 128) and not choose(128, 64)
  assert not choose(128, 128, stages=3)          # 3 stages + the zero slot: 256 KiB


def test_backward_schedule_choice():
  """The fused backward issues dpT with sT (the overlap order) where it was measured faster:
  soft-capped steps, masked or not, and plain ones without a mask; plain masked steps (causal,
  windows, segments) keep the softmax first."""
  from ringflash.kernels import pallas_gpu_mosaic_bwd as bwd
  assert bwd.overlap_schedule(30.0, masked=True) and bwd.overlap_schedule(30.0, masked=False)
  assert bwd.overlap_schedule(None, masked=False)
  assert not bwd.overlap_schedule(None, masked=True)


def _in_shard_map(fn, seq_dims, out_dims, mesh=None):
  """fn inside shard_map over a one-device mesh (default: this host's first device) with
  each array's sequence dimension mapped, as the ring calls the kernels: there, positions
  and bounds read from such arrays carry the mesh axis in their type, and every loop carry
  inside the kernel must agree with it."""
  def seq(d):
    return jax.sharding.PartitionSpec(*([None] * d + ["sp"]))

  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",)) if mesh is None else mesh
  return jax.shard_map(fn, mesh=mesh, in_specs=tuple(map(seq, seq_dims)),
                       out_specs=tuple(map(seq, out_dims)))


def _kernel_fn(which, causal, segs, window, n, kh, h, hv, t, softcap, dtype=jnp.bfloat16):
  """(fn, ShapeDtypeStructs of its arguments, sequence dims of args and outputs) of the
  backend's forward or backward, with the backend's default tiles."""
  b = 2 if segs else 1
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  k = jax.ShapeDtypeStruct((b, t, kh, h), dtype)
  v = jax.ShapeDtypeStruct((b, t, kh, hv), dtype)
  pos = jax.ShapeDtypeStruct((t,), jnp.int32)
  seg = jax.ShapeDtypeStruct((b, t), jnp.int32) if segs else None
  if t % 128:       # a backward alone: the forward's tiles would refuse t
    tiles = ringflash.GpuBlockSizes(64, 64, 2)
  else:
    tiles = pallas_gpu.resolve_tiles(None, _problem(t, t, h, kh, n // kh, hv=hv,
                                                    softcap=softcap))
  spec = base.KernelSpec(scale=h ** -0.5, causal=causal, tiles=tiles, window=window,
                         softcap=softcap)
  if which == "forward":
    fn = lambda q, k, v, p, s: pallas_gpu.forward(q, k, v, p, p, s, s, spec)
    return fn, [q, k, v, pos, seg], [1, 1, 1, 0, 1], [1, 2]
  o = jax.ShapeDtypeStruct((b, t, n, hv), dtype)
  lse = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
  fn = lambda q, k, v, o, lse, do, p, s: pallas_gpu.backward(q, k, v, o, lse, do, p, p, s, s,
                                                             spec)
  return fn, [q, k, v, o, lse, o, pos, seg], [1, 1, 1, 1, 2, 1, 0, 1], [1, 1, 1]


@pytest.mark.parametrize("in_ring", [False, True], ids=["alone", "in_shard_map"])
@pytest.mark.parametrize("which,causal,segs,window,n,kh,h,hv,t,softcap", LOWER_CASES)
def test_mosaic_kernels_lower_for_cuda(which, causal, segs, window, n, kh, h, hv, t, softcap,
                                       in_ring):
  if which == "backward":             # at the key length the backward pads to
    rows = pallas_gpu._backward_key_rows(h, hv, t, interpret=False)
    assert pallas_gpu.backward_kernel(h, hv, -(-t // rows) * rows, interpret=False) in (
        "mosaic", "wide")
  fn, args, seq_dims, out_dims = _kernel_fn(which, causal, segs, window, n, kh, h, hv, t,
                                            softcap)
  if in_ring:
    fn = _in_shard_map(fn, seq_dims, out_dims)
  text = _lower_for_cuda(fn, *args)
  # the kernel is a Mosaic GPU custom call, not a fallback
  assert "mosaic_gpu" in text
  assert "triton" not in text.lower()


@pytest.mark.parametrize("h,hv", [(128, 128), (192, 128)])
def test_float16_backward_lowers_for_cuda(h, hv):
  """The float16 backward (its ds range scaling around the fused and the wide Mosaic
  kernels) lowers for CUDA inside shard_map, as the ring calls it."""
  assert pallas_gpu.backward_kernel(h, hv, 256, interpret=False) in ("mosaic", "wide")
  fn, args, seq_dims, out_dims = _kernel_fn("backward", True, False, None, 4, 2, h, hv, 256,
                                            None, dtype=jnp.float16)
  text = _lower_for_cuda(_in_shard_map(fn, seq_dims, out_dims), *args)
  assert "mosaic_gpu" in text and "triton" not in text.lower()


def _abstract_h200():
  """A one-device abstract mesh (axis "sp") of an H200: in its context Pallas Triton lowers
  for that GPU on a machine without one (it reads the GPU's kind from the abstract mesh).
  None where this jax has no AbstractDevice."""
  device_cls = getattr(jax.sharding, "AbstractDevice", None)
  if device_cls is None:
    return None
  try:
    device = device_cls(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=device)
  except TypeError:
    return None


TRITON_LOWER_CASES = [
    # which, causal, segs, window, n, kh, h, hv, t, softcap: head dims the Mosaic kernels
    # would pad more (t not a multiple of 128 either)
    ("backward", True, False, None, 4, 1, 136, 136, 320, None),       # 128 + 16 / 128 + 16
    ("backward", False, True, None, 4, 2, 136, 136, 320, 30.0),
    ("backward", True, False, (40, 0), 2, 2, 160, 72, 320, 5.0),
    ("backward", True, False, None, 2, 1, 160, 72, 320, None),        # 128 + 32 / 64 + 16
]


@pytest.mark.parametrize("which,causal,segs,window,n,kh,h,hv,t,softcap", TRITON_LOWER_CASES)
def test_triton_backward_lowers_for_cuda(which, causal, segs, window, n, kh, h, hv, t,
                                         softcap):
  """The backward of head dims the Mosaic kernels would pad more: Pallas -> Triton for CUDA
  (power-of-two column pieces), alone and inside shard_map, its keys padded to its tile;
  its exponentials are ex2 (no libdevice expf) and soft-cap's tanh the MUFU's
  tanh.approx.f32, as the forward's, not libdevice's accurate tanhf (on the H200, 1.15-1.23x
  the soft-capped backward: docs/GPU_NOTES.md run 99)."""
  assert pallas_gpu.backward_kernel(h, hv, 384, interpret=False) == "triton"
  assert pallas_gpu._backward_key_rows(h, hv, t, interpret=False) == pallas_gpu.BWD_BLOCK
  mesh = _abstract_h200()
  if mesh is None:
    pytest.skip("needs jax.sharding.AbstractDevice to lower Pallas Triton without a GPU")
  fn, args, seq_dims, out_dims = _kernel_fn(which, causal, segs, window, n, kh, h, hv, t,
                                            softcap)
  for f in (fn, _in_shard_map(fn, seq_dims, out_dims, mesh)):
    with jax.sharding.use_abstract_mesh(mesh):
      text = _lower_for_cuda(f, *args)
    assert "triton" in text.lower() and "mosaic_gpu" not in text
    assert "__nv_exp2f" in text and "__nv_expf" not in text
    if softcap is not None:
      assert "tanh.approx.f32" in text and "__nv_tanhf" not in text


def test_forward_tiles_beyond_shared_memory_raise():
  """bk = 128 at head dim 256 needs 320 KiB: a ValueError naming block_sizes, not a failed
  compile."""
  with pytest.raises(ValueError, match="block_sizes"):
    pallas_gpu.resolve_tiles(ringflash.GpuBlockSizes(64, 128), _problem(512, 512, 256, 1, 1))
  tiles = pallas_gpu.resolve_tiles(ringflash.GpuBlockSizes(64, 128),
                                   _problem(512, 512, 128, 1, 1))
  assert (tiles.block_q, tiles.block_k, tiles.stages) == (64, 128, 2)


@pytest.mark.parametrize("which,h,hv,per_block", [
    ("forward", 64, 64, 128),          # 2 * block_q query rows a block
    ("mosaic", 64, 64, 128),           # the fused backward: 2 * 64 key rows a block
    ("wide", 192, 128, 64),            # the wide backward: 64 key rows a block
    ("triton", 160, 72, None),         # Pallas' Triton lowering folds its grid: no bound
])
def test_grids_past_cudas_bound_are_not_implemented_naming_the_rows(which, h, hv, per_block):
  """Mosaic GPU launches (heads, tiles, batch) reversed: a call's row tiles are the grid's
  y extent, which CUDA bounds at 65535 (a query run of 8388480 rows at block_q = 64, a key
  run of 4194176 in the wide backward, whose keys are padded to a multiple of 128). Past it
  the call is refused while tracing, naming the longest run that fits; nothing checked it
  before. Traced only: no array of that size is made."""
  block = per_block or 64
  limit = block * pallas_gpu.MAX_GRID_TILES
  ok = limit // 128 * 128                       # the rows the backward pads to 128 keep it
  past = block * (pallas_gpu.MAX_GRID_TILES + 1)
  rows = {}
  for n_rows in (ok, past):
    long_side = (n_rows, 128) if which == "forward" else (128, n_rows)
    t, s = long_side
    spec = base.KernelSpec(scale=h ** -0.5, causal=False,
                           tiles=ringflash.GpuBlockSizes(64, 128, 2))
    sd = jax.ShapeDtypeStruct
    q, k = sd((1, t, 1, h), jnp.bfloat16), sd((1, s, 1, h), jnp.bfloat16)
    v = sd((1, s, 1, hv), jnp.bfloat16)
    qp, kp = sd((t,), jnp.int32), sd((s,), jnp.int32)
    if which == "forward":
      fn = lambda q, k, v, qp, kp: pallas_gpu.forward(q, k, v, qp, kp, None, None, spec)
      args = (q, k, v, qp, kp)
    else:
      assert pallas_gpu.backward_kernel(h, hv, s, False) == which, s
      out, dout = sd((1, t, 1, hv), jnp.bfloat16), sd((1, t, 1, hv), jnp.bfloat16)
      lse = sd((1, 1, t), jnp.float32)
      fn = lambda q, k, v, o, l, do, qp, kp: pallas_gpu.backward(q, k, v, o, l, do, qp, kp, None,
                                                                 None, spec)
      args = (q, k, v, out, lse, dout, qp, kp)
    try:
      jax.jit(fn).trace(*args)
      rows[n_rows] = "traced"
    except NotImplementedError as err:
      rows[n_rows] = str(err)
  assert rows[ok] == "traced"
  if per_block is None:
    assert rows[past] == "traced"
  else:
    what = "query" if which == "forward" else "key"
    assert rows[past] == (
        f"backend 'pallas_gpu' runs a kernel call of {past} {what} rows as 65536 "
        f"CUDA blocks of {per_block} rows along one grid axis, which CUDA bounds at 65535: at "
        f"most {ok} {what} rows a call; spread the sequence over more devices")


@pytest.mark.parametrize("block_k", [320, 384])
def test_forward_key_tiles_past_one_wgmma_are_refused_by_name(block_k):
  """Shared memory fits (64, 320) at head dim 64, but Q K^T is one wgmma of N = block_k,
  which Mosaic GPU bounds at 256: it failed while lowering, naming no argument."""
  with pytest.raises(ValueError, match=f"block_sizes.block_k={block_k} must be at most 256"):
    ringflash.GpuBlockSizes(64, block_k)
  tiles = pallas_gpu.resolve_tiles(ringflash.GpuBlockSizes(64, 256),
                                   _problem(1024, 1024, 64, 1, 1))
  spec = base.KernelSpec(scale=0.125, causal=True, tiles=tiles)
  q = k = v = jax.ShapeDtypeStruct((1, 1024, 1, 64), jnp.bfloat16)
  pos = jax.ShapeDtypeStruct((1024,), jnp.int32)
  _lower_for_cuda(lambda q, k, v, p: pallas_gpu.forward(q, k, v, p, p, None, None, spec),
                  q, k, v, pos)                             # 256 lowers


@pytest.mark.parametrize("h,hv,block_k,stages", [
    (128, 128, 128, 3),     # Q, K and V alone 224 KiB: under the 227, over with the rest
    (256, 256, 64, 3),
    (64, 64, 128, 7),
])
def test_forward_shared_memory_is_what_mosaic_allocates(h, hv, block_k, stages):
  """common.forward_smem_bytes counts the forward's shared memory as Mosaic GPU allocates it
  (aligned buffers, reduction scratch, barriers): for tiles just over Hopper's 227 KiB
  Mosaic GPU's own count, from its error, is the same number, and resolve_tiles refuses
  those tiles with a ValueError naming block_sizes before any compile."""
  t = 1024
  tiles = ringflash.GpuBlockSizes(64, block_k, stages)
  with pytest.raises(ValueError, match="block_sizes"):
    pallas_gpu.resolve_tiles(tiles, _problem(t, t, h, 2, 2, hv=hv))
  expected = common.forward_smem_bytes(h, hv, 64, block_k, stages, 2)
  assert expected > common.SMEM_BYTES
  spec = base.KernelSpec(scale=h ** -0.5, causal=True, tiles=tiles)
  q = jax.ShapeDtypeStruct((1, t, 4, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, t, 2, h), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, t, 2, hv), jnp.bfloat16)
  pos = jax.ShapeDtypeStruct((t,), jnp.int32)
  with pytest.raises(ValueError, match=f"smem_bytes={expected} >"):
    _lower_for_cuda(lambda q, k, v, p: pallas_gpu.forward(q, k, v, p, p, None, None, spec),
                    q, k, v, pos)


@pytest.mark.parametrize("h,hv,stages,fits", [
    (256, 256, (2, 2), False),      # K, V, 2 Q and 2 dO slots, pT, dsT, dQ parts: 249 KiB
    (256, 256, (2, 1), True),
    (192, 128, (3, 1), True),       # Hv <= 128: three Q slots, one dO slot
    (256, 128, (3, 1), True),       # 218 KiB
    (192, 256, (2, 2), True),       # 225 KiB
    (64, 192, (2, 2), True),
])
def test_wide_backward_shared_memory_is_what_mosaic_allocates(h, hv, stages, fits):
  """pallas_gpu_mosaic_bwd_wide.smem_bytes counts the kernel's shared memory as Mosaic GPU
  allocates it: where it is over Hopper's 227 KiB, Mosaic GPU's own count (from its error)
  is the same number; stages_for takes the first slot counts that fit."""
  from ringflash.kernels import pallas_gpu_mosaic_bwd_wide as wide
  expected = wide.smem_bytes(h, hv, *stages)
  assert (expected <= common.SMEM_BYTES) == fits
  if fits:
    assert wide.stages_for(h, hv) == stages
    return
  assert wide.stages_for(h, hv) == (2, 1)
  t, n, kh = 256, 2, 1
  f32, i32 = jnp.float32, jnp.int32
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
      ((1, t, n, h), jnp.bfloat16), ((1, t, kh, h), jnp.bfloat16),
      ((1, t, kh, hv), jnp.bfloat16), ((1, t, n, hv), jnp.bfloat16), ((1, n, 2, t), f32),
      ((t,), i32), ((t,), i32), ((1, t), i32), ((1, t), i32), ((1, t // 64, 8), i32))]
  call = functools.partial(wide._kernel_call, scale=0.1, causal=True, window=None,
                           softcap=None, stages=stages)
  with pytest.raises(ValueError, match=f"smem_bytes={expected} >"):
    _lower_for_cuda(call, *args)


@pytest.mark.parametrize("h,hv,softcap,dtype,why", [
    (128, 128, 30.0, jnp.bfloat16, None),
    (192, 128, None, jnp.bfloat16, None),             # MLA
    (128, 64, None, jnp.float16, None),
    (64, 128, 2.0, jnp.bfloat16, None),
    (80, 80, None, jnp.bfloat16, None),               # padded
    (8, 256, None, jnp.bfloat16, None),
    (100, 100, None, jnp.bfloat16, "head_dim a multiple of 8 up to 256, got 100"),
    (264, 128, None, jnp.bfloat16, "head_dim a multiple of 8 up to 256, got 264"),
    (128, 60, None, jnp.bfloat16, "head_dim_v a multiple of 8 up to 256, got 60"),
    (128, 128, None, jnp.float32, "bfloat16 and float16"),
])
def test_unsupported_names_what_it_refuses(h, hv, softcap, dtype, why):
  """Head dims: multiples of 8 up to 256 (H and Hv each), with or without a soft-cap; the
  inputs bf16 or fp16. Every accepted combination resolves tiles that fit."""
  problem = _problem(512, 512, h, 2, 2, hv=hv, softcap=softcap, dtype=dtype)
  reason = pallas_gpu.unsupported(problem)
  if why is None:
    assert reason is None
    tiles = pallas_gpu.resolve_tiles(None, problem)
    assert tiles.block_k in (64, 128)
  else:
    assert why in reason and "pallas_gpu" in reason


@pytest.mark.parametrize("h,hv,block_k,kernel,dims,triton", [
    (128, 128, 128, "mosaic", (128, 128), None),
    (64, 64, 128, "mosaic", (64, 64), None),
    (128, 64, 128, "mosaic", (128, 64), None),
    (64, 128, 128, "mosaic", (64, 128), None),
    (80, 96, 128, "mosaic", (128, 128), None),          # both padded to 128
    # MLA: forward and wide backward native; the Triton backward (keys not a multiple of
    # 128) at 128 + 64 / 128, its warps and stages measured
    (192, 128, 128, "wide", (192, 128), ((4, 4), (3, 3))),
    (256, 256, 64, "wide", (256, 256), ((8, 8), (2, 2))),
    (224, 128, 64, "wide", (256, 128), ((4, 8), (3, 3))),
    (64, 256, 64, "wide", (64, 256), None),
    (176, 120, 128, "wide", (192, 128), ((4, 4), (3, 3))),  # Triton's: 128 + 64 / 128
    # padded to 192 / 128 the wide kernel was slower than Triton's 128 + 32 / 64 + 16
    (160, 72, 128, "triton", (192, 128), None),
    (136, 136, 64, "triton", (192, 192), None),
])
def test_which_kernel_takes_which_head_dims(h, hv, block_k, kernel, dims, triton):
  """The forward's default key tile, which backward runs at which head dims (padded for the
  Mosaic ones), and the Triton backward's column pieces, warps and stages where it runs
  (key lengths not a multiple of 128, interpret mode)."""
  tiles = pallas_gpu.resolve_tiles(None, _problem(1024, 1024, h, 2, 2, hv=hv))
  assert tiles.block_k == block_k
  assert pallas_gpu.backward_kernel(h, hv, 1024, interpret=False) == kernel
  assert (pallas_gpu.mosaic_dim(h), pallas_gpu.mosaic_dim(hv)) == dims   # the forward's
  assert pallas_gpu.backward_kernel(h, hv, 1024 + 64, interpret=False) == "triton"
  assert pallas_gpu.backward_kernel(h, hv, 1024, interpret=True) == "triton"
  hp, hvp = sum(pallas_gpu.triton_dims(h)), sum(pallas_gpu.triton_dims(hv))
  assert pallas_gpu.triton_config(hp, hvp) == (((4, 4), (2, 2)) if triton is None else triton)
  # the dk, dv kernel's tiles keys first except at 256 / 256 (8 warps: transposed)
  assert pallas_gpu.triton_keys_major(hp, hvp) == ((h, hv) != (256, 256))


@pytest.mark.parametrize("h,hv,s,interpret,block_k,key_rows", [
    (128, 128, 1537, False, 128, 128),   # both pad 63 keys more than tiles of 64 would
    (80, 80, 4032, False, 128, 128),     # 64 divides it, 128 does not
    (192, 128, 320, False, 128, 128),    # the wide backward
    (160, 72, 320, False, 128, 64),      # the Triton backward's tile
    (136, 136, 700, False, 64, 64),      # Hv padded to 192: the forward's tile of 64
    (128, 128, 320, True, 128, 64),      # interpreted: the Triton backward
])
def test_lengths_no_tile_divides_take_the_faster_tiles(h, hv, s, interpret, block_k,
                                                       key_rows):
  """At key lengths no tile divides, the forward keeps its 128-key tiles and the backward
  pads the keys to 128 where that lets a Mosaic backward run, although each pads up to 64
  keys more than tiles of 64 would: on the H100 the forward's 128-key tiles ran 1.05-1.22x
  as fast as 64-key ones, and the Mosaic backward 1.24-1.38x the Triton one (1.00x at S =
  4000 causal; S = 4000 and 16320: docs/GPU_NOTES.md run 176)."""
  assert pallas_gpu.resolve_tiles(None, _problem(s, s, h, 2, 2, hv=hv)).block_k == block_k
  assert pallas_gpu._backward_key_rows(h, hv, s, interpret) == key_rows


@pytest.mark.parametrize("d,pieces", [
    (8, (16,)), (16, (16,)), (40, (32, 16)), (64, (64,)), (72, (64, 16)), (96, (64, 32)),
    (112, (128,)), (128, (128,)), (136, (128, 16)), (192, (128, 64)), (200, (256,)),
    (256, (256,)),
])
def test_triton_head_dim_pieces(d, pieces):
  """Each head dim as at most two power-of-two pieces, larger first, padding the least."""
  assert pallas_gpu.triton_dims(d) == pieces


# ----------------------------------------------------------------------------- H200


def _dense_grads(dense, q, k, v, do):
  """Gradients of the dense oracle: fp32 (the reference) and plain low precision, jitted."""

  @jax.jit
  def grads(q, k, v, do):
    _, vjp32 = jax.vjp(lambda *a: dense(True, *a), q, k, v)
    _, vjp16 = jax.vjp(lambda *a: dense(False, *a), q, k, v)
    return vjp32(do.astype(jnp.float32)), vjp16(do)

  return grads(q, k, v, do)


def _mesh():
  return Mesh(np.array(helpers.hopper_devices()[:1]), ("sp",))


# Head dims 128 and 256 (the contract cases, tests/contract/, run head dim 64).
CASES = [
    # causal, segs, n, kh, h, t, dtype, grads
    (True, True, 4, 4, 128, 512, jnp.bfloat16, True),      # rows with no valid key
    (True, False, 8, 2, 128, 512, jnp.bfloat16, True),     # GQA 4:1
    (True, False, 2, 2, 256, 256, jnp.bfloat16, True),     # head dim 256: wide backward
    (False, False, 2, 1, 128, 1024, jnp.bfloat16, True),
]


@needs_hopper
@pytest.mark.parametrize("causal,segs,n,kh,h,t,dtype,grads", CASES)
def test_ring_one_gpu_matches_oracle(causal, segs, n, kh, h, t, dtype, grads):
  _check_ring_one_gpu(causal, segs, n, kh, h, h, t, dtype, grads, softcap=None)


# The vocabulary of real models at the head dims of real models (the contract cases,
# tests/contract/, run the same features at head dim 64). Each names its kernels.
VOCAB_CASES = [
    # causal, segs, n, kh, h, hv, softcap, t
    (True, True, 4, 2, 128, 128, 20.0, 512),   # soft-cap; fused backward; rows with no key
    (True, False, 4, 1, 192, 128, None, 512),  # MLA: forward and wide backward at 192 / 128
    (False, False, 4, 2, 128, 64, 5.0, 512),   # Hv < H, soft-cap; fused backward
    (True, False, 2, 2, 80, 80, None, 512),    # padded to 128; forward and fused backward
]


@needs_hopper
@pytest.mark.parametrize("causal,segs,n,kh,h,hv,softcap,t", VOCAB_CASES)
def test_ring_one_gpu_vocabulary_matches_oracle(causal, segs, n, kh, h, hv, softcap, t):
  _check_ring_one_gpu(causal, segs, n, kh, h, hv, t, jnp.bfloat16, True, softcap=softcap)


# Soft-capped scores across the whole cap: q scaled so that scale q.k spreads over about
# +-gain, beyond the cap, where tanh saturates and a row's scores are far apart (the caps
# of the other cases are small beside O(1) scores).
SOFTCAP_RANGE_CASES = [
    # softcap, gain
    (30.0, 40.0),    # Grok's cap
    (50.0, 40.0),    # Gemma 2's
    (100.0, 60.0),
]


@needs_hopper
@pytest.mark.parametrize("softcap,gain", SOFTCAP_RANGE_CASES)
def test_softcap_across_the_cap_matches_oracle(softcap, gain):
  _check_ring_one_gpu(True, True, 4, 2, 128, 128, 512, jnp.bfloat16, True, softcap=softcap,
                      gain=gain)


def _check_ring_one_gpu(causal, segs, n, kh, h, hv, t, dtype, grads, softcap, gain=1.0):
  """ring_attention on a one-GPU mesh (backend pallas_gpu), forward and gradients, against
  the oracle (bf16 criterion); q scaled by gain."""
  b = 2 if segs else 1
  q, k, v, do = _inputs(2, b, t, t, n, kh, h, hv, dtype)
  q = (q.astype(jnp.float32) * gain).astype(dtype)
  q_seg, kv_seg = _segments(b, t, t, with_empty=True) if segs else (None, None)
  seg_arg = (q_seg, kv_seg) if segs else None
  mesh = _mesh()

  def ours(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal, segment_ids=seg_arg,
                                    backend="pallas_gpu", return_residual=True,
                                    logits_soft_cap=softcap)

  def dense(upcast, q, k, v):
    return oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg,
                            upcast=upcast, softcap=softcap)[0]

  # Everything under jit: run eagerly, each operation of the ring and of the oracle would be
  # compiled on its own, which takes minutes per case on the GPU.
  (out, lse), vjp = jax.jit(lambda *a: jax.vjp(ours, *a))(q, k, v)
  want, want_lse = jax.jit(lambda *a: oracle.attention(*a, causal=causal, q_seg=q_seg,
                                                       kv_seg=kv_seg, softcap=softcap))(q, k, v)
  plain = jax.jit(lambda *a: dense(False, *a))(q, k, v)
  assert out.dtype == dtype and out.shape == (b, t, n, hv)
  assert _max_err(out, want) <= 2 * _max_err(plain, want)
  finite = jnp.isfinite(want_lse)
  assert bool(jnp.all(jnp.isfinite(lse) == finite))
  assert float(jnp.max(jnp.where(finite, jnp.abs(lse - want_lse), 0.0))) < 2e-2
  if not grads:
    return
  got = jax.jit(vjp)((do, jnp.zeros_like(lse)))
  want_g, plain_g = _dense_grads(dense, q, k, v, do)
  for name, g, w, p in zip(("dq", "dk", "dv"), got, want_g, plain_g):
    assert g.shape == w.shape, name
    assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), name
    assert _max_err(g, w) <= 3 * _max_err(p, w), (name, _max_err(g, w), _max_err(p, w))


BWD_CASES = [
    # causal, segs, window, n, kh, h, t, s
    (False, False, None, 4, 2, 128, 512, 512),
    (True, False, None, 4, 2, 128, 512, 512),
    (True, True, None, 4, 4, 128, 512, 512),           # rows with no valid key
    (False, False, (40, 20), 2, 2, 128, 512, 512),     # sliding window
    (True, False, None, 8, 2, 64, 256, 512),           # GQA 4:1, T < S, head dim 64
    (False, True, None, 4, 1, 64, 384, 256),           # MQA, T > S
]


@needs_hopper
@pytest.mark.parametrize("causal,segs,window,n,kh,h,t,s", BWD_CASES)
def test_mosaic_backward_matches_oracle(causal, segs, window, n, kh, h, t, s):
  """The fused Mosaic GPU backward alone, from the oracle's out and lse (bf16 criterion)."""
  b = 2 if segs else 1
  q, k, v, do = helpers.inputs(3, b, t, s, n, kh, h, jnp.bfloat16)
  q_seg, kv_seg = _segments(b, t, s, with_empty=True) if segs else (None, None)
  q_pos = jnp.arange(t, dtype=jnp.int32)
  k_pos = jnp.arange(s, dtype=jnp.int32)
  spec = base.KernelSpec(scale=h ** -0.5, causal=causal,
                         tiles=ringflash.GpuBlockSizes(64, 128, 2), window=window)

  def dense(upcast, q, k, v):
    return oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg,
                            upcast=upcast, window=window)[0]

  out, lse = jax.jit(lambda *a: oracle.attention(*a, causal=causal, q_seg=q_seg,
                                                 kv_seg=kv_seg, window=window))(q, k, v)
  got = jax.jit(lambda *a: pallas_gpu_mosaic_bwd.backward(*a, spec))(
      q, k, v, out, lse, do, q_pos, k_pos, q_seg, kv_seg)
  want, plain = _dense_grads(dense, q, k, v, do)
  for name, g, w, p in zip(("dq", "dk", "dv"), got, want, plain):
    assert g.dtype == jnp.float32 and g.shape == w.shape, name
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert _max_err(g, w) <= 3 * _max_err(p, w), (name, _max_err(g, w), _max_err(p, w))
  if segs:  # rows with no valid key: zero dq
    assert float(jnp.abs(got[0][:, t - t // 8:]).max()) == 0.0


# Local lengths no tile divides: the backend pads rows up to whole tiles (ids that see
# nothing) and cuts them off. The forward's tiles: 128 query rows a CUDA block and block_k
# keys (resolve_tiles: 128, 64 above H 192); the backward's: 64 query rows and 128 keys (64
# where the Triton backward runs: H = 136).
ODD_CASES = [
    # causal, segs, window, h, t, s, q_off
    (True, False, None, 128, 200, 1000, 800),     # queries at 800..999: the end of the keys
    (False, True, None, 64, 333, 77, 0),          # rows with no valid key; T > S
    (True, False, (50, 0), 80, 130, 1537, 1400),  # window; keys past every query; H padded
    (False, True, (30, 30), 136, 150, 700, 0),    # block_k 64, the Triton backward
]


@needs_hopper
@pytest.mark.parametrize("causal,segs,window,h,t,s,q_off", ODD_CASES)
def test_backend_pads_lengths_no_tile_divides(causal, segs, window, h, t, s, q_off):
  """pallas_gpu.forward and backward (as the ring calls them, resolve_tiles on the local
  lengths) at lengths no tile divides, against the oracle: out and lse (2x a dense bf16
  implementation's error; -inf exactly where the oracle's is), then dq, dk, dv from the
  oracle's out and lse (3x), each with the inputs' rows."""
  b, n, kh = (2 if segs else 1), 4, 2
  q, k, v, do = helpers.inputs(5, b, t, s, n, kh, h, jnp.bfloat16)
  q_seg, kv_seg = _segments(b, t, s, with_empty=True) if segs else (None, None)
  q_pos = jnp.arange(t, dtype=jnp.int32) + q_off
  k_pos = jnp.arange(s, dtype=jnp.int32)
  tiles = pallas_gpu.resolve_tiles(None, _problem(t, s, h, kh, n // kh))
  spec = base.KernelSpec(scale=h ** -0.5, causal=causal, tiles=tiles, window=window)

  def dense(upcast, q, k, v):
    return oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg, q_pos=q_pos,
                            kv_pos=k_pos, upcast=upcast, window=window)

  out, lse = jax.jit(lambda *a: pallas_gpu.forward(*a, spec))(q, k, v, q_pos, k_pos, q_seg,
                                                              kv_seg)
  want, want_lse = jax.jit(lambda *a: dense(True, *a))(q, k, v)
  plain = jax.jit(lambda *a: dense(False, *a)[0])(q, k, v)
  assert out.shape == (b, t, n, h) and lse.shape == (b, n, t)
  assert _max_err(out, want) <= 2 * _max_err(plain, want)
  finite = jnp.isfinite(want_lse)
  assert bool(jnp.all(jnp.isfinite(lse) == finite))
  assert float(jnp.max(jnp.where(finite, jnp.abs(lse - want_lse), 0.0))) < 2e-2
  got = jax.jit(lambda *a: pallas_gpu.backward(*a, spec))(
      q, k, v, want.astype(q.dtype), want_lse, do, q_pos, k_pos, q_seg, kv_seg)
  want_g, plain_g = _dense_grads(lambda upcast, *a: dense(upcast, *a)[0], q, k, v, do)
  for name, g, w, p in zip(("dq", "dk", "dv"), got, want_g, plain_g):
    assert g.shape == w.shape, name
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert _max_err(g, w) <= 3 * _max_err(p, w), (name, _max_err(g, w), _max_err(p, w))


@needs_hopper
def test_decode_on_a_cache_shard_no_tile_divides():
  """decode_attention on one GPU with a cache of 1000 slots (no key tile of 64 or 128
  divides it), t = 3 new tokens of rows of lengths 3, 700 and 1000, a window: within twice
  a dense bf16 implementation's error of the oracle, out and lse."""
  b, t, s, n, kh, h = 3, 3, 1000, 4, 2, 64
  q, k, v, _ = helpers.inputs(9, b, t, s, n, kh, h, jnp.bfloat16)
  lengths = jnp.array([3, 700, 1000], jnp.int32)
  mesh = _mesh()
  seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sp"))
  out, lse = jax.jit(lambda q, k, v: ringflash.decode_attention(
      q, k, v, cache_lengths=lengths, mesh=mesh, backend="pallas_gpu", local_window_size=100,
      return_residual=True))(q, jax.device_put(k, seq), jax.device_put(v, seq))

  def dense(upcast):
    rows = [oracle.attention(q[r:r + 1], k[r:r + 1], v[r:r + 1], causal=True, window=100,
                             q_pos=jnp.arange(m - t, m), upcast=upcast)
            for r, m in enumerate(np.asarray(lengths))]
    return jnp.concatenate([o for o, _ in rows]), jnp.concatenate([x for _, x in rows])

  want, want_lse = dense(True)
  plain, _ = dense(False)
  assert out.shape == (b, t, n, h)
  assert _max_err(out, want) <= 2 * _max_err(plain, want)
  assert float(jnp.max(jnp.abs(lse - want_lse))) < 2e-2


@needs_hopper
def test_auto_picks_pallas_gpu():
  from ringflash import introspect  # pylint: disable=g-import-not-at-top
  d = helpers.hopper_devices()[0]
  shape = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
  assert introspect.ring_spec(shape, shape, shape, ring_size=1, device=d).backend == "pallas_gpu"


BWD_VOCAB_CASES = [
    # causal, segs, n, kh, h, hv, softcap, t
    (True, True, 4, 2, 128, 128, 30.0, 512),   # fused, soft-cap, rows with no valid key
    (True, False, 4, 2, 64, 128, 2.0, 512),    # fused, Hv > H, soft-cap
    (False, False, 4, 1, 192, 128, 4.0, 512),  # wide, MLA, soft-cap
    (True, True, 4, 2, 176, 120, None, 512),   # wide at 192 / 128 (both padded)
    (True, True, 4, 2, 160, 72, None, 512),    # Triton at 128 + 32 / 64 + 16 (72 padded)
    (True, True, 4, 2, 256, 256, 30.0, 512),   # wide, soft-cap, rows with no valid key
    (False, False, 2, 1, 64, 256, None, 256),  # wide, Hv > H
    (True, False, 2, 1, 80, 48, 3.0, 576),     # keys padded to 640: fused, at 128 / 64
    (False, True, 2, 2, 192, 128, None, 576),  # keys padded to 640: the wide kernel
]


@needs_hopper
@pytest.mark.parametrize("causal,segs,n,kh,h,hv,softcap,t", BWD_VOCAB_CASES)
def test_backward_vocabulary_matches_oracle(causal, segs, n, kh, h, hv, softcap, t):
  """The backend's backward (the fused Mosaic kernel or the Triton one, with padding or
  column pieces) from the oracle's out and lse, with soft-cap and Hv != H (bf16
  criterion)."""
  b = 2 if segs else 1
  q, k, v, do = _inputs(3, b, t, t, n, kh, h, hv)
  q_seg, kv_seg = _segments(b, t, t, with_empty=True) if segs else (None, None)
  pos = jnp.arange(t, dtype=jnp.int32)
  if t % 128:       # the backward's tiles are BWD_BLOCK; the forward's would refuse t
    tiles = ringflash.GpuBlockSizes(64, 64, 2)
  else:
    tiles = pallas_gpu.resolve_tiles(None, _problem(t, t, h, kh, n // kh, hv=hv,
                                                    softcap=softcap))
  spec = base.KernelSpec(scale=h ** -0.5, causal=causal, tiles=tiles, softcap=softcap)

  def dense(upcast, q, k, v):
    return oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg,
                            upcast=upcast, softcap=softcap)[0]

  out, lse = jax.jit(lambda *a: oracle.attention(*a, causal=causal, q_seg=q_seg,
                                                 kv_seg=kv_seg, softcap=softcap))(q, k, v)
  got = jax.jit(lambda *a: pallas_gpu.backward(*a, spec))(
      q, k, v, out.astype(q.dtype), lse, do, pos, pos, q_seg, kv_seg)
  want, plain = _dense_grads(dense, q, k, v, do)
  for name, g, w, p in zip(("dq", "dk", "dv"), got, want, plain):
    assert g.dtype == jnp.float32 and g.shape == w.shape, name
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert _max_err(g, w) <= 3 * _max_err(p, w), (name, _max_err(g, w), _max_err(p, w))
  if segs:  # rows with no valid key: zero dq
    assert float(jnp.abs(got[0][:, t - t // 8:]).max()) == 0.0


@needs_hopper
def test_wide_backward_nan_lse_reaches_only_the_keys_it_sees():
  """The non-finite rule in the wide backward (MLA's 192 / 128, causal, T = 256, G = 2): a
  NaN reaches a backward kernel only through lse (base.guard_backward); at row 80 of query
  head 1 it makes that row's dQ and the dK, dV of the keys it sees (j <= 80) NaN, every
  other gradient unchanged. dK and dV come from one CUDA block each, bit for bit; dQ sums
  the key tiles' TMA reduce-adds in whatever order they land, so it is compared to float32
  rounding."""
  b, t, n, kh, h, hv = 1, 256, 4, 2, 192, 128
  assert pallas_gpu.backward_kernel(h, hv, t, interpret=False) == "wide"
  q, k, v, do = _inputs(5, b, t, t, n, kh, h, hv)
  pos = jnp.arange(t, dtype=jnp.int32)
  spec = base.KernelSpec(scale=h ** -0.5, causal=True, tiles=ringflash.GpuBlockSizes(64, 128, 2))
  run = jax.jit(lambda *a: pallas_gpu.backward(*a, pos, pos, None, None, spec))
  out, lse = jax.jit(lambda *a: oracle.attention(*a, causal=True))(q, k, v)
  out = out.astype(q.dtype)
  dq0, dk0, dv0 = (np.asarray(x) for x in run(q, k, v, out, lse, do))
  row, head = 80, 1
  dq, dk, dv = (np.asarray(x) for x in run(q, k, v, out, lse.at[0, head, row].set(jnp.nan),
                                            do))
  assert np.isnan(dq[0, row, head]).all()
  dq_nan = np.zeros(dq.shape, bool)
  dq_nan[0, row, head] = True
  np.testing.assert_allclose(dq[~dq_nan], dq0[~dq_nan], rtol=1e-5, atol=1e-6)
  for g, g0 in ((dk, dk0), (dv, dv0)):
    assert np.isnan(g[0, :row + 1, 0]).all()
    seen = np.zeros(g.shape, bool)
    seen[0, :row + 1, 0] = True
    np.testing.assert_array_equal(g[~seen], g0[~seen])


@needs_hopper
def test_wide_backward_nan_value_through_the_ring():
  """A NaN in V at key 100 (kv head 0) through ring_attention on one GPU at 192 / 128, causal
  (the wide backward): rows before it do not see it and keep their output and dQ; rows from
  100 on of query heads 0 and 1 see it: NaN output and dQ. A loss that masks those rows gets
  finite gradients equal to the clean inputs' under the same mask (key 100's dV included: no
  unmasked row sees it). Gradients are bf16 here: dQ's float32 sums land in any order (TMA
  reduce-adds) before the cast, so dQ may differ by one bf16 rounding step (2^-8 relative)."""
  b, t, n, kh, h, hv, key = 1, 256, 4, 2, 192, 128, 100
  same = functools.partial(np.testing.assert_allclose, rtol=2 ** -7, atol=1e-6)
  q, k, v, do = _inputs(6, b, t, t, n, kh, h, hv)
  mesh = _mesh()

  def ours(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=True, backend="pallas_gpu")

  fwd_bwd = jax.jit(lambda q, k, v, do: (lambda o, f: (o, f(do)))(*jax.vjp(ours, q, k, v)))
  v_nan = v.at[0, key, 0].set(jnp.nan)
  out0, grads0 = fwd_bwd(q, k, v, do)
  out, grads = fwd_bwd(q, k, v_nan, do)
  out, out0 = np.asarray(out, np.float32), np.asarray(out0, np.float32)
  assert np.isnan(out[0, key:, :2]).all()
  np.testing.assert_array_equal(out[0, :key], out0[0, :key])
  np.testing.assert_array_equal(out[0, :, 2:], out0[0, :, 2:])
  dq, dq0 = np.asarray(grads[0]), np.asarray(grads0[0])
  assert np.isnan(dq[0, key:, :2]).all()
  same(dq[0, :key], dq0[0, :key])
  same(dq[0, :, 2:], dq0[0, :, 2:])
  masked_do = do.at[0, key:, :2].set(0)
  _, grads = fwd_bwd(q, k, v_nan, masked_do)
  _, grads0 = fwd_bwd(q, k, v, masked_do)
  for name, g, g0 in zip(("dq", "dk", "dv"), grads, grads0):
    g, g0 = np.asarray(g, np.float32), np.asarray(g0, np.float32)
    assert np.isfinite(g).all(), name
    same(g, g0, err_msg=name)


# Strategies over several devices. Under ring_attention_sharded, Ulysses' kernel sees the
# whole gathered sequence and all-gather's every key: their tiles divide those lengths, so a
# device's share need not be a multiple of the backend's 128 rows there (a share of 64 under
# Ulysses below). Each case runs with the xla backend on two CPU devices as well, which
# checks this test's own code wherever the suite runs.
STRATEGY_CASES = [
    # strategy, entry, t, causal
    ("ring", "global", 512, True),
    ("allgather", "global", 512, True),
    ("ulysses", "global", 512, False),
    ("ring", "sharded", 256, False),
    ("allgather", "sharded", 256, True),
    ("ulysses", "sharded", 128, True),          # shares of 64 rows, the gathered 128 tiled
]
# On CPU (xla) the default suite runs two of them; the rest are marked slow there.
_FAST_ON_CPU = {("ring", "global"), ("ulysses", "sharded")}


def _two_devices(backend):
  """Two devices for `backend`, or None: Hopper GPUs for pallas_gpu, else CPU devices."""
  if backend == "pallas_gpu":
    devices = helpers.hopper_devices()
  else:
    devices = [d for d in jax.devices() if d.platform == "cpu"]
  return devices[:2] if len(devices) >= 2 else None


@pytest.mark.parametrize("strategy,entry,t,causal,backend", [
    pytest.param(*case, backend, marks=() if backend == "pallas_gpu" or case[:2] in _FAST_ON_CPU
                 else pytest.mark.slow)
    for case in STRATEGY_CASES for backend in ("xla", "pallas_gpu")], ids=str)
def test_strategies_over_two_devices_match_the_oracle(strategy, entry, t, causal, backend):
  """ring_attention, or ring_attention_sharded inside the caller's shard_map, with the
  strategy named, over a ring of two devices; bfloat16, GQA (4 query heads, 2 kv heads);
  out, lse and the gradients of q, k, v against the oracle (the bf16 criterion of
  _check_ring_one_gpu). The pallas_gpu cases need two Hopper GPUs."""
  devices = _two_devices(backend)
  if devices is None:
    pytest.skip(f"needs two {'Hopper GPUs' if backend == 'pallas_gpu' else 'CPU devices'}")
  b, n, kh, h = 1, 4, 2, 128
  q, k, v, do = _inputs(8, b, t, t, n, kh, h, h)
  mesh = Mesh(np.array(devices), ("sp",))
  options = dict(is_causal=causal, backend=backend, strategy=strategy, return_residual=True)
  seq = jax.sharding.PartitionSpec(None, "sp")

  if entry == "global":
    def ours(q, k, v):
      return ringflash.ring_attention(q, k, v, mesh=mesh, **options)
  else:
    def ours(q, k, v):
      body = functools.partial(ringflash.ring_attention_sharded, axis_name="sp", **options)
      return jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 3,
                           out_specs=(seq, jax.sharding.PartitionSpec(None, None, "sp")))(
                               q, k, v)

  def dense(upcast, q, k, v):
    return oracle.attention(q, k, v, causal=causal, upcast=upcast)[0]

  placed = [jax.device_put(x, jax.sharding.NamedSharding(mesh, seq)) for x in (q, k, v)]
  (out, lse), vjp = jax.jit(lambda *a: jax.vjp(ours, *a))(*placed)
  want, want_lse = jax.jit(lambda *a: oracle.attention(*a, causal=causal))(q, k, v)
  plain = jax.jit(lambda *a: dense(False, *a))(q, k, v)
  assert out.dtype == jnp.bfloat16 and out.shape == (b, t, n, h)
  assert _max_err(out, want) <= 2 * _max_err(plain, want)
  assert float(jnp.max(jnp.abs(lse - want_lse))) < 2e-2
  got = jax.jit(vjp)((jax.device_put(do, jax.sharding.NamedSharding(mesh, seq)),
                      jnp.zeros_like(lse)))
  want_g, plain_g = _dense_grads(dense, q, k, v, do)
  for name, g, w, p in zip(("dq", "dk", "dv"), got, want_g, plain_g):
    assert g.shape == w.shape, name
    assert _max_err(g, w) <= 3 * _max_err(p, w), (name, _max_err(g, w), _max_err(p, w))
