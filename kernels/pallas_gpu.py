"""The Hopper backend: Pallas Mosaic GPU kernels behind the kernel contract (kernels/base.py).

Four kernels, one module each, sharing kernels/pallas_gpu_common.py (tile plan, launch):
  kernels/pallas_gpu_mosaic_fwd.py       the forward (wgmma, TMA, warp specialization);
  kernels/pallas_gpu_mosaic_bwd.py       the backward, one fused kernel, for head dims H and
                                         Hv of 64 or 128 (after padding);
  kernels/pallas_gpu_mosaic_bwd_wide.py  the same for the other head dims up to 256, its two
                                         compute warpgroups split by role;
  kernels/pallas_gpu_triton_bwd.py       a Pallas Triton backward for head dims the Mosaic
                                         backwards would pad more (and the CPU interpreter).
This module says what the backend runs (`unsupported`), resolves its tiles and dispatches.

Head dims. The Mosaic GPU kernels store Q, K, V and dO tiles as 64-column swizzle tiles
(128 bytes of 2-byte columns), so they take head dims that are multiples of 64; Triton's
blocks are powers of two. Any other head dim, a multiple of 8 up to 256, is zero-padded here,
per call, in a static branch (a call whose dims fit pads nothing and costs nothing more):
  - q and k to Hp, the next size the kernel takes: q.k is unchanged (the padded columns are
    zero) and so are the scores, since the scale is fixed in the spec (1 / sqrt(H) of the
    true H by default), not derived from the padded shape;
  - v (and, in the backward, out and dout) to Hvp: the padded output columns are zero and
    are cut off, and so are the padded columns of dq, dk and dv.
Which kernel takes which (H, Hv), each dim padded on its own:
  forward: the Mosaic kernel, H and Hv padded to a multiple of 64 (mosaic_dim): 80 -> 128,
    160 -> 192; 192 runs natively (S = Q K^T contracts over three swizzle tiles), so MLA's
    192 / 128 pads nothing.
  backward (backward_kernel): the fused Mosaic kernel where both padded dims are 64 or 128,
    e.g. 128/128, 128/64, 64/128, 80/80 -> 128/128, 112/48 -> 128/64; it keeps dK [64, Hp]
    and dV [64, Hvp] of each compute warpgroup in fp32 registers, and beyond 128 + 128
    columns they no longer fit (MLA's 192 / 128 would need 160 of a thread's 240 registers
    for them alone). The other pairs up to 256 / 256, e.g. 192/128, 256/256, 224/128 ->
    256/128, go to the wide Mosaic kernel, whose warpgroups keep one of dK and dV each
    (64 x 256 fp32 is 128 registers a thread), where its padding adds no more columns than
    the Triton backward's; the Triton backward takes the rest (160/72) and interpret mode,
    each dim as one or two power-of-two column pieces (triton_dims: 192 -> 128 + 64,
    160 -> 128 + 32, 72 -> 64 + 16, padded to 80). Key lengths that are not a multiple of
    128 are padded to one for the Mosaic backwards (_backward_key_rows). Measured on the
    H200 (T = 16k, N = K = 16, the backward alone, docs/GPU_NOTES.md run 105): the wide
    kernel takes 12.5 ms causal at 256 / 256 (the Triton one 29.8), 9.8 ms at MLA's
    192 / 128 (Triton 14.0), against 5.3 ms for the fused one at 128 / 128 (run 88).

Soft-cap (spec.softcap): a static branch in all three kernels (each module's docstring has
the details): the forward replaces the raw scores s by t = tanh(scale s / cap) and runs its
base-2 online softmax on cap log2(e) t with the same single FMA; the backwards recompute t
the same way and multiply dS by 1 - t^2 before the dK and dQ products. On the H200 (T = 16k,
H = 128) a capped forward runs at 0.81-0.83x the plain one's speed and forward+backward at
0.89-0.91x (docs/GPU_NOTES.md runs 86, 89 and 121; runs 41-74, 82-83 and 118-119 say why).

float16 (a static branch; bfloat16 is untouched): the backwards multiply ds = p (dp - D) by
q and k in float16 on the tensor cores, and ds passes 65504 where the output cotangent is
large while the gradients are small. backward scales ds per kv head by a power of two into
range from outside the kernels (through v and D) and divides dq and dk back
(_float16_ds_range); where ds cannot pass 2^15 the scale is 1.

The Mosaic GPU kernels do not run on CPU: JAX's Mosaic GPU interpreter (jax 0.12) interprets
neither pl.run_state over a WGMMA accumulator (the ping-pong forward's P V) nor a store into
one (the overlap forward), docs/GPU_NOTES.md "Mosaic GPU's interpreter"; so the backend runs
on Hopper GPUs only (`unsupported` says so on other devices; the Triton backward alone runs
interpreted on CPU, where its tests call it directly).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from ringflash.kernels import base
from ringflash.kernels.tiles import GpuBlockSizes
from ringflash.kernels import pallas_gpu_common as common

NAME = "pallas_gpu"
# Local lengths a padded sequence is rounded to (a CUDA block covers 128 query rows).
LENGTH_MULTIPLE = 128

# Head dims (H and Hv) the backend takes: multiples of HEAD_DIM_STEP up to MAX_HEAD_DIM.
HEAD_DIM_STEP = 8
MAX_HEAD_DIM = 256
# Head dims the Mosaic GPU kernels take natively: whole 64-column swizzle tiles.
MOSAIC_DIM_STEP = 64
# Rows per backward tile (query and key) of the backward kernels: the Mosaic backwards keep
# dK and dV of 64 key rows in compute warpgroups' registers; the Triton backward uses the
# same tiles.
BWD_BLOCK = 64
# Padded head dims (H and Hv each) of the fused Mosaic backward; the wide one serves the
# others.
MOSAIC_BWD_HEAD_DIMS = (64, 128)


def mosaic_dim(d: int) -> int:
  """The head dim the Mosaic GPU kernels run for a true head dim d: the next multiple of
  64 (80 -> 128, 192 -> 192)."""
  return -(-d // MOSAIC_DIM_STEP) * MOSAIC_DIM_STEP


def triton_dims(d: int) -> tuple[int, ...]:
  """The column pieces the Triton backward takes a head dim d as (its blocks are powers of
  two): one power of two, or two (the larger first, each at least 16), whichever pads d the
  least, one piece on a tie; d is zero-padded to their sum. 192 -> (128, 64) (MLA: nothing
  padded, where one piece of 256 would add a third to the products over H); 160 -> (128,
  32); 72 -> (64, 16); 256 -> (256,); 224 -> (256,)."""
  options = [(1 << i,) for i in range(4, 9)]
  options += [(1 << i, 1 << j) for i in range(4, 9) for j in range(4, i)]
  return min((o for o in options if sum(o) >= d), key=lambda o: (sum(o), len(o)))


def backward_kernel(head_dim: int, value_dim: int, kv_len: int, interpret: bool) -> str:
  """Which backward runs a block pair: "mosaic" (kernels/pallas_gpu_mosaic_bwd.py, padded
  dims both 64 or 128), "wide" (kernels/pallas_gpu_mosaic_bwd_wide.py, the other dims, where
  its padding to multiples of 64 adds no more columns than the Triton backward's pieces)
  or "triton" (kernels/pallas_gpu_triton_bwd.py: the rest, key lengths that are not a
  multiple of 2 * BWD_BLOCK, and interpret mode). `backward` pads the keys to such a multiple
  where that lets a Mosaic kernel run (_backward_key_rows).

  On the H200 (T = 16k, N = K = 16, the backward alone, docs/GPU_NOTES.md run 105) the wide
  kernel took 0.40x the Triton one's time at 256 / 256 and 0.70x at 192 / 128 (the same
  columns), but 1.21x at 160 / 72, which it pads to 192 / 128 where Triton's pieces pad to
  160 / 80: hence the rule on columns."""
  if interpret or kv_len % (2 * BWD_BLOCK):
    return "triton"
  hp, hvp = mosaic_dim(head_dim), mosaic_dim(value_dim)
  if hp in MOSAIC_BWD_HEAD_DIMS and hvp in MOSAIC_BWD_HEAD_DIMS:
    return "mosaic"
  if hp + hvp <= sum(triton_dims(head_dim)) + sum(triton_dims(value_dim)):
    return "wide"
  return "triton"


def triton_config(hp: int, hvp: int) -> tuple[tuple[int, int], tuple[int, int]]:
  """(num_warps, num_stages) of the Triton backward's two kernels (dq; dk and dv) at padded
  head dims hp, hvp (the sums of triton_dims), as measured on the H200 (docs/GPU_NOTES.md,
  T = 16k, N = K = 16):
  - 192 / 128 (MLA, pieces 128 + 64 / 128): 4 warps, 3 stages (runs 84-85: 0.99x causal
    and 1.12x not of the former one piece of 256 at its best setting; 2 stages 0.81 / 0.84,
    8 warps for dk and dv 0.96 / 1.06);
  - 256 / 128 (224 / 128 ...): dq 4 warps, dk and dv 8, both 3 stages (run 76: 1.27x
    causal and 1.29x not over 4 warps and 2 stages);
  - 256 / 256: 8 warps, 2 stages (3 stages exceed shared memory; 1 stage was slower, and
    4 warps: 39.7 ms against 32.4 causal, an earlier session);
  - elsewhere 4 warps, 2 stages (at 160 / 72, pieces 128 + 32 / 64 + 16, run 85: 1.6x the
    former 256 / 128 at its best setting; 3 stages 1.2-1.3x)."""
  if (hp, hvp) == (192, 128):
    return (4, 4), (3, 3)
  if (hp, hvp) == (256, 128):
    return (4, 8), (3, 3)
  if hp + hvp > 384:
    return (8, 8), (2, 2)
  return (4, 4), (2, 2)


def triton_keys_major(hp: int, hvp: int) -> bool:
  """Whether the Triton backward's dk, dv kernel computes its tiles keys first (k q^T)
  rather than transposing them (pallas_gpu_triton_bwd.backward's keys_major), at padded head
  dims hp, hvp. Measured on the H200 (docs/GPU_NOTES.md, runs 102-103; T = 16k, N = K = 16,
  the backward alone, keys first over transposed): 1.11-1.16x at 192 / 128 (causal, not,
  soft-capped), 1.05x at 256 / 128, 1.08-1.11x at 160 / 80, 1.01-1.04x at 128 / 128 and
  1.05x at 64 / 64; 0.94-0.97x at 256 / 256 (8 warps), which keeps the transposes."""
  return hp + hvp <= 384


def _major(compute_capability) -> int:
  try:
    return int(str(compute_capability).split(".")[0])
  except ValueError:
    return 0


def unsupported(problem: base.Problem) -> str | None:
  """Why this backend cannot compute `problem` on its devices (None: it can)."""
  if problem.platform not in ("gpu", "cuda"):
    return (f"backend {NAME!r} runs on GPUs of compute capability >= 9.0 only, not on "
            f"{problem.platform!r} devices (its Mosaic GPU kernels do not run in JAX's interpreter)")
  if _major(problem.compute_capability) < 9:
    return (f"backend {NAME!r} needs a GPU of compute capability >= 9.0 (Hopper), got "
            f"{problem.compute_capability}")
  for name, d in (("head_dim", problem.head_dim), ("head_dim_v", problem.value_dim)):
    if d % HEAD_DIM_STEP or not 0 < d <= MAX_HEAD_DIM:
      return (f"backend {NAME!r} supports {name} a multiple of {HEAD_DIM_STEP} up to "
              f"{MAX_HEAD_DIM}, got {d}")
  if jnp.dtype(problem.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return (f"backend {NAME!r} supports bfloat16 and float16 inputs, got "
            f"{jnp.dtype(problem.dtype)}")
  return None


def resolve_tiles(given: GpuBlockSizes | None, problem: base.Problem) -> GpuBlockSizes:
  """Every tile size resolved for `problem` (same signature in every backend).

  The forward's shared memory holds Q of 2 * block_q rows and `stages` slots of K and V
  tiles of block_k rows, at the padded head dims Hp and Hvp (mosaic_dim). The default
  block_k is 128 where the [64, Hvp] fp32 accumulator and the [64, 128] scores fit the
  registers beside each other (Hvp <= 128) and Hp <= 192 (at H = 192, Hv = 128:
  Q 48 KiB + K 96 KiB + V 64 KiB = 208 KiB of 227), else 64. Lengths the tiles do not divide
  are padded per call (base.fit_rows), also where 128 pads 64 keys more than 64 would: on the
  H100 (N = K = 16, H = 128, docs/GPU_NOTES.md run 176) block_k = 128 took the forward
  1.05-1.22x as fast as 64 at T = S = 4000 and 16320 (run 175, at lengths 1024-16384: 1.00-
  1.23x from 2048 on, 0.96-1.02x at 1024).

  Raises:
    ValueError: naming block_sizes, when the tiles do not fit Hopper's shared memory.
  """
  given = GpuBlockSizes() if given is None else given
  h, hv = mosaic_dim(problem.head_dim), mosaic_dim(problem.value_dim)
  bq = 64 if given.block_q is None else given.block_q
  if given.block_k is not None:
    bk = given.block_k
  else:
    bk = 128 if hv <= 128 and h <= 192 else 64       # where the registers allow it
  stages = 2 if given.stages is None else given.stages
  itemsize = jnp.dtype(problem.dtype).itemsize
  smem = common.forward_smem_bytes(h, hv, bq, bk, stages, itemsize)
  if smem > common.SMEM_BYTES:
    raise ValueError(f"block_sizes=({bq}, {bk}, stages={stages}) at head_dim={h}, "
                     f"head_dim_v={hv} (padded) needs {smem} bytes of shared memory per "
                     f"CUDA block (Q of 2 * block_q rows, {stages} stages of K and V of "
                     f"block_k rows); Hopper has {common.SMEM_BYTES} (backend {NAME!r})")
  return GpuBlockSizes(block_q=bq, block_k=bk, stages=stages)


# CUDA bounds a grid's y and z extents at 65535 blocks. Mosaic GPU launches a grid
# (heads, tiles, batch) reversed, so the row tiles of a call are its y extent (Pallas' Triton
# lowering folds a grid past the bound into x; the Triton backward has no such limit).
MAX_GRID_TILES = 2**16 - 1


def _check_grid(rows: int, per_block: int, what: str, padded_to: int | None = None) -> None:
  """Raises NotImplementedError where a Mosaic kernel's grid of rows / per_block blocks
  exceeds CUDA's bound (at trace time, before anything runs). rows are already padded to a
  multiple of padded_to (default per_block), which the largest length it names is too."""
  blocks = rows // per_block
  if blocks > MAX_GRID_TILES:
    step = padded_to or per_block
    most = MAX_GRID_TILES * per_block // step * step
    raise NotImplementedError(
        f"backend {NAME!r} runs a kernel call of {rows} {what} rows as {blocks} CUDA blocks "
        f"of {per_block} rows along one grid axis, which CUDA bounds at {MAX_GRID_TILES}: at "
        f"most {most} {what} rows a call; spread the sequence over more devices")


def _pad_last(x, size: int):
  """x zero-padded along its last axis to `size` (x itself when it has that size)."""
  if x.shape[-1] == size:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec):
  """Block-pair forward; see kernels/base.py for the contract.

  Head dims that are not multiples of 64 are zero-padded (q, k to mosaic_dim(H); v to
  mosaic_dim(Hv)) and the padded output columns cut off: a static branch, nothing happens
  at H, Hv in (64, 128, 192, 256). So are local lengths that the tiles (2 * block_q query
  rows a CUDA block, block_k key rows) do not divide (base.fit_rows), with the padded rows' ids
  seeing nothing.

  Returns o float32 [B, T, N, Hv] and lse float32 [B, N, T].
  """
  from ringflash.kernels import pallas_gpu_mosaic_fwd  # pylint: disable=g-import-not-at-top
  tiles = spec.tiles
  t, hv = q.shape[1], v.shape[-1]
  refs = (q, k, v, q_pos, k_pos, q_seg, k_seg)
  (q, k, v, q_pos, k_pos, q_seg, k_seg), _ = base.fit_rows(
      2 * tiles.block_q, tiles.block_k, q, k, v, q_pos, k_pos, q_seg, k_seg)
  _check_grid(q.shape[1], 2 * tiles.block_q, "query")
  hp = mosaic_dim(q.shape[-1])
  q_in, k_in, v_in = _pad_last(q, hp), _pad_last(k, hp), _pad_last(v, mosaic_dim(hv))
  work, full = common.tile_flags(q_pos, k_pos, q_seg, k_seg, spec, tiles.block_q,
                                 tiles.block_k)
  plan = common.tile_plan(work, full)
  with base.no_vma_check():
    o, lse = pallas_gpu_mosaic_fwd.forward(
        q_in, k_in, v_in, q_pos, k_pos, q_seg, k_seg, plan, scale=spec.scale,
        causal=spec.causal, window=spec.window, softcap=spec.softcap,
        has_seg=q_seg is not None, block_q=tiles.block_q, block_k=tiles.block_k,
        stages=tiles.stages)
  o = o.transpose(0, 2, 1, 3)
  if o.shape[-1] != hv:
    o = o[..., :hv]
  if o.shape[1] != t:
    o, lse = o[:, :t], lse[..., :t]
  return base.match_vma(o, *refs), base.match_vma(lse, *refs)


def _backward_key_rows(h: int, hv: int, s: int, interpret: bool) -> int:
  """The multiple the backward pads its keys to: 2 * BWD_BLOCK where a Mosaic backward
  (backward_kernel) runs at that length, else BWD_BLOCK (the Triton backward's tile). On the
  H100 (N = K = 16, S = 4000 and 16320, docs/GPU_NOTES.md run 176) the Mosaic backward on
  keys padded to 128 took the backward 1.24-1.38x as fast as the Triton one on keys padded
  to 64, at 128 / 128 and 192 / 128 (1.00x at S = 4000 causal)."""
  if backward_kernel(h, hv, base.round_up(s, 2 * BWD_BLOCK), interpret) != "triton":
    return 2 * BWD_BLOCK
  return BWD_BLOCK


def backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
             dlse=None):
  """Block-pair backward from the global out and lse; see kernels/base.py for the contract.

  One of three kernels (backward_kernel): the fused Mosaic backward (H and Hv padded to 64
  or 128), the wide one (most other head dims), both on a GPU, else the Triton backward
  (interpreted on CPU). Keys are padded to a multiple of 2 * BWD_BLOCK for the Mosaic ones
  (_backward_key_rows), queries to BWD_BLOCK. Each pads q, k to its head dim (mosaic_dim of
  H, or the sum of its triton_dims pieces) and v, out, dout to that of Hv, in static
  branches, and dq, dk, dv are cut back to H, H, Hv.
  """
  h, hv = q.shape[-1], v.shape[-1]
  t, s = q.shape[1], k.shape[1]
  gamma = delta = None
  if q.dtype == jnp.float16:                    # a static branch: bfloat16 is untouched
    gamma, v, delta = _float16_ds_range(v, out, dout, dlse, spec.scale)
  # rows up to whole tiles (a static branch), the padded rows' gradients cut off after
  (q, k, v, q_pos, k_pos, q_seg, k_seg), pt = base.fit_rows(
      BWD_BLOCK, _backward_key_rows(h, hv, s, spec.interpret), q, k, v, q_pos, k_pos, q_seg,
      k_seg)
  out, dout = base.pad_rows(out, pt), base.pad_rows(dout, pt)
  lse, dlse, delta = (base.pad_rows(x, pt, axis=2) for x in (lse, dlse, delta))
  kernel = backward_kernel(h, hv, k.shape[1], spec.interpret)
  if kernel != "triton":          # keys padded to 2 * BWD_BLOCK (_backward_key_rows)
    _check_grid(k.shape[1], 2 * BWD_BLOCK if kernel == "mosaic" else BWD_BLOCK, "key",
                padded_to=2 * BWD_BLOCK)
  if kernel == "mosaic":
    from ringflash.kernels import pallas_gpu_mosaic_bwd  # pylint: disable=g-import-not-at-top
    hp, hvp = mosaic_dim(h), mosaic_dim(hv)
    run = functools.partial(pallas_gpu_mosaic_bwd.backward, dlse=dlse, delta=delta)
  elif kernel == "wide":
    from ringflash.kernels import pallas_gpu_mosaic_bwd_wide  # pylint: disable=g-import-not-at-top
    hp, hvp = mosaic_dim(h), mosaic_dim(hv)
    run = functools.partial(pallas_gpu_mosaic_bwd_wide.backward, dlse=dlse, delta=delta)
  else:
    from ringflash.kernels import pallas_gpu_triton_bwd  # pylint: disable=g-import-not-at-top
    pieces = triton_dims(h), triton_dims(hv)
    hp, hvp = sum(pieces[0]), sum(pieces[1])
    warps, stages = triton_config(hp, hvp)
    run = functools.partial(pallas_gpu_triton_bwd.backward, dlse=dlse, block=BWD_BLOCK,
                            num_warps=warps, num_stages=stages, pieces=pieces,
                            keys_major=triton_keys_major(hp, hvp), delta=delta)
  dq, dk, dv = run(_pad_last(q, hp), _pad_last(k, hp), _pad_last(v, hvp), _pad_last(out, hvp),
                   lse, _pad_last(dout, hvp), q_pos, k_pos, q_seg, k_seg, spec)
  if hp != h:
    dq, dk = dq[..., :h], dk[..., :h]
  if hvp != hv:
    dv = dv[..., :hv]
  if dq.shape[1] != t or dk.shape[1] != s:
    dq, dk, dv = dq[:, :t], dk[:, :s], dv[:, :s]
  if gamma is not None:                 # dq and dk came out times gamma; dv does not see it
    kh = k.shape[2]
    dq = dq / jnp.repeat(gamma, q.shape[2] // kh, axis=1)[:, None, :, None]
    dk = dk / gamma[:, None, :, None]
  return dq, dk, dv


# The largest |ds| a float16 backward lets through before its products, where float16's
# largest finite value is 65504 (a bound, so half of that).
FLOAT16_DS_LIMIT = 2.0 ** 15


def _float16_ds_range(v, out, dout, dlse, scale: float):
  """Keeps ds = p (dp - D) inside float16 for the kernels' float16 products ds k and ds^T q.

  The kernels multiply ds in the inputs' dtype on the tensor cores (one dtype for both
  operands), and with a loss scale or large values ds passes 65504 while every gradient is
  small. Per batch row and kv head, gamma = 2^-e (e >= 0) brings a bound on |ds| below
  FLOAT16_DS_LIMIT; the kernels then see v gamma (so dp = dout v^T comes out times gamma) and
  D = rowsum(dout out) - dlse times gamma (computed here once, in float32), so that ds and
  with it dq and dk come out times gamma, which the caller divides out in float32. dv = p^T
  dout does not read v. gamma is a power of two: nothing is rounded except values of v gamma
  that fall below float16's normal range, whose error (2^-25 each, in the scaled units) is
  far below float16's rounding of ds at the bound. Where the bound is below the limit,
  gamma = 1 and the kernels see v unchanged.

  The bound: |ds_ij| <= max(1, scale) (|dout_i| |v_j| + |D_i|) (Cauchy-Schwarz; p <= 1, a
  soft-cap's derivative <= 1; the Triton backward scales after its cast, the Mosaic ones
  before). Non-finite norms and D are left out: a row or key that holds one is non-finite in
  its gradients anyway (the non-finite rule), and the others keep their own range.

  Returns gamma float32 [B, K], v gamma (float16) and D gamma (float32 [B, N, T])."""
  b, t, n, _ = dout.shape
  kh = v.shape[2]
  grp = n // kh

  def finite_max(x, axes):
    return jnp.max(jnp.where(jnp.isfinite(x), x, 0.0), axis=axes)

  d_norm = jnp.linalg.norm(dout.astype(jnp.float32), axis=-1)              # [B, T, N]
  d_norm = finite_max(d_norm.reshape(b, t, kh, grp), (1, 3))               # [B, K]
  v_norm = finite_max(jnp.linalg.norm(v.astype(jnp.float32), axis=-1), 1)  # [B, K]
  delta = base.softmax_delta(out, dout, dlse)                               # [B, N, T]
  d_max = finite_max(jnp.abs(delta).reshape(b, kh, grp, t), (2, 3))        # [B, K]
  bound = max(1.0, scale) * (d_norm * v_norm + d_max)
  e = jnp.ceil(jnp.log2(jnp.maximum(bound, 1.0) / FLOAT16_DS_LIMIT))
  e = jnp.where(jnp.isfinite(e), jnp.clip(e, 0.0, 126.0), 0.0).astype(jnp.int32)
  # 2^-e built from its exponent bits: exact (a GPU's exp2 is an approximation)
  gamma = lax.bitcast_convert_type((127 - e) << 23, jnp.float32)           # [B, K]
  v = (v.astype(jnp.float32) * gamma[:, None, :, None]).astype(v.dtype)
  return gamma, v, delta * jnp.repeat(gamma, grp, axis=1)[:, :, None]


# JAX cannot differentiate a pallas_call: grad of grad says so, naming the backend.
forward = base.first_order_only(NAME, forward)
backward = base.first_order_only(NAME, backward)
