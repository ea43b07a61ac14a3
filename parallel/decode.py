"""Decoding: a few new tokens attend a KV cache sharded over the sequence; the cache never moves.

Per device inside shard_map over the sequence axis (P devices). Each device attends the t new
tokens (replicated) to the cache slots it holds with the kernel contract, and the partial
results combine exactly through their log-sum-exp: with m = pmax(lse) over the devices,
  out = psum(o * exp(lse - m)) / psum(exp(lse - m)),   lse = m + log(psum(exp(lse - m))),
one max and one sum reduction of [B, t, N, Hv + 1] floats (the approach of Tree Attention). A
device whose slots hold nothing the row sees has lse = -inf and weight exactly 0; a row seen
by no device gives 0 (lse -inf). Everything is float32 from the kernel to the one division.

Which key a query sees: query i of row b sits at position p_bi = L_b - t + i (L_b the row's
cache length) and sees the slots whose position x satisfies x <= p_bi (causal) and, with a
window of `left`, x >= p_bi - left. Positions are per row and per slot ([B, S] int32): a slot
that holds nothing has EMPTY (any position at or past it is free) and is never seen. The
kernel contract takes positions shared by the batch, so visibility goes to the kernel as
segment ids instead (VISIBLE or INVISIBLE_K per row and slot; the kernel runs without causal
or window rules). The t queries of a row see nested, not equal, key sets, and one key has
one segment id, so the keys split in two:
  core: seen by all t queries: x <= L_b - t and x >= L_b - 1 - left; one kernel call for
    all t queries over the whole shard;
  band i: seen by query i but not by all: at most 2 (t - 1) keys per row (the newer new tokens
    and the window's lower edge); one call per query, whose tiles are all skipped but those
    few.
With t = 1 there is no band: one call. The kernel skips every tile (and on the xla backend the
whole shard) in which no row sees a key: the tile's segment range misses the queries' (see
base.block_may_have_work), which is how a window or a short row skips shards that hold
nothing in range.

Worked example, P = 4 devices, S = 32 slots (8 per device), natural positions (slot s holds
position s: device 2 holds 16..23), one row with L = 19 and t = 2: the new tokens sit at
positions 17 and 18. core: x <= 17, so device 0 sees 0..7, device 1 8..15, device 2 16..17,
device 3 nothing (its lse is -inf: weight 0, its kernel skipped). band of query 1: key 18, on
device 2. With a window left = 4, core is 14..17 (x >= 18 - 4) and band of query 0 adds key 13
(17 - 4): devices 0 and 3 then hold nothing in range and skip their kernels whole.

Split-KV (flash-decoding): with t = 1 a kernel call has only B * K query tiles to spread over
the processors, each streaming the whole shard. On GPUs the shard is cut into `chunks` runs of
consecutive slots viewed as extra batch rows (a free reshape of [B, S, K, H] to
[B * c, S / c, K, H]; the queries repeated per run), so B * K * c tiles run at once, and the c
partial results of a row merge exactly through their LSE before the reduction over devices.
Example: B = 1, K = 4, S_local = 524288 on an H200 (132 SMs): c = 64 runs of 8192 slots.

GQA: the G = N / K query heads of a kv head are folded into query rows, so the kernel sees
[B, t * G, K, H] queries with one query head per kv head: row i * G + g, head c holds query
head c * G + g of token i. Rows are padded up to the backend's LENGTH_MULTIPLE (the GPU kernel
tiles 128 query rows) with rows that see nothing (segment id PAD_Q) and are dropped after.

The KV cache (ringflash.KVCache) keeps every device's share of slots balanced: slot counter n
(the n-th slot a row fills) is local slot n // P of device n mod P. A prefill of T tokens, as
the ring computed them (device i holds its contiguous chunk), fills local slots 0..T/P - 1 of
every device in place: counters 0..T - 1. Then token T goes to device T mod P, local slot T / P,
and so on. Example, P = 4, prefill T = 8 (contiguous): device 1 holds positions 2, 3 in its
slots 0, 1; appended tokens 8..12 land on devices 0, 1, 2, 3, 0 at local slots 2, 2, 2, 2, 3,
so device 1 then holds positions 2 3 9. Positions travel with the slots, so masks stay exact.

Baselines of the same computation, for the bench: "allgather" (every device gathers the whole
cache, then one local attention) and "ring" (the shards rotate P - 1 hops around the ring,
merged step by step as in parallel/ring.py).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from ringflash.kernels import base
from ringflash.kernels import get_backend
from ringflash.parallel import plan as ring_plan
from ringflash.parallel.merge import merge

# A free slot's position: later than any query (caches hold fewer than 2**30 slots), and small
# enough that no mask difference of positions leaves int32.
EMPTY = 2**30
# Segment ids: a key a query sees has VISIBLE; one it does not see INVISIBLE_K; a padding
# query row PAD_Q (sees nothing). The padding ids of kernels/base.py, so the kernels' range
# test skips a tile of unseen keys.
VISIBLE = 0
INVISIBLE_K = base.PAD_K
PAD_Q = base.PAD_Q
STRATEGIES = ("reduce", "allgather", "ring")


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """Static part of one decode attention.

  Attributes:
    core: the kernel spec (resolved tiles) of the core call, rows_core query rows.
    band: the kernel spec of the band calls (rows_band rows), None when t == 1.
    backend: the kernel backend's name.
    axis_name: the mesh axis (or axes) the cache's sequence is sharded over.
    size: P, devices along it.
    t: new tokens per row. group: G = N // K.
    rows_core: t * G rounded up to the backend's row multiple. rows_band: G rounded up.
    window_left: how far back a query sees (local_window_size's left), or None.
    strategy: "reduce" (local kernel + one reduction), "allgather" or "ring".
    guard: apply base.guard_kv to the shard (False: the K/V were guarded when written).
    chunks: runs of slots each kernel call splits its keys into (split-KV), dividing them.
  """

  core: base.KernelSpec
  band: base.KernelSpec | None
  backend: str
  axis_name: str | tuple[str, ...]
  size: int
  t: int
  group: int
  rows_core: int
  rows_band: int
  window_left: int | None
  strategy: str = "reduce"
  guard: bool = True
  chunks: int = 1


# Split-KV: runs of at least this many slots, whole tiles of 128 keys.
MIN_CHUNK = 1024
CHUNK_MULTIPLE = 128


def split_count(platform: str, core_count: int | None, tiles: int, kv_len: int) -> int:
  """How many runs (a power of two) a kernel call cuts its kv_len keys into: the most whose
  `tiles` query tiles times the runs stay within two per processor (two waves of CUDA blocks):
  on GPUs only (a TPU core and the xla backend's loops run tiles one after another). Runs
  stay whole multiples of CHUNK_MULTIPLE keys and at least MIN_CHUNK long.

  Example: H200 (132 SMs), B = 1, K = 4 (4 tiles), kv_len 524288: 64 runs of 8192 keys.
  """
  if platform not in ("gpu", "cuda"):
    return 1
  want = 2 * (core_count or 132)
  c = 1
  while (tiles * 2 * c <= want and kv_len % (2 * c * CHUNK_MULTIPLE) == 0
         and kv_len // (2 * c) >= MIN_CHUNK):
    c *= 2
  return c


def padded_rows(rows: int, multiple: int) -> int:
  """rows rounded up to a multiple of `multiple` (the backend's LENGTH_MULTIPLE)."""
  return -(-rows // multiple) * multiple


def natural_positions(axis_name, batch: int, local_len: int):
  """[B, S_local] int32: slot s of device i holds position i * S_local + s (every row)."""
  start = lax.axis_index(axis_name) * local_len
  pos = start + jnp.arange(local_len, dtype=jnp.int32)
  return jnp.broadcast_to(pos[None], (batch, local_len))


def visibility(lengths, positions, t: int, window_left: int | None):
  """Which slots the new tokens see: (core [B, S] bool, bands [t] of [B, S] bool | None).

  core: seen by all t queries of the row; bands[i]: seen by query i but not by all.
  lengths [B] and positions [B, S] are any int32 (a slot at or past EMPTY is free): they are
  compared as uint32 offset by 2**31, which keeps int32's order, so that neither a query's
  position (lengths - t + i, below int32 for a row shorter than t near its smallest) nor a
  distance to a key overflows.
  """
  def biased(x):
    return lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32) ^ jnp.uint32(2**31)

  ends = biased(lengths)[:, None]                               # [B, 1]
  x = biased(positions)                                         # [B, S]
  real = positions < EMPTY
  left = window_left

  def seen(back, p_back=None):
    """Keys x <= lengths - back (x + back cannot pass 2**32 below EMPTY), within the window
    of the query at lengths - p_back >= them (p_back None: no window)."""
    ok = real & (x + jnp.uint32(back) <= ends)
    if p_back is None:
      return ok
    return ok & (ends - jnp.uint32(p_back) - x <= jnp.uint32(left))   # exact where ok

  core = seen(t, None if left is None else 1)
  if t == 1:
    return core, None
  bands = [seen(t - i, None if left is None else t - i) & ~core for i in range(t)]
  return core, bands


def _fold(q, group: int, rows: int):
  """q [B, t, N, H] -> [B, rows, K, H]: row i * G + g, head c is query head c * G + g of
  token i; rows past t * G are zero padding."""
  b, t, n, h = q.shape
  kh = n // group
  qf = q.reshape(b, t, kh, group, h).transpose(0, 1, 3, 2, 4).reshape(b, t * group, kh, h)
  if rows > t * group:
    qf = jnp.pad(qf, ((0, 0), (0, rows - t * group), (0, 0), (0, 0)))
  return qf


def _unfold(o, lse, t: int, group: int):
  """The kernel's (o [B, rows, K, Hv], lse [B, K, rows]) -> (o [B, t, N, Hv], lse [B, N, t]),
  padding rows dropped."""
  b, _, kh, hv = o.shape
  o = o[:, :t * group].reshape(b, t, group, kh, hv).transpose(0, 1, 3, 2, 4)
  lse = lse[:, :, :t * group].reshape(b, kh, t, group).transpose(0, 1, 3, 2)
  return o.reshape(b, t, kh * group, hv), lse.reshape(b, kh * group, t)


def _lse_merge(o, lse, shift, shift_out, total):
  """Exact merge of partial attention results over one axis, in float32.

  o [..., rows, heads, Hv] and lse [..., heads, rows] are the parts (each normalized over its
  own keys); shift (lse's shape) is their max over the merged axis, -inf replaced by 0, and
  shift_out the same without that axis; total sums over it (jnp.sum over an axis of a batch
  of runs, or a psum over devices). The max only shifts the exponents; whether a row has a
  key, or saw a NaN, is read from the sum of the weights: a max may skip NaN operands (CPU's
  all-reduce does), a sum cannot. A part with lse = -inf weighs exactly 0 (its o is 0, so
  o * w is too); one with a NaN lse weighs NaN, and so does the row.

  Returns:
    (o [..., rows, heads, Hv], lse [..., heads, rows]) without the merged axis; a row with no
    key in any part gets 0 and -inf.
  """
  w = jnp.swapaxes(jnp.exp(lse - shift), -1, -2)[..., None]       # [..., rows, heads, 1]
  summed = total(jnp.concatenate([o * w, w], axis=-1))   # one reduction of both
  num, den = summed[..., :-1], summed[..., -1]
  none = den == 0                                       # every part -inf: no key at all
  safe = jnp.where(none, 1.0, den)
  out = jnp.where(none[..., None], 0.0, num / safe[..., None])
  lse = jnp.where(none, -jnp.inf, jnp.swapaxes(shift_out, -1, -2) + jnp.log(safe))
  return out, jnp.swapaxes(lse, -1, -2)


def _max_shift(m):
  return jnp.where(m == -jnp.inf, 0.0, m)


def _attend(qf, k, v, visible, real_rows: int, spec: base.KernelSpec, backend: str,
            chunks: int):
  """One kernel call of folded queries against this shard; visibility as segment ids.

  With chunks = c > 1 (split-KV), the shard's slots are viewed as c runs of S / c per row,
  run j of row b as batch row b * c + j (a free reshape), and the c results of a row merged.

  Returns:
    The kernel's layout: (o [B, rows, K, Hv] float32, lse [B, K, rows] float32).
  """
  b, rows = qf.shape[:2]
  s = k.shape[1]
  # The queries are replicated over the ring, the shard's keys vary over it: mark them
  # varying here, where JAX would otherwise insert the conversion inside the kernel's
  # branches, which fails when those branches are batched (jax.vmap over cache_lengths
  # turns the kernel's tile-skipping cond into a select of both branches).
  qf = base.match_vma(qf, k)
  if chunks > 1:
    k = k.reshape((b * chunks, s // chunks) + k.shape[2:])
    v = v.reshape((b * chunks, s // chunks) + v.shape[2:])
    visible = visible.reshape(b * chunks, s // chunks)
    qf = jnp.repeat(qf, chunks, axis=0)
  q_seg = jnp.broadcast_to(jnp.where(jnp.arange(rows) < real_rows, VISIBLE, PAD_Q)
                           .astype(jnp.int32)[None], (qf.shape[0], rows))
  k_seg = jnp.where(visible, VISIBLE, INVISIBLE_K).astype(jnp.int32)
  q_pos = jnp.zeros((rows,), jnp.int32)                 # no position rule: unused
  k_pos = jnp.zeros((k.shape[1],), jnp.int32)
  o, lse = get_backend(backend).forward(qf, k, v, q_pos, k_pos, q_seg, k_seg, spec)
  if chunks == 1:
    return o, lse
  o = o.reshape((b, chunks) + o.shape[1:])
  lse = lse.reshape((b, chunks) + lse.shape[1:])
  shift = _max_shift(jnp.max(lse, axis=1, keepdims=True))
  return _lse_merge(o, lse, shift, shift[:, 0], lambda x: jnp.sum(x, axis=1))


def attend_shard(q, k, v, lengths, positions, spec: DecodeSpec):
  """(o [B, t, N, Hv] float32, lse [B, N, t] float32) of the new tokens against the slots of
  k, v [B, S, K, H] whose positions are `positions` [B, S]; K/V already guarded."""
  t, g = spec.t, spec.group
  core, bands = visibility(lengths, positions, t, spec.window_left)
  o, lse = _unfold(*_attend(_fold(q, g, spec.rows_core), k, v, core, t * g, spec.core,
                            spec.backend, spec.chunks), t, g)
  if bands is None:
    return o, lse
  parts = [_unfold(*_attend(_fold(q[:, i:i + 1], g, spec.rows_band), k, v, bands[i], g,
                            spec.band, spec.backend, spec.chunks), 1, g) for i in range(t)]
  o_band = jnp.concatenate([p[0] for p in parts], axis=1)
  lse_band = jnp.concatenate([p[1] for p in parts], axis=2)
  return merge(o, lse, o_band, lse_band)


def combine(o, lse, axis_name):
  """The exact float32 combine over the devices of `axis_name`: one max and one sum
  reduction (see _lse_merge).

  Args:
    o: [B, t, N, Hv] float32, normalized over this device's keys; lse [B, N, t] float32
      (-inf: no key here; NaN: the row saw a non-finite value here).

  Returns:
    (o [B, t, N, Hv], lse [B, N, t]) float32 over every device's keys, the same on all.
  """
  shift = _max_shift(lax.pmax(lse, axis_name))
  return _lse_merge(o, lse, shift, shift, lambda x: lax.psum(x, axis_name))


def decode_local(q, k, v, lengths, positions, spec: DecodeSpec):
  """Per device, inside shard_map over spec.axis_name: the new tokens' attention over the
  whole sharded cache, by spec.strategy.

  Args:
    q: [B, t, N, H] the new tokens' queries (the same on every device).
    k: [B, S_local, K, H], v: [B, S_local, K, Hv]: this device's cache slots.
    lengths: [B] int: cache length per row (the new tokens are its last t positions).
    positions: [B, S_local] int32 the slots' positions (EMPTY: free), or None: natural
      (slot s of device i holds i * S_local + s).

  Returns:
    (o [B, t, N, Hv] float32, lse [B, N, t] float32), the same on every device.
  """
  if positions is None:
    positions = natural_positions(spec.axis_name, k.shape[0], k.shape[1])
  if spec.guard:
    k, v = base.guard_kv(k, v)
  q = base.guard_q(q, spec.core.softcap)
  if spec.strategy == "reduce":
    return combine(*attend_shard(q, k, v, lengths, positions, spec), spec.axis_name)
  if spec.strategy == "allgather":
    def gather(x):
      return lax.all_gather(x, spec.axis_name, axis=1, tiled=True)
    return attend_shard(q, gather(k), gather(v), lengths, gather(positions), spec)
  # ring: at step s this device holds the slots of device (i - s) mod P; the next shard is
  # in flight while the kernel runs on the current one; P - 1 transfers.
  held = (k, v, positions)
  o = lse = None
  for step in range(spec.size):
    following = ring_plan.shift(held, spec.axis_name) if step < spec.size - 1 else None
    o_s, lse_s = attend_shard(q, held[0], held[1], lengths, held[2], spec)
    o, lse = (o_s, lse_s) if o is None else merge(o, lse, o_s, lse_s)
    held = following
  return o, lse


def prefill_local(ck, cv, k, v, lengths, *, axis_name, size: int, layout: str):
  """Per device: the ring's K/V shard written into local slots 0..T_local - 1, in place.

  Args:
    ck, cv: [B, S_local, K, H|Hv] this device's cache. k, v: [B, T_local, K, H|Hv] this
      device's prefill shard (its rows of the `layout`), cast to the cache's dtype.
    lengths: [B] int: tokens of each row; slots of positions at or past it stay free.

  Returns:
    (ck, cv, positions [B, S_local] int32).
  """
  b, s_local = ck.shape[:2]
  t_local = k.shape[1]
  k, v = base.guard_kv(k.astype(ck.dtype), v.astype(cv.dtype))
  ck = lax.dynamic_update_slice_in_dim(ck, k, 0, axis=1)
  cv = lax.dynamic_update_slice_in_dim(cv, v, 0, axis=1)
  pos = ring_plan.device_positions(layout, lax.axis_index(axis_name), size, t_local)
  pos = jnp.where(pos[None] < lengths[:, None], pos[None], EMPTY).astype(jnp.int32)
  free = jnp.full((b, s_local - t_local), EMPTY, jnp.int32)
  return ck, cv, base.match_vma(jnp.concatenate([pos, free], axis=1), ck)


def append_local(ck, cv, positions, lengths, used, k_new, v_new, *, axis_name, size: int):
  """Per device: token j of row b (position lengths_b + j, slot counter n = used_b + j) is
  written by device n mod P into its local slot n // P; the others leave their slots. Counters
  past the cache's capacity are dropped.

  Args:
    ck, cv: [B, S_local, K, H|Hv]; positions [B, S_local] int32: this device's cache.
    lengths, used: [B] int32 tokens and slots of each row before the append.
    k_new, v_new: [B, t, K, H|Hv] the new tokens' keys and values (the same on every device).

  Returns:
    (ck, cv, positions), updated in place.
  """
  b, s_local = positions.shape
  t = k_new.shape[1]
  k_new, v_new = base.guard_kv(k_new.astype(ck.dtype), v_new.astype(cv.dtype))
  n = used[:, None] + jnp.arange(t, dtype=jnp.int32)                       # [B, t]
  mine = (n % size == lax.axis_index(axis_name)) & (n < s_local * size)
  slot = jnp.where(mine, n // size, s_local)            # s_local: out of range, dropped
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  ck = ck.at[rows, slot].set(k_new, mode="drop")
  cv = cv.at[rows, slot].set(v_new, mode="drop")
  new_pos = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
  positions = positions.at[rows, slot].set(new_pos.astype(jnp.int32), mode="drop")
  return ck, cv, positions
