"""The Triton backward of the pallas_gpu backend: two Pallas Triton kernels (dq; dk and dv).

Used where the fused Mosaic GPU backward (kernels/pallas_gpu_mosaic_bwd.py) does not apply:
head dims that the Mosaic backwards would pad more than it (kernels/pallas_gpu.py's
backward_kernel: 160 / 72, 136 / 136), and interpret mode on CPU.

From the GLOBAL out and lse (kernels/base.py): p = exp(s - lse) is the final probability of
each pair, evaluated as 2^(s log2(e) - lse log2(e)) with log2(e) folded into the scale (one
multiply and one ex2 a score, as the Mosaic GPU kernels do; exp is libdevice's expf, a
range reduction around the ex2), D = rowsum(dout * out) - dlse, and for one (query tile, key
tile)
  dv += p^T dout,  ds = p * (dout v^T - D),  dq += scale ds k,  dk += scale ds^T q.
Kernel 1 (grid B x N x T/bq) keeps a dq tile in registers and walks the key tiles that may
have work; kernel 2 (grid B x K x S/bk) keeps dk, dv of one key tile and walks, for each of
the G = N / K query heads of its group, the query tiles that may have work: GQA without
repeating K/V and without per-query-head dk/dv partials. Kernel 2's products take p and ds
transposed (dv += p^T dout, dk += ds^T q); with `keys_major` it computes them so, from
s^T = k q^T and dp^T = v dout^T, instead of transposing the [bq, bk] tiles in registers
(on the H200, T = 16k: 1.01-1.16x the backward's speed at head dims up to 192 / 128 and
256 / 128, 0.94-0.97x at 256 / 256, where kernels/pallas_gpu.py turns it off; docs/
GPU_NOTES.md, runs 102-103). Both use the tile ranges of
common.tile_flags (base.block_may_have_work on tile ranges) and the exact in-tile mask,
which they skip on a run of tiles whose every pair is valid (below a causal diagonal: all
but the diagonal's tiles).

Head dims: q, k are [.., H] and v, dout [.., Hv]; dv += p^T dout and dp = dout v^T run over
Hv, everything else over H. On a GPU, Triton's blocks need powers of two, so each head dim
is taken as one or two column pieces of power-of-two widths (`pieces`; the backend,
kernels/pallas_gpu.py, triton_dims, chooses them and zero-pads to their sum). MLA's H = 192
is the pieces (128, 64): q of a tile is two blocks of the same array, columns [0, 128) and
[128, 192) (block index 2 of width 64), s = q_a k_a^T + q_b k_b^T, and dq and dk come out as
one array per piece, joined after the kernels. Padding 192 to 256 instead would add a third
to the work of the three products over H (q k^T, ds k, ds^T q).

Soft-cap (a static branch): s = scale q.k becomes cap t with t = tanh(s / cap), before the
mask, as in the forward; p = exp(cap t - lse), and ds = p (dp - D) (1 - t^2), the derivative
of the cap applied before the dq and dk products. On a GPU t is the MUFU's tanh.approx.f32,
the forward's own (libdevice's accurate tanhf, which jnp.tanh lowers to, is several
instructions where it is one); interpreted, jnp.tanh.

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


def _loops(rng_ref, body, carry):
  """body(tile, carry, masked) over [lo, flo) and [fhi, hi) with the mask and over
  [flo, fhi) without (rng_ref: common.work_ranges' four bounds)."""
  lo, flo, fhi, hi = rng_ref[0], rng_ref[1], rng_ref[2], rng_ref[3]
  for start, stop, masked in ((lo, flo, True), (flo, fhi, False), (fhi, hi, True)):
    carry = lax.fori_loop(0, stop - start,
                          lambda r, c, start=start, masked=masked: body(start + r, c, masked),
                          carry)
  return carry


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _dot_pieces(a, b):
  """sum_i a[i] b[i]^T over the column pieces of a head dim: a[i] [m, w_i], b[i] [n, w_i]."""
  total = _dot(a[0], b[0].T)
  for x, y in zip(a[1:], b[1:]):
    total = total + _dot(x, y.T)
  return total


def _scores(q, k, scale, softcap, approx):
  """(s, dcap): the scores scale q.k^T in base 2 (times log2(e); q, k: lists of column
  pieces), soft-capped (cap t, t = tanh(scale q.k / cap)) where there is a cap, and the cap's
  derivative 1 - t^2 (None without a cap). approx: tanh on the MUFU (a GPU only)."""
  dot = _dot_pieces(q, k)
  if softcap is None:
    return dot * (scale * common.LOG2E), None
  x = dot * (scale / softcap)
  if approx:
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    t = pltriton.approx_tanh(x)
  else:
    t = jnp.tanh(x)
  return (softcap * common.LOG2E) * t, 1.0 - t * t


def _tile(q, k, v, do, lse2, delta, qpos, kpos, qseg, kseg, *, scale, causal, window,
          softcap, approx, masked=True, keys_major=False):
  """(p, ds) of one (query tile, key tile): q [bq, H], k [bk, H], v [bk, Hv], do [bq, Hv]
  (each a list of column pieces), lse2 (lse log2(e)) and delta [bq], positions and segment
  ids (or None) of the rows and keys. Masked pairs are exact zeros in both, also where D is
  NaN; `masked` False: a tile whose every pair is valid, no mask evaluated. keys_major:
  p and ds come out [bk, bq] (k q^T and v do^T), for the products of dk and dv, which take
  them transposed; else [bq, bk]."""
  if keys_major:
    s, dcap = _scores(k, q, scale, softcap, approx)  # [bk, bq], base 2
    dp = _dot_pieces(v, do)
  else:
    s, dcap = _scores(q, k, scale, softcap, approx)  # [bq, bk], base 2
    dp = _dot_pieces(do, v)
  # A per-query vector spans the tile's query axis (a new key axis inserted), and vice versa.
  key_axis, query_axis = (0, 1) if keys_major else (1, 0)

  def rows(x):
    return None if x is None else jnp.expand_dims(x, key_axis)

  def keys(x):
    return None if x is None else jnp.expand_dims(x, query_axis)

  p = jnp.exp2(s - rows(lse2))
  valid = None
  if masked:
    valid = base.pair_mask(rows(qpos), keys(kpos), rows(qseg), keys(kseg), causal=causal,
                           window=window)
  ds = p * (dp - rows(delta))
  if dcap is not None:
    ds = ds * dcap
  if valid is not None:
    p = jnp.where(valid, p, 0.0)
    ds = jnp.where(valid, ds, 0.0)
  return p, ds


def _unpack(refs, nh, nv, has_seg):
  """The kernels' refs by name: q, do, k, v (lists of column pieces: nh for q and k, nv for
  v and do), lse, delta, q_pos, k_pos, q_seg, k_seg (None without segments), the tile range,
  and the outputs (a list of nh pieces, then for the dk, dv kernel nv more)."""
  pieces, rest = refs[:2 * (nh + nv)], refs[2 * (nh + nv):]
  q, do = pieces[:nh], pieces[nh:nh + nv]
  k, v = pieces[nh + nv:2 * nh + nv], pieces[2 * nh + nv:]
  lse, delta, qpos, kpos = rest[:4]
  if has_seg:
    qseg, kseg, rest = rest[4], rest[5], rest[6:]
  else:
    qseg, kseg, rest = None, None, rest[4:]
  return q, do, k, v, lse, delta, qpos, kpos, qseg, kseg, rest[0], rest[1:]


def _dq_kernel(*refs, nh, nv, has_seg, scale, causal, window, softcap, approx, bk):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  (q_refs, do_refs, k_refs, v_refs, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref,
   kseg_ref, rng_ref, dq_refs) = _unpack(refs, nh, nv, has_seg)
  q = [r[...] for r in q_refs]                      # [bq, w] each
  do = [r[...] for r in do_refs]
  lse = lse_ref[...]                                # [bq]
  delta = delta_ref[...]
  qpos = qpos_ref[...]
  qseg = None if qseg_ref is None else qseg_ref[...]

  def body(j, dq, masked):
    ks = pl.ds(j * bk, bk)
    kt = [r[ks, :] for r in k_refs]                 # [bk, w] each
    kseg = None if kseg_ref is None else kseg_ref[ks]
    _, ds = _tile(q, kt, [r[ks, :] for r in v_refs], do, lse, delta, qpos, kpos_ref[ks],
                  qseg, kseg, scale=scale, causal=causal, window=window, softcap=softcap,
                  approx=approx, masked=masked)
    ds = ds.astype(kt[0].dtype)
    return tuple(acc + _dot(ds, x) for acc, x in zip(dq, kt))

  dq = _loops(rng_ref, body, tuple(jnp.zeros(r.shape, jnp.float32) for r in dq_refs))
  for r, acc in zip(dq_refs, dq):
    r[...] = acc * scale


def _dkv_kernel(*refs, nh, nv, has_seg, scale, causal, window, softcap, approx, bq,
                groups, keys_major):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  (q_refs, do_refs, k_refs, v_refs, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref,
   kseg_ref, rng_ref, out_refs) = _unpack(refs, nh, nv, has_seg)
  dk_refs, dv_refs = out_refs[:nh], out_refs[nh:]
  kt = [r[...] for r in k_refs]                     # [bk, w] each
  vt = [r[...] for r in v_refs]
  kpos = kpos_ref[...]
  kseg = None if kseg_ref is None else kseg_ref[...]
  dk = tuple(jnp.zeros(r.shape, jnp.float32) for r in dk_refs)
  dv = tuple(jnp.zeros(r.shape, jnp.float32) for r in dv_refs)
  for g in range(groups):                           # query heads of this kv head

    def body(i, carry, masked, g=g):
      dk, dv = carry
      qs = pl.ds(i * bq, bq)
      qt = [r[qs, g, :] for r in q_refs]            # [bq, w] each
      dot_ = [r[qs, g, :] for r in do_refs]
      lse = lse_ref[g, qs]                          # [bq]
      delta = delta_ref[g, qs]
      qseg = None if qseg_ref is None else qseg_ref[qs]
      p, ds = _tile(qt, kt, vt, dot_, lse, delta, qpos_ref[qs], kpos, qseg, kseg, scale=scale,
                    causal=causal, window=window, softcap=softcap, approx=approx,
                    masked=masked, keys_major=keys_major)
      pt, dst = p.astype(dot_[0].dtype), ds.astype(qt[0].dtype)
      if not keys_major:
        pt, dst = pt.T, dst.T                       # [bk, bq]
      dv = tuple(acc + _dot(pt, x) for acc, x in zip(dv, dot_))
      dk = tuple(acc + _dot(dst, x) for acc, x in zip(dk, qt))
      return dk, dv

    dk, dv = _loops(rng_ref, body, (dk, dv))
  for r, acc in zip(dk_refs, dk):
    r[...] = acc * scale
  for r, acc in zip(dv_refs, dv):
    r[...] = acc


def backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
             dlse=None, block: int = 64, num_warps: tuple[int, int] = (4, 4),
             num_stages: tuple[int, int] = (2, 2),
             pieces: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
             keys_major: bool = True, delta=None):
  """Block-pair backward (see kernels/base.py): (dq, dk, dv) float32.

  q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], out and dout [B, T, N, Hv]. block: query
  and key rows per tile; num_warps and num_stages: per Triton program of the dq kernel and of
  the dk, dv kernel; pieces: the column pieces of H and of Hv (module docstring), each
  summing to its head dim, each piece a multiple of the one after it (so that it starts at a
  whole block of its own width); on a GPU powers of two. None: one piece each
  (kernels/pallas_gpu.py, triton_config and triton_dims, choose them by head dims);
  keys_major: the dk, dv kernel's tiles computed [bk, bq] (module docstring); delta: D
  [B, N, T] where the caller computed it (out and dlse are then not read).
  """
  b, t = q.shape[0], q.shape[1]
  s = k.shape[1]
  bq = bk = block
  nq, nk = t // bq, s // bk
  h_pieces, hv_pieces = pieces or ((q.shape[-1],), (v.shape[-1],))
  for name, dim, ws in (("H", q.shape[-1], h_pieces), ("Hv", v.shape[-1], hv_pieces)):
    if sum(ws) != dim or any(a % b_ for a, b_ in zip(ws, ws[1:])):
      raise ValueError(f"pieces of {name}={dim}: {ws} must sum to it, each a multiple of "
                       "the next")
  refs = (q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, dlse)
  window = spec.window

  if delta is None:
    delta = base.softmax_delta(out, dout, dlse)
  # In base 2. No key: +inf, so that p = 0 exactly; NaN (the row saw a NaN value) stays NaN.
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * common.LOG2E).astype(jnp.float32)
  work, full = common.tile_flags(q_pos, k_pos, q_seg, k_seg, spec, bq, bk)
  work, full = jnp.broadcast_to(work, (b, nq, nk)), jnp.broadcast_to(full, (b, nq, nk))
  q_rng = common.work_ranges(work, full)            # [B, nq, 4] key tiles per query tile
  k_rng = common.work_ranges(work.transpose(0, 2, 1), full.transpose(0, 2, 1))  # [B, nk, 4]
  q_pos = q_pos.astype(jnp.int32)
  k_pos = k_pos.astype(jnp.int32)
  # Inside shard_map the kernels see per-device values; like plgpu.kernel, trace the calls
  # without mesh-axis typing and restore it on the outputs (match_vma below).
  with base.no_vma_check():
    dq, dk, dv = _calls(q, k, v, dout, lse2, delta, q_pos, k_pos, q_seg, k_seg, q_rng,
                        k_rng, spec, window, bq, bk, num_warps, num_stages, h_pieces,
                        hv_pieces, keys_major)
  return tuple(base.match_vma(x, *refs) for x in (dq, dk, dv))


def _piece_specs(shape, widths, index_map):
  """One BlockSpec per column piece of an array's last axis: block `shape` + (width,), and
  the block index of the piece's first column (a multiple of its width, pieces being
  multiples of the ones after them): (128, 64) of 192 -> blocks 0 and 2."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  specs, start = [], 0
  for w in widths:
    specs.append(pl.BlockSpec(shape + (w,),
                              lambda *ix, col=start // w: (*index_map(*ix), col)))
    start += w
  return specs


def _join(parts):
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def _calls(q, k, v, dout, lse2, delta, q_pos, k_pos, q_seg, k_seg, q_rng, k_rng, spec,
           window, bq, bk, num_warps, num_stages, h_pieces, hv_pieces, keys_major):
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  b, t, n, _ = q.shape
  s, kh = k.shape[1], k.shape[2]
  groups = n // kh
  nq, nk = t // bq, s // bk
  nh, nv = len(h_pieces), len(hv_pieces)
  has_seg = q_seg is not None
  seg_args = (q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)) if has_seg else ()
  params_dq, params_dkv = (
      dict(interpret=bool(spec.interpret),
           compiler_params=pltriton.CompilerParams(num_warps=w, num_stages=st))
      for w, st in zip(num_warps, num_stages))
  kernel_args = dict(nh=nh, nv=nv, has_seg=has_seg, scale=spec.scale, causal=spec.causal,
                     window=window, softcap=spec.softcap, approx=not spec.interpret)
  pieced = (q,) * nh + (dout,) * nv + (k,) * nh + (v,) * nv

  # dq: grid (batch, query head, query tile), the query tiles in reverse: under a causal
  # mask the last tiles have the most key tiles, so they start first and the short ones
  # fill the end of the launch, as in the forward (on the H200, causal, T = 16k: 1.01x at
  # 192 / 128 and 1.05x at 160 / 72 over the tiles in order; docs/GPU_NOTES.md run 87).
  def qt(i):
    return nq - 1 - i

  seg_specs_q = [pl.BlockSpec((None, bq), lambda bi, ni, i: (bi, qt(i))),
                 pl.BlockSpec((None, s), lambda bi, ni, i: (bi, 0))] if has_seg else []

  def row_block(bi, ni, i):                         # q, dout: this tile's rows of head ni
    return bi, qt(i), ni

  def kv_all(bi, ni, i):                            # k, v: every key of ni's kv head
    del i
    return bi, 0, ni // groups

  dq = pl.pallas_call(
      functools.partial(_dq_kernel, bk=bk, **kernel_args),
      grid=(b, n, nq),
      in_specs=[
          *_piece_specs((None, bq, None), h_pieces, row_block),                     # q
          *_piece_specs((None, bq, None), hv_pieces, row_block),                    # dout
          *_piece_specs((None, s, None), h_pieces, kv_all),                         # k
          *_piece_specs((None, s, None), hv_pieces, kv_all),                        # v
          pl.BlockSpec((None, None, bq), lambda bi, ni, i: (bi, ni, qt(i))),         # lse
          pl.BlockSpec((None, None, bq), lambda bi, ni, i: (bi, ni, qt(i))),         # delta
          pl.BlockSpec((bq,), lambda bi, ni, i: (qt(i),)),                           # q_pos
          pl.BlockSpec((s,), lambda bi, ni, i: (0,)),                                # k_pos
          *seg_specs_q,
          pl.BlockSpec((None, None, 4), lambda bi, ni, i: (bi, qt(i), 0)),           # range
      ],
      out_specs=[pl.BlockSpec((None, bq, None, w), lambda bi, ni, i: (bi, qt(i), ni, 0))
                 for w in h_pieces],                               # one array a piece
      out_shape=[jax.ShapeDtypeStruct((b, t, n, w), jnp.float32) for w in h_pieces],
      **params_dq,
  )(*pieced, lse2, delta, q_pos, k_pos, *seg_args, q_rng)

  # dk, dv: grid (batch, kv head, key tile); the G query heads of the group in one block
  seg_specs_k = [pl.BlockSpec((None, t), lambda bi, hi, j: (bi, 0)),
                 pl.BlockSpec((None, bk), lambda bi, hi, j: (bi, j))] if has_seg else []

  def q_all(bi, hi, j):                             # q, dout: every row of the G heads
    del j
    return bi, 0, hi

  def key_block(bi, hi, j):                         # k, v, dk, dv: this key tile
    return bi, j, hi

  dkv = pl.pallas_call(
      functools.partial(_dkv_kernel, bq=bq, groups=groups, keys_major=keys_major,
                        **kernel_args),
      grid=(b, kh, nk),
      in_specs=[
          *_piece_specs((None, t, groups), h_pieces, q_all),                        # q
          *_piece_specs((None, t, groups), hv_pieces, q_all),                       # dout
          *_piece_specs((None, bk, None), h_pieces, key_block),                     # k
          *_piece_specs((None, bk, None), hv_pieces, key_block),                    # v
          pl.BlockSpec((None, groups, t), lambda bi, hi, j: (bi, hi, 0)),            # lse
          pl.BlockSpec((None, groups, t), lambda bi, hi, j: (bi, hi, 0)),            # delta
          pl.BlockSpec((t,), lambda bi, hi, j: (0,)),                                # q_pos
          pl.BlockSpec((bk,), lambda bi, hi, j: (j,)),                               # k_pos
          *seg_specs_k,
          pl.BlockSpec((None, None, 4), lambda bi, hi, j: (bi, j, 0)),               # range
      ],
      out_specs=[pl.BlockSpec((None, bk, None, w), lambda bi, hi, j: (bi, j, hi, 0))
                 for w in h_pieces + hv_pieces],                   # one array a piece
      out_shape=[jax.ShapeDtypeStruct((b, s, kh, w), jnp.float32)
                 for w in h_pieces + hv_pieces],
      **params_dkv,
  )(*pieced, lse2, delta, q_pos, k_pos, *seg_args, k_rng)
  return _join(dq), _join(dkv[:nh]), _join(dkv[nh:])
