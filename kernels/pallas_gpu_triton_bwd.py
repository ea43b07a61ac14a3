"""The Triton backward of the pallas_gpu backend: two Pallas Triton kernels (dq; dk and dv).

Used where the fused Mosaic GPU backward (kernels/pallas_gpu_mosaic_bwd.py) does not apply:
a head dim H or Hv above 128 (e.g. 256, or MLA's 192 / 128), key lengths that are not a
multiple of 128, and interpret mode on CPU.

From the GLOBAL out and lse (kernels/base.py): p = exp(s - lse) is the final probability of
each pair, D = rowsum(dout * out) - dlse, and for one (query tile, key tile)
  dv += p^T dout,  ds = p * (dout v^T - D),  dq += scale ds k,  dk += scale ds^T q.
Kernel 1 (grid B x N x T/bq) keeps a dq tile in registers and walks the key tiles that may
have work; kernel 2 (grid B x K x S/bk) keeps dk, dv of one key tile and walks, for each of
the G = N / K query heads of its group, the query tiles that may have work: GQA without
repeating K/V and without per-query-head dk/dv partials. Both use the tile ranges of
common.tile_flags (base.block_may_have_work on tile ranges) and the exact in-tile mask.

Head dims: q, k are [.., H] and v, dout [.., Hv]; dv += p^T dout and dp = dout v^T run over
Hv, everything else over H. On a GPU, Triton's blocks need powers of two: the backend
(kernels/pallas_gpu.py, triton_dim) zero-pads H and Hv to 64, 128 or 256 (192 -> 256) and
cuts dq, dk, dv back.

Soft-cap (a static branch): s = scale q.k becomes cap t with t = tanh(s / cap), before the
mask, as in the forward; p = exp(cap t - lse), and ds = p (dp - D) (1 - t^2), the derivative
of the cap applied before the dq and dk products.

Rows with no valid key (lse = -inf) get lse = +inf here, so that p = exp(s - inf) = 0 and
every gradient of the row is exactly 0 with no inf - inf; a NaN lse stays NaN
(kernels/base.py, guard_backward).
On CPU the kernels run in Pallas interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ringflash.kernels import base
from ringflash.kernels import pallas_gpu_common as common


def _ranges(work):
  """[first, last + 1) of the True entries along the last axis; (0, 0) where none."""
  n = work.shape[-1]
  ar = jnp.arange(n, dtype=jnp.int32)
  lo = jnp.where(work, ar, n).min(axis=-1)
  hi = jnp.where(work, ar + 1, 0).max(axis=-1)
  lo = jnp.where(hi > 0, lo, 0)
  return jnp.stack([lo, hi], axis=-1).astype(jnp.int32)


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _scores(q, k, scale, softcap):
  """(s, dcap): the scores scale q.k^T, soft-capped (cap t, t = tanh(s / cap)) where there
  is a cap, and the cap's derivative 1 - t^2 (None without a cap)."""
  s = _dot(q, k.T) * scale
  if softcap is None:
    return s, None
  t = jnp.tanh(s * (1.0 / softcap))
  return softcap * t, 1.0 - t * t


def _tile(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, *, scale, causal, window, softcap):
  """(p, ds) of one (query tile, key tile): q [bq, H], k [bk, H], v [bk, Hv], do [bq, Hv],
  lse and delta [bq], positions and segment ids (or None) of the rows and keys. Masked pairs
  are exact zeros in both, also where D is NaN."""
  s, dcap = _scores(q, k, scale, softcap)           # [bq, bk]
  p = jnp.exp(s - lse[:, None])
  valid = base.pair_mask(qpos[:, None], kpos[None, :],
                         None if qseg is None else qseg[:, None],
                         None if kseg is None else kseg[None, :], causal=causal, window=window)
  ds = p * (_dot(do, v.T) - delta[:, None])
  if dcap is not None:
    ds = ds * dcap
  if valid is not None:
    p = jnp.where(valid, p, 0.0)
    ds = jnp.where(valid, ds, 0.0)
  return p, ds


def _dq_kernel(q_ref, do_ref, k_ref, v_ref, lse_ref, delta_ref, qpos_ref, kpos_ref,
               qseg_ref, kseg_ref, rng_ref, dq_ref, *, scale, causal, window, softcap, bk):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  q = q_ref[...]                                    # [bq, H]
  do = do_ref[...]
  lse = lse_ref[...]                                # [bq]
  delta = delta_ref[...]
  qpos = qpos_ref[...]
  qseg = None if qseg_ref is None else qseg_ref[...]

  def body(j, dq):
    ks = pl.ds(j * bk, bk)
    kt = k_ref[ks, :]                               # [bk, H]
    kseg = None if kseg_ref is None else kseg_ref[ks]
    _, ds = _tile(q, kt, v_ref[ks, :], do, lse, delta, qpos, kpos_ref[ks], qseg, kseg,
                  scale=scale, causal=causal, window=window, softcap=softcap)
    return dq + _dot(ds.astype(kt.dtype), kt)

  lo = rng_ref[0]
  dq = lax.fori_loop(0, rng_ref[1] - lo, lambda r, c: body(lo + r, c),
                     jnp.zeros(dq_ref.shape, jnp.float32))
  dq_ref[...] = dq * scale


def _dkv_kernel(q_ref, do_ref, k_ref, v_ref, lse_ref, delta_ref, qpos_ref, kpos_ref,
                qseg_ref, kseg_ref, rng_ref, dk_ref, dv_ref, *, scale, causal, window, softcap,
                bq, groups):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  kt = k_ref[...]                                   # [bk, H]
  vt = v_ref[...]
  kpos = kpos_ref[...]
  kseg = None if kseg_ref is None else kseg_ref[...]
  dk = jnp.zeros(dk_ref.shape, jnp.float32)
  dv = jnp.zeros(dv_ref.shape, jnp.float32)
  for g in range(groups):                           # query heads of this kv head

    def body(i, carry, g=g):
      dk, dv = carry
      qs = pl.ds(i * bq, bq)
      qt = q_ref[qs, g, :]                          # [bq, H]
      dot_ = do_ref[qs, g, :]
      lse = lse_ref[g, qs]                          # [bq]
      delta = delta_ref[g, qs]
      qseg = None if qseg_ref is None else qseg_ref[qs]
      p, ds = _tile(qt, kt, vt, dot_, lse, delta, qpos_ref[qs], kpos, qseg, kseg, scale=scale,
                    causal=causal, window=window, softcap=softcap)
      dv = dv + _dot(p.astype(dot_.dtype).T, dot_)
      dk = dk + _dot(ds.astype(qt.dtype).T, qt)
      return dk, dv

    lo = rng_ref[0]
    dk, dv = lax.fori_loop(0, rng_ref[1] - lo, lambda r, c, body=body: body(lo + r, c),
                           (dk, dv))
  dk_ref[...] = dk * scale
  dv_ref[...] = dv


def backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
             dlse=None, block: int = 64, num_warps: tuple[int, int] = (4, 4),
             num_stages: tuple[int, int] = (2, 2)):
  """Block-pair backward (see kernels/base.py): (dq, dk, dv) float32.

  q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], out and dout [B, T, N, Hv]; on a GPU H
  and Hv powers of two. block: query and key rows per tile; num_warps and num_stages: per
  Triton program of the dq kernel and of the dk, dv kernel (kernels/pallas_gpu.py,
  triton_config, chooses them by head dims).
  """
  b, t = q.shape[0], q.shape[1]
  s = k.shape[1]
  bq = bk = block
  nq, nk = t // bq, s // bk
  refs = (q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, dlse)
  window = spec.window

  delta = base.softmax_delta(out, dout, dlse)
  # No key: +inf, so that p = 0 exactly; NaN (the row saw a NaN value) stays NaN.
  lse_safe = jnp.where(lse == -jnp.inf, jnp.inf, lse).astype(jnp.float32)
  work, _ = common.tile_flags(q_pos, k_pos, q_seg, k_seg, spec, bq, bk)
  work = jnp.broadcast_to(work, (b, nq, nk))
  q_rng = _ranges(work)                             # [B, nq, 2] key tiles per query tile
  k_rng = _ranges(work.transpose(0, 2, 1))          # [B, nk, 2] query tiles per key tile
  q_pos = q_pos.astype(jnp.int32)
  k_pos = k_pos.astype(jnp.int32)
  # Inside shard_map the kernels see per-device values; like plgpu.kernel, trace the calls
  # without mesh-axis typing and restore it on the outputs (match_vma below).
  with base.no_vma_check():
    dq, dk, dv = _calls(q, k, v, dout, lse_safe, delta, q_pos, k_pos, q_seg, k_seg, q_rng,
                        k_rng, spec, window, bq, bk, num_warps, num_stages)
  return tuple(base.match_vma(x, *refs) for x in (dq, dk, dv))


def _calls(q, k, v, dout, lse_safe, delta, q_pos, k_pos, q_seg, k_seg, q_rng, k_rng, spec,
           window, bq, bk, num_warps, num_stages):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  hv = v.shape[-1]
  groups = n // kh
  nq, nk = t // bq, s // bk
  has_seg = q_seg is not None
  seg_args = (q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)) if has_seg else ()
  params_dq, params_dkv = (
      dict(interpret=bool(spec.interpret),
           compiler_params=pltriton.CompilerParams(num_warps=w, num_stages=st))
      for w, st in zip(num_warps, num_stages))

  def with_seg(kernel):
    """Insert None for the segment refs when there are none (8 refs precede them)."""
    if has_seg:
      return kernel

    def wrapped(*r):
      return kernel(*r[:8], None, None, *r[8:])
    return wrapped

  # dq: grid (batch, query head, query tile)
  seg_specs_q = [pl.BlockSpec((None, bq), lambda bi, ni, i: (bi, i)),
                 pl.BlockSpec((None, s), lambda bi, ni, i: (bi, 0))] if has_seg else []
  dq = pl.pallas_call(
      with_seg(functools.partial(_dq_kernel, scale=spec.scale, causal=spec.causal,
                                 window=window, softcap=spec.softcap, bk=bk)),
      grid=(b, n, nq),
      in_specs=[
          pl.BlockSpec((None, bq, None, h), lambda bi, ni, i: (bi, i, ni, 0)),       # q
          pl.BlockSpec((None, bq, None, hv), lambda bi, ni, i: (bi, i, ni, 0)),      # dout
          pl.BlockSpec((None, s, None, h), lambda bi, ni, i: (bi, 0, ni // groups, 0)),
          pl.BlockSpec((None, s, None, hv), lambda bi, ni, i: (bi, 0, ni // groups, 0)),
          pl.BlockSpec((None, None, bq), lambda bi, ni, i: (bi, ni, i)),             # lse
          pl.BlockSpec((None, None, bq), lambda bi, ni, i: (bi, ni, i)),             # delta
          pl.BlockSpec((bq,), lambda bi, ni, i: (i,)),                               # q_pos
          pl.BlockSpec((s,), lambda bi, ni, i: (0,)),                                # k_pos
          *seg_specs_q,
          pl.BlockSpec((None, None, 2), lambda bi, ni, i: (bi, i, 0)),               # range
      ],
      out_specs=pl.BlockSpec((None, bq, None, h), lambda bi, ni, i: (bi, i, ni, 0)),
      out_shape=jax.ShapeDtypeStruct((b, t, n, h), jnp.float32),
      **params_dq,
  )(q, dout, k, v, lse_safe, delta, q_pos, k_pos, *seg_args, q_rng)

  # dk, dv: grid (batch, kv head, key tile); the G query heads of the group in one block
  seg_specs_k = [pl.BlockSpec((None, t), lambda bi, hi, j: (bi, 0)),
                 pl.BlockSpec((None, bk), lambda bi, hi, j: (bi, j))] if has_seg else []
  k_block = pl.BlockSpec((None, bk, None, h), lambda bi, hi, j: (bi, j, hi, 0))
  v_block = pl.BlockSpec((None, bk, None, hv), lambda bi, hi, j: (bi, j, hi, 0))
  dk, dv = pl.pallas_call(
      with_seg(functools.partial(_dkv_kernel, scale=spec.scale, causal=spec.causal,
                                 window=window, softcap=spec.softcap, bq=bq, groups=groups)),
      grid=(b, kh, nk),
      in_specs=[
          pl.BlockSpec((None, t, groups, h), lambda bi, hi, j: (bi, 0, hi, 0)),      # q
          pl.BlockSpec((None, t, groups, hv), lambda bi, hi, j: (bi, 0, hi, 0)),     # dout
          k_block,                                                                   # k
          v_block,                                                                   # v
          pl.BlockSpec((None, groups, t), lambda bi, hi, j: (bi, hi, 0)),            # lse
          pl.BlockSpec((None, groups, t), lambda bi, hi, j: (bi, hi, 0)),            # delta
          pl.BlockSpec((t,), lambda bi, hi, j: (0,)),                                # q_pos
          pl.BlockSpec((bk,), lambda bi, hi, j: (j,)),                               # k_pos
          *seg_specs_k,
          pl.BlockSpec((None, None, 2), lambda bi, hi, j: (bi, j, 0)),               # range
      ],
      out_specs=[k_block, v_block],
      out_shape=[jax.ShapeDtypeStruct((b, s, kh, h), jnp.float32),
                 jax.ShapeDtypeStruct((b, s, kh, hv), jnp.float32)],
      **params_dkv,
  )(q, dout, k, v, lse_safe, delta, q_pos, k_pos, *seg_args, k_rng)
  return dq, dk, dv
