"""The Mosaic GPU forward of the pallas_gpu backend (Hopper: wgmma, TMA, warp specialization).

Layout of one CUDA block (grid: query heads x query-tile pairs x batch), three warpgroups:
two compute warpgroups own `bq` query rows each (2 * bq rows per block) and one memory
warpgroup streams K/V tiles of `bk` rows through a `stages`-deep ring of shared-memory slots
with TMA. Per K/V step a compute warpgroup issues S = Q K^T (wgmma, fp32 accumulator),
applies the online softmax in registers (base 2, the scale folded into one FMA), and issues
O += P V (wgmma, P from registers). Two schedules (`overlap_schedule` picks one):

- ping-pong: a schedule barrier lets the two compute warpgroups take turns on the tensor
  cores while the other does its softmax (FlashAttention-3's ping-pong); each warpgroup waits
  for its own S and then for its own P V.
- overlap (H = Hv = 128 without a soft-cap): no schedule barrier; per step a warpgroup issues
  S = Q K^T of this tile and then P V of the previous tile (P kept in registers from the
  previous step), and runs this tile's softmax while P V is on the tensor cores
  (FlashAttention-3's intra-warpgroup overlap); it waits for P V only before P is replaced.
  The first step's P V multiplies zeros by a tile of zeros in shared memory (one more V slot),
  so that every step has the same instructions and no NaN of a real V tile meets P = 0. On
  the H200 this is 2-10% faster than the ping-pong for plain attention at H = 128 (MHA and
  GQA), no faster at H = 64 or 192 / 128, and no faster soft-capped (docs/GPU_NOTES.md runs
  66-69), hence the choice.

The plan (kernels/pallas_gpu_common.py) gives each query tile its key-tile range and full
run. The two query tiles of one block share the K/V stream, so the memory warpgroup loads the
union of their ranges [u_lo, u_hi); a compute warpgroup passes over the union steps outside
its own range without computing (it still waits and releases each slot so that barrier phases
stay in step).

Rows with no valid key end with l = 0: o = 0 and lse = -inf.

Head dims. Q and K tiles are [rows, H] and V tiles [bk, Hv], each stored as 64-column
swizzle tiles, so H and Hv are multiples of 64 here (the backend, kernels/pallas_gpu.py,
zero-pads the others): S = Q K^T contracts over H in H / 64 swizzle tiles (H = 192 runs
natively, three of them), the accumulator is [bq, Hv] and O += P V has Hv columns. With
Hv != H nothing else changes: o is [B, N, T, Hv].

Soft-cap (a static branch; the plain path is untouched). The scores from the wgmma are raw
q.k; the plain path keeps them and folds the scale into one FMA, p = 2^(s c - m) with
c = scale log2(e). With a cap, the capped score is cap tanh(scale s / cap) = cap t, so the
kernel replaces s by t = tanh(s scale / cap) (one multiply and one MUFU tanh.approx.f32 per
score, approx_math being on) and sets c = cap log2(e): the mask, the running max and
p = 2^(t c - m) then read exactly as in the plain path, in base-2 units of the capped
scores. A masked pair gets -inf after the cap (the contract's order: cap, then mask).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ringflash.kernels import base
from ringflash.kernels import pallas_gpu_common as common


def overlap_schedule(h: int, hv: int, block_q: int, block_k: int, stages: int, itemsize: int,
                     softcap: float | None) -> bool:
  """Whether the forward runs the overlap schedule (module docstring): plain attention at
  H = Hv = 128, where it was measured faster, when its extra V slot fits shared memory."""
  smem = common.forward_smem_bytes(h, hv, block_q, block_k, stages, itemsize, extra_v_slots=1)
  return softcap is None and h == hv == 128 and smem <= common.SMEM_BYTES


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, plan, *, scale: float, causal: bool,
            window, has_seg: bool, block_q: int, block_k: int, stages: int,
            softcap: float | None = None):
  """The Mosaic GPU call: o float32 [B, N, T, Hv], lse float32 [B, N, T] (natural log).

  q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], H and Hv multiples of 64.
  plan: int32 [B|1, T / block_q, 8] from common.tile_plan.
  """
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  b, t, n, h = q.shape
  kh, hv = k.shape[2], v.shape[-1]
  grp = n // kh
  bq, bk = block_q, block_k
  dtype = q.dtype
  # p = 2^(s c - m): s the raw score (plain) or t = tanh(s scale / cap) (soft-capped).
  c = float((scale if softcap is None else softcap) * common.LOG2E)
  masked = causal or has_seg or window is not None
  use_pos = causal or window is not None
  layout = plgpu.Layout.WGMMA
  row, col = layout.reduce(1), layout.reduce(0)   # [bq] along rows, [bk] along columns
  overlap = overlap_schedule(h, hv, bq, bk, stages, jnp.dtype(dtype).itemsize, softcap)
  zero_slot = stages                              # the overlap schedule's tile of zeros

  def body(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, plan_ref,
           o_ref, lse_ref, scoped):
    bi = lax.axis_index("batch")
    head = lax.axis_index("heads")
    # Blocks start in grid order: the last query tiles first, which have the most key
    # tiles under a causal mask, so that the short blocks fill the tail of the launch.
    pair = (t // (2 * bq) - 1) - lax.axis_index("q_seq")
    wg = lax.axis_index("wg")
    (q_smem2, k_smem, v_smem, lse_smem2), (k_bar, v_bar, q_bar), (k_free, v_free), sched = (
        scoped)
    pb = lax.min(bi, plan_ref.shape[0] - 1)        # plan rows: B, or 1 without segments

    def turn():
      if overlap:
        return
      plgpu.barrier_arrive(sched)
      plgpu.barrier_wait(sched)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      qt = 2 * pair + wg
      q_base = qt * bq
      u_lo = plan_ref[pb, qt, 0]
      lo, flo, fhi, hi = (plan_ref[pb, qt, 1], plan_ref[pb, qt, 2], plan_ref[pb, qt, 3],
                          plan_ref[pb, qt, 4])
      u_hi = plan_ref[pb, qt, 5]
      q_smem = q_smem2.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_base, bq), head], q_smem, q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      if use_pos:
        qpos = plgpu.load(qpos_ref.at[pl.ds(q_base, bq)], layout=row, optimized=False)
      if has_seg:
        qseg = plgpu.load(qseg_ref.at[bi, pl.ds(q_base, bq)], layout=row, optimized=False)
      m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row)
      l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row)
      acc = plgpu.layout_cast(jnp.full((bq, hv), 0.0, jnp.float32), layout)
      if overlap:
        # Both compute warpgroups write the same zeros; each reads the slot only after its
        # own write is fenced.
        v_smem.at[zero_slot][...] = plgpu.layout_cast(jnp.zeros((bk, hv), dtype), layout)
        plgpu.commit_smem()

      pl.when(wg == 1)(turn)

      def slot_of(kv):
        return lax.rem(kv - u_lo, jnp.array(stages, jnp.int32))

      def skip_step(kv, carry):
        slot = slot_of(kv)
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        turn()
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        turn()
        return carry

      def softmax(s, m_i, l_i, kv, use_mask):
        """p (float32), alpha, the new m and l of one tile's raw scores s."""
        if softcap is not None:
          s = jnp.tanh(s * (scale / softcap))       # capped score / cap, in [-1, 1]
        if use_mask:
          qp = kp = qsg = ksg = None
          if use_pos:
            kpos = plgpu.load(kpos_ref.at[pl.ds(kv * bk, bk)], layout=col, optimized=False)
            qp = lax.broadcast_in_dim(qpos, (bq, bk), [0])
            kp = lax.broadcast_in_dim(kpos, (bq, bk), [1])
          if has_seg:
            kseg = plgpu.load(kseg_ref.at[bi, pl.ds(kv * bk, bk)], layout=col,
                              optimized=False)
            qsg = lax.broadcast_in_dim(qseg, (bq, bk), [0])
            ksg = lax.broadcast_in_dim(kseg, (bq, bk), [1])
          valid = base.pair_mask(qp, kp, qsg, ksg, causal=causal, window=window)
          s = jnp.where(valid, s, -jnp.inf)
        # m is kept in base-2 units of the scaled logits: p = 2^(c s - m).
        m_new = jnp.maximum(m_i, s.max(axis=1) * c)
        # A row that met a valid key keeps m >= LOWEST, also where all its valid scores
        # are below float32's range (c s = -inf; kernels/base.py): one select a row, and on
        # masked tiles the row's LOWEST-or--inf from its mask.
        if use_mask:
          met = jnp.where(valid, base.LOWEST, s).max(axis=1)    # s: -inf where masked
          m_new = jnp.where(m_new < met, met, m_new)
          # A row with no valid key so far keeps m = -inf; shift it by 0 instead, so that
          # its p and alpha are exactly 0 and no (-inf) - (-inf) appears.
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
          m_new = base.floor_at_lowest(m_new)
          m_use = m_new
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        return p, alpha, m_new, l_i

      def step(kv, carry, use_mask):
        # The ping-pong schedule.
        acc, m_i, l_i = carry
        slot = slot_of(kv)
        plgpu.barrier_wait(k_bar.at[slot])

        def qk_scope(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
          turn()
          return acc_ref[...]

        s = pl.run_scoped(qk_scope, plgpu.ACC((bq, bk), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        p, alpha, m_new, l_i = softmax(s, m_i, l_i, kv, use_mask)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p16 = p.astype(dtype)
        acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_wait(sched)

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_i

      def rescale_and_pv(o_acc, p16, alpha, slot, real):
        """O = alpha O, then P V of the tile in `slot` (of the tile of zeros where not
        `real`) issued into O, not waited for."""
        o = plgpu.wgmma_accumulator_load(o_acc, wait_n=None)   # its last P V: waited for
        o_acc[...] = o * lax.broadcast_in_dim(alpha, o.shape, [0])
        pl.when(real)(lambda: plgpu.barrier_wait(v_bar.at[slot]))
        plgpu.wgmma(o_acc, p16, v_smem.at[jnp.where(real, slot, zero_slot)])

      def step_overlap(kv, carry, use_mask, o_acc):
        # The overlap schedule: carry holds the previous tile's P (bf16) and alpha; O lives
        # in the accumulator o_acc.
        p16_prev, alpha_prev, m_i, l_i = carry
        slot = slot_of(kv)
        first = kv == lo
        prev = slot_of(kv - 1)
        plgpu.barrier_wait(k_bar.at[slot])

        def qk_scope(s_ref):
          plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
          rescale_and_pv(o_acc, p16_prev, alpha_prev, prev, jnp.logical_not(first))
          return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)    # S; P V may run on

        s = pl.run_scoped(qk_scope, plgpu.ACC((bq, bk), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        p, alpha, m_new, l_i = softmax(s, m_i, l_i, kv, use_mask)
        plgpu.wgmma_wait(0)
        pl.when(jnp.logical_not(first))(lambda: plgpu.barrier_arrive(v_free.at[prev]))
        return p.astype(dtype), alpha, m_new, l_i

      def run(start, stop, fn, carry):
        # Loops count from 0: inside shard_map the loaded bounds carry the mesh axis in
        # their type, and a loop index starting at such a bound would not match its own
        # increment.
        return lax.fori_loop(0, stop - start, lambda i, c: fn(start + i, c), carry)

      def steps(fn, carry):
        if masked:
          carry = run(lo, flo, functools.partial(fn, use_mask=True), carry)
        carry = run(flo, fhi, functools.partial(fn, use_mask=False), carry)
        if masked:
          carry = run(fhi, hi, functools.partial(fn, use_mask=True), carry)
        return carry

      def overlapped(o_acc):
        o_acc[...] = acc
        p16 = plgpu.layout_cast(jnp.zeros((bq, bk), dtype), layout)
        one = plgpu.layout_cast(jnp.full((bq,), 1.0, jnp.float32), row)
        p16, alpha, m_f, l_f = steps(functools.partial(step_overlap, o_acc=o_acc),
                                     (p16, one, m_i, l_i))
        # The last tile's P V (with no tile: zeros times the tile of zeros).
        has = lo < hi
        last = slot_of(hi - 1)
        rescale_and_pv(o_acc, p16, alpha, last, has)
        o = plgpu.wgmma_accumulator_load(o_acc, wait_n=0)
        pl.when(has)(lambda: plgpu.barrier_arrive(v_free.at[last]))
        return o, m_f, l_f

      run(u_lo, lo, skip_step, None)
      if overlap:
        carry = pl.run_scoped(overlapped, plgpu.ACC((bq, hv), jnp.float32))
      else:
        carry = steps(step, (acc, m_i, l_i))
      run(hi, u_hi, skip_step, None)
      acc, m_i, l_i = carry
      pl.when(wg == 0)(turn)

      inv, lse = base.finish_rows(m_i, l_i, common.LN2)
      o = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      lse_smem = lse_smem2.at[wg]
      lse_smem[...] = lse
      o_ref.at[bi, head, pl.ds(q_base, bq)][...] = o
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, head, pl.ds(q_base, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      kvh = lax.div(head, jnp.array(grp, head.dtype))
      qt = 2 * pair
      u_lo = plan_ref[pb, qt, 0]
      u_hi = plan_ref[pb, qt, 5]
      count = u_hi - u_lo

      def issue(kv, slot):
        src = (bi, pl.ds(kv * bk, bk), kvh)
        plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])

      for i in range(stages):
        pl.when(i < count)(functools.partial(issue, u_lo + i, i))

      @pl.loop(0, jnp.maximum(count - stages, 0))
      def _refill(r):
        slot = lax.rem(r, jnp.array(stages, jnp.int32))
        kv = u_lo + r + stages
        src = (bi, pl.ds(kv * bk, bk), kvh)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])

  def entry(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, plan_ref, o_ref,
            lse_ref):
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    scratch = [
        plgpu.SMEM((2, bq, h), dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((stages, bk, h), dtype, transforms=(tiling, swizzle)),      # K
        plgpu.SMEM((stages + overlap, bk, hv), dtype, transforms=(tiling, swizzle)),  # V
        plgpu.SMEM((2, bq), jnp.float32),
    ]
    pl.run_scoped(
        lambda *args: body(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
                           plan_ref, o_ref, lse_ref, args),
        scratch,
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=2)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )

  if not has_seg:
    q_seg = jnp.zeros((b, t), jnp.int32)
    k_seg = jnp.zeros((b, k.shape[1]), jnp.int32)
  out_type = (jax.ShapeDtypeStruct((b, n, t, hv), jnp.float32),
              jax.ShapeDtypeStruct((b, n, t), jnp.float32))
  return common.warp_specialized(entry, out_type, grid=(n, t // (2 * bq), b),
                          grid_names=("heads", "q_seq", "batch"))(
      q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), q_seg.astype(jnp.int32),
      k_seg.astype(jnp.int32), plan)
