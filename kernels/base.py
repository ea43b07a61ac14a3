"""The kernel contract: attention over ONE (query block, key/value block) pair on ONE device.

Every backend module (`xla`, `pallas_tpu`, `pallas_gpu`) implements the same two functions:

  forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec) -> (o, lse)
    q [B, T, N, H], k/v [B, S, K, H] with N % K == 0 (query head n uses kv head n // (N // K));
    o [B, T, N, H] float32, normalized over this block pair only;
    lse [B, N, T] float32, natural log of sum_j exp(scale * q.k_j) over the valid keys of this
    pair, -inf for a row with no valid key (and then o == 0).

  backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec, dlse=None)
      -> (dq, dk, dv), float32 partial gradients of this block pair;
    out [B, T, N, H] and lse [B, N, T] are the GLOBAL (merged over all pairs) ones, so that
    p = exp(s - lse) is already the final softmax probability of every pair and no partial
    result needs re-normalizing. dlse [B, N, T] float32 is the cotangent of the global lse
    (None means zero).

Positions are int32 global token indices ([T] and [S]); segment ids are int [B, T] and
[B, S] or None (no document masking). A layout only changes which positions a device holds:
every mask here is a function of (q_pos, k_pos, q_seg, k_seg) and nothing else.

This module holds what the backends share: the static spec, tile sizes and the mask.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of a kernel: `block_q` query rows by `block_k` key rows.

  None leaves the choice to the backend's per-hardware default. Each backend checks the
  sizes it is given against the local lengths and its own tiling rules.
  """

  block_q: int | None = None
  block_k: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"block_sizes.{name} must be a positive int or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """Static description of the attention a kernel computes; hashable, part of jit keys.

  Attributes:
    scale: multiplier of q.k before the softmax.
    causal: mask key positions greater than the query position.
    block_q: query rows per tile (resolved: an int dividing the local query length).
    block_k: key rows per tile (resolved: an int dividing the local key length).
    interpret: run Pallas kernels in interpret mode (set when the devices are CPUs).
    window: None, or (left, right) non-negative ints, jax.nn's `local_window_size`: query
      position i sees key positions j with i - left <= j <= i + right. Example: (3, 2) lets
      query 6 see keys 3..8. Combined with `causal`, the right side is cut at j <= i.
  """

  scale: float
  causal: bool
  block_q: int
  block_k: int
  interpret: bool = False
  window: tuple[int, int] | None = None


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
  valid = jnp.ones((1, q_pos.shape[0], k_pos.shape[0]), dtype=jnp.bool_)
  if spec.causal:
    valid = valid & (k_pos[None, None, :] <= q_pos[None, :, None])
  if spec.window is not None:
    left, right = spec.window
    # i - left <= j <= i + right, written as differences so no bound leaves int32.
    diff = q_pos[None, :, None] - k_pos[None, None, :]           # i - j
    valid = valid & (diff <= left) & (diff >= -right)
  if q_seg is not None:
    valid = valid & (q_seg[:, :, None] == k_seg[:, None, :])
  return valid


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


def softmax_delta(out, dout, dlse=None):
  """D [B, N, T] float32 = rowsum(dout * out) - dlse: the backward's per-row term, with
  dS = P * (dP - D) (dlse None means zero), computed once per backward by every backend."""
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  delta = delta.transpose(0, 2, 1)
  return delta if dlse is None else delta - dlse


def matmul_precision(dtype):
  """Products of fp32 inputs at full precision (TPU would otherwise use bf16 passes)."""
  return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def largest_divisor_at_most(n: int, cap: int, multiple_of: int = 1) -> int | None:
  """The largest d <= cap with n % d == 0 and d % multiple_of == 0, or None."""
  for d in range(min(n, cap), 0, -1):
    if n % d == 0 and d % multiple_of == 0:
      return d
  return None


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
