"""The Hopper backend: Pallas Mosaic GPU forward (wgmma, TMA, warp specialization, here) and
backward (kernels/pallas_gpu_mosaic_bwd.py, one fused kernel for head dims 64 and 128); the
Pallas Triton backward (kernels/pallas_gpu_bwd.py) serves head dim 256, key lengths that are
not a multiple of 128, and interpret mode on CPU.

Forward layout of one CUDA block (grid: query heads x query-tile pairs x batch), three
warpgroups: two compute warpgroups own `bq` query rows each (2 * bq rows per block) and one
memory warpgroup streams K/V tiles of `bk` rows through a `stages`-deep ring of shared-memory
slots with TMA. Per K/V step a compute warpgroup issues S = Q K^T (wgmma, fp32 accumulator),
applies the online softmax in registers (base 2, the scale folded into one FMA), and issues
O += P V (wgmma, P from registers). A schedule barrier lets the two compute warpgroups take
turns on the tensor cores while the other does its softmax (FlashAttention-3's ping-pong).

Masks and skipping. Before the kernel, `tile_plan` looks at each (query tile, key tile) pair
through base.block_may_have_work on the tiles' [min, max] position and segment ranges. For
query tile i it yields the key-tile range [lo, hi) that may have work and, inside it, one run
[flo, fhi) of tiles whose every pair is valid (no mask needed). Example, causal, contiguous,
T = S = 1024, bq = 64, bk = 128: query tile 5 holds positions 320..383, so lo = 0,
hi = 3 (key tile 2 holds 256..383), full run [0, 2), and tile 2 is evaluated with the mask.
The two query tiles of one block share the K/V stream, so the memory warpgroup loads the
union of their ranges [u_lo, u_hi); a compute warpgroup passes over the union steps outside
its own range without computing (it still waits and releases each slot so that barrier phases
stay in step). The in-tile mask is computed from the tile's global positions and segment ids,
exactly as base.mask defines it (causal: k_pos <= q_pos; window (left, right):
-right <= q_pos - k_pos <= left; segments: equal ids).

Rows with no valid key end with l = 0: o = 0 and lse = -inf.
Specs with features this kernel does not evaluate in-tile (fields of KernelSpec beyond
scale, causal, window, block sizes and interpret, set to non-default values) run on the xla
backend.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ringflash.kernels import base

NAME = "pallas_gpu"

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Fields of KernelSpec the kernels evaluate themselves.
_KNOWN_SPEC_FIELDS = frozenset({"scale", "causal", "block_q", "block_k", "interpret",
                                 "window"})
# Shared memory a CUDA block may use on Hopper (227 KiB).
_SMEM_BYTES = 227 * 1024
# Backward tile rows (query and key) of the Triton backward kernels.
BWD_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
  """Static tiling of the Mosaic GPU forward: one compute warpgroup per `block_q` rows,
  `block_k` key rows per pipeline step, `stages` shared-memory slots for K and V each."""

  block_q: int
  block_k: int
  stages: int = 2

  def __post_init__(self):
    if self.block_q % 64:
      raise ValueError(f"block_sizes.block_q={self.block_q} must be a multiple of 64 "
                       f"(backend {NAME!r})")
    if self.block_k % 64:
      raise ValueError(f"block_sizes.block_k={self.block_k} must be a multiple of 64 "
                       f"(backend {NAME!r})")
    if self.stages < 2:
      raise ValueError(f"stages={self.stages} must be at least 2")


def _default_blocks(head_dim: int) -> tuple[int, int]:
  # Shared memory per block: 2 * bq * H (Q) + 2 * stages * bk * H (K, V) elements of 2 bytes;
  # bk = 128 with 2 stages at H = 128 is 160 KiB of the 227 KiB.
  return (64, 128) if head_dim <= 128 else (64, 64)


def resolve_block_sizes(block_sizes: base.BlockSizes, q_len: int, kv_len: int, *,
                        head_dim: int, kv_heads: int, group: int, dtype,
                        device_kind: str) -> tuple[int, int]:
  """Tile sizes (bq, bk) for local lengths q_len, kv_len.

  bq is the rows of one compute warpgroup; a CUDA block covers 2 * bq query rows, so q_len
  must be a multiple of 2 * bq and kv_len a multiple of bk (and of the backward's 64).

  Raises:
    ValueError: naming block_sizes, when a size is not a multiple of 64 or does not tile
      the local lengths; or when head_dim or dtype is unsupported.
  """
  del device_kind, kv_heads, group  # one default for Hopper parts (H100, H200), any GQA
  if head_dim not in (64, 128, 256):
    raise ValueError(f"head_dim must be 64, 128 or 256 for backend {NAME!r}, got {head_dim}")
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"dtype must be bfloat16 or float16 for backend {NAME!r}, got "
                     f"{jnp.dtype(dtype)}; use backend='xla' for float32")
  dq, dk = _default_blocks(head_dim)
  bq = dq if block_sizes.block_q is None else block_sizes.block_q
  bk = dk if block_sizes.block_k is None else block_sizes.block_k
  if block_sizes.block_k is None and kv_len % bk and kv_len % 64 == 0:
    bk = 64
  cfg = ForwardConfig(bq, bk)  # multiples of 64
  itemsize = jnp.dtype(dtype).itemsize
  smem = (2 * bq * head_dim + 2 * cfg.stages * bk * head_dim) * itemsize + 2 * bq * 4
  if smem > _SMEM_BYTES:
    raise ValueError(f"block_sizes=({bq}, {bk}) at head_dim={head_dim} needs {smem} bytes of "
                     f"shared memory per CUDA block (Q of 2 * block_q rows, {cfg.stages} "
                     f"stages of K and V of block_k rows); Hopper has {_SMEM_BYTES} (backend "
                     f"{NAME!r})")
  if q_len % (2 * bq) or q_len % BWD_BLOCK:
    raise ValueError(f"block_sizes.block_q={bq}: the local query length {q_len} must be a "
                     f"multiple of 2 * block_q = {2 * bq} (backend {NAME!r}; use "
                     f"backend='xla' for other lengths)")
  if kv_len % bk or kv_len % BWD_BLOCK:
    raise ValueError(f"block_sizes.block_k={bk}: the local key length {kv_len} must be a "
                     f"multiple of block_k and of {BWD_BLOCK} (backend {NAME!r}; use "
                     f"backend='xla' for other lengths)")
  return bq, bk


def _unsupported_features(spec: base.KernelSpec) -> bool:
  """True when the spec sets a masking feature that these kernels do not evaluate."""
  for field in dataclasses.fields(spec):
    if field.name in _KNOWN_SPEC_FIELDS:
      continue
    if getattr(spec, field.name) != field.default:
      return True
  return False


# ----------------------------------------------------------------------------- tile plan


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


def tile_plan(work, full):
  """Per query tile: int32 [B|1, nq, 8] = (u_lo, lo, flo, fhi, hi, u_hi, 0, 0).

  [lo, hi): the key tiles that may have work (every tile outside is skipped); [flo, fhi):
  a run of full tiles inside it, computed without a mask; [u_lo, u_hi): the union of the
  ranges of the two query tiles 2c, 2c + 1 that one CUDA block computes (the K/V stream).
  A tile with no work has lo = hi = u_lo, an empty range inside the union.
  """
  nk = work.shape[-1]
  ar = jnp.arange(nk, dtype=jnp.int32)
  any_work = work.any(axis=-1)
  lo = _first_true(work, 0)
  hi = jnp.where(any_work, nk - _first_true(work[..., ::-1], nk), 0).astype(jnp.int32)
  flo = _first_true(full, 0)
  has_full = full.any(axis=-1)
  broken = (ar >= flo[..., None]) & ~full
  fhi = jnp.where(has_full, _first_true(broken, nk), 0).astype(jnp.int32)
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

  lo = jnp.where(any_work, lo, u_lo)
  hi = jnp.where(any_work, hi, u_lo)
  lo, hi = clamp(lo, u_lo, u_hi), clamp(hi, u_lo, u_hi)
  flo = jnp.where(has_full, clamp(flo, lo, hi), lo)
  fhi = jnp.where(has_full, clamp(fhi, flo, hi), flo)
  zero = jnp.zeros_like(lo)
  return jnp.stack([u_lo, lo, flo, fhi, hi, u_hi, zero, zero], axis=-1).astype(jnp.int32)


def in_tile_mask(qp, kp, q_seg, k_seg, *, causal: bool, window):
  """base.mask inside a kernel, from positions and segment ids already broadcast to one
  tile's [rows, cols] (any orientation; None where unused): bool, or None if nothing masks.

  causal: k_pos <= q_pos; window (left, right): -right <= q_pos - k_pos <= left; segments:
  equal ids. Example: q_pos 6 with window (3, 2) keeps k_pos 3..8.
  """
  valid = None
  if causal:
    valid = kp <= qp
  if window is not None:
    diff = qp - kp                               # i - j, as base.mask writes it
    near = (diff <= window[0]) & (diff >= -window[1])
    valid = near if valid is None else valid & near
  if q_seg is not None:
    same = q_seg == k_seg
    valid = same if valid is None else valid & same
  return valid


def warp_specialized(entry, out_type, *, grid, grid_names):
  """plgpu.kernel with this backend's block shape: compute warpgroups 0 and 1, memory
  warpgroup 2, on the thread axis "wg"."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.kernel(entry, out_type=out_type, grid=grid, grid_names=grid_names,
                      num_threads=3, thread_name="wg",
                      compiler_params=plgpu.CompilerParams(approx_math=True))


# ----------------------------------------------------------------------------- forward


def _forward_kernel_call(q, k, v, q_pos, k_pos, q_seg, k_seg, plan, *, scale: float,
                         causal: bool, window, has_seg: bool, cfg: ForwardConfig):
  """The Mosaic GPU call: o float32 [B, N, T, H], lse float32 [B, N, T] (natural log)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  b, t, n, h = q.shape
  kh = k.shape[2]
  grp = n // kh
  bq, bk, stages = cfg.block_q, cfg.block_k, cfg.stages
  dtype = q.dtype
  c = float(scale * _LOG2E)
  masked = causal or has_seg or window is not None
  use_pos = causal or window is not None
  layout = plgpu.Layout.WGMMA
  row, col = layout.reduce(1), layout.reduce(0)   # [bq] along rows, [bk] along columns

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
      acc = plgpu.layout_cast(jnp.full((bq, h), 0.0, jnp.float32), layout)

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

      def step(kv, carry, use_mask):
        acc, m_i, l_i = carry
        slot = slot_of(kv)
        plgpu.barrier_wait(k_bar.at[slot])

        def qk_scope(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
          turn()
          return acc_ref[...]

        s = pl.run_scoped(qk_scope, plgpu.ACC((bq, bk), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
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
          valid = in_tile_mask(qp, kp, qsg, ksg, causal=causal, window=window)
          s = jnp.where(valid, s, -jnp.inf)
        # m is kept in base-2 units of the scaled logits: p = 2^(c s - m).
        m_new = jnp.maximum(m_i, s.max(axis=1) * c)
        if use_mask:
          # A row with no valid key so far keeps m = -inf; shift it by 0 instead, so that
          # its p and alpha are exactly 0 and no (-inf) - (-inf) appears.
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
          m_use = m_new
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha + p.sum(axis=1)
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

      def run(start, stop, fn, carry):
        # Loops count from 0: inside shard_map the loaded bounds carry the mesh axis in
        # their type, and a loop index starting at such a bound would not match its own
        # increment.
        return lax.fori_loop(0, stop - start, lambda i, c: fn(start + i, c), carry)

      carry = (acc, m_i, l_i)
      run(u_lo, lo, skip_step, None)
      if masked:
        carry = run(lo, flo, functools.partial(step, use_mask=True), carry)
      carry = run(flo, fhi, functools.partial(step, use_mask=False), carry)
      if masked:
        carry = run(fhi, hi, functools.partial(step, use_mask=True), carry)
      run(hi, u_hi, skip_step, None)
      acc, m_i, l_i = carry
      pl.when(wg == 0)(turn)

      ok = l_i > 0.0
      inv = jnp.where(ok, 1.0 / jnp.where(ok, l_i, 1.0), 0.0)
      o = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      lse = jnp.where(ok, m_i * _LN2 + jnp.log(jnp.where(ok, l_i, 1.0)), -jnp.inf)
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
        plgpu.SMEM((stages, bk, h), dtype, transforms=(tiling, swizzle)),
        plgpu.SMEM((stages, bk, h), dtype, transforms=(tiling, swizzle)),
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
  out_type = (jax.ShapeDtypeStruct((b, n, t, h), jnp.float32),
              jax.ShapeDtypeStruct((b, n, t), jnp.float32))
  return warp_specialized(entry, out_type, grid=(n, t // (2 * bq), b),
                          grid_names=("heads", "q_seq", "batch"))(
      q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), q_seg.astype(jnp.int32),
      k_seg.astype(jnp.int32), plan)


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec):
  """Block-pair forward; see kernels/base.py for the contract.

  Returns o float32 [B, T, N, H] and lse float32 [B, N, T].
  """
  if spec.interpret or _unsupported_features(spec):
    from ringflash.kernels import xla  # pylint: disable=g-import-not-at-top
    return xla.forward(q, k, v, q_pos, k_pos, q_seg, k_seg,
                       dataclasses.replace(spec, interpret=False))
  cfg = ForwardConfig(spec.block_q, spec.block_k, stages=2)
  work, full = tile_flags(q_pos, k_pos, q_seg, k_seg, spec, cfg.block_q, cfg.block_k)
  plan = tile_plan(work, full)
  with base.no_vma_check():
    o, lse = _forward_kernel_call(q, k, v, q_pos, k_pos, q_seg, k_seg, plan, scale=spec.scale,
                                  causal=spec.causal, window=spec.window,
                                  has_seg=q_seg is not None, cfg=cfg)
  refs = (q, k, v, q_pos, k_pos, q_seg, k_seg)
  return base.match_vma(o.transpose(0, 2, 1, 3), *refs), base.match_vma(lse, *refs)


def backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
             dlse=None):
  """Block-pair backward from the global out and lse; see kernels/base.py for the contract."""
  from ringflash.kernels import pallas_gpu_bwd  # pylint: disable=g-import-not-at-top
  if _unsupported_features(spec):
    from ringflash.kernels import xla  # pylint: disable=g-import-not-at-top
    return xla.backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg,
                        dataclasses.replace(spec, interpret=False), dlse=dlse)
  from ringflash.kernels import pallas_gpu_mosaic_bwd  # pylint: disable=g-import-not-at-top
  if (not spec.interpret and pallas_gpu_mosaic_bwd.supports(q.shape[-1])
      and k.shape[1] % (2 * pallas_gpu_mosaic_bwd.BLOCK) == 0):
    return pallas_gpu_mosaic_bwd.backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg,
                                          spec, dlse=dlse)
  return pallas_gpu_bwd.backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec,
                                 dlse=dlse)
