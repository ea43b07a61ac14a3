"""The kernel contract: attention over ONE (query block, key/value block) pair on ONE device.

Every backend module (`xla`, `pallas_tpu`, `pallas_gpu`) implements the same two functions:

  forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec) -> (o, lse)
    q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] with N % K == 0 (query head n uses kv
    head n // (N // K)); the value head dim Hv may differ from H;
    o [B, T, N, Hv] float32, normalized over this block pair only;
    lse [B, N, T] float32, natural log of sum_j exp(s_ij) over the valid keys of this pair,
    with s = scale * q.k_j (soft-capped: spec.softcap * tanh(s / spec.softcap)), -inf for a
    row with no valid key (and then o == 0).

  backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec, dlse=None)
      -> (dq, dk, dv), float32 partial gradients of this block pair;
    out [B, T, N, Hv] and lse [B, N, T] are the GLOBAL (merged over all pairs) ones, so that
    p = exp(s - lse) is already the final softmax probability of every pair and no partial
    result needs re-normalizing. dlse [B, N, T] float32 is the cotangent of the global lse
    (None means zero).

Positions are int32 global token indices ([T] and [S]); segment ids are int [B, T] and
[B, S] or None (no document masking). A layout only changes which positions a device holds:
every mask here is a function of (q_pos, k_pos, q_seg, k_seg) and nothing else.

Non-finite values, the same on every backend: a NaN or Inf in a position a row attends to
(its query, or the key or value of a key it sees) makes that row's output non-finite, and
the gradients that depend on it; one in a position the row does not see never reaches it.
"No valid key" (o = 0, lse = -inf) is decided by the mask alone, never by a NaN statistic
(`finish_rows`).

Scores below float32's range: a finite query and key whose scaled product overflows float32
give a score of -inf, as a masked pair does. A row whose valid scores are ALL such has no
float32 answer (exactly, a one-hot on the largest true score), yet must not pass for a row
without keys (0, a silently wrong finite answer). So the kernels floor the running max of a
row that met a valid key at LOWEST (float32's lowest finite value), and such a row ends with
o = 0 and lse = LOWEST (`finish_rows`): a merge weighs it exactly 0 beside any row part with a
representable score, and so does a sink; where LOWEST is still a row's final lse, the API
makes that row NaN (ringflash/_inputs.py, `overflowed_rows`), as a softmax over -inf does.

The caller applies `guard_kv` to K/V and `guard_q` to Q once before forward
kernels and `guard_backward` once before backward kernels (the ring does, before its pieces
travel); the kernels then only need `where` masks (never a product) between masked pairs and
their scores, and "no key" taken from the running max and sum.

A backend module also has NAME, `unsupported(problem)` (why it cannot run a call: None if it
can) and `resolve_tiles(block_sizes, problem)` (its tile configuration, kernels/tiles.py,
with every size resolved). This module holds what the backends share: the problem and spec,
the mask rules, tile skipping tests and the non-finite guards.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Problem:
  """What a backend is asked to compute on each device, static: the facts its capability
  check and its tile choice read.

  Attributes:
    q_len, kv_len: the runs of query and key rows that tiles must divide (local lengths,
      halved where a zigzag chunk or a bidirectional half is the unit).
    head_dim: H.
    kv_heads: K. group: N // K query heads per kv head.
    dtype: the inputs' dtype.
    platform: the devices' platform ("cpu", "gpu", "cuda", "tpu").
    device_kind: e.g. "TPU v5p", "NVIDIA H200" ("" when unknown).
    compute_capability: a GPU's "9.0", else None.
    causal, window, segments: the masks in use.
    head_dim_v: Hv, the value (and output) head dim; None means H.
    softcap: the logit soft-cap, or None.
  """

  q_len: int
  kv_len: int
  head_dim: int
  kv_heads: int
  group: int
  dtype: jnp.dtype
  platform: str
  device_kind: str = ""
  compute_capability: str | None = None
  causal: bool = False
  window: tuple[int, int] | None = None
  segments: bool = False
  head_dim_v: int | None = None
  softcap: float | None = None

  @property
  def value_dim(self) -> int:
    """Hv (H when the values share the keys' head dim)."""
    return self.head_dim if self.head_dim_v is None else self.head_dim_v

  @property
  def interpret(self) -> bool:
    """Pallas kernels run in interpret mode on CPU devices."""
    return self.platform == "cpu"


@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """Static description of the attention a kernel computes; hashable, part of jit keys.

  Attributes:
    scale: multiplier of q.k before the softmax.
    causal: mask key positions greater than the query position.
    tiles: the backend's tile configuration, resolved (every size an int that divides its
      local length, except in pallas_gpu, which pads the rows up to whole tiles per call):
      xla.XlaBlockSizes, pallas_tpu.TpuBlockSizes or pallas_gpu.GpuBlockSizes.
    interpret: run Pallas kernels in interpret mode (set when the devices are CPUs).
    window: None, or (left, right) non-negative ints, jax.nn's `local_window_size`: query
      position i sees key positions j with i - left <= j <= i + right. Example: (3, 2) lets
      query 6 see keys 3..8. Combined with `causal`, the right side is cut at j <= i.
    softcap: None, or cap > 0: scores are s = cap * tanh(scale * q.k / cap), before the
      mask (Gemma 2's order); the backward multiplies ds by 1 - (s / cap)^2.
  """

  scale: float
  causal: bool
  tiles: object
  interpret: bool = False
  window: tuple[int, int] | None = None
  softcap: float | None = None

  @property
  def block_q(self) -> int:
    """The forward's query rows per tile (the ring's plan counts tiles of this size)."""
    return self.tiles.block_q

  @property
  def block_k(self) -> int:
    """The forward's key rows per tile."""
    return self.tiles.block_k


def capped(s, spec: KernelSpec):
  """Scores soft-capped as the spec says: cap * tanh(s / cap), or s itself without a cap.
  s is the scaled score scale * q.k (float32); the mask applies after this."""
  if spec.softcap is None:
    return s
  return spec.softcap * jnp.tanh(s / spec.softcap)


def capped_grad(ds, s_capped, spec: KernelSpec):
  """dL/d(scale * q.k) from dL/ds of the capped score s_capped = cap * tanh(x / cap):
  ds * (1 - (s_capped / cap)^2); ds itself without a cap."""
  if spec.softcap is None:
    return ds
  t = s_capped / spec.softcap
  return ds * (1.0 - t * t)


def pair_mask(qp, kp, q_seg, k_seg, *, causal: bool, window):
  """The mask rules, on operands already broadcast against each other (any orientation):
  bool, or None where no rule applies. Every kernel evaluates its in-tile mask with this.

  causal: k_pos <= q_pos; window (left, right): -right <= q_pos - k_pos <= left, written as
  differences so no bound leaves int32; segments: equal ids. Example: q_pos 6 with window
  (3, 2) keeps k_pos 3..8.
  """
  valid = None
  if causal:
    valid = kp <= qp
  if window is not None:
    diff = qp - kp                                             # i - j
    near = (diff <= window[0]) & (diff >= -window[1])
    valid = near if valid is None else valid & near
  if q_seg is not None:
    same = q_seg == k_seg
    valid = same if valid is None else valid & same
  return valid


def mask(q_pos, k_pos, q_seg, k_seg, spec: KernelSpec):
  """Which (query, key) pairs may attend, for one tile.

  Args:
    q_pos: [tq] int32 global positions of the tile's queries.
    k_pos: [tk] int32 global positions of the tile's keys.
    q_seg: [B, tq] int segment ids, or None.
    k_seg: [B, tk] int segment ids, or None.
    spec: the kernel spec.

  Returns:
    bool [B, tq, tk] ([1, tq, tk] without segment ids): True where the pair is valid.
  """
  valid = pair_mask(q_pos[None, :, None], k_pos[None, None, :],
                    None if q_seg is None else q_seg[:, :, None],
                    None if k_seg is None else k_seg[:, None, :],
                    causal=spec.causal, window=spec.window)
  full = jnp.ones((1, q_pos.shape[0], k_pos.shape[0]), dtype=jnp.bool_)
  return full if valid is None else full & valid


def ranges_may_have_work(q_lo, q_hi, k_lo, k_hi, *, causal: bool, window):
  """Whether queries with positions in [q_lo, q_hi] may see keys in [k_lo, k_hi].

  Uses only comparisons and `&`, so it runs on Python ints, NumPy arrays (the ring's
  planner, ringflash/layouts.py, counts tiles with it) and traced jnp scalars (the kernels
  and the ring) alike: one rule decides what the planner counts and what the code skips.
  Exact when both sets are full integer ranges; conservative (may say True for a pair
  without valid entries) when they are not, e.g. striped positions 3, 11, 19, ...

  Causal: some key j <= some query i  <=>  k_lo <= q_hi.
  Window (left, right): some pair has -right <= i - j <= left  <=>
    k_hi >= q_lo - left (the latest key reaches back to the earliest query's window) and
    k_lo <= q_hi + right. Example, window (2, 0): queries 10..13 and keys 5..7 fail
    (7 < 10 - 2); keys 5..8 pass (query 10 sees key 8).

  Args:
    q_lo, q_hi, k_lo, k_hi: int positions (scalars or arrays that broadcast).
    causal: the spec's causal flag.
    window: the spec's window, None or (left, right).

  Returns:
    bool (Python, NumPy or jnp, following the inputs).
  """
  ok = True
  if causal:
    ok = ok & (k_lo <= q_hi)
  if window is not None:
    left, right = window
    ok = ok & (q_lo - k_hi <= left) & (k_lo - q_hi <= right)
  return ok


def block_may_have_work(q_pos, k_pos, spec: KernelSpec, q_seg=None, k_seg=None):
  """A cheap, conservative test of whether a block pair (or one tile) has any valid entry.

  Looks only at the ranges [min, max] of positions and segment ids, O(T + S) work, never
  at the pairs. False only when no pair can be valid: with causal masking, when the smallest
  key position exceeds the largest query position (contiguous layout, device i at ring step
  s holds the keys of device i - s mod P, so every step whose source lies after i is dead:
  about half the hops); with a window, when the key range lies entirely outside the window
  of the query range (see ranges_may_have_work); with segment ids, when in every batch row
  the query ids' range and the key ids' range are disjoint (packed documents: tiles of
  different documents). Kernels call it per block pair (a dead ring hop is skipped whole)
  and per tile (tile-skipping flags); a True still lets the exact mask decide pair by pair.

  Args:
    q_pos: [tq] int32 positions. k_pos: [tk] int32 positions.
    spec: the kernel spec.
    q_seg: [B, tq] int or None. k_seg: [B, tk] int or None.

  Returns:
    A scalar bool (traced).
  """
  ok = jnp.bool_(True)
  if spec.causal or spec.window is not None:
    ok = ok & ranges_may_have_work(jnp.min(q_pos), jnp.max(q_pos), jnp.min(k_pos),
                                   jnp.max(k_pos), causal=spec.causal, window=spec.window)
  if q_seg is not None and k_seg is not None:
    overlap = (jnp.min(k_seg, axis=1) <= jnp.max(q_seg, axis=1)) & (
        jnp.min(q_seg, axis=1) <= jnp.max(k_seg, axis=1))
    ok = ok & jnp.any(overlap)
  return ok


def guard_kv(k, v):
  """The non-finite rule on keys and values, applied once before any forward kernel.

  A key whose k row or v row holds a NaN or Inf gets k = NaN and v = 0. Its scores are then
  NaN: a row that sees the key gets NaN through its softmax (the in-tile mask replaces the
  scores of masked pairs by -inf with a `where`, so a row that does not see it is
  untouched); and its zero value cannot leak through the product p @ v, where a masked pair
  has weight exactly 0 and 0 * NaN would be NaN. Elementwise, O(S * H).

  Args:
    k: [B, S, K, H]; v: [B, S, K, Hv].

  Returns:
    (k, v) of the same shapes and dtypes.
  """
  bad = ~(jnp.all(jnp.isfinite(k), axis=-1) & jnp.all(jnp.isfinite(v), axis=-1))  # [B, S, K]
  return (jnp.where(bad[..., None], jnp.asarray(jnp.nan, k.dtype), k),
          jnp.where(bad[..., None], jnp.zeros((), v.dtype), v))


def guard_q(q, softcap):
  """The non-finite rule on queries under a soft-cap, applied once before any forward kernel.

  Without a cap, a query row's NaN or Inf reaches its scores and its softmax (an infinite
  score makes the row's max infinite and exp(inf - inf) NaN). cap * tanh(s / cap) would turn
  an infinite score into a finite +-cap, and the backward (guard_backward: such an entry
  counts as 0) would then differ from the forward; so with a cap, a query row holding a NaN
  or Inf becomes all NaN. Elementwise, O(T * H); without a cap q is returned as it is.

  Args:
    q: [B, T, N, H]; softcap: the spec's cap or None.
  """
  if softcap is None:
    return q
  return nan_query_rows(q)


def nan_query_rows(q):
  """q [..., T, N, H] with every query row (one token, one head) that holds a NaN or Inf made
  all NaN. NaN is added, so where JAX differentiates it (outside a custom_vjp) the cotangent
  of q passes as it is. Elementwise, O(T * H)."""
  bad = ~jnp.all(jnp.isfinite(q), axis=-1, keepdims=True)                 # [..., T, N, 1]
  return jnp.where(bad, q + jnp.asarray(jnp.nan, q.dtype), q)


def guard_backward(q, k, v, out, dout, lse, dlse=None):
  """The non-finite rule for the backward kernels, applied once before them.

  Every non-finite entry of q, k, v, out and dout is replaced by 0, so that no product of a
  backward kernel (p^T dout, ds^T q, ds k, dout v^T, rowsum(dout * out)) carries a NaN into
  a row or key through a pair of weight 0. What a row saw is carried by its statistics
  instead: the forward made lse NaN for every row that saw a non-finite query, key or value
  (guard_kv), and here lse becomes NaN for the rows whose dout (or dlse) is non-finite, and
  for the rows whose valid scores were all below float32's range (lse = LOWEST); then
  p = exp(s - lse) is NaN on exactly the visible pairs of those rows, which are the
  gradients that depend on the bad values. A row whose cotangents are all zero contributes
  nothing, NaN or not: where its lse is not finite it becomes -inf, as for a row without
  keys, so a loss that masks the rows which saw a NaN gets finite, exact gradients. A finite
  row keeps its lse, so the backward stays linear in the cotangent there too (its
  derivative with respect to a zero cotangent, which second-order methods take, is not
  zeroed). Rows with no valid key keep zero gradients.

  Args:
    q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], out and dout [B, T, N, Hv],
    lse [B, N, T] float32 (global), dlse [B, N, T] or None.

  Returns:
    (q, k, v, out, dout, lse, dlse), guarded.
  """
  def zero(x):
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))

  def rows(x):                                     # [B, T, N] -> [B, N, T]
    return x.transpose(0, 2, 1)

  row_bad = rows(~jnp.all(jnp.isfinite(dout), axis=-1))
  silent = rows(jnp.all(dout == 0, axis=-1))
  if dlse is not None:
    row_bad = row_bad | ~jnp.isfinite(dlse)
    silent = silent & (dlse == 0)
    dlse = zero(dlse)
  lse = jnp.where(row_bad & (lse != -jnp.inf), jnp.nan, lse)
  # A row whose valid scores were all below float32's range is NaN (the forward's
  # overflowed_rows, ringflash/_inputs.py): so are its gradients, where the loss reads it.
  lse = jnp.where(lse == LOWEST, jnp.nan, lse)
  lse = jnp.where(silent & ~jnp.isfinite(lse), -jnp.inf, lse)
  return zero(q), zero(k), zero(v), zero(out), zero(dout), lse, dlse


LOWEST = float(np.finfo(np.float32).min)
# Segment ids of padding rows (ringflash/_inputs.py, and the pallas_gpu backend's rows up to
# whole tiles): a query row with PAD_Q sees nothing, a key with PAD_K is seen by nothing; no
# real id equals either (the API refuses them), and as the largest and smallest int32 their
# tiles fail every range test (block_may_have_work).
PAD_Q = int(np.iinfo(np.int32).max)
PAD_K = int(np.iinfo(np.int32).min)


def floor_at_lowest(x):
  """x with -inf raised to LOWEST (NaN stays NaN: a `where`, not a max, which some hardware
  computes as maxNum): valid scores, or the running max of a row that met a valid key."""
  return jnp.where(x < LOWEST, LOWEST, x)


def finish_rows(m, l, m_scale=1.0):
  """The end of an online softmax, per row: (inv, lse) with o = acc * inv.

  m: the running max (in the units m * m_scale of natural-log scores; m_scale = ln 2 for a
  base-2 max), floored at LOWEST once the row met a valid key; l: the running sum.
    no valid key (m = -inf, l = 0):            inv = 0, lse = -inf;
    every valid score below float32 (m = LOWEST, l finite): inv = 0, lse = LOWEST;
    a NaN (l NaN):                             inv NaN, lse NaN;
    otherwise:                                 inv = 1 / l, lse = m * m_scale + log(l).
  A row met a key where its max left -inf or its sum is NaN (a NaN score; max reductions on
  some hardware skip NaN operands): rows whose every valid score is NaN must not pass for
  rows without keys, nor for rows of scores below float32.
  """
  # Ordered comparisons only: no `~` (Mosaic GPU cannot lower a bool array's not) and no
  # float `!=` or isnan (an unordered comparison, which Mosaic TPU does not lower: libtpu
  # 0.0.52 with jax 0.12.1 refuses "comparison direction: une"). l == l: l is not NaN.
  # m > LOWEST: the row met a valid score float32 holds (m is -inf, LOWEST or more; a NaN
  # m fails it, as it failed m > -inf).
  floor_only = (m == LOWEST) & (l == l)
  real = (m > LOWEST) | (jnp.where(l == l, 0.0, 1.0) > 0.5)
  l_safe = jnp.where(real, l, 1.0)
  inv = jnp.where(real, 1.0 / l_safe, 0.0)
  lse = jnp.where(real, m * m_scale + jnp.log(l_safe),
                  jnp.where(floor_only, LOWEST, -jnp.inf))
  return inv, lse


def softmax_delta(out, dout, dlse=None):
  """D [B, N, T] float32 = rowsum(dout * out) - dlse: the backward's per-row term, with
  dS = P * (dP - D) (dlse None means zero), computed once per backward by every backend."""
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  delta = delta.transpose(0, 2, 1)
  return delta if dlse is None else delta - dlse


def ds_dtype(dtype):
  """The dtype of ds (and of q, k beside it) in the backward's products ds k and ds^T q:
  the inputs' own, except float16, whose range (65504) ds = p (dp - D) passes where the
  output cotangent is large (a loss scale of 2^15 on O(1) values is enough): float32 there.
  bfloat16 has float32's range."""
  return jnp.float32 if jnp.dtype(dtype) == jnp.float16 else dtype


def matmul_precision(dtype):
  """Products of fp32 inputs at full precision (TPU would otherwise use bf16 passes)."""
  return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def largest_divisor_at_most(n: int, cap: int, multiple_of: int = 1) -> int | None:
  """The largest d <= cap with n % d == 0 and d % multiple_of == 0, or None."""
  for d in range(min(n, cap), 0, -1):
    if n % d == 0 and d % multiple_of == 0:
      return d
  return None


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def pad_rows(x, n: int, axis: int = 1, value=0):
  """x with n rows of `value` appended along `axis` (x itself for n = 0 or None)."""
  if x is None or not n:
    return x
  pads = [(0, 0)] * x.ndim
  pads[axis] = (0, n)
  return jnp.pad(x, pads, constant_values=value)


def fit_rows(q_rows: int, k_rows: int, q, k, v, q_pos, k_pos, q_seg, k_seg):
  """The block pair with rows appended up to multiples of q_rows (queries) and k_rows
  (keys), so that whole tiles cover them: zero rows at the last row's position (tile ranges
  stay the real ones) whose segment ids see nothing, PAD_Q for queries and PAD_K for keys
  (ids of zeros made for the real rows where there were none), as ringflash/_inputs.py pads
  a sequence. The caller pads its other arrays of query rows by the same count (pad_rows)
  and cuts the padded rows off its results. T = 200, S = 1000, tiles 128 and 64: 56 query
  rows and 24 key rows. Used by the backends whose tiles need not divide a local length
  (pallas_gpu; xla's default tiles of a length without a large divisor).

  Returns ((q, k, v, q_pos, k_pos, q_seg, k_seg), padded query rows), all unchanged where
  the tiles divide the lengths (a static branch).
  """
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  pt, ps = round_up(t, q_rows) - t, round_up(s, k_rows) - s
  if not (pt or ps):
    return (q, k, v, q_pos, k_pos, q_seg, k_seg), 0
  if q_seg is None:
    q_seg = match_vma(jnp.zeros((b, t), jnp.int32), q)
    k_seg = match_vma(jnp.zeros((b, s), jnp.int32), k)
  q_seg = pad_rows(q_seg.astype(jnp.int32), pt, value=PAD_Q)
  k_seg = pad_rows(k_seg.astype(jnp.int32), ps, value=PAD_K)
  q_pos, k_pos = pad_rows(q_pos, pt, 0, q_pos[-1]), pad_rows(k_pos, ps, 0, k_pos[-1])
  return (pad_rows(q, pt), pad_rows(k, ps), pad_rows(v, ps), q_pos, k_pos, q_seg,
          k_seg), pt


def match_vma(x, *refs):
  """x, marked as varying over every manual mesh axis that any of `refs` varies over.

  Inside shard_map, JAX types each value by the mesh axes it varies over; a constant made
  by jnp.zeros varies over none, so a loop carry or cond branch built from one would not
  match the values computed from the inputs. This reads the axes off the inputs' types, so
  kernels stay unaware of meshes; outside shard_map it returns x unchanged.
  """
  def vma(a):
    aval = jax.typeof(a)
    if hasattr(aval, "vma"):                    # jax 0.11
      return aval.vma
    manual = getattr(aval, "manual_axis_type", None)   # newer jax
    return manual.varying if manual is not None else frozenset()

  want = frozenset().union(*(vma(r) for r in refs if r is not None))
  missing = tuple(sorted(want - vma(x)))
  if not missing:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, missing, to="varying")
  return lax.pvary(x, missing)  # jax releases before pcast


def no_vma_check():
  """A context in which values are traced without mesh-axis typing.

  Pallas GPU kernels (Mosaic GPU's plgpu.kernel does this itself, Triton's pallas_call does
  not) cannot type their outputs by mesh axes inside shard_map: their calls are traced in
  this context and the outputs re-typed with match_vma.
  """
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
  return jax_config._check_vma(False)  # pylint: disable=protected-access


def filled(shape, value, refs, dtype=jnp.float32):
  """jnp.full(shape, value, dtype) typed as varying like `refs` (see match_vma)."""
  return match_vma(jnp.full(shape, value, dtype), *refs)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order(name: str, x):
  """x itself; differentiating it raises first_order_only's error (see there)."""
  del name
  return x


@_first_order.defjvp
def _no_second_derivative(name, primals, tangents):
  del primals, tangents
  raise NotImplementedError(
      f"backend {name!r} computes first derivatives only (JAX cannot differentiate its "
      f"Pallas kernels): jax.grad of jax.grad, jax.hessian and forward mode of the kernels "
      f"need backend='xla'")


def first_order_only(name: str, kernel):
  """`kernel` (a Pallas backend's forward or backward), made to say why it has no derivative.

  JAX cannot differentiate a pallas_call; where something does (jax.grad of jax.grad or
  jax.hessian, which differentiate the backward pass; forward mode of the kernels), it raised
  a NotImplementedError with no message. Each floating-point input first passes an identity
  whose custom_jvp rule raises one that names the backend and the one that has second
  derivatives (xla, written in jnp): a differentiated kernel has an input with a tangent,
  and that input's identity comes first. (The identity, not the kernel, is what the custom_jvp
  wraps: the Mosaic GPU kernels hold mutable refs, which a custom_jvp body cannot.) Nothing
  changes where nothing is differentiated.
  """
  def guard(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):   # tracers too
      return _first_order(name, x)
    return x

  @functools.wraps(kernel)
  def call(*args, **kwargs):
    return kernel(*[guard(a) for a in args], **{k: guard(a) for k, a in kwargs.items()})

  return call
