"""The TPU backend: Pallas Mosaic kernels behind the kernel contract (see kernels/base.py).

Three kernels over one (query block, key/value block) pair:
  forward   grid (B, K // hk, T // bq, S // bk): online softmax over key tiles, o and lse;
  dkv       grid (B, K // hk, S // bk, T // bq): dk, dv of one key tile, summed over query tiles;
  dq        grid (B, K // hk, T // bq, S // bk): dq of one query tile, summed over key tiles.
The last grid axis is the reduction ("arbitrary"); its fp32 accumulators live in VMEM scratch.

Layout. q, dout and o are viewed as [B, T, N * H] and k, v as [B, S, K * H] (free reshapes of
the contract's [B, T, N, H] / [B, S, K, H]), so one block of `hk` kv heads is a lane slice:
kv heads h * hk ... h * hk + hk - 1 are lanes [h * hk * H, (h + 1) * hk * H) of k, and their
query heads (GQA: query head n uses kv head n // G, G = N // K) are lanes
[h * hk * G * H, (h + 1) * hk * G * H) of q. `hk` is the fewest kv heads whose lanes make a
multiple of 128 (1 when H = 128), or all K. Inside a kernel the G query heads of one kv head
are stacked along rows into one [G * bq, H] operand, so each key tile is loaded once per
group and meets one [G * bq, bk] matmul: K/V are never repeated.
Per-row statistics (lse, and D = rowsum(dout * out) - dlse) travel as [B, K // hk, T, hk * G]:
tile [bq, hk * G], column c * G + g holds query head (h * hk + c) * G + g.

Masks: base.mask on the tile's positions ([bq, 1] and [1, bk] blocks, flattened) and segment
ids, so every mask the project defines reaches the kernel unchanged. Tile skipping: the flags
base.block_may_have_work(tile) are computed outside the kernel and scalar-prefetched; a tile
without work is neither computed nor fetched: the index map of the reduced operand then
repeats the block of the step before, so the pipeline issues no DMA for it.
"""

from __future__ import annotations

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

# device_kind -> (block_q, block_k, VMEM budget of one kernel in bytes). VMEM per core:
# v4 16 MiB, v5e / v5p / v6e 128 MiB. block_q is reduced for large GQA groups so that the
# stacked [G * bq, bk] fp32 score tiles stay within the budget.
_DEFAULTS = {
    "TPU v4": (512, 512, 14 * 2**20),
    "TPU v5 lite": (512, 512, 48 * 2**20),
    "TPU v5e": (512, 512, 48 * 2**20),
    "TPU v5": (512, 512, 48 * 2**20),
    "TPU v5p": (512, 512, 48 * 2**20),
    "TPU v6 lite": (512, 1024, 48 * 2**20),
    "TPU v6e": (512, 1024, 48 * 2**20),
}
_FALLBACK = (512, 512, 14 * 2**20)    # unknown TPU
_INTERPRET = (512, 512, 2**40)         # CPU interpret mode: no VMEM to fit


def _generation(device_kind: str):
  if not device_kind.startswith("TPU"):
    return _INTERPRET
  return _DEFAULTS.get(device_kind, _FALLBACK)


def _vmem_estimate(bq: int, bk: int, g: int, hk: int, h: int, itemsize: int) -> int:
  """Bytes of VMEM the largest kernel (dkv) needs: double-buffered blocks, scratch, temps."""
  rows = g * bq * hk
  blocks = 2 * (2 * rows * h * itemsize + 2 * bk * hk * h * itemsize + 2 * bk * hk * h * 4)
  stats = 2 * 2 * bq * 128 * 4                         # lse and D tiles, lane-padded
  temps = 4 * g * bq * bk * 4                          # s, p, dp, ds of one kv head
  return blocks + stats + temps + 2 * bk * hk * h * 4  # + dk, dv scratch


def unsupported(problem: base.Problem) -> str | None:
  """Why this backend cannot compute `problem` on its devices (None: it can)."""
  if problem.platform not in ("tpu", "cpu"):
    return (f"backend {NAME!r} runs on TPU devices (and, interpreted, on CPU devices), not "
            f"on {problem.platform!r} devices")
  if problem.softcap is not None:
    return f"backend {NAME!r} does not soft-cap logits (logits_soft_cap)"
  if problem.value_dim != problem.head_dim:
    return (f"backend {NAME!r} needs the value head dim to equal the query's, got "
            f"{problem.value_dim} and {problem.head_dim}")
  return None


def resolve_tiles(given: TpuBlockSizes | None, problem: base.Problem) -> TpuBlockSizes:
  """Every tile size resolved for `problem` (same signature in every backend).

  Defaults per TPU generation (keyed by device_kind, e.g. "TPU v5p", "TPU v5 lite",
  "TPU v6e", "TPU v4"): the largest valid divisor not above the generation's size, with
  block_q lowered until the tiles fit the generation's VMEM budget: the `group` = N // K
  query heads of a kv head are stacked into [group * bq, bk] score tiles, so large GQA
  groups get shorter query tiles (v4, 16 MiB of VMEM, G = 16: bq 64). A block holds the
  fewest of the kv heads whose lanes fill 128 (two at H = 64, all of them when none divides
  evenly); when even the smallest query tile does not fit, block_k is lowered too (v4,
  H = 64, K = 5: bk 256). The backward kernels default to the forward's tiles.

  Raises:
    ValueError: naming block_sizes, when a given size is not a valid tile of its length.
  """
  given = TpuBlockSizes() if given is None else given
  sub = 16 if jnp.dtype(problem.dtype).itemsize == 2 else 8
  cap_q, cap_k, budget = _generation(problem.device_kind if not problem.interpret else "")
  q_len, kv_len = problem.q_len, problem.kv_len

  def check(name, length, multiple):
    value = getattr(given, name)
    if value is not None and (length % value or (value % multiple and value != length)):
      raise ValueError(
          f"block_sizes.{name}={value} must divide the local length {length} and be a "
          f"multiple of {multiple} or equal to it (backend {NAME!r}, TPU tiling)")
    return value

  def default(length, cap, multiple):
    d = base.largest_divisor_at_most(length, cap, multiple)
    return length if d is None else d

  for name in ("block_q", "block_q_dkv", "block_q_dq"):
    check(name, q_len, sub)
  for name in ("block_k", "block_k_dkv", "block_k_dq"):
    check(name, kv_len, 128)
  bk = given.block_k if given.block_k is not None else default(kv_len, cap_k, 128)
  bq = given.block_q
  if bq is None:
    hk = _heads_per_block(problem.kv_heads, problem.head_dim)
    itemsize = jnp.dtype(problem.dtype).itemsize
    first_cap_q = cap_q
    while True:
      bq = default(q_len, cap_q, sub)
      if _vmem_estimate(bq, bk, problem.group, hk, problem.head_dim, itemsize) <= budget:
        break
      if cap_q > sub:
        cap_q //= 2
      elif given.block_k is None and cap_k > 128:
        cap_k //= 2
        bk, cap_q = default(kv_len, cap_k, 128), first_cap_q
      else:
        break      # the smallest tiles; Mosaic reports what still does not fit

  def or_(value, fallback):
    return fallback if value is None else value

  return TpuBlockSizes(block_q=bq, block_k=bk,
                       block_q_dkv=or_(given.block_q_dkv, bq),
                       block_k_dkv=or_(given.block_k_dkv, bk),
                       block_q_dq=or_(given.block_q_dq, bq),
                       block_k_dq=or_(given.block_k_dq, bk))


def _heads_per_block(num_kv: int, h: int) -> int:
  """Fewest kv heads hk (dividing num_kv) whose k lanes hk * H are a multiple of 128, else all.

  With hk * H % 128 == 0 the query lanes hk * G * H are too, so both lane blocks are legal.
  """
  for hk in range(1, num_kv + 1):
    if num_kv % hk == 0 and (hk * h) % 128 == 0:
      return hk
  return num_kv


def _compiler_params(vmem_bytes: int):
  """Grid semantics (the last axis reduces) and a VMEM limit of the estimate plus headroom,
  at least the 16 MiB every generation has."""
  cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
  limit = min(max(vmem_bytes + 4 * 2**20, 16 * 2**20), 100 * 2**20)
  return cls(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
             vmem_limit_bytes=limit)


# ---------------------------------------------------------------------------------------------
# Tile flags for skipping, computed outside the kernels.

def _tile_flags(q_pos, k_pos, q_seg, k_seg, spec, bq, bk):
  """int32 [Bf, nq, nk]: 1 where tile (i, j) may hold a valid pair (Bf = B with segments).

  Tile (i, j) covers queries i * bq ... i * bq + bq - 1 and keys j * bk ... j * bk + bk - 1.
  """
  nq, nk = q_pos.shape[0] // bq, k_pos.shape[0] // bk
  qp, kp = q_pos.reshape(nq, bq), k_pos.reshape(nk, bk)
  if q_seg is None:
    def one(a, b_):
      return base.block_may_have_work(a, b_, spec)
    flags = jax.vmap(lambda a: jax.vmap(lambda b_: one(a, b_))(kp))(qp)[None]
  else:
    bsz = q_seg.shape[0]
    qs, ks = q_seg.reshape(bsz, nq, bq), k_seg.reshape(bsz, nk, bk)

    def one(a, b_, sa, sb):
      return base.block_may_have_work(a, b_, spec, sa[None], sb[None])

    per_row = lambda sq, sk: jax.vmap(           # noqa: E731
        lambda a, sa: jax.vmap(lambda b_, sb: one(a, b_, sa, sb))(kp, sk))(qp, sq)
    flags = jax.vmap(per_row)(qs, ks)
  return flags.astype(jnp.int32)


def _fetch_index(flags):
  """int32 [..., n]: the block to hold at each step of the last (reduction) axis.

  A working step j holds block j. A skipped step holds the block of the last working step
  before it (already in VMEM, so no DMA), or, before the first working step of the row, that
  first working block (fetched early instead of an unused one). Example, flags 0 1 1 0 0 1:
  index 1 1 2 2 2 5; a row with no work holds block 0.
  """
  n = flags.shape[-1]
  j = jnp.arange(n, dtype=jnp.int32)
  last = lax.cummax(jnp.where(flags > 0, j, -1), axis=flags.ndim - 1)
  first = jnp.min(jnp.where(flags > 0, j, n), axis=-1, keepdims=True)
  first = jnp.where(first == n, 0, first)
  return jnp.where(last >= 0, last, first).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Shared in-kernel pieces.

class _Tile:
  """Static geometry of a kernel: hk kv heads of G query heads, bq x bk tiles, head dim H."""

  def __init__(self, hk, g, h, bq, bk, spec, has_seg, dtype):
    self.hk, self.g, self.h, self.bq, self.bk = hk, g, h, bq, bk
    self.spec, self.has_seg, self.prec = spec, has_seg, base.matmul_precision(dtype)

  def stack_rows(self, ref, c):
    """[G * bq, H]: the G query heads of kv head c of a [bq, hk * G * H] block, stacked.

    Rows g * bq ... g * bq + bq - 1 are query head c * G + g (lanes (c * G + g) * H ...).
    """
    parts = [ref[:, pl.ds((c * self.g + g) * self.h, self.h)] for g in range(self.g)]
    return parts[0] if self.g == 1 else jnp.concatenate(parts, axis=0)

  def stack_col(self, tile, c):
    """[G * bq, 1] from a [bq, hk * G] statistics tile: columns c * G + g, stacked."""
    lane = lax.broadcasted_iota(jnp.int32, tile.shape, 1)
    parts = [jnp.sum(jnp.where(lane == c * self.g + g, tile, 0.0), axis=1, keepdims=True)
             for g in range(self.g)]
    return parts[0] if self.g == 1 else jnp.concatenate(parts, axis=0)

  def valid(self, qp_ref, kp_ref, qs_ref, ks_ref):
    """bool [G * bq, bk]: base.mask on this tile, repeated for the G stacked heads."""
    q_seg = k_seg = None
    if self.has_seg:
      q_seg, k_seg = qs_ref[...].reshape(1, -1), ks_ref[...].reshape(1, -1)
    ok = base.mask(qp_ref[...].reshape(-1), kp_ref[...].reshape(-1), q_seg, k_seg, self.spec)
    ok = jnp.broadcast_to(ok[0], (self.bq, self.bk))
    return ok if self.g == 1 else jnp.concatenate([ok] * self.g, axis=0)

  def scores(self, q, k):
    """fp32 [G * bq, bk] = scale * q k^T."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=self.prec,
                        preferred_element_type=jnp.float32)
    return s * self.spec.scale

  def mm(self, a, b, contract_a, contract_b):
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                           precision=self.prec, preferred_element_type=jnp.float32)


def _pos_inputs(q_pos, k_pos, q_seg, k_seg, bq, bk, q_index, k_index):
  """Positions as q_pos [T, 1] / k_pos [1, S] (and segment ids as [B, T, 1] / [B, 1, S]) with
  their block specs; q_index / k_index map the grid indices to the query / key tile index."""
  arrays = [q_pos.astype(jnp.int32).reshape(-1, 1), k_pos.astype(jnp.int32).reshape(1, -1)]
  specs = [pl.BlockSpec((bq, 1), lambda *a: (q_index(*a), 0)),
           pl.BlockSpec((1, bk), lambda *a: (0, k_index(*a)))]
  if q_seg is not None:
    b = q_seg.shape[0]
    arrays += [q_seg.astype(jnp.int32).reshape(b, -1, 1),
               k_seg.astype(jnp.int32).reshape(b, 1, -1)]
    specs += [pl.BlockSpec((None, bq, 1), lambda *a: (a[0], q_index(*a), 0)),
              pl.BlockSpec((None, 1, bk), lambda *a: (a[0], 0, k_index(*a)))]
  return arrays, specs


def _flag_at(flags_ref, b, i, j, bf, nq, nk):
  """flags [Bf, nq, nk] flattened: entry (b if Bf > 1 else 0, i, j)."""
  bb = b if bf > 1 else 0
  return flags_ref[(bb * nq + i) * nk + j]


def _geometry(q, k):
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  hk = _heads_per_block(kh, h)
  return b, t, s, n, kh, h, g, hk


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
          vmem_bytes, name, refs, cost):
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
      compiler_params=_compiler_params(vmem_bytes),
      cost_estimate=cost,
      interpret=spec.interpret,
      name=name)(*scalars, *arrays)


# ---------------------------------------------------------------------------------------------
# Forward.

def _fwd_kernel(flags_ref, idx_ref, *refs, t: _Tile, bf, nq, nk):
  del idx_ref  # used by the index maps only
  (qp_ref, kp_ref, qs_ref, ks_ref), rest = _split_refs(refs, t.has_seg, 8)
  q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(_flag_at(flags_ref, b, i, j, bf, nq, nk) > 0)
  def _compute():
    valid = t.valid(qp_ref, kp_ref, qs_ref, ks_ref)               # [G * bq, bk]
    for c in range(t.hk):
      kv_lanes = pl.ds(c * t.h, t.h)
      s = jnp.where(valid, t.scores(t.stack_rows(q_ref, c), k_ref[:, kv_lanes]), -jnp.inf)
      m = m_sc[c]                                                 # [G * bq, 1]
      m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
      # A row with no valid key so far keeps m = -inf; it is shifted by 0 so that no
      # (-inf) - (-inf) appears: its p and alpha are then exactly 0. NaN stays NaN.
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp(s - m_safe)
      alpha = jnp.exp(m - m_safe)
      l_sc[c] = alpha * l_sc[c] + jnp.sum(p, axis=1, keepdims=True)
      m_sc[c] = m_new
      pv = t.mm(p.astype(v_ref.dtype), v_ref[:, kv_lanes], 1, 0)  # [G * bq, H]
      acc_sc[c] = alpha * acc_sc[c] + pv

  @pl.when(j == nk - 1)
  def _finish():
    lane = lax.broadcasted_iota(jnp.int32, lse_ref.shape, 1)
    lse_tile = jnp.zeros(lse_ref.shape, jnp.float32)
    for c in range(t.hk):
      l = l_sc[c]
      ok = base.has_key(m_sc[c], l)
      l_safe = jnp.where(ok, l, 1.0)
      o = jnp.where(ok, acc_sc[c] / l_safe, 0.0)                 # [G * bq, H]
      lse = jnp.where(ok, m_sc[c] + jnp.log(l_safe), -jnp.inf)
      for g in range(t.g):
        rows = slice(g * t.bq, (g + 1) * t.bq)
        o_ref[:, pl.ds((c * t.g + g) * t.h, t.h)] = o[rows]
        lse_tile = jnp.where(lane == c * t.g + g, lse[rows], lse_tile)
    lse_ref[...] = lse_tile


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec):
  """Block-pair forward; see kernels/base.py for the contract."""
  bsz, tq, s, n, kh, h, g, hk = _geometry(q, k)
  bq, bk = spec.tiles.block_q, spec.tiles.block_k
  nq, nk, nh = tq // bq, s // bk, kh // hk
  has_seg = q_seg is not None
  flags = _tile_flags(q_pos, k_pos, q_seg, k_seg, spec, bq, bk)   # [Bf, nq, nk]
  bf = flags.shape[0]
  fetch = _fetch_index(flags)                                     # [Bf, nq, nk]
  t = _Tile(hk, g, h, bq, bk, spec, has_seg, q.dtype)
  refs = (q, k, v, q_pos, k_pos, q_seg, k_seg)

  def kv_block(b, hh, i, j, flags_ref, idx_ref):
    del hh, flags_ref
    return _flag_at(idx_ref, b, i, j, bf, nq, nk)

  pos_arrays, pos_specs = _pos_inputs(q_pos, k_pos, q_seg, k_seg, bq, bk,
                                      lambda b, hh, i, j, *_: i, kv_block)
  q_lanes, kv_lanes = hk * g * h, hk * h
  in_specs = pos_specs + [
      pl.BlockSpec((None, bq, q_lanes), lambda b, hh, i, j, *_: (b, i, hh)),
      pl.BlockSpec((None, bk, kv_lanes), lambda b, hh, i, j, f, x: (b, kv_block(
          b, hh, i, j, f, x), hh)),
      pl.BlockSpec((None, bk, kv_lanes), lambda b, hh, i, j, f, x: (b, kv_block(
          b, hh, i, j, f, x), hh)),
  ]
  out_specs = [
      pl.BlockSpec((None, bq, q_lanes), lambda b, hh, i, j, *_: (b, i, hh)),
      pl.BlockSpec((None, None, bq, hk * g), lambda b, hh, i, j, *_: (b, hh, i, 0)),
  ]
  out_shape = [((bsz, tq, n * h), jnp.float32), ((bsz, nh, tq, hk * g), jnp.float32)]
  scratch = [pltpu.VMEM((hk, g * bq, 1), jnp.float32),
             pltpu.VMEM((hk, g * bq, 1), jnp.float32),
             pltpu.VMEM((hk, g * bq, h), jnp.float32)]
  kernel = functools.partial(_fwd_kernel, t=t, bf=bf, nq=nq, nk=nk)
  arrays = pos_arrays + [q.reshape(bsz, tq, n * h), k.reshape(bsz, s, kh * h),
                        v.reshape(bsz, s, kh * h)]
  o, lse = _call(kernel, (bsz, nh, nq, nk), (flags.reshape(-1), fetch.reshape(-1)), arrays,
                 in_specs, out_specs, out_shape, scratch, spec,
                 _vmem_estimate(bq, bk, g, hk, h, q.dtype.itemsize), "ringflash_fwd", refs,
                 _cost(2, bsz, tq, s, n, h, spec, arrays, out_shape))
  # lse [B, K // hk, T, hk * G] -> [B, N, T]: query head (hh * hk) * G + col is row
  # hh * hk * G + col of the [B, N, T] result.
  lse = lse.transpose(0, 1, 3, 2).reshape(bsz, n, tq)
  return base.match_vma(o.reshape(bsz, tq, n, h), *refs), base.match_vma(lse, *refs)


# ---------------------------------------------------------------------------------------------
# Backward. With p = exp(s - lse) (final probabilities: lse is the global one) and
# D = rowsum(dout * out) - dlse:
#   dv = p^T dout,  dp = dout v^T,  ds = p * (dp - D),  dk = scale ds^T q,  dq = scale ds k.

def _bwd_tile(t: _Tile, c, valid, q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref):
  """p, ds [G * bq, bk] (fp32) and the stacked q, dout of kv head c for one tile."""
  kv_lanes = pl.ds(c * t.h, t.h)
  q = t.stack_rows(q_ref, c)                                      # [G * bq, H]
  do = t.stack_rows(do_ref, c)
  lse = t.stack_col(lse_ref[...], c)                              # [G * bq, 1]
  delta = t.stack_col(d_ref[...], c)
  row_ok = lse != -jnp.inf              # a NaN lse (the row saw a NaN value) stays NaN
  s = t.scores(q, k_ref[:, kv_lanes])
  # Double where: rows without a key (lse = -inf) and masked pairs get p = 0 exactly, and
  # exp never sees -inf - -inf; ds too, so that a NaN D of a row never reaches a key it
  # does not see.
  keep = valid & row_ok
  p = jnp.where(keep, jnp.exp(s - jnp.where(row_ok, lse, 0.0)), 0.0)
  dp = t.mm(do, v_ref[:, kv_lanes], 1, 1)                         # [G * bq, bk]
  ds = jnp.where(keep, p * (dp - delta), 0.0)
  return p, ds, q, do


def _split_refs(refs, has_seg, n_rest):
  npos = 4 if has_seg else 2
  pos = tuple(refs[:npos]) + ((None, None) if not has_seg else ())
  rest = refs[npos:]
  assert len(rest) == n_rest
  return pos, rest


def _dkv_kernel(flags_ref, idx_ref, *refs, t: _Tile, bf, nq, nk):
  del idx_ref
  (qp_ref, kp_ref, qs_ref, ks_ref), rest = _split_refs(refs, t.has_seg, 10)
  q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dk_ref, dv_ref, dk_sc, dv_sc = rest
  # Grid (b, hh, j, i): key tile j is fixed while query tiles i are reduced over.
  b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(i == 0)
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  # flags here are the transposed [Bf, nk, nq]: entry (b, j, i).
  @pl.when(_flag_at(flags_ref, b, j, i, bf, nk, nq) > 0)
  def _compute():
    valid = t.valid(qp_ref, kp_ref, qs_ref, ks_ref)
    for c in range(t.hk):
      p, ds, q, do = _bwd_tile(t, c, valid, q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref)
      dv_sc[c] += t.mm(p.astype(do.dtype), do, 0, 0)                          # [bk, H]
      dk_sc[c] += t.spec.scale * t.mm(ds.astype(q.dtype), q, 0, 0)

  @pl.when(i == nq - 1)
  def _finish():
    for c in range(t.hk):
      dk_ref[:, pl.ds(c * t.h, t.h)] = dk_sc[c]
      dv_ref[:, pl.ds(c * t.h, t.h)] = dv_sc[c]


def _dq_kernel(flags_ref, idx_ref, *refs, t: _Tile, bf, nq, nk):
  del idx_ref
  (qp_ref, kp_ref, qs_ref, ks_ref), rest = _split_refs(refs, t.has_seg, 8)
  q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dq_ref, dq_sc = rest
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(_flag_at(flags_ref, b, i, j, bf, nq, nk) > 0)
  def _compute():
    valid = t.valid(qp_ref, kp_ref, qs_ref, ks_ref)
    for c in range(t.hk):
      _, ds, _, _ = _bwd_tile(t, c, valid, q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref)
      dq_sc[c] += t.spec.scale * t.mm(ds.astype(k_ref.dtype), k_ref[:, pl.ds(c * t.h, t.h)],
                                      1, 0)                                   # [G * bq, H]

  @pl.when(j == nk - 1)
  def _finish():
    for c in range(t.hk):
      dq = dq_sc[c]
      for g in range(t.g):
        dq_ref[:, pl.ds((c * t.g + g) * t.h, t.h)] = dq[g * t.bq:(g + 1) * t.bq]


def backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
             dlse=None):
  """Block-pair backward from the global out and lse; see kernels/base.py for the contract."""
  bsz, tq, s, n, kh, h, g, hk = _geometry(q, k)
  nh = kh // hk
  has_seg = q_seg is not None
  refs = (q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, dlse)

  delta = base.softmax_delta(out, dout, dlse).transpose(0, 2, 1)                # [B, T, N]
  # Statistics as [B, K // hk, T, hk * G]: head hh * hk * G + col of [B, T, N] is column col
  # of block hh.
  delta = delta.reshape(bsz, tq, nh, hk * g).transpose(0, 2, 1, 3)
  lse4 = lse.reshape(bsz, nh, hk * g, tq).transpose(0, 1, 3, 2)
  q3, do3 = q.reshape(bsz, tq, n * h), dout.reshape(bsz, tq, n * h)
  k3, v3 = k.reshape(bsz, s, kh * h), v.reshape(bsz, s, kh * h)
  q_lanes, kv_lanes, stat_lanes = hk * g * h, hk * h, hk * g
  arrays_common = [q3, k3, v3, do3, lse4, delta]

  # dk, dv: grid (b, hh, j, i); the query tile index i is reduced, so q, dout and the
  # statistics revisit their last working block on skipped steps. Flags are transposed to
  # [Bf, nk, nq] so that the reduced axis is last, as _fetch_index and _flag_at expect.
  bq, bk = spec.tiles.block_q_dkv, spec.tiles.block_k_dkv
  nq, nk = tq // bq, s // bk
  t = _Tile(hk, g, h, bq, bk, spec, has_seg, q.dtype)
  flags = _tile_flags(q_pos, k_pos, q_seg, k_seg, spec, bq, bk)       # [Bf, nq, nk]
  bf = flags.shape[0]
  flags_t = flags.transpose(0, 2, 1)
  fetch_t = _fetch_index(flags_t)

  def q_block(b, hh, j, i, flags_ref, idx_ref):
    del hh, flags_ref
    return _flag_at(idx_ref, b, j, i, bf, nk, nq)

  pos_arrays, pos_specs = _pos_inputs(q_pos, k_pos, q_seg, k_seg, bq, bk, q_block,
                                      lambda b, hh, j, i, *_: j)
  q_spec = pl.BlockSpec((None, bq, q_lanes),
                        lambda b, hh, j, i, f, x: (b, q_block(b, hh, j, i, f, x), hh))
  kv_spec = pl.BlockSpec((None, bk, kv_lanes), lambda b, hh, j, i, *_: (b, j, hh))
  stat_spec = pl.BlockSpec((None, None, bq, stat_lanes),
                           lambda b, hh, j, i, f, x: (b, hh, q_block(b, hh, j, i, f, x), 0))
  dkv_kernel = functools.partial(_dkv_kernel, t=t, bf=bf, nq=nq, nk=nk)
  arrays = pos_arrays + arrays_common
  out_shape = [((bsz, s, kh * h), jnp.float32)] * 2
  dk, dv = _call(
      dkv_kernel, (bsz, nh, nk, nq), (flags_t.reshape(-1), fetch_t.reshape(-1)), arrays,
      pos_specs + [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec],
      [kv_spec, kv_spec], out_shape,
      [pltpu.VMEM((hk, bk, h), jnp.float32)] * 2, spec,
      _vmem_estimate(bq, bk, g, hk, h, q.dtype.itemsize), "ringflash_bwd_dkv", refs,
      _cost(4, bsz, tq, s, n, h, spec, arrays, out_shape))

  # dq: grid (b, hh, i, j); the key tile index j is reduced.
  bq, bk = spec.tiles.block_q_dq, spec.tiles.block_k_dq
  nq, nk = tq // bq, s // bk
  t = _Tile(hk, g, h, bq, bk, spec, has_seg, q.dtype)
  flags = _tile_flags(q_pos, k_pos, q_seg, k_seg, spec, bq, bk)       # [Bf, nq, nk]
  bf = flags.shape[0]
  fetch = _fetch_index(flags)

  def kv_block(b, hh, i, j, flags_ref, idx_ref):
    del hh, flags_ref
    return _flag_at(idx_ref, b, i, j, bf, nq, nk)

  pos_arrays, pos_specs = _pos_inputs(q_pos, k_pos, q_seg, k_seg, bq, bk,
                                      lambda b, hh, i, j, *_: i, kv_block)
  q_spec = pl.BlockSpec((None, bq, q_lanes), lambda b, hh, i, j, *_: (b, i, hh))
  kv_spec = pl.BlockSpec((None, bk, kv_lanes),
                         lambda b, hh, i, j, f, x: (b, kv_block(b, hh, i, j, f, x), hh))
  stat_spec = pl.BlockSpec((None, None, bq, stat_lanes), lambda b, hh, i, j, *_: (b, hh, i, 0))
  dq_kernel = functools.partial(_dq_kernel, t=t, bf=bf, nq=nq, nk=nk)
  arrays = pos_arrays + arrays_common
  out_shape = [((bsz, tq, n * h), jnp.float32)]
  (dq,) = _call(
      dq_kernel, (bsz, nh, nq, nk), (flags.reshape(-1), fetch.reshape(-1)), arrays,
      pos_specs + [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec],
      [q_spec], out_shape,
      [pltpu.VMEM((hk, g * bq, h), jnp.float32)], spec,
      _vmem_estimate(bq, bk, g, hk, h, q.dtype.itemsize), "ringflash_bwd_dq", refs,
      _cost(3, bsz, tq, s, n, h, spec, arrays, out_shape))

  return (base.match_vma(dq.reshape(bsz, tq, n, h), *refs),
          base.match_vma(dk.reshape(bsz, s, kh, h), *refs),
          base.match_vma(dv.reshape(bsz, s, kh, h), *refs))
