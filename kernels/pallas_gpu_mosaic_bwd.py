"""Backward of the pallas_gpu backend on Hopper: one fused Pallas Mosaic GPU kernel.

From the GLOBAL out and lse (kernels/base.py), for one (key tile, query tile) pair, written
transposed (key rows, query columns) so that every product that feeds dK and dV has its left
operand in registers:
  sT = K Q^T,  pT = 2^(c sT - lse2),  dpT = V dO^T,  dsT = scale * pT * (dpT - D),
  dV += pT dO,  dK += dsT Q,  dQ += dsT^T K,
with c = scale * log2(e), lse2 = lse * log2(e) and D = rowsum(dout * out) - dlse.
Five matrix products per pair, the least any FlashAttention backward needs: S and dP are not
recomputed by a second kernel.

One CUDA block (grid: kv heads x key-tile pairs x batch) has three warpgroups. Compute
warpgroup w (0, 1) owns key rows [64 (2c + w), 64 (2c + w) + 64) of K and V and keeps their
dK and dV (fp32, 64 x H and 64 x Hv) in registers for the whole kernel. The memory warpgroup
streams Q, dO and (lse2, D) tiles of 64 query rows through a `stages`-deep ring of
shared-memory slots with TMA, for each of the G = N / K query heads of the group in turn
(GQA without repeating K/V and without per-query-head dK/dV), over the union of the two key
tiles' query-tile ranges.

dQ needs the sum over both warpgroups' key rows: each warpgroup stores its dsT (bf16) in
shared memory, the two meet at a barrier, and warpgroup w computes dQ's columns
[w H / 2, (w + 1) H / 2) over all 128 key rows (two wgmmas of K = 64), then adds them to a
float32 dQ in global memory with a TMA reduce-add. dsT is double-buffered by step parity:
a warpgroup writes the buffer of step i + 2 only after passing the barrier of step i + 1,
which the other warpgroup reaches only after its dQ product of step i has completed.

The query-tile ranges come from common.tile_flags / tile_plan applied to the transposed
flags (key tiles in the role of query tiles): tiles outside [lo, hi) are skipped, tiles in
the full run [flo, fhi) are computed without a mask. A warpgroup passing a union step outside
its own range writes a zero dsT (the other warpgroup's dQ product reads it) and computes its
dQ columns as usual.

The order of a step (overlap_schedule says which): either the softmax (pT from sT), then
dV's and dpT's products together; or dpT's product issued with sT's, so that it runs while
the warpgroup computes pT, then dV's product, which runs while it computes dsT. The two
warpgroups meet once a step (the dsT exchange), so they reach the softmax together: in the
first order the tensor cores have nothing to run under it.

Rows with no valid key (lse = -inf) get lse2 = +inf, so that pT = 0 and every gradient of the
row is exactly 0; a NaN lse stays NaN (kernels/base.py, guard_backward).

Head dims. H and Hv are 64 or 128 here (kernels/pallas_gpu.py pads the smaller ones and
sends larger ones to kernels/pallas_gpu_mosaic_bwd_wide.py): each compute warpgroup holds
dK [64, H] and dV [64, Hv] in fp32 registers, H / 2 + Hv / 2 registers a thread, and
128 + 128 columns is what the 240 registers take beside sT, dpT and the dQ part. Hv != H
changes only the V and dO tiles ([64, Hv]), dV, and dpT = V dO^T, which contracts over Hv;
sT, dsT and dQ depend on H alone.

Soft-cap (a static branch; the plain path is untouched). With s = scale q.k and the capped
score cap t, t = tanh(s / cap), the kernel recomputes t = tanh(sT scale / cap) from the raw
sT (one MUFU tanh.approx.f32 a score, as the forward does, so that pT matches the forward's
lse) and pT = 2^(t c' - lse2) with c' = cap log2(e). The derivative of the cap,
d(cap t)/ds = 1 - t^2, multiplies dsT before the dK and dQ products; it is folded into pT
right after pT16 (for dV) is taken: pT (1 - t^2) replaces pT in dsT = pT (dpT - D) scale.
Two MUFU operations a score (tanh, ex2) keep the MUFU the busiest unit; soft-capped steps
take the overlapping order, with dpT's product under them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ringflash.kernels import base
from ringflash.kernels import pallas_gpu_common as common

BLOCK = 64        # query rows per step and key rows per compute warpgroup


def overlap_schedule(softcap: float | None, masked: bool) -> bool:
  """Whether a step issues dpT = V dO^T together with sT = K Q^T, so that dpT's product runs
  under the softmax and dV's under dsT (module docstring), rather than the softmax first
  and then dV's and dpT's products together.

  On the H200 (T = 16k, N = K = 16, H = 128, the backward alone, docs/GPU_NOTES.md runs
  118-119) the overlap took soft-capped backwards 2.8% faster causal and 4.5% not (two MUFU
  operations a score, and the two warpgroups, which meet once a step, reach the softmax
  together: nothing else ran under it), but plain causal ones 3.3% slower (2.3% faster
  without a mask)."""
  return softcap is not None or not masked


def backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
             dlse=None, delta=None, stages: int = 2):
  """Block-pair backward (see kernels/base.py): (dq, dk, dv) float32.

  q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], out and dout [B, T, N, Hv], with H and
  Hv in (64, 128) and S a multiple of 128. delta: D [B, N, T] where the caller computed it
  (out and dlse are then not read).
  """
  refs = (q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, dlse)
  ld, plan = common.backward_plan(lse, out, dout, dlse, q_pos, k_pos, q_seg, k_seg, spec, BLOCK,
                                  delta)
  with base.no_vma_check():
    dq, dk, dv = _kernel_call(q, k, v, dout, ld, q_pos, k_pos, q_seg, k_seg, plan,
                              scale=spec.scale, causal=spec.causal, window=spec.window,
                              softcap=spec.softcap, stages=stages)
  return tuple(base.match_vma(x, *refs) for x in (dq, dk, dv))


# Jitted as one unit: the dQ accumulator is a Ref, which an eager shard_map (a ring run
# outside jit) could not hold between operations.
@functools.partial(jax.jit, static_argnames=("scale", "causal", "window", "softcap", "stages"))
def _kernel_call(q, k, v, dout, ld, q_pos, k_pos, q_seg, k_seg, plan, *, scale: float,
                 causal: bool, window, softcap: float | None, stages: int):
  """dq float32 [B, T, N, H]; dk float32 [B, S, K, H]; dv float32 [B, S, K, Hv]."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  hv = v.shape[-1]
  grp = n // kh
  dtype = q.dtype
  bl = BLOCK
  # dQ's columns are split between the warpgroups at H = 128 (64 each, one 128-byte swizzle
  # tile of K); at H = 64 (a 32-column wgmma does not lower) the warpgroups alternate steps.
  split = h > 64
  hh = h // 2 if split else h                   # dQ columns per product
  nsplit = h // hh                              # K is stored in nsplit column parts
  # pT = 2^(x c - lse2): x the raw sT (plain) or t = tanh(sT scale / cap) (soft-capped).
  c = float((scale if softcap is None else softcap) * common.LOG2E)
  has_seg = q_seg is not None
  masked = causal or has_seg or window is not None
  use_pos = causal or window is not None
  overlap = overlap_schedule(softcap, masked)
  layout = plgpu.Layout.WGMMA
  row, col = layout.reduce(1), layout.reduce(0)   # [64] along rows (keys), columns (queries)

  def body(q_ref, k_ref, v_ref, do_ref, ld_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
           plan_ref, dq_ref, dk_ref, dv_ref, scoped):
    bi = lax.axis_index("batch")
    kvh = lax.axis_index("heads")
    pair = lax.axis_index("kv_seq")
    wg = lax.axis_index("wg")
    ((k_smem, v_smem, q_smem, do_smem, ld_smem, ds_smem, dq_smem),
     (k_bar, v_bar, q_bar, do_bar, ld_bar), slot_free, ds_bar) = scoped
    pb = lax.min(bi, plan_ref.shape[0] - 1)        # plan rows: B, or 1 without segments
    u_lo = plan_ref[pb, 2 * pair, 0]
    u_hi = plan_ref[pb, 2 * pair, 5]
    cnt = u_hi - u_lo                               # query tiles per head (the union)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(240, action="increase")
      kt = 2 * pair + wg
      k_base = kt * bl
      lo, flo, fhi, hi = (plan_ref[pb, kt, 1], plan_ref[pb, kt, 2], plan_ref[pb, kt, 3],
                          plan_ref[pb, kt, 4])
      for j in range(nsplit):        # K in column parts, each one swizzle tile wide
        plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(k_base, bl), kvh, pl.ds(j * hh, hh)],
                                k_smem.at[wg, j], k_bar.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[bi, pl.ds(k_base, bl), kvh], v_smem.at[wg],
                              v_bar.at[wg])
      plgpu.barrier_wait(k_bar.at[0])               # dQ reads both warpgroups' K
      plgpu.barrier_wait(k_bar.at[1])
      plgpu.barrier_wait(v_bar.at[wg])
      kpos = kseg = None
      if use_pos:
        kpos = plgpu.load(kpos_ref.at[pl.ds(k_base, bl)], layout=row, optimized=False)
      if has_seg:
        kseg = plgpu.load(kseg_ref.at[bi, pl.ds(k_base, bl)], layout=row, optimized=False)
      zeros = plgpu.layout_cast(jnp.full((bl, h), 0.0, jnp.float32), layout)
      zeros_v = (zeros if hv == h else
                 plgpu.layout_cast(jnp.full((bl, hv), 0.0, jnp.float32), layout))
      zeros_s = plgpu.layout_cast(jnp.full((bl, bl), 0.0, jnp.float32), layout)
      zeros_q = plgpu.layout_cast(jnp.full((bl, hh), 0.0, jnp.float32), layout)

      def locate(g, qt):
        i = g * cnt + (qt - u_lo)
        slot = lax.rem(i, jnp.array(stages, jnp.int32))
        parity = lax.rem(i, jnp.array(2, jnp.int32))
        return i, slot, parity, kvh * grp + g

      def finish(i, qt, head, slot, parity, dst16, dk):
        """Share dsT, then dK += dsT Q (unless skipped) and this warpgroup's part of dQ.

        dK's product is issued before waiting for the other warpgroup's dsT, so that it
        runs while the two meet; both products are awaited together.
        """
        ds_smem.at[parity, wg][...] = dst16
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_bar)
        doer = True if split else wg == parity

        def dq_products(dq_acc):
          for half in range(2):                     # the two warpgroups' key rows
            plgpu.wgmma(dq_acc, ds_smem.at[parity, half].T,
                        k_smem.at[half, wg if split else 0])

        def products(refs):
          dq_acc, dk_acc = refs
          if dk_acc is not None:
            plgpu.wgmma(dk_acc, dst16, q_smem.at[slot])      # dK += dsT Q
          plgpu.barrier_wait(ds_bar)
          if split:
            dq_products(dq_acc)
          else:
            pl.when(doer)(functools.partial(dq_products, dq_acc))

        dq, dk = pl.run_state(products)(
            (plgpu.ACC.init(zeros_q), None if dk is None else plgpu.ACC.init(dk)))
        plgpu.barrier_arrive(slot_free.at[slot])

        def store_dq():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous dQ left dq_smem
          dq_smem.at[wg][...] = dq
          plgpu.commit_smem()
          cols = pl.ds(wg * hh, hh) if split else pl.ds(0, h)
          plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_ref.at[bi, pl.ds(qt * bl, bl), head, cols],
                                  reduction_op="add")

        if split:
          store_dq()
        else:
          pl.when(doer)(store_dq)
        return dk

      def skip_step(g, qt, carry):
        i, slot, parity, head = locate(g, qt)
        plgpu.barrier_wait(q_bar.at[slot])
        plgpu.barrier_wait(ld_bar.at[slot])
        plgpu.barrier_wait(do_bar.at[slot])
        finish(i, qt, head, slot, parity,
               plgpu.layout_cast(jnp.full((bl, bl), 0.0, dtype), layout), None)
        return carry

      def step(g, qt, carry, use_mask):
        dk, dv = carry
        i, slot, parity, head = locate(g, qt)
        q_s, do_s = q_smem.at[slot], do_smem.at[slot]
        plgpu.barrier_wait(q_bar.at[slot])

        def issue_st(s_ref):
          for j in range(nsplit):                   # contract over H in column parts
            plgpu.wgmma(s_ref, k_smem.at[wg, j], q_s.at[:, pl.ds(j * hh, hh)].T)

        def probabilities(st):
          """pT (times the cap's derivative with a soft-cap) and pT in bf16 (for dV), from
          the raw sT [keys, queries]."""
          if softcap is not None:
            st = jnp.tanh(st * (scale / softcap))   # capped score / cap, in [-1, 1]
          plgpu.barrier_wait(ld_bar.at[slot])
          lse2 = plgpu.load(ld_smem.at[slot, 0], layout=col, optimized=False)
          pt = jnp.exp2(st * c - lax.broadcast_in_dim(lse2, st.shape, [1]))
          if use_mask:
            valid = common.backward_pair_mask(qt, kpos, kseg, qpos_ref, qseg_ref, bi, bl, col,
                                              causal=causal, window=window)
            pt = jnp.where(valid, pt, 0.0)
          pt16 = pt.astype(dtype)
          if softcap is not None:
            pt = pt * (1.0 - st * st)               # pT times the cap's derivative
          return pt, pt16

        def ds(pt, dpt):
          """dsT in bf16; 0 on masked pairs (pT is): no second mask."""
          delta = plgpu.load(ld_smem.at[slot, 1], layout=col, optimized=False)
          return (pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1])) * scale
                  ).astype(dtype)

        if overlap:
          # dpT's product runs under the softmax, dV's under dsT.
          plgpu.barrier_wait(do_bar.at[slot])
          def st_dpt(dp_ref):
            def scores(s_ref):
              issue_st(s_ref)
              plgpu.wgmma(dp_ref, v_smem.at[wg], do_s.T)          # dpT = V dO^T
              return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # sT; dpT runs on

            pt, pt16 = probabilities(pl.run_scoped(scores, plgpu.ACC((bl, bl), jnp.float32)))
            return pt, pt16, plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)

          pt, pt16, dpt = pl.run_scoped(st_dpt, plgpu.ACC((bl, bl), jnp.float32))

          def dv_ds(dv_ref):
            dv_ref[...] = dv
            plgpu.wgmma(dv_ref, pt16, do_s)                       # dV += pT dO
            dst16 = ds(pt, dpt)
            return plgpu.wgmma_accumulator_load(dv_ref, wait_n=0), dst16

          dv, dst16 = pl.run_scoped(dv_ds, plgpu.ACC((bl, hv), jnp.float32))
        else:
          def scores(s_ref):
            issue_st(s_ref)
            return s_ref[...]

          pt, pt16 = probabilities(pl.run_scoped(scores, plgpu.ACC((bl, bl), jnp.float32)))
          plgpu.barrier_wait(do_bar.at[slot])

          def dv_dp(refs):
            dv_ref, dp_ref = refs
            plgpu.wgmma(dv_ref, pt16, do_s)                       # dV += pT dO
            plgpu.wgmma(dp_ref, v_smem.at[wg], do_s.T)            # dpT = V dO^T

          dv, dpt = pl.run_state(dv_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros_s)))
          dst16 = ds(pt, dpt)
        return finish(i, qt, head, slot, parity, dst16, dk), dv

      def run(g, start, stop, fn, carry):
        # Loops count from 0: inside shard_map the loaded bounds carry the mesh axis in
        # their type, and a loop index starting at such a bound would not match its own
        # increment.
        return lax.fori_loop(0, stop - start, lambda r, cr: fn(g, start + r, cr), carry)

      def head_loop(g, carry):
        run(g, u_lo, lo, skip_step, None)
        if masked:
          carry = run(g, lo, flo, functools.partial(step, use_mask=True), carry)
        carry = run(g, flo, fhi, functools.partial(step, use_mask=False), carry)
        if masked:
          carry = run(g, fhi, hi, functools.partial(step, use_mask=True), carry)
        run(g, hi, u_hi, skip_step, None)
        return carry

      dk, dv = lax.fori_loop(0, grp, head_loop, (zeros, zeros_v))
      dk_ref.at[bi, pl.ds(k_base, bl), kvh][...] = dk
      dv_ref.at[bi, pl.ds(k_base, bl), kvh][...] = dv
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(24, action="decrease")
      total = grp * cnt
      per = jnp.maximum(cnt, 1)

      def issue(i, slot):
        g = lax.div(i, per)
        qt = u_lo + lax.rem(i, per)
        head = kvh * grp + g
        rows = pl.ds(qt * bl, bl)
        plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, head], q_smem.at[slot], q_bar.at[slot])
        plgpu.copy_gmem_to_smem(ld_ref.at[bi, head, :, rows], ld_smem.at[slot],
                                ld_bar.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, head], do_smem.at[slot],
                                do_bar.at[slot])

      for i in range(stages):
        pl.when(i < total)(functools.partial(issue, jnp.int32(i), i))

      @pl.loop(0, jnp.maximum(total - stages, 0))
      def _refill(r):
        slot = lax.rem(r, jnp.array(stages, jnp.int32))
        plgpu.barrier_wait(slot_free.at[slot])
        issue(r + stages, slot)

  def entry(q_ref, k_ref, v_ref, do_ref, ld_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
            plan_ref, dq_ref, dk_ref, dv_ref):
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    f32_tiling = plgpu.TilingTransform((8, 32))
    scratch = [
        plgpu.SMEM((2, nsplit, bl, hh), dtype, transforms=(tiling, swizzle)),  # K parts
        plgpu.SMEM((2, bl, hv), dtype, transforms=(tiling, swizzle)),         # V
        plgpu.SMEM((stages, bl, h), dtype, transforms=(tiling, swizzle)),     # Q
        plgpu.SMEM((stages, bl, hv), dtype, transforms=(tiling, swizzle)),    # dO
        plgpu.SMEM((stages, 2, bl), jnp.float32),                             # lse2, D
        plgpu.SMEM((2, 2, bl, bl), dtype, transforms=(tiling, swizzle)),      # dsT
        plgpu.SMEM((2, bl, hh), jnp.float32, transforms=(f32_tiling, swizzle)),  # dQ
    ]
    pl.run_scoped(
        lambda *args: body(q_ref, k_ref, v_ref, do_ref, ld_ref, qpos_ref, kpos_ref, qseg_ref,
                           kseg_ref, plan_ref, dq_ref, dk_ref, dv_ref, args),
        scratch,
        # one arrival per TMA copy: K arrives in nsplit column parts
        (plgpu.Barrier(num_arrivals=nsplit, num_barriers=2), plgpu.Barrier(num_barriers=2),
         plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages)),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )

  if not has_seg:
    q_seg = jnp.zeros((b, t), jnp.int32)
    k_seg = jnp.zeros((b, s), jnp.int32)
  dq_acc = jax.new_ref(jnp.zeros((b, t, n, h), jnp.float32))
  out_type = (jax.ShapeDtypeStruct((b, s, kh, h), jnp.float32),
              jax.ShapeDtypeStruct((b, s, kh, hv), jnp.float32))

  # entry's refs: the inputs, then the dQ accumulator (a Ref), then dK, dV
  dk, dv = common.warp_specialized(entry, out_type, grid=(kh, s // (2 * bl), b),
                                       grid_names=("heads", "kv_seq", "batch"))(
      q, k, v, dout, ld, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
      q_seg.astype(jnp.int32), k_seg.astype(jnp.int32), plan, dq_acc)
  return jax.freeze(dq_acc), dk, dv
