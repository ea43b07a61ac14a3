"""What the pallas_gpu kernels share: constants, the tile plan, the warp-specialized launch.

The forward (kernels/pallas_gpu_mosaic_fwd.py) and both backwards
(kernels/pallas_gpu_mosaic_bwd.py, kernels/pallas_gpu_triton_bwd.py) import this module and
nothing of each other; kernels/pallas_gpu.py, the backend, chooses among them.

Masks and skipping. Before a kernel, `tile_flags` looks at each (query tile, key tile) pair
through base.block_may_have_work on the tiles' [min, max] position and segment ranges, and
`tile_plan` turns the flags into, for query tile i, the key-tile range [lo, hi) that may have
work and, inside it, one run [flo, fhi) of tiles whose every pair is valid (no mask needed).
Example, causal, contiguous, T = S = 1024, bq = 64, bk = 128: query tile 5 holds positions
320..383, so lo = 0, hi = 3 (key tile 2 holds 256..383), full run [0, 2), and tile 2 is
evaluated with the mask. Inside a tile the mask is base.pair_mask on the tile's positions and
segment ids. The backwards apply the same plan transposed (key tiles in the role of query
tiles).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ringflash.kernels import base

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Shared memory a CUDA block may use on Hopper (227 KiB).
SMEM_BYTES = 227 * 1024
# How Mosaic GPU lays out a kernel's shared memory: each scoped buffer starts at a multiple of
# SMEM_ALIGNMENT bytes; a kernel with row reductions (the forward's max and sum) gets
# REDUCTION_SCRATCH bytes for them (plgpu.CompilerParams.reduction_scratch_bytes, its
# default); each barrier takes MBARRIER_BYTES.
SMEM_ALIGNMENT = 1024
REDUCTION_SCRATCH = 128 * 4 * 4
MBARRIER_BYTES = 8


def forward_smem_bytes(h: int, hv: int, block_q: int, block_k: int, stages: int,
                       itemsize: int, extra_v_slots: int = 0) -> int:
  """Shared memory of the Mosaic forward, as Mosaic GPU allocates it: Q of 2 * block_q rows,
  `stages` K slots, `stages + extra_v_slots` V slots of block_k rows and the two
  warpgroups' lse rows, each aligned; the reduction scratch; 4 * stages + 3 barriers (K and
  V arrivals and releases per stage, Q's two and the schedule barrier)."""
  buffers = (2 * block_q * h * itemsize, stages * block_k * h * itemsize,
             (stages + extra_v_slots) * block_k * hv * itemsize, 2 * block_q * 4)
  aligned = sum(-(-size // SMEM_ALIGNMENT) * SMEM_ALIGNMENT for size in buffers)
  return aligned + REDUCTION_SCRATCH + (4 * stages + 3) * MBARRIER_BYTES


def _tile_ranges(pos, seg, size):
  """Per tile [min, max] of positions ([n, 2]) and segment ids ([B, n, 2] or None)."""
  p = pos.reshape(-1, size)
  p2 = jnp.stack([p.min(axis=1), p.max(axis=1)], axis=-1)
  if seg is None:
    return p2, None
  s = seg.astype(jnp.int32).reshape(seg.shape[0], -1, size)
  return p2, jnp.stack([s.min(axis=2), s.max(axis=2)], axis=-1)


def tile_flags(q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec, bq: int, bk: int):
  """Per batch row and tile pair: (may have work, every pair valid), bool [B|1, nq, nk] each.

  "May have work" is base.block_may_have_work on the tiles' [min, max] ranges (it reads
  only the ranges). "Every pair valid" is the converse test for the masks evaluated here:
  causal needs the tile's largest key position <= its smallest query position; segments
  need one id on both sides; a window (left, right) needs q_hi - k_lo <= left and
  k_hi - q_lo <= right.
  """
  qr, qs = _tile_ranges(q_pos, q_seg, bq)          # [nq, 2], [B, nq, 2] | None
  kr, ks = _tile_ranges(k_pos, k_seg, bk)          # [nk, 2], [B, nk, 2] | None

  def pair(qp, kp, qsg, ksg):
    return base.block_may_have_work(qp, kp, spec, qsg, ksg)

  if qs is None:
    work = jax.vmap(lambda qp: jax.vmap(lambda kp: pair(qp, kp, None, None))(kr))(qr)[None]
  else:
    work = jax.vmap(                                # batch
        lambda qsb, ksb: jax.vmap(                  # query tiles
            lambda qp, qsg: jax.vmap(               # key tiles
                lambda kp, ksg: pair(qp, kp, qsg[None], ksg[None]))(kr, ksb))(qr, qsb))(qs, ks)
  full = jnp.ones(work.shape, jnp.bool_)
  if spec.causal:
    full = full & (kr[None, None, :, 1] <= qr[None, :, None, 0])
  window = spec.window
  if window is not None:
    left, right = window
    # every pair has -right <= i - j <= left: q_hi - k_lo <= left and k_hi - q_lo <= right
    full = full & (qr[None, :, None, 1] - kr[None, None, :, 0] <= left)
    full = full & (kr[None, None, :, 1] - qr[None, :, None, 0] <= right)
  if qs is not None:
    one_q = (qs[..., 0] == qs[..., 1])[:, :, None]                 # [B, nq, 1]
    one_k = (ks[..., 0] == ks[..., 1])[:, None, :]                 # [B, 1, nk]
    full = full & one_q & one_k & (qs[:, :, None, 0] == ks[:, None, :, 0])
  return work, full & work


def _first_true(x, default):
  """Index of the first True along the last axis, or `default` where none."""
  n = x.shape[-1]
  idx = jnp.where(x, jnp.arange(n, dtype=jnp.int32), n)
  first = idx.min(axis=-1)
  return jnp.where(first == n, default, first).astype(jnp.int32)


def work_ranges(work, full):
  """Per row of tiles (along the last axis), int32 [..., 4] = (lo, flo, fhi, hi): [lo, hi)
  from the first tile with work to the last ((0, 0) where none), and inside it [flo, fhi),
  the first run of full tiles (flo = fhi = lo where there is none). Causal, 4 tiles, row 2:
  work = (1, 1, 1, 0), full = (1, 1, 0, 0) -> (0, 0, 2, 3). `full` implies `work`
  (tile_flags), so [flo, fhi) lies inside [lo, hi)."""
  n = work.shape[-1]
  ar = jnp.arange(n, dtype=jnp.int32)
  lo = _first_true(work, 0)
  hi = jnp.where(work, ar + 1, 0).max(axis=-1).astype(jnp.int32)
  has_full = full.any(axis=-1)
  flo = _first_true(full, 0)
  fhi = _first_true((ar >= flo[..., None]) & ~full, n)
  return jnp.stack([lo, jnp.where(has_full, flo, lo), jnp.where(has_full, fhi, lo), hi],
                   axis=-1).astype(jnp.int32)


def tile_plan(work, full):
  """Per query tile: int32 [B|1, nq, 8] = (u_lo, lo, flo, fhi, hi, u_hi, 0, 0).

  [lo, hi): the key tiles that may have work (every tile outside is skipped); [flo, fhi):
  a run of full tiles inside it, computed without a mask (work_ranges); [u_lo, u_hi): the
  union of the ranges of the two query tiles 2c, 2c + 1 that one CUDA block computes (the
  K/V stream). A tile with no work has lo = hi = u_lo, an empty range inside the union.
  """
  nk = work.shape[-1]
  any_work = work.any(axis=-1)
  ranges = work_ranges(work, full)
  lo, flo, fhi, hi = (ranges[..., i] for i in range(4))
  # pair query tiles (2c, 2c + 1): the union of the ranges with work
  b, nq = work.shape[0], work.shape[1]
  lo_w = jnp.where(any_work, lo, nk).reshape(b, nq // 2, 2)
  hi_w = jnp.where(any_work, hi, 0).reshape(b, nq // 2, 2)
  u_lo = jnp.repeat(lo_w.min(axis=-1), 2, axis=1)
  u_hi = jnp.repeat(hi_w.max(axis=-1), 2, axis=1)
  u_hi = jnp.maximum(u_hi, u_lo)                   # both empty: u_lo = nk = u_hi
  u_lo = jnp.minimum(u_lo, u_hi)

  def clamp(x, a, b_):
    return jnp.minimum(jnp.maximum(x, a), b_)

  # A tile with no work: its empty range moves to u_lo (and so do flo, fhi, equal to lo).
  lo = jnp.where(any_work, lo, u_lo)
  hi = jnp.where(any_work, hi, u_lo)
  lo, hi = clamp(lo, u_lo, u_hi), clamp(hi, u_lo, u_hi)
  flo = clamp(flo, lo, hi)
  fhi = clamp(fhi, flo, hi)
  zero = jnp.zeros_like(lo)
  return jnp.stack([u_lo, lo, flo, fhi, hi, u_hi, zero, zero], axis=-1).astype(jnp.int32)


def backward_plan(lse, out, dout, dlse, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
                  block: int, delta=None):
  """What both Mosaic backwards read besides the tensors: ld float32 [B, N, 2, T] = (lse2,
  D) per row, with lse2 = lse * log2(e) (+inf for a row with no key, so that pT = 0
  exactly; a NaN lse stays NaN) and D = rowsum(dout * out) - dlse; and the tile plan of
  tile_plan with key tiles in the role of query tiles (per key tile of `block` rows, the
  query tiles with work). delta: D where the caller computed it (out, dlse are not read)."""
  if delta is None:
    delta = base.softmax_delta(out, dout, dlse)
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E).astype(jnp.float32)
  ld = jnp.stack([lse2, delta], axis=2)                       # [B, N, 2, T]
  work, full = tile_flags(q_pos, k_pos, q_seg, k_seg, spec, block, block)
  plan = tile_plan(jnp.swapaxes(work, -1, -2), jnp.swapaxes(full, -1, -2))
  return ld, plan


def backward_pair_mask(qt, kpos, kseg, qpos_ref, qseg_ref, bi, size: int, col, *, causal: bool,
                       window):
  """The [keys, queries] validity of a backward step's tile, for the Mosaic GPU backwards:
  the key tile's positions and segment ids (kpos, kseg: [size] in the row layout, None where
  the mask does not use them) against query tile qt's, loaded in the column layout `col`
  from qpos_ref and qseg_ref[bi]."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  from jax.experimental import pallas as pl                # pylint: disable=g-import-not-at-top
  q0 = qt * size
  qp = kp = qsg = ksg = None
  if kpos is not None:
    qpos = plgpu.load(qpos_ref.at[pl.ds(q0, size)], layout=col, optimized=False)
    kp = jax.lax.broadcast_in_dim(kpos, (size, size), [0])
    qp = jax.lax.broadcast_in_dim(qpos, (size, size), [1])
  if kseg is not None:
    qseg = plgpu.load(qseg_ref.at[bi, pl.ds(q0, size)], layout=col, optimized=False)
    ksg = jax.lax.broadcast_in_dim(kseg, (size, size), [0])
    qsg = jax.lax.broadcast_in_dim(qseg, (size, size), [1])
  return base.pair_mask(qp, kp, qsg, ksg, causal=causal, window=window)


def warp_specialized(entry, out_type, *, grid, grid_names):
  """plgpu.kernel with this backend's block shape: compute warpgroups 0 and 1, memory
  warpgroup 2, on the thread axis "wg"."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.kernel(entry, out_type=out_type, grid=grid, grid_names=grid_names,
                      num_threads=3, thread_name="wg",
                      compiler_params=plgpu.CompilerParams(approx_math=True))
