"""The Hopper backend: Pallas Mosaic GPU kernels behind the kernel contract (kernels/base.py).

Three kernels, one module each, sharing kernels/pallas_gpu_common.py (tile plan, launch):
  kernels/pallas_gpu_mosaic_fwd.py   the forward (wgmma, TMA, warp specialization);
  kernels/pallas_gpu_mosaic_bwd.py   the backward, one fused kernel, head dims 64 and 128;
  kernels/pallas_gpu_triton_bwd.py   a Pallas Triton backward for head dim 256 and key
                                     lengths that are not a multiple of 128.
This module says what the backend runs (`unsupported`), resolves its tiles and dispatches.

The Mosaic GPU kernels have no CPU interpreter, so the backend runs on Hopper GPUs only
(`unsupported` says so on other devices; the Triton backward alone runs interpreted on CPU,
where its tests call it directly).
"""

from __future__ import annotations

import jax.numpy as jnp

from ringflash.kernels import base
from ringflash.kernels.tiles import GpuBlockSizes
from ringflash.kernels import pallas_gpu_common as common

NAME = "pallas_gpu"
# Local lengths a padded sequence is rounded to (a CUDA block covers 128 query rows).
LENGTH_MULTIPLE = 128

HEAD_DIMS = (64, 128, 256)
# Rows per backward tile (query and key) of both backward kernels: the fused Mosaic backward
# keeps dK and dV of 64 key rows in each compute warpgroup's registers; the Triton backward
# uses the same tiles.
BWD_BLOCK = 64
# Head dims of the fused Mosaic backward; the Triton backward serves the others.
MOSAIC_BWD_HEAD_DIMS = (64, 128)


def _major(compute_capability) -> int:
  try:
    return int(str(compute_capability).split(".")[0])
  except ValueError:
    return 0


def unsupported(problem: base.Problem) -> str | None:
  """Why this backend cannot compute `problem` on its devices (None: it can)."""
  if problem.platform not in ("gpu", "cuda"):
    return (f"backend {NAME!r} runs on GPUs of compute capability >= 9.0 only, not on "
            f"{problem.platform!r} devices (its Mosaic GPU kernels have no interpreter)")
  if _major(problem.compute_capability) < 9:
    return (f"backend {NAME!r} needs a GPU of compute capability >= 9.0 (Hopper), got "
            f"{problem.compute_capability}")
  if problem.softcap is not None:
    return f"backend {NAME!r} does not soft-cap logits (logits_soft_cap)"
  if problem.value_dim != problem.head_dim:
    return (f"backend {NAME!r} needs the value head dim to equal the query's, got "
            f"{problem.value_dim} and {problem.head_dim}")
  if problem.head_dim not in HEAD_DIMS:
    return f"backend {NAME!r} supports head_dim in {HEAD_DIMS}, got {problem.head_dim}"
  if jnp.dtype(problem.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return (f"backend {NAME!r} supports bfloat16 and float16 inputs, got "
            f"{jnp.dtype(problem.dtype)}")
  if problem.q_len % (2 * 64) or problem.kv_len % 64:
    return (f"backend {NAME!r} needs local query lengths that are multiples of 128 and key "
            f"lengths that are multiples of 64, got {problem.q_len} and {problem.kv_len}")
  return None


def resolve_tiles(given: GpuBlockSizes | None, problem: base.Problem) -> GpuBlockSizes:
  """Every tile size resolved for `problem` (same signature in every backend).

  Raises:
    ValueError: naming block_sizes, when a size does not tile the local lengths or the
      tiles do not fit Hopper's shared memory.
  """
  given = GpuBlockSizes() if given is None else given
  h = problem.head_dim
  # Shared memory per block: 2 * bq * H (Q) + 2 * stages * bk * H (K, V) elements of 2 bytes;
  # bk = 128 with 2 stages at H = 128 is 160 KiB of the 227 KiB.
  bq = 64 if given.block_q is None else given.block_q
  bk = (128 if h <= 128 else 64) if given.block_k is None else given.block_k
  if given.block_k is None and problem.kv_len % bk:
    bk = 64
  stages = 2 if given.stages is None else given.stages
  itemsize = jnp.dtype(problem.dtype).itemsize
  smem = (2 * bq * h + 2 * stages * bk * h) * itemsize + 2 * bq * 4
  if smem > common.SMEM_BYTES:
    raise ValueError(f"block_sizes=({bq}, {bk}, stages={stages}) at head_dim={h} needs "
                     f"{smem} bytes of shared memory per CUDA block (Q of 2 * block_q rows, "
                     f"{stages} stages of K and V of block_k rows); Hopper has "
                     f"{common.SMEM_BYTES} (backend {NAME!r})")
  if problem.q_len % (2 * bq):
    raise ValueError(f"block_sizes.block_q={bq}: the local query length {problem.q_len} "
                     f"must be a multiple of 2 * block_q = {2 * bq} (backend {NAME!r})")
  if problem.kv_len % bk:
    raise ValueError(f"block_sizes.block_k={bk}: the local key length {problem.kv_len} must "
                     f"be a multiple of block_k (backend {NAME!r})")
  return GpuBlockSizes(block_q=bq, block_k=bk, stages=stages)


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec):
  """Block-pair forward; see kernels/base.py for the contract.

  Returns o float32 [B, T, N, H] and lse float32 [B, N, T].
  """
  from ringflash.kernels import pallas_gpu_mosaic_fwd  # pylint: disable=g-import-not-at-top
  tiles = spec.tiles
  work, full = common.tile_flags(q_pos, k_pos, q_seg, k_seg, spec, tiles.block_q,
                                 tiles.block_k)
  plan = common.tile_plan(work, full)
  with base.no_vma_check():
    o, lse = pallas_gpu_mosaic_fwd.forward(
        q, k, v, q_pos, k_pos, q_seg, k_seg, plan, scale=spec.scale, causal=spec.causal,
        window=spec.window, has_seg=q_seg is not None, block_q=tiles.block_q,
        block_k=tiles.block_k, stages=tiles.stages)
  refs = (q, k, v, q_pos, k_pos, q_seg, k_seg)
  return base.match_vma(o.transpose(0, 2, 1, 3), *refs), base.match_vma(lse, *refs)


def backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
             dlse=None):
  """Block-pair backward from the global out and lse; see kernels/base.py for the contract.

  The fused Mosaic backward where it applies (a GPU, head dim 64 or 128, key length a
  multiple of 2 * BWD_BLOCK), else the Triton backward (interpreted on CPU).
  """
  if (not spec.interpret and q.shape[-1] in MOSAIC_BWD_HEAD_DIMS
      and k.shape[1] % (2 * BWD_BLOCK) == 0):
    from ringflash.kernels import pallas_gpu_mosaic_bwd  # pylint: disable=g-import-not-at-top
    return pallas_gpu_mosaic_bwd.backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg,
                                          spec, dlse=dlse)
  from ringflash.kernels import pallas_gpu_triton_bwd  # pylint: disable=g-import-not-at-top
  return pallas_gpu_triton_bwd.backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg,
                                        spec, dlse=dlse, block=BWD_BLOCK)
