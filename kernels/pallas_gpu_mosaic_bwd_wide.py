"""Backward of the pallas_gpu backend for wide head dims (up to 256): one fused Mosaic GPU
kernel whose two compute warpgroups split the work by role.

The fused backward of kernels/pallas_gpu_mosaic_bwd.py keeps dK [64, H] and dV [64, Hv] of
its key rows in each compute warpgroup's registers, which holds only while H + Hv <= 256
(240 registers a thread). Here one CUDA block owns ONE key tile of 64 rows and its two
compute warpgroups divide the five products of a (key tile, query tile) pair by what they
accumulate, each keeping one of dV and dK (64 x 256 in fp32: 128 registers a thread):

  warpgroup 0:  sT = K Q^T, pT = 2^(c sT - lse2)    dV += pT dO     dQ parts 0, 2, ...
  warpgroup 1:  dpT = V dO^T, dsT = pT (dpT - D)     dK += dsT Q     dQ parts 1, 3, ...

with c = scale * log2(e), lse2 = lse * log2(e) and D = rowsum(dout * out) - dlse (as in
kernels/pallas_gpu_mosaic_bwd.py, all tiles [key rows, query columns]). pT (fp32, times the
cap's derivative 1 - t^2 under a soft-cap) goes from warpgroup 0 to warpgroup 1 and dsT
(bf16) back through shared memory; each then computes dQ = dsT^T K for its 64-column parts
of H and adds them to a float32 dQ in global memory with a TMA reduce-add. At H = Hv the two
warpgroups have the same tensor-core work (2 + 2 + 1 products of 64 x 64 x 256 at 256 / 256).

A step (query tile i of the block's query heads) in order, the arrows the barriers:
  wg0: wait Q_i; sT; pT -> pt_smem ->(pt_bar); release Q_i; wait dO_i; dV; release dO_i;
       (ds_bar)-> dQ parts
  wg1: wait dO_i; dpT; release dO_i; (pt_bar)-> dsT -> ds_smem ->(ds_bar); wait Q_i; dK;
       release Q_i; dQ parts
One buffer of each suffices: warpgroup 0 writes pT of step i + 1 only after ds_bar of step i,
which warpgroup 1 reaches after reading pT of step i; warpgroup 1 writes dsT of step i + 1
only after pt_bar of step i + 1, which warpgroup 0 reaches after its dQ products of step i
have completed. The memory warpgroup streams Q (with lse2, D) and dO through their own rings
of slots, each slot released by both compute warpgroups.

Query tiles come from common.tile_plan on the transposed flags (key tiles in the role of
query tiles): [lo, hi) are visited, [flo, fhi) without a mask (warpgroup 0 walks the
masked runs and that one as separate loops; warpgroup 1, which never masks, walks [lo, hi)
as one, in the same order). Rows with no valid key get
lse2 = +inf (pT = 0 and every gradient 0); a NaN lse stays NaN. Warpgroup 0 applies the
mask to pT; dsT = pT (dpT - D) is then 0 on every masked pair, since the kernel's V, dO and
D are finite (kernels/base.py, guard_backward: a NaN reaches a backward kernel only through
lse, which pT carries).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ringflash.kernels import base
from ringflash.kernels import pallas_gpu_common as common

BLOCK = 64        # key rows per CUDA block, query rows per step
PART = 64         # columns of a swizzle tile (128 bytes of bf16): the products' column parts
# (Q, dO) slot counts tried in order, by value head dim (up to 128, beyond); the first that
# fits shared memory is used. On the H200 (docs/GPU_NOTES.md, runs 113-114: the backward
# alone, T = 16k, N = K = 16) three Q slots and one dO slot took 0.92-0.98x the time of two
# and two at 192 / 128, 256 / 128, 192 / 64 and 256 / 64; at 64 / 192 1.05x (dO is the
# larger tile there), so Hv beyond 128 keeps two of each.
STAGE_CHOICES = {128: ((3, 1), (2, 1), (1, 1)), 256: ((2, 2), (2, 1), (1, 1))}


def smem_bytes(h: int, hv: int, q_stages: int, do_stages: int, itemsize: int = 2) -> int:
  """Shared memory of the kernel as Mosaic GPU allocates it (each buffer aligned to 1 KiB):
  K, V, the Q and dO slots with (lse2, D) per Q slot, pT (fp32), dsT, the two warpgroups' dQ
  staging parts (fp32), and the barriers (no row reductions: no reduction scratch)."""
  bl = BLOCK
  buffers = (bl * h * itemsize, bl * hv * itemsize, q_stages * bl * h * itemsize,
             do_stages * bl * hv * itemsize, q_stages * 2 * bl * 4, bl * bl * 4,
             bl * bl * itemsize, 2 * bl * PART * 4)
  aligned = sum(-(-size // common.SMEM_ALIGNMENT) * common.SMEM_ALIGNMENT for size in buffers)
  barriers = 2 + 3 * q_stages + 2 * do_stages + 2
  return aligned + barriers * common.MBARRIER_BYTES


def stages_for(h: int, hv: int, itemsize: int = 2) -> tuple[int, int] | None:
  """(Q slots, dO slots): the first of STAGE_CHOICES[128 or 256, from Hv] that fits shared
  memory, or None."""
  for st in STAGE_CHOICES[128 if hv <= 128 else 256]:
    if smem_bytes(h, hv, *st, itemsize=itemsize) <= common.SMEM_BYTES:
      return st
  return None


def backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
             dlse=None, delta=None):
  """Block-pair backward (see kernels/base.py): (dq, dk, dv) float32.

  q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], out and dout [B, T, N, Hv], with H and
  Hv multiples of 64 up to 256 and S a multiple of 128 (pairs of key tiles in the plan).
  delta: D [B, N, T] where the caller computed it (out and dlse are then not read).
  """
  refs = (q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, dlse)
  h, hv = q.shape[-1], v.shape[-1]
  stages = stages_for(h, hv, q.dtype.itemsize)
  if stages is None:
    raise NotImplementedError(f"head dims {h=}, {hv=} exceed the wide backward's shared memory")
  ld, plan = common.backward_plan(lse, out, dout, dlse, q_pos, k_pos, q_seg, k_seg, spec, BLOCK,
                                  delta)
  with base.no_vma_check():
    dq, dk, dv = _kernel_call(q, k, v, dout, ld, q_pos, k_pos, q_seg, k_seg, plan,
                              scale=spec.scale, causal=spec.causal, window=spec.window,
                              softcap=spec.softcap, stages=stages)
  return tuple(base.match_vma(x, *refs) for x in (dq, dk, dv))


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window", "softcap", "stages"))
def _kernel_call(q, k, v, dout, ld, q_pos, k_pos, q_seg, k_seg, plan, *, scale: float,
                 causal: bool, window, softcap: float | None, stages: tuple[int, int]):
  """dq float32 [B, T, N, H]; dk float32 [B, S, K, H]; dv float32 [B, S, K, Hv]."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  hv = v.shape[-1]
  grp = n // kh
  dtype = q.dtype
  bl = BLOCK
  qst, dost = stages
  nh, nhv = h // PART, hv // PART                 # column parts of H and Hv
  c = float((scale if softcap is None else softcap) * common.LOG2E)
  has_seg = q_seg is not None
  masked = causal or has_seg or window is not None
  use_pos = causal or window is not None
  layout = plgpu.Layout.WGMMA
  row, col = layout.reduce(1), layout.reduce(0)   # [64] along rows (keys), columns (queries)

  def body(q_ref, k_ref, v_ref, do_ref, ld_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
           plan_ref, dq_ref, dk_ref, dv_ref, scoped):
    bi = lax.axis_index("batch")
    kvh = lax.axis_index("heads")
    kt = lax.axis_index("kv_seq")
    wg = lax.axis_index("wg")
    ((k_smem, v_smem, q_smem, do_smem, ld_smem, pt_smem, ds_smem, dq_smem),
     (k_bar, v_bar, q_bar, ld_bar, do_bar), (q_free, do_free), (pt_bar, ds_bar)) = scoped
    pb = lax.min(bi, plan_ref.shape[0] - 1)        # plan rows: B, or 1 without segments
    lo, flo, fhi, hi = (plan_ref[pb, kt, 1], plan_ref[pb, kt, 2], plan_ref[pb, kt, 3],
                        plan_ref[pb, kt, 4])
    cnt = hi - lo                                   # query tiles per head
    k_base = kt * bl

    def locate(g, qt):
      i = g * cnt + (qt - lo)
      return lax.rem(i, jnp.array(qst, jnp.int32)), lax.rem(i, jnp.array(dost, jnp.int32)), \
          kvh * grp + g

    def mask(qt, kpos, kseg):
      return common.backward_pair_mask(qt, kpos, kseg, qpos_ref, qseg_ref, bi, bl, col,
                                       causal=causal, window=window)

    def visit(step, carry, split):
      """step(g, qt, carry, use_mask) over the block's query heads and tiles, in order; with
      split, the tiles that need the mask (before flo, from fhi) in loops of their own."""
      def run(g, start, stop, fn, cr):
        # from 0: a loop index starting at a loaded bound would not match its increment
        return lax.fori_loop(0, stop - start, lambda r, x: fn(g, start + r, x), cr)

      def head_loop(g, cr):
        if not split:
          return run(g, lo, hi, functools.partial(step, use_mask=False), cr)
        cr = run(g, lo, flo, functools.partial(step, use_mask=True), cr)
        cr = run(g, flo, fhi, functools.partial(step, use_mask=False), cr)
        return run(g, fhi, hi, functools.partial(step, use_mask=True), cr)

      return lax.fori_loop(0, grp, head_loop, carry)

    def dq_parts(qt, head, first):
      """dQ[:, part] += dsT^T K[:, part] for parts first, first + 2, ... (a TMA reduce-add)."""
      for j in range(first, nh, 2):
        def product(acc_ref, j=j):
          plgpu.wgmma(acc_ref, ds_smem.T, k_smem.at[j])
          return acc_ref[...]

        dq = pl.run_scoped(product, plgpu.ACC((bl, PART), jnp.float32))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous part left dq_smem
        dq_smem.at[first][...] = dq
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dq_smem.at[first],
                                dq_ref.at[bi, pl.ds(qt * bl, bl), head, pl.ds(j * PART, PART)],
                                reduction_op="add")

    def load_parts(src, dst, bar, parts):
      """The block's key rows of src [B, S, K, parts * PART] into dst [parts, 64, PART]."""
      for j in range(parts):
        plgpu.copy_gmem_to_smem(src.at[bi, pl.ds(k_base, bl), kvh, pl.ds(j * PART, PART)],
                                dst.at[j], bar)
      plgpu.barrier_wait(bar)

    def keys_by_queries(a_parts, b, parts):
      """[64 keys, 64 queries] fp32 = A B^T, contracted over the column parts of A (in
      parts) and B (a [64, parts * PART] tile): sT = K Q^T, dpT = V dO^T."""
      def product(acc_ref):
        for j in range(parts):
          plgpu.wgmma(acc_ref, a_parts.at[j], b.at[:, pl.ds(j * PART, PART)].T)
        return acc_ref[...]

      return pl.run_scoped(product, plgpu.ACC((bl, bl), jnp.float32))

    def accumulate(step, cols, out_ref, split):
      """step over the block's query tiles from a zero [64, cols] fp32 accumulator (dV or
      dK), stored to out_ref's rows of the block's key tile; then waits for the last dQ
      reduce-adds to leave shared memory."""
      acc = visit(step, plgpu.layout_cast(jnp.full((bl, cols), 0.0, jnp.float32), layout),
                  split)
      out_ref.at[bi, pl.ds(k_base, bl), kvh][...] = acc
      plgpu.wait_smem_to_gmem(0)

    def positions():
      kpos = kseg = None
      if use_pos:
        kpos = plgpu.load(kpos_ref.at[pl.ds(k_base, bl)], layout=row, optimized=False)
      if has_seg:
        kseg = plgpu.load(kseg_ref.at[bi, pl.ds(k_base, bl)], layout=row, optimized=False)
      return kpos, kseg

    @pl.when(wg == 0)
    def _scores():
      plgpu.set_max_registers(240, action="increase")
      load_parts(k_ref, k_smem, k_bar, nh)
      kpos, kseg = positions()

      def step(g, qt, dv, use_mask):
        qs, ds_, head = locate(g, qt)
        plgpu.barrier_wait(q_bar.at[qs])
        st = keys_by_queries(k_smem, q_smem.at[qs], nh)              # sT = K Q^T
        if softcap is not None:
          st = jnp.tanh(st * (scale / softcap))   # capped score / cap, in [-1, 1]
        plgpu.barrier_wait(ld_bar.at[qs])
        lse2 = plgpu.load(ld_smem.at[qs, 0], layout=col, optimized=False)
        pt = jnp.exp2(st * c - lax.broadcast_in_dim(lse2, st.shape, [1]))
        if use_mask:
          pt = jnp.where(mask(qt, kpos, kseg), pt, 0.0)
        pt16 = pt.astype(dtype)
        if softcap is not None:
          pt = pt * (1.0 - st * st)               # pT times the cap's derivative
        pt_smem[...] = pt
        plgpu.commit_smem()
        plgpu.barrier_arrive(pt_bar)
        plgpu.barrier_arrive(q_free.at[qs])
        plgpu.barrier_wait(do_bar.at[ds_])

        def pdo(acc_ref):
          plgpu.wgmma(acc_ref, pt16, do_smem.at[ds_])           # dV += pT dO

        dv = pl.run_state(pdo)(plgpu.ACC.init(dv))
        plgpu.barrier_arrive(do_free.at[ds_])
        plgpu.barrier_wait(ds_bar)
        dq_parts(qt, head, 0)
        return dv

      accumulate(step, hv, dv_ref, split=masked)

    @pl.when(wg == 1)
    def _gradients():
      plgpu.set_max_registers(240, action="increase")
      load_parts(v_ref, v_smem, v_bar, nhv)
      plgpu.barrier_wait(k_bar)                   # its dQ parts read K

      def step(g, qt, dk, use_mask):
        del use_mask                              # warpgroup 0's pT carries the mask
        qs, ds_, head = locate(g, qt)
        plgpu.barrier_wait(do_bar.at[ds_])
        dpt = keys_by_queries(v_smem, do_smem.at[ds_], nhv)          # dpT = V dO^T
        plgpu.barrier_arrive(do_free.at[ds_])
        plgpu.barrier_wait(ld_bar.at[qs])
        delta = plgpu.load(ld_smem.at[qs, 1], layout=col, optimized=False)
        plgpu.barrier_wait(pt_bar)
        pt = plgpu.load(pt_smem, layout=layout)
        # 0 on masked pairs (pT is): no second mask
        dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1])) * scale
        dst16 = dst.astype(dtype)
        ds_smem[...] = dst16
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_bar)
        plgpu.barrier_wait(q_bar.at[qs])

        def dsq(acc_ref):
          plgpu.wgmma(acc_ref, dst16, q_smem.at[qs])            # dK += dsT Q

        dk = pl.run_state(dsq)(plgpu.ACC.init(dk))
        plgpu.barrier_arrive(q_free.at[qs])
        dq_parts(qt, head, 1)
        return dk

      accumulate(step, h, dk_ref, split=False)    # one loop: it never masks

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(24, action="decrease")
      total = grp * cnt
      per = jnp.maximum(cnt, 1)

      @pl.loop(0, total)
      def _issue(i):
        g = lax.div(i, per)
        qt = lo + lax.rem(i, per)
        head = kvh * grp + g
        rows = pl.ds(qt * bl, bl)
        qs = lax.rem(i, jnp.array(qst, jnp.int32))
        ds_ = lax.rem(i, jnp.array(dost, jnp.int32))

        @pl.when(i >= qst)
        def _():
          plgpu.barrier_wait(q_free.at[qs])       # both warpgroups are done with step i - qst

        plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, head], q_smem.at[qs], q_bar.at[qs])
        plgpu.copy_gmem_to_smem(ld_ref.at[bi, head, :, rows], ld_smem.at[qs], ld_bar.at[qs])

        @pl.when(i >= dost)
        def _():
          plgpu.barrier_wait(do_free.at[ds_])

        plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, head], do_smem.at[ds_], do_bar.at[ds_])

  def entry(q_ref, k_ref, v_ref, do_ref, ld_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
            plan_ref, dq_ref, dk_ref, dv_ref):
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    f32_tiling = plgpu.TilingTransform((8, 32))
    scratch = [
        plgpu.SMEM((nh, bl, PART), dtype, transforms=(tiling, swizzle)),      # K parts
        plgpu.SMEM((nhv, bl, PART), dtype, transforms=(tiling, swizzle)),     # V parts
        plgpu.SMEM((qst, bl, h), dtype, transforms=(tiling, swizzle)),        # Q
        plgpu.SMEM((dost, bl, hv), dtype, transforms=(tiling, swizzle)),      # dO
        plgpu.SMEM((qst, 2, bl), jnp.float32),                                # lse2, D
        plgpu.SMEM((bl, bl), jnp.float32, transforms=(f32_tiling, swizzle)),  # pT
        plgpu.SMEM((bl, bl), dtype, transforms=(tiling, swizzle)),            # dsT
        plgpu.SMEM((2, bl, PART), jnp.float32, transforms=(f32_tiling, swizzle)),  # dQ
    ]
    pl.run_scoped(
        lambda *args: body(q_ref, k_ref, v_ref, do_ref, ld_ref, qpos_ref, kpos_ref, qseg_ref,
                           kseg_ref, plan_ref, dq_ref, dk_ref, dv_ref, args),
        scratch,
        # one arrival per TMA copy: K and V arrive in column parts
        (plgpu.Barrier(num_arrivals=nh), plgpu.Barrier(num_arrivals=nhv),
         plgpu.Barrier(num_barriers=qst), plgpu.Barrier(num_barriers=qst),
         plgpu.Barrier(num_barriers=dost)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=qst),
         plgpu.Barrier(num_arrivals=2, num_barriers=dost)),
        (plgpu.Barrier(), plgpu.Barrier()),
        collective_axes="wg",
    )

  if not has_seg:
    q_seg = jnp.zeros((b, t), jnp.int32)
    k_seg = jnp.zeros((b, s), jnp.int32)
  dq_acc = jax.new_ref(jnp.zeros((b, t, n, h), jnp.float32))
  out_type = (jax.ShapeDtypeStruct((b, s, kh, h), jnp.float32),
              jax.ShapeDtypeStruct((b, s, kh, hv), jnp.float32))
  dk, dv = common.warp_specialized(entry, out_type, grid=(kh, s // bl, b),
                                   grid_names=("heads", "kv_seq", "batch"))(
      q, k, v, dout, ld, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
      q_seg.astype(jnp.int32), k_seg.astype(jnp.int32), plan, dq_acc)
  return jax.freeze(dq_acc), dk, dv
