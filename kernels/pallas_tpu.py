"""The TPU backend: Pallas Mosaic kernels behind the kernel contract (see kernels/base.py).

Three kernels over one (query block, key/value block) pair, grid (B, K // hk, rows, steps):
  forward   rows: query tiles, steps: key tiles; online softmax, o and lse;
  dkv       rows: key tiles, steps: query tiles; dk, dv of one key tile;
  dq        rows: query tiles, steps: key tiles; dq of one query tile.
The last grid axis is the reduction ("arbitrary"); its fp32 accumulators live in VMEM scratch.

Layout: the contract's arrays as they are, no reshape (on TPU [B, T, N, H] -> [B, T, N * H] is
a copy: tiles of [T, N, H] cover (N, H), those of [T, N * H] cover (T, N * H)). Blocks are
[bq, hk * G, H] of q, dout, o, dq and [bk, hk, H] of k, v, dk, dv: hk kv heads with their
G = N // K query heads (kv heads hh * hk ... hh * hk + hk - 1, query heads hh * hk * G ...).
A block's last two dims must be multiples of (8, 128) or whole: H is whole, so any H and Hv
work (80, 96, 192 / 128: Mosaic pads its registers' lanes; nothing is zero-padded here), and
hk is the fewest multiple of 8 dividing K, else K (K = 8, G = 4: hk = 8, q blocks
[bq, 32, H]). Head n of a block is ref[:, n, :]; the G query heads of a kv head are stacked
along rows into one [G * bq, H] operand, so a key tile meets one [G * bq, bk] matmul per kv
head and K/V are never repeated. Row statistics (lse, D = rowsum(dout * out) - dlse) travel
as [B, T // bq, N, bq], lane-dense (a [.., T, N] array would pad N to 128 lanes); the dQ
kernel transposes its [hk * G, bq] tile, the dK/dV kernel computes transposed scores
k q^T [bk, G * bq], in which per-query statistics are rows. (XLA may keep arrays of a head
dim like 80 in a layout of its own and copy them into this one; checked to compile on v4,
v5e, v5p, v6e at H = 80, 96, 192, (H, Hv) = (192, 128), (64, 128), (128, 64).)

Tiles: block_q a multiple of 16 rows (8 for 4-byte inputs), block_k of 128 where one divides
the key length and VMEM allows, else of the same 16 or 8 (positions are stored per tile,
[T // bq, 1, bq], so any tile is a legal block). On real TPUs local lengths must be multiples of 8 (`unsupported`): a tile of
125 rows stacked G times cuts vector registers ("Invalid vector register cast").

Masks: base.pair_mask on the tile's positions and segment ids, built from int32 ids stacked
before the comparison (bool vectors concatenated at unaligned offsets do not lower).

Tile skipping, metadata linear in the lengths. Per tile, the range [min, max] of its
positions (and, per batch row, of its segment ids) is scalar-prefetched into SMEM (`bounds`:
2 (T / bq + S / bk) int32, times 1 + B with segment ids); each grid step evaluates on them
the test of base.block_may_have_work (base.ranges_may_have_work and the overlap of the
segment-id ranges) and skips its work when it fails: exactly the tiles the per-tile flags of
earlier versions skipped. DMA: per row, the first and last step with work (`span`) are
prefetched too; at step j the reduced operand holds block clamp(j, first, last): the first
working block early, the last one kept after it (no DMA), block 0 in a row without work.
Where a row's working tiles are contiguous (causal, windows, sorted segment ids, padding
ids) this is the old "last working block" fetch; blocks in a gap between working tiles
(interleaved documents) are fetched but not computed. The flags grew as (T / bq) x (S / bk)
and overflowed SMEM at ~160k tokens per device; `bounds` and `span` hold a few KiB at 1M.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ringflash.kernels import base
from ringflash.kernels.tiles import TpuBlockSizes

NAME = "pallas_tpu"
# Local lengths a padded sequence is rounded to (a bf16 sublane tile of rows).
LENGTH_MULTIPLE = 16
# Local lengths the kernels tile on a real TPU (interpret mode takes any).
_TPU_LENGTH = 8
_LANES = 128

# device_kind -> (block_q, block_k, VMEM per core in bytes), as the TPU compiler reports
# them: v4 16 MiB, v5e ("TPU v5 lite") 128 MiB, v5p ("TPU v5") 64 MiB, v6e ("TPU v6 lite")
# 128 MiB. Default tiles keep _vmem_estimate within _BUDGET of it: Mosaic's own scratch comes
# on top (measured: 43.4 MiB for an estimate of 36.8, v5p, GQA 32/8, bq 256, bk 512).
_DEFAULTS = {
    "TPU v4": (512, 512, 16 * 2**20),
    "TPU v5 lite": (512, 512, 128 * 2**20),
    "TPU v5e": (512, 512, 128 * 2**20),
    "TPU v5": (512, 512, 64 * 2**20),
    "TPU v5p": (512, 512, 64 * 2**20),
    "TPU v6 lite": (512, 1024, 128 * 2**20),
    "TPU v6e": (512, 1024, 128 * 2**20),
}
_FALLBACK = (512, 512, 16 * 2**20)    # unknown TPU
_INTERPRET = (512, 512, 2**40)         # CPU interpret mode: no VMEM to fit
_BUDGET = 0.6
_VMEM_LIMIT = 100 * 2**20
# Scores a grid step computes (hk * G * bq * bk) at most: Mosaic unrolls every vector op of
# the hk kv heads of a block into vector-register ops, so its compile time grows with this
# (2^22: a GQA 32/8 training step compiles in about a minute on one core).
_SCORES_PER_STEP = 2**22


def _generation(device_kind: str):
  """(block_q, block_k, VMEM bytes) of a TPU generation (interpret mode: unbounded)."""
  if not device_kind.startswith("TPU"):
    return _INTERPRET
  return _DEFAULTS.get(device_kind, _FALLBACK)


def _rup(x: int, m: int) -> int:
  return -(-x // m) * m


def _heads_per_block(num_kv: int) -> int:
  """hk: the fewest kv heads, a multiple of 8 dividing K, else all K.

  Blocks [bk, hk, H] of k and [bq, hk * G, H] of q then have legal second-minor dims
  (multiples of 8, or whole) for every H. K = 8 or 16 or 32: 8; K = 2, 4, 12: K.
  """
  for hk in range(8, num_kv + 1, 8):
    if num_kv % hk == 0:
      return hk
  return num_kv


def _vmem_estimate(bq: int, bk: int, g: int, hk: int, h: int, itemsize: int,
                   hv: int | None = None) -> int:
  """Bytes of VMEM the largest of the three kernels needs: double-buffered blocks (heads
  padded to the 8-row tiles of VMEM, 1, 2 or 4 heads kept as they are, lanes to 128),
  scratch and the fp32 temporaries of one kv head (Mosaic's own scratch comes on top)."""
  hv = h if hv is None else hv
  hq = hk * g

  def blk(rows, heads, width, isz=itemsize):
    return rows * (heads if heads <= 4 else _rup(heads, 8)) * _rup(width, _LANES) * isz

  q_in = blk(bq, hq, h) + blk(bq, hq, hv)                       # q and dout
  kv_in = blk(bk, hk, h) + blk(bk, hk, hv)
  stats = 2 * _rup(hq, 8) * _rup(bq, _LANES) * 4                # lse and D tiles
  pos = 4 * 8 * (_rup(bq, _LANES) + _rup(bk, _LANES)) * 4
  temps = 4 * g * bq * _rup(bk, _LANES) * 4 + 2 * g * bq * _rup(max(h, hv), _LANES) * itemsize
  fwd = (2 * (blk(bq, hq, h) + kv_in + blk(bq, hq, hv, 4) + stats // 2)
         + hk * g * bq * _rup(hv, _LANES) * 4 + 2 * g * bq * _rup(hk, _LANES) * 4)
  dq = 2 * (q_in + kv_in + blk(bq, hq, h, 4) + stats) + hk * g * bq * _rup(h, _LANES) * 4
  dkv = (2 * (q_in + kv_in + blk(bk, hk, h, 4) + blk(bk, hk, hv, 4) + stats)
         + hk * bk * (_rup(h, _LANES) + _rup(hv, _LANES)) * 4)
  return max(fwd, dq, dkv) + temps + pos


def unsupported(problem: base.Problem) -> str | None:
  """Why this backend cannot compute `problem` on its devices (None: it can)."""
  if problem.platform not in ("tpu", "cpu"):
    return (f"backend {NAME!r} runs on TPU devices (and, interpreted, on CPU devices), not "
            f"on {problem.platform!r} devices")
  if not problem.interpret:
    if jnp.dtype(problem.dtype) == jnp.float16:
      # Mosaic has no float16 vector loads on any TPU generation (v4, v5e, v5p, v6e:
      # "Invalid vector type for load"); "auto" takes xla.
      return (f"backend {NAME!r} runs float32 and bfloat16 on TPU, not float16 (Mosaic "
              f"loads no float16 vectors): give bfloat16, or backend 'xla'")
    for what, length in (("query", problem.q_len), ("key", problem.kv_len)):
      if length % _TPU_LENGTH:
        return (f"backend {NAME!r} tiles local {what} lengths that are multiples of "
                f"{_TPU_LENGTH} on TPU, got {length} (pad the sequence, or use the "
                f"contiguous layout, which pads it)")
    bq, bk, need = _default_tiles(problem, None)
    vmem = _generation(problem.device_kind)[2]
    if need > vmem:
      return (f"backend {NAME!r}: blocks of {_heads_per_block(problem.kv_heads)} kv heads "
              f"(the fewest, a multiple of 8 dividing K={problem.kv_heads}, else all K) of "
              f"{problem.group} query heads need about {need / 2**20:.1f} MiB of VMEM even at "
              f"{bq} x {bk} tiles, of the {vmem / 2**20:.0f} MiB this TPU has: use backend "
              f"'xla'")
  return None


def _tile_multiple(length: int, sub: int) -> int:
  """The multiple every tile of a local length is made of, query or key: the sublanes (16
  for 2-byte dtypes, else 8) where they divide it, else 8, else 1 (a length that is not a
  multiple of 8 runs only interpreted: `unsupported`). Key positions are stored per tile
  ([S // bk, 1, bk]), so any such key tile is a legal block; 128 is preferred, not needed."""
  return next(m for m in (sub, 8, 1) if length % m == 0)


def _divisor(length: int, cap: int, *multiples: int) -> int:
  """The largest divisor of length not above cap that is a multiple of the first of
  `multiples` that has one; length itself where none has."""
  for multiple in multiples:
    d = base.largest_divisor_at_most(length, cap, multiple)
    if d is not None:
      return d
  return length


def _default_tiles(problem: base.Problem, block_k: int | None) -> tuple[int, int, int]:
  """(block_q, block_k, estimated VMEM bytes): the largest valid divisors not above the
  generation's sizes, lowered until the estimate fits _BUDGET of its VMEM and a grid step
  computes at most _SCORES_PER_STEP scores: block_q is halved down to 128, then block_k
  down to 128, then block_q down to the sublanes, then block_k below 128 (the dK/dV kernel
  of blocks of many kv heads: K = 25 has no multiple of 8 dividing it, so a block holds all
  25). block_k: the user's, kept. The last estimate may still exceed the budget: the
  smallest tiles, whose estimate `unsupported` compares with the whole VMEM."""
  itemsize = jnp.dtype(problem.dtype).itemsize
  sub = 16 if itemsize == 2 else 8
  cap_q, cap_k, vmem = _generation(problem.device_kind if not problem.interpret else "")
  budget = _BUDGET * vmem
  q_len, kv_len = problem.q_len, problem.kv_len
  hk = _heads_per_block(problem.kv_heads)
  k_multiple = _tile_multiple(kv_len, sub)

  bk = block_k if block_k is not None else _divisor(kv_len, cap_k, _LANES, sub, 8)
  while True:
    bq = _divisor(q_len, cap_q, sub, 8)
    need = _vmem_estimate(bq, bk, problem.group, hk, problem.head_dim, itemsize,
                          problem.value_dim)
    if need <= budget and hk * problem.group * bq * bk <= _SCORES_PER_STEP:
      return bq, bk, need
    if cap_q > 128:
      cap_q //= 2
    elif block_k is None and cap_k > _LANES:
      cap_k //= 2
      bk = _divisor(kv_len, cap_k, _LANES, sub, 8)
    elif cap_q > sub:
      cap_q //= 2
    elif block_k is None and bk > k_multiple:     # k_multiple itself divides kv_len
      bk = base.largest_divisor_at_most(kv_len, bk - 1, k_multiple)
    else:
      return bq, bk, need    # the smallest tiles


def resolve_tiles(given: TpuBlockSizes | None, problem: base.Problem) -> TpuBlockSizes:
  """Every tile size resolved for `problem` (same signature in every backend).

  Defaults per TPU generation (device_kind "TPU v5", "TPU v5 lite", "TPU v6 lite", "TPU v4",
  ...), lowered to fit its VMEM (_default_tiles; v4, K = 8, G = 4: 64 x 128; v5p: 256 x
  512). The backward kernels default to the forward's tiles.

  Raises:
    ValueError: naming block_sizes, when a given size is not a valid tile of its length.
  """
  given = TpuBlockSizes() if given is None else given
  sub = 16 if jnp.dtype(problem.dtype).itemsize == 2 else 8
  q_len, kv_len = problem.q_len, problem.kv_len

  def check(name, length, multiple):
    value = getattr(given, name)
    if value is not None and (length % value or (value % multiple and value != length)):
      raise ValueError(
          f"block_sizes.{name}={value} must divide the local length {length} and be a "
          f"multiple of {multiple} or equal to it (backend {NAME!r}, TPU tiling)")
    return value

  # The default's rule (_default_tiles): sublane multiples where they divide the length,
  # else 8 (a bfloat16 length of 520 = 8 x 65 defaults to 104), else 1.
  for name in ("block_q", "block_q_dkv", "block_q_dq"):
    check(name, q_len, _tile_multiple(q_len, sub))
  for name in ("block_k", "block_k_dkv", "block_k_dq"):
    check(name, kv_len, _tile_multiple(kv_len, sub))
  if given.block_q is None:
    bq, bk, _ = _default_tiles(problem, given.block_k)
  else:
    bq, bk = given.block_q, given.block_k
    if bk is None:
      cap_k = _generation(problem.device_kind if not problem.interpret else "")[1]
      bk = _divisor(kv_len, cap_k, _LANES, sub, 8)
  return TpuBlockSizes(block_q=bq, block_k=bk, **{
      f"block_{x}_{kind}": getattr(given, f"block_{x}_{kind}") or (bq if x == "q" else bk)
      for kind in ("dkv", "dq") for x in ("q", "k")})


def _compiler_params():
  """Grid semantics (the last axis reduces) and the VMEM a kernel may use. The limit is not
  an allocation and may exceed a generation's VMEM (the compiler then reports what does not
  fit): the tiles were chosen to fit _BUDGET of the generation's VMEM by the estimate, and
  Mosaic's own scratch must not be cut off by a limit drawn from that estimate."""
  cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
  return cls(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
             vmem_limit_bytes=_VMEM_LIMIT)


# ---------------------------------------------------------------------------------------------
# Tile skipping: per-tile ranges in SMEM, linear in the lengths.

@dataclasses.dataclass(frozen=True)
class _Tiling:
  """Static facts of one kernel's tiling and the layout of its prefetched int32 metadata.

  bounds, one flat array (nq query tiles, nk key tiles, B batch rows):
    [0, nq)            q_lo: smallest query position of each query tile
    [nq, 2 nq)         q_hi: largest
    [2 nq, 2 nq + nk)  k_lo, then [2 nq + nk, 2 nq + 2 nk) k_hi
    with segment ids, then per batch row b: qs_lo [b * nq + i], qs_hi, ks_lo [b * nk + j],
    ks_hi, each section B * nq or B * nk long.
  span, per row r of tiles of the grid (query tiles when key tiles are reduced, else key
  tiles) and batch row (bf = B with segment ids, else 1): first [bb * rows + r], then last
  [bf * rows + bb * rows + r], the first and last reduced tile with work (0 and 0 when none).
  """

  nq: int
  nk: int
  bsz: int
  segments: bool
  causal: bool
  window: tuple[int, int] | None
  reduce_q: bool            # the dK/dV kernel: rows are key tiles, query tiles are reduced

  @property
  def bf(self) -> int:
    return self.bsz if self.segments else 1

  @property
  def rows(self) -> int:
    return self.nk if self.reduce_q else self.nq

  def work(self, bounds, b, i, j):
    """Whether query tile i and key tile j (batch row b) may hold a valid pair: the test of
    base.block_may_have_work on the tiles' ranges. Works on the SMEM ref inside a kernel
    (scalars) and on the jnp array outside (broadcasting index arrays)."""
    nq, nk, bsz = self.nq, self.nk, self.bsz
    ok = base.ranges_may_have_work(bounds[i], bounds[nq + i], bounds[2 * nq + j],
                                   bounds[2 * nq + nk + j], causal=self.causal,
                                   window=self.window)
    if self.segments:
      o = 2 * (nq + nk)
      qs_lo, qs_hi = bounds[o + b * nq + i], bounds[o + bsz * nq + b * nq + i]
      o += 2 * bsz * nq
      ks_lo, ks_hi = bounds[o + b * nk + j], bounds[o + bsz * nk + b * nk + j]
      ok = ok & (ks_lo <= qs_hi) & (qs_lo <= ks_hi)
    return ok

  def fetch(self, span, b, row, step):
    """The tile the reduced operand holds at `step` of `row`: clamp(step, first, last)."""
    bb = b if self.bf > 1 else 0
    first = span[bb * self.rows + row]
    last = span[(self.bf + bb) * self.rows + row]
    return jnp.minimum(jnp.maximum(step, first), last)


def _bounds(q_pos, k_pos, q_seg, k_seg, bq: int, bk: int):
  """The int32 `bounds` of _Tiling: per-tile [min, max] of positions and segment ids."""
  nq, nk = q_pos.shape[0] // bq, k_pos.shape[0] // bk
  qp = q_pos.astype(jnp.int32).reshape(nq, bq)
  kp = k_pos.astype(jnp.int32).reshape(nk, bk)
  parts = [qp.min(1), qp.max(1), kp.min(1), kp.max(1)]
  if q_seg is not None:
    b = q_seg.shape[0]
    qs = q_seg.astype(jnp.int32).reshape(b, nq, bq)
    ks = k_seg.astype(jnp.int32).reshape(b, nk, bk)
    parts += [qs.min(-1).ravel(), qs.max(-1).ravel(), ks.min(-1).ravel(), ks.max(-1).ravel()]
  return jnp.concatenate(parts)


def _tile_work(tiling: _Tiling, bounds):
  """bool [bf, nq, nk]: the work test of every tile (for the spans, and for tests)."""
  b = jnp.arange(tiling.bf, dtype=jnp.int32)[:, None, None]
  i = jnp.arange(tiling.nq, dtype=jnp.int32)[None, :, None]
  j = jnp.arange(tiling.nk, dtype=jnp.int32)[None, None, :]
  ok = tiling.work(bounds, b, i, j)
  return jnp.broadcast_to(ok, (tiling.bf, tiling.nq, tiling.nk))


def _spans(tiling: _Tiling, bounds):
  """The int32 `span` of _Tiling: per row of tiles the first and last reduced tile with
  work. Example, a row whose tiles 0..5 have work 0 1 1 0 0 1: first 1, last 5; the
  reduced operand then holds blocks 1 1 2 3 4 5 (3, 4 fetched, not computed)."""
  work = _tile_work(tiling, bounds)
  if tiling.reduce_q:
    work = work.transpose(0, 2, 1)                              # [bf, nk, nq]
  n = work.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  first = jnp.min(jnp.where(work, idx, n), axis=-1)
  last = jnp.max(jnp.where(work, idx, -1), axis=-1)
  none = last < 0
  first, last = jnp.where(none, 0, first), jnp.where(none, 0, last)
  return jnp.concatenate([first.ravel(), last.ravel()]).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Shared in-kernel pieces.

def _col(row):
  """[1, n] -> [n, 1] (a transpose of the row broadcast to 8 sublanes)."""
  return jnp.transpose(jnp.broadcast_to(row, (8, row.shape[1])))[:, :1]


class _Tile:
  """Static geometry of a kernel: hk kv heads of G query heads, bq x bk tiles."""

  def __init__(self, hk, g, bq, bk, spec, has_seg, dtype):
    self.hk, self.g, self.bq, self.bk = hk, g, bq, bk
    self.spec, self.has_seg, self.prec = spec, has_seg, base.matmul_precision(dtype)
    self.masked = spec.causal or spec.window is not None or has_seg

  def stack_rows(self, ref, c):
    """[G * bq, D]: the G query heads of kv head c of a [bq, hk * G, D] block, stacked.

    Rows g * bq ... g * bq + bq - 1 are query head c * G + g of the block.
    """
    parts = [ref[:, c * self.g + g, :] for g in range(self.g)]
    return parts[0] if self.g == 1 else jnp.concatenate(parts, axis=0)

  def stack_lanes(self, ref, c):
    """[1, G * bq] from a [hk * G, bq] statistics tile: rows c * G + g side by side."""
    parts = [ref[pl.ds(c * self.g + g, 1), :] for g in range(self.g)]
    return parts[0] if self.g == 1 else jnp.concatenate(parts, axis=1)

  def stack_col(self, tile_t, c):
    """[G * bq, 1] from a transposed [bq, hk * G] statistics tile: columns c * G + g."""
    parts = [tile_t[:, c * self.g + g:c * self.g + g + 1] for g in range(self.g)]
    return parts[0] if self.g == 1 else jnp.concatenate(parts, axis=0)

  def _tiled(self, x, axis):
    return x if self.g == 1 else jnp.concatenate([x] * self.g, axis=axis)

  def valid_rows(self, qp_ref, kp_ref, qs_ref, ks_ref):
    """bool [G * bq, bk] (stacked queries x keys), or None without a mask: base.pair_mask on
    the tile's ids. The int32 ids are stacked, not the bool result (see module docstring)."""
    if not self.masked:
      return None
    qs = ks = None
    if self.has_seg:
      qs, ks = self._tiled(_col(qs_ref[...]), 0), ks_ref[...]
    return base.pair_mask(self._tiled(_col(qp_ref[...]), 0), kp_ref[...], qs, ks,
                          causal=self.spec.causal, window=self.spec.window)

  def valid_cols(self, qp_ref, kp_ref, qs_ref, ks_ref):
    """bool [bk, G * bq] (keys x stacked queries), or None: valid_rows transposed."""
    if not self.masked:
      return None
    qs = ks = None
    if self.has_seg:
      qs, ks = self._tiled(qs_ref[...], 1), _col(ks_ref[...])
    return base.pair_mask(self._tiled(qp_ref[...], 1), _col(kp_ref[...]), qs, ks,
                          causal=self.spec.causal, window=self.spec.window)

  def scores(self, a, b):
    """fp32 capped(scale * a b^T): [rows of a, rows of b].

    Interpreted (CPU), XLA may recompute the product inside each consumer's fusion (the max,
    the exponent), summed in another order: at scores near 1e9 the roundings differ by more
    than exp's range. The barrier keeps one copy; Mosaic computes the tile once anyway."""
    s = base.capped(self.mm(a, b, transpose_b=True) * self.spec.scale, self.spec)
    return lax.optimization_barrier(s) if self.spec.interpret else s

  def mm(self, a, b, transpose_b=False):
    """fp32 a b, or a b^T."""
    return lax.dot_general(a, b, (((1,), (1 if transpose_b else 0,)), ((), ())),
                           precision=self.prec, preferred_element_type=jnp.float32)


def _when(cond, fn):
  """pl.when(cond)(fn), or fn() when cond is the Python True (a test without a mask)."""
  if cond is True:
    fn()
  else:
    pl.when(cond)(fn)


def _pos_inputs(q_pos, k_pos, q_seg, k_seg, bq, bk, q_index, k_index):
  """Positions as [T // bq, 1, bq] / [S // bk, 1, bk] (and segment ids as
  [B, T // bq, 1, bq] / [B, S // bk, 1, bk]): a tile is a [1, b] row whatever b, dense in
  HBM. q_index / k_index map the grid indices to the query / key tile index."""
  t, s = q_pos.shape[0], k_pos.shape[0]
  arrays = [q_pos.astype(jnp.int32).reshape(t // bq, 1, bq),
            k_pos.astype(jnp.int32).reshape(s // bk, 1, bk)]
  specs = [pl.BlockSpec((None, 1, bq), lambda *a: (q_index(*a), 0, 0)),
           pl.BlockSpec((None, 1, bk), lambda *a: (k_index(*a), 0, 0))]
  if q_seg is not None:
    b = q_seg.shape[0]
    arrays += [q_seg.astype(jnp.int32).reshape(b, t // bq, 1, bq),
               k_seg.astype(jnp.int32).reshape(b, s // bk, 1, bk)]
    specs += [pl.BlockSpec((None, None, 1, bq), lambda *a: (a[0], q_index(*a), 0, 0)),
              pl.BlockSpec((None, None, 1, bk), lambda *a: (a[0], k_index(*a), 0, 0))]
  return arrays, specs


def _stats_in(x, bq: int):
  """[B, N, T] -> [B, T // bq, N, bq]: the statistics of query tile i of the hk * G heads of
  block hh are block (b, i, hh, 0), [hk * G, bq]. Example, bq = 256: lse[b, n, 300] is
  [b, 1, n, 44]; with K = 8, G = 4 (hk = 8) it is row n of block (b, 1, 0, 0)."""
  b, n, t = x.shape
  return x.reshape(b, n, t // bq, bq).transpose(0, 2, 1, 3)


def _stats_out(x):
  """_stats_in's inverse: [B, T // bq, N, bq] -> [B, N, T]."""
  b, nq, n, bq = x.shape
  return x.transpose(0, 2, 1, 3).reshape(b, n, nq * bq)


def _split_refs(refs, has_seg, n_rest):
  npos = 4 if has_seg else 2
  pos = tuple(refs[:npos]) + ((None, None) if not has_seg else ())
  rest = refs[npos:]
  assert len(rest) == n_rest
  return pos, rest


def _struct(shape, dtype, like):
  """ShapeDtypeStruct typed (inside shard_map) as varying over the mesh axes `like` does."""
  aval = jax.typeof(like)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:                                   # newer jax
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
  vma = getattr(aval, "vma", None)
  if vma:                                               # jax 0.11
    return jax.ShapeDtypeStruct(shape, dtype, vma=vma)
  return jax.ShapeDtypeStruct(shape, dtype)


def _cost(matmuls: int, bsz, tq, s, n, h, spec, arrays, out_shapes) -> pl.CostEstimate:
  """What one call costs, for XLA's scheduler: without it a Mosaic call looks free, and the
  scheduler sees no reason to issue the ring's K/V transfer before it (no overlap).

  matmuls: [T, S, H]-sized products per query head (forward 2, dk/dv 4, dq 3), 2 flops per
  multiply-add, halved for causal masking; one exp per score.
  """
  pairs = bsz * n * tq * s // (2 if spec.causal else 1)
  moved = sum(x.size * x.dtype.itemsize for x in arrays) + sum(
      int(np.prod(shape)) * jnp.dtype(dtype).itemsize for shape, dtype in out_shapes)
  return pl.CostEstimate(flops=2 * matmuls * pairs * h, transcendentals=pairs,
                         bytes_accessed=int(moved))


def _call(kernel, grid, scalars, arrays, in_specs, out_specs, out_shapes, scratch, spec,
          name, refs, cost):
  """pallas_call with every operand (and result) typed as varying like the union of refs."""
  like = base.match_vma(jnp.zeros((), jnp.float32), *refs)
  scalars = [base.match_vma(x, like) for x in scalars]
  arrays = [base.match_vma(x, like) for x in arrays]
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(scalars), grid=grid, in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=[_struct(shape, dtype, like) for shape, dtype in out_shapes],
      compiler_params=_compiler_params(),
      cost_estimate=cost,
      interpret=spec.interpret,
      name=name)(*scalars, *arrays)


# Mosaic TPU counts a kernel call's grid steps in int32 (libtpu: "Iteration bounds are too
# large" past it); ringflash plan's search for the longest sequence reached it at 36M tokens
# a device with one head of 8.
_MAX_GRID_STEPS = 2**31 - 1


class _Blocks:
  """One kernel call's tiling: its prefetched metadata, grid and block specs.

  Grid (B, K // hk, rows, steps): rows are query tiles and steps key tiles (forward, dQ), or
  the reverse (dK/dV, reduce_q); the reduced operands hold the span-clamped tile of a step.
  """

  def __init__(self, spec, q, k, q_pos, k_pos, q_seg, k_seg, bq, bk, reduce_q):
    bsz, tq, n = q.shape[:3]
    s, kh = k.shape[1], k.shape[2]
    self.hk = _heads_per_block(kh)
    self.hq, self.bq, self.bk = self.hk * (n // kh), bq, bk
    steps = bsz * (kh // self.hk) * (tq // bq) * (s // bk)
    if steps > _MAX_GRID_STEPS:
      raise NotImplementedError(
          f"backend {NAME!r} runs a kernel call of {tq} query and {s} key rows as a grid of "
          f"{bsz} x {kh // self.hk} x {tq // bq} x {s // bk} = {steps} steps ({bq}-row "
          f"query and {bk}-row key tiles), past the 2**31 - 1 steps Mosaic counts: spread "
          f"the sequence over more devices, give larger tiles, or use backend 'xla'")
    self.tiling = _Tiling(nq=tq // bq, nk=s // bk, bsz=bsz, segments=q_seg is not None,
                          causal=spec.causal, window=spec.window, reduce_q=reduce_q)
    bounds = _bounds(q_pos, k_pos, q_seg, k_seg, bq, bk)
    self.scalars = (bounds, _spans(self.tiling, bounds))
    tiles = (self.tiling.nk, self.tiling.nq) if reduce_q else (self.tiling.nq, self.tiling.nk)
    self.grid = (bsz, kh // self.hk) + tiles
    self.pos_arrays, self.pos_specs = _pos_inputs(q_pos, k_pos, q_seg, k_seg, bq, bk,
                                                  self.q_tile, self.k_tile)

  def q_tile(self, b, hh, row, step, bounds_ref, span_ref):
    del hh, bounds_ref
    return self.tiling.fetch(span_ref, b, row, step) if self.tiling.reduce_q else row

  def k_tile(self, b, hh, row, step, bounds_ref, span_ref):
    del hh, bounds_ref
    return row if self.tiling.reduce_q else self.tiling.fetch(span_ref, b, row, step)

  def q(self, width):
    """[bq, hk * G, width] blocks of a [B, T, N, width] array (q, dout, o, dq)."""
    return pl.BlockSpec((None, self.bq, self.hq, width),
                        lambda b, hh, *a: (b, self.q_tile(b, hh, *a), hh, 0))

  def k(self, width):
    """[bk, hk, width] blocks of a [B, S, K, width] array (k, v, dk, dv)."""
    return pl.BlockSpec((None, self.bk, self.hk, width),
                        lambda b, hh, *a: (b, self.k_tile(b, hh, *a), hh, 0))

  def stats(self):
    """[hk * G, bq] blocks of a [B, T // bq, N, bq] statistics array (_stats_in)."""
    return pl.BlockSpec((None, None, self.hq, self.bq),
                        lambda b, hh, *a: (b, self.q_tile(b, hh, *a), hh, 0))


# ---------------------------------------------------------------------------------------------
# Forward.

def _fwd_kernel(bounds_ref, span_ref, *refs, t: _Tile, tiling: _Tiling):
  del span_ref  # used by the index maps only
  (qp_ref, kp_ref, qs_ref, ks_ref), rest = _split_refs(refs, t.has_seg, 8)
  q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def compute():
    valid = t.valid_rows(qp_ref, kp_ref, qs_ref, ks_ref)         # [G * bq, bk] | None
    for c in range(t.hk):
      s = t.scores(t.stack_rows(q_ref, c), k_ref[:, c, :])        # [G * bq, bk]
      if valid is not None:
        # A valid score below float32's range (-inf) counts as LOWEST (kernels/base.py).
        s = jnp.where(valid, base.floor_at_lowest(s), -jnp.inf)
      m = m_sc[:, c:c + 1]                                        # [G * bq, 1]
      m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
      if valid is None:                                           # every key valid
        m_new = base.floor_at_lowest(m_new)
      # A row with no valid key so far keeps m = -inf; it is shifted by 0 so that no
      # (-inf) - (-inf) appears: its p and alpha are then exactly 0. NaN stays NaN.
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp(s - m_safe)
      alpha = jnp.exp(m - m_safe)
      l_sc[:, c:c + 1] = alpha * l_sc[:, c:c + 1] + jnp.sum(p, axis=1, keepdims=True)
      m_sc[:, c:c + 1] = m_new
      acc_sc[c] = alpha * acc_sc[c] + t.mm(p.astype(v_ref.dtype), v_ref[:, c, :])

  _when(tiling.work(bounds_ref, b, i, j), compute)

  @pl.when(j == tiling.nk - 1)
  def _finish():
    m, l = m_sc[...], l_sc[...]                                   # [G * bq, lanes]: head c
    inv, lse = base.finish_rows(m, l)
    lse_t = jnp.transpose(lse)                                    # [lanes, G * bq]
    for c in range(t.hk):
      # inv = 0: no key, or only scores below float32 (acc may then be inf).
      inv_c = inv[:, c:c + 1]
      o = jnp.where(inv_c == 0, 0.0, acc_sc[c] * inv_c)           # [G * bq, Hv]
      for g in range(t.g):
        o_ref[:, c * t.g + g, :] = o[g * t.bq:(g + 1) * t.bq]
        lse_ref[pl.ds(c * t.g + g, 1), :] = lse_t[c:c + 1, g * t.bq:(g + 1) * t.bq]


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec):
  """Block-pair forward; see kernels/base.py for the contract."""
  bsz, tq, n, h = q.shape
  hv, g = v.shape[-1], n // k.shape[2]
  bq = spec.tiles.block_q
  blocks = _Blocks(spec, q, k, q_pos, k_pos, q_seg, k_seg, bq, spec.tiles.block_k, False)
  hk = blocks.hk
  refs = (q, k, v, q_pos, k_pos, q_seg, k_seg)
  out_shape = [((bsz, tq, n, hv), jnp.float32), ((bsz, tq // bq, n, bq), jnp.float32)]
  lanes = _rup(hk, _LANES)
  scratch = [pltpu.VMEM((g * bq, lanes), jnp.float32),            # m, head c in lane c
             pltpu.VMEM((g * bq, lanes), jnp.float32),            # l
             pltpu.VMEM((hk, g * bq, hv), jnp.float32)]           # acc
  t = _Tile(hk, g, bq, blocks.bk, spec, q_seg is not None, q.dtype)
  arrays = blocks.pos_arrays + [q, k, v]
  o, lse = _call(functools.partial(_fwd_kernel, t=t, tiling=blocks.tiling), blocks.grid,
                 blocks.scalars, arrays,
                 blocks.pos_specs + [blocks.q(h), blocks.k(h), blocks.k(hv)],
                 [blocks.q(hv), blocks.stats()], out_shape, scratch, spec, "ringflash_fwd",
                 refs, _cost(2, bsz, tq, k.shape[1], n, h, spec, arrays, out_shape))
  return base.match_vma(o, *refs), base.match_vma(_stats_out(lse), *refs)


# ---------------------------------------------------------------------------------------------
# Backward. With p = exp(s - lse) (final probabilities: lse is the global one) and
# D = rowsum(dout * out) - dlse:
#   dv = p^T dout,  dp = dout v^T,  ds = p * (dp - D),  dk = scale ds^T q,  dq = scale ds k,
# where with a soft-cap ds is first multiplied by 1 - (s / cap)^2 (base.capped_grad).
# Double where: rows without a key (lse = -inf) and masked pairs get p = 0 exactly, and exp
# never sees -inf - -inf; ds too, so that a NaN D of a row never reaches a key it does not
# see. A NaN lse (the row saw a NaN value) stays NaN.

def _dkv_kernel(bounds_ref, span_ref, *refs, t: _Tile, tiling: _Tiling):
  del span_ref
  (qp_ref, kp_ref, qs_ref, ks_ref), rest = _split_refs(refs, t.has_seg, 10)
  q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dk_ref, dv_ref, dk_sc, dv_sc = rest
  # Grid (b, hh, j, i): key tile j is fixed while query tiles i are reduced over. Scores
  # are computed transposed, [bk, G * bq], so per-query statistics are [1, G * bq] rows.
  b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(i == 0)
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  def compute():
    valid = t.valid_cols(qp_ref, kp_ref, qs_ref, ks_ref)         # [bk, G * bq] | None
    for c in range(t.hk):
      q = t.stack_rows(q_ref, c)                                  # [G * bq, H]
      do = t.stack_rows(do_ref, c)                                # [G * bq, Hv]
      lse = t.stack_lanes(lse_ref, c)                             # [1, G * bq]
      delta = t.stack_lanes(d_ref, c)
      row_ok = ~(lse == -jnp.inf)        # NaN stays in (no unordered `!=` in Mosaic TPU)
      keep = row_ok if valid is None else valid & row_ok
      s = t.scores(k_ref[:, c, :], q)                             # [bk, G * bq]
      p = jnp.where(keep, jnp.exp(s - jnp.where(row_ok, lse, 0.0)), 0.0)
      dp = t.mm(v_ref[:, c, :], do, transpose_b=True)            # [bk, G * bq]
      ds = jnp.where(keep, base.capped_grad(p * (dp - delta), s, t.spec), 0.0)
      dv_sc[c] += t.mm(p.astype(do.dtype), do)                    # [bk, Hv]
      ds_type = base.ds_dtype(q.dtype)                            # float16: float32
      dk_sc[c] += t.spec.scale * t.mm(ds.astype(ds_type), q.astype(ds_type))   # [bk, H]

  _when(tiling.work(bounds_ref, b, i, j), compute)

  @pl.when(i == tiling.nq - 1)
  def _finish():
    for c in range(t.hk):
      dk_ref[:, c, :] = dk_sc[c]
      dv_ref[:, c, :] = dv_sc[c]


def _dq_kernel(bounds_ref, span_ref, *refs, t: _Tile, tiling: _Tiling):
  del span_ref
  (qp_ref, kp_ref, qs_ref, ks_ref), rest = _split_refs(refs, t.has_seg, 8)
  q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dq_ref, dq_sc = rest
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  def compute():
    valid = t.valid_rows(qp_ref, kp_ref, qs_ref, ks_ref)         # [G * bq, bk] | None
    lse_t = jnp.transpose(lse_ref[...])                           # [bq, hk * G]
    d_t = jnp.transpose(d_ref[...])
    for c in range(t.hk):
      k = k_ref[:, c, :]
      lse = t.stack_col(lse_t, c)                                 # [G * bq, 1]
      delta = t.stack_col(d_t, c)
      row_ok = ~(lse == -jnp.inf)        # NaN stays in (no unordered `!=` in Mosaic TPU)
      keep = row_ok if valid is None else valid & row_ok
      s = t.scores(t.stack_rows(q_ref, c), k)                     # [G * bq, bk]
      p = jnp.where(keep, jnp.exp(s - jnp.where(row_ok, lse, 0.0)), 0.0)
      dp = t.mm(t.stack_rows(do_ref, c), v_ref[:, c, :], transpose_b=True)  # [G * bq, bk]
      ds = jnp.where(keep, base.capped_grad(p * (dp - delta), s, t.spec), 0.0)
      ds_type = base.ds_dtype(k.dtype)                            # float16: float32
      dq_sc[c] += t.spec.scale * t.mm(ds.astype(ds_type), k.astype(ds_type))   # [G * bq, H]

  _when(tiling.work(bounds_ref, b, i, j), compute)

  @pl.when(j == tiling.nk - 1)
  def _finish():
    for c in range(t.hk):
      dq = dq_sc[c]
      for g in range(t.g):
        dq_ref[:, c * t.g + g, :] = dq[g * t.bq:(g + 1) * t.bq]


def backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
             dlse=None):
  """Block-pair backward from the global out and lse; see kernels/base.py for the contract."""
  bsz, tq, n, h = q.shape
  s, kh, hv, g = k.shape[1], k.shape[2], v.shape[-1], n // k.shape[2]
  refs = (q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, dlse)
  delta = base.softmax_delta(out, dout, dlse)                              # [B, N, T]

  def run(kernel, bq, bk, reduce_q, outputs, out_shape, scratch, name, matmuls):
    blocks = _Blocks(spec, q, k, q_pos, k_pos, q_seg, k_seg, bq, bk, reduce_q)
    t = _Tile(blocks.hk, g, bq, bk, spec, q_seg is not None, q.dtype)
    arrays = blocks.pos_arrays + [q, k, v, dout, _stats_in(lse, bq), _stats_in(delta, bq)]
    in_specs = blocks.pos_specs + [blocks.q(h), blocks.k(h), blocks.k(hv), blocks.q(hv),
                                   blocks.stats(), blocks.stats()]
    return _call(functools.partial(kernel, t=t, tiling=blocks.tiling), blocks.grid,
                 blocks.scalars, arrays, in_specs, outputs(blocks), out_shape,
                 scratch(blocks.hk), spec, name, refs,
                 _cost(matmuls, bsz, tq, s, n, h, spec, arrays, out_shape))

  # dk, dv: key tile j is a row, query tiles i are reduced: q, dout and the statistics hold
  # clamp(i, first, last) of key tile j's span (module docstring).
  bq, bk = spec.tiles.block_q_dkv, spec.tiles.block_k_dkv
  dk, dv = run(_dkv_kernel, bq, bk, True, lambda bl: [bl.k(h), bl.k(hv)],
               [((bsz, s, kh, h), jnp.float32), ((bsz, s, kh, hv), jnp.float32)],
               lambda hk: [pltpu.VMEM((hk, bk, h), jnp.float32),
                           pltpu.VMEM((hk, bk, hv), jnp.float32)], "ringflash_bwd_dkv", 4)
  # dq: query tile i is a row, key tiles j are reduced.
  bq, bk = spec.tiles.block_q_dq, spec.tiles.block_k_dq
  (dq,) = run(_dq_kernel, bq, bk, False, lambda bl: [bl.q(h)],
              [((bsz, tq, n, h), jnp.float32)],
              lambda hk: [pltpu.VMEM((hk, g * bq, h), jnp.float32)], "ringflash_bwd_dq", 3)
  return (base.match_vma(dq, *refs), base.match_vma(dk, *refs), base.match_vma(dv, *refs))


# JAX cannot differentiate a pallas_call: grad of grad says so, naming the backend.
forward = base.first_order_only(NAME, forward)
backward = base.first_order_only(NAME, backward)
