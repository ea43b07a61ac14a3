"""The ring's static schedule: who holds which positions, which hops run, which tiles work.

Everything here is static (NumPy and Python ints) except `device_positions` and
`held_positions`, which the ring evaluates inside shard_map.

Layouts. A layout says which global positions each device of a ring of P devices holds;
masks are functions of global positions, so a layout changes nothing but those positions.
With global length T and L = T / P tokens per device:

  contiguous  device i holds positions i*L ... i*L + L - 1.
  zigzag      the sequence is cut into 2P chunks of c = L / 2; device i holds chunks i and
              2P - 1 - i. P = 4, T = 16 (c = 2): device 0 holds 0 1 14 15, device 1 holds
              2 3 12 13, device 2 holds 4 5 10 11, device 3 holds 6 7 8 9.
  striped     token t lives on device t mod P, at local row t // P. P = 4, T = 16: device 1
              holds 1 5 9 13.
(ringflash/layouts.py holds the public permutations to_layout / from_layout and says which
layout to use.)

Lanes and steps. A lane is a stream of K/V pieces: every device starts it holding piece
`part` of its own rows and passes what it holds `direction` (+1 or -1) once per step, so at
step s device i holds the piece of device `source(i, s) = (i - direction * s) mod P`
(`Lane.source`, the one definition of "the block held at step s"): direction +1, P = 4,
device 2 holds the pieces of devices 2, 1, 0, 3 at steps 0..3. `held_positions` gives the
global positions of that piece, so positions never travel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ringflash.kernels import base

LAYOUTS = ("contiguous", "zigzag", "striped")


def shift(x, axis_name, direction: int = 1):
  """lax.ppermute of x (a pytree) in which ring member j sends to j + direction (mod P),
  j counting over axis_name's axes in the order given, first major (as the sequence is
  split over them). lax.ppermute takes a tuple of axes only in the mesh's order, so the
  members' pairs are renumbered in that order."""
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  sizes = [lax.axis_size(a) for a in names]
  size = int(np.prod(sizes))
  pairs = [(j, (j + direction) % size) for j in range(size)]
  mesh_names = tuple(getattr(jax.sharding.get_abstract_mesh(), "axis_names", ()) or ())
  order = sorted(names, key=mesh_names.index) if set(names) <= set(mesh_names) else names
  if list(order) == list(names):
    return lax.ppermute(x, axis_name, pairs)
  dims = dict(zip(names, sizes))

  def renumbered(j):
    coords = dict(zip(names, np.unravel_index(j, sizes)))
    return int(np.ravel_multi_index([coords[a] for a in order], [dims[a] for a in order]))

  return lax.ppermute(x, tuple(order), [(renumbered(a), renumbered(b)) for a, b in pairs])


def check_layout(layout, ring_size: int, length: int, *, name: str = "layout",
                 length_name: str = "length") -> None:
  """Raises ValueError unless `layout` is known and a GLOBAL `length` fits it on the ring.

  contiguous and striped need length % P == 0, zigzag length % (2P) == 0.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"{name} must be one of {LAYOUTS}, got {layout!r}")
  if isinstance(ring_size, bool) or not isinstance(ring_size, (int, np.integer)) or ring_size < 1:
    raise ValueError(f"ring_size must be a positive int, got {ring_size!r}")
  if (isinstance(length, bool) or not isinstance(length, (int, np.integer))
      or not 0 <= length <= np.iinfo(np.int32).max):
    raise ValueError(f"{length_name} must be an int in [0, 2**31 - 1] (positions are int32), "
                     f"got {length!r}")
  parts = 2 * ring_size if layout == "zigzag" else ring_size
  if length % parts:
    what = f"2 * ring_size = {parts} (zigzag chunks)" if layout == "zigzag" else (
        f"the ring size {ring_size}")
    raise ValueError(f"{name}={layout!r}: {length_name} {length} must be divisible by {what}")


def _positions(xp, layout: str, index, ring_size: int, local_len: int, rows=None):
  """Global positions of the `local_len` rows held by device `index` (xp: np or jnp), or of
  the local `rows` given (an int array) among them.

  `index` may be a traced scalar (the ring's lax.axis_index) or a NumPy int array
  broadcasting against the rows (the planner's [P, 1] column of device indices). Each
  layout's positions increase along a device's rows.
  """
  if rows is None:
    rows = xp.arange(local_len, dtype=xp.int32)
  if layout == "contiguous":
    return index * local_len + rows
  if layout == "striped":
    # Row r of device i is token r * P + i: P = 4, device 1, rows 0..3 -> 1 5 9 13.
    return rows * ring_size + index
  # zigzag, c = local_len / 2. Rows 0..c-1 are chunk i, rows c..2c-1 chunk 2P-1-i; chunk m
  # starts at m * c. P = 4, c = 2, device 1: rows 0 1 -> 2 3 (chunk 1), rows 2 3 -> 12 13
  # (chunk 6).
  c = local_len // 2
  chunk = xp.where(rows < c, index, 2 * ring_size - 1 - index)
  return chunk * c + rows % c


def layout_positions(layout: str, ring_size: int, length: int,
                     group: int = 1) -> np.ndarray:
  """[P, length / P] int32: row i lists the global positions ring member i holds, in local
  order.

  group > 1 (the hybrid strategy): the layout is over P * group devices and ring member i
  holds the rows of devices i * group ... i * group + group - 1, concatenated (an all-to-all
  over the group's axis gathered them). zigzag, P = 2, group = 2, 16 tokens: devices 0..3
  hold 0 1 14 15 | 2 3 12 13 | 4 5 10 11 | 6 7 8 9, so ring member 0 holds
  0 1 14 15 2 3 12 13 and member 1 holds 4 5 10 11 6 7 8 9. Rows are increasing within each
  device's run (the zigzag chunk i comes before chunk 2P-1-i), not across runs.

  Args:
    layout: "contiguous", "zigzag" or "striped".
    ring_size: P.
    length: the GLOBAL sequence length.
    group: devices whose rows one ring member holds.

  Raises:
    ValueError: unknown layout, ring_size or group not a positive int, length not an int32
      >= 0 or not divisible by P * group (twice that for zigzag).
  """
  check_layout(layout, ring_size, 0)          # ring_size, named before the product
  _positive(group=group)
  devices = ring_size * group
  check_layout(layout, devices, length)
  index = np.arange(devices, dtype=np.int32)[:, None]
  pos = _positions(np, layout, index, devices, length // devices)
  pos = np.broadcast_to(pos, (devices, length // devices)).astype(np.int32)
  return pos.reshape(ring_size, length // ring_size)


def fitting_length(layout: str, ring_size: int, length: int) -> int:
  """The smallest length >= `length` that fits `layout` on the ring: a multiple of P, of 2P
  for zigzag (check_layout's rule)."""
  parts = 2 * ring_size if layout == "zigzag" else ring_size
  return -(-length // parts) * parts


def layout_order(layout: str, ring_size: int, length: int) -> np.ndarray:
  """[length] int32: the natural position of each row of a layout-ordered sequence of
  `length` tokens, for any length.

  A length that fits the layout on the ring (a multiple of P, of 2P for zigzag) gives
  layout_positions flattened. Any other is laid out as the smallest length that fits, its
  positions at or past `length` left out: zigzag, P = 2, 7 tokens (as 8: 0 1 6 7 | 2 3 4 5)
  gives 0 1 6 2 3 4 5. ring_attention pads such a sequence inside (the left-out rows become
  padding keys and rows) and returns the output in this order.

  Raises:
    ValueError: unknown layout, or a ring_size that is not a positive int.
  """
  check_layout(layout, ring_size, 0)
  full = fitting_length(layout, ring_size, length)
  if full > np.iinfo(np.int32).max:      # positions are int32 (and the order as long)
    raise ValueError(f"ring_size={ring_size}: the {layout} layout orders {length} tokens as "
                     f"{full}, past int32's positions")
  pos = layout_positions(layout, ring_size, full).reshape(-1)
  return pos[pos < length] if full != length else pos


def to_natural(x, layout: str, ring_size: int, axis: int):
  """x's rows along `axis`, a layout-ordered sequence over `ring_size` devices (device 0's
  rows, then device 1's, ...), in natural order; from_natural is its inverse.

  Static slices, reshapes and transposes, not a gather: nothing of the permutation is kept
  for the transpose, so a rematerialized backward needs no index array (jax.checkpoint).
  A kernel over a whole sequence (Ulysses, all-gather) skips tiles by contiguous key ranges
  per query tile: it wants the natural order, where each row's keys are one range.
  zigzag, P = 2, 8 tokens: layout rows hold positions 0 1 6 7 2 3 4 5; chunk pairs
  [0 1 | 6 7], [2 3 | 4 5]: the first chunks in device order, then the second chunks in
  reverse device order, give 0 1 2 3 4 5 6 7. striped, P = 2: 0 2 4 6 1 3 5 7 is a [2, 4]
  array whose transpose, flattened, is natural.
  """
  if layout == "contiguous":
    return x
  n = x.shape[axis]
  lead, rest = x.shape[:axis], x.shape[axis + 1:]
  if layout == "striped":
    x = x.reshape(lead + (ring_size, n // ring_size) + rest)
    return jnp.swapaxes(x, axis, axis + 1).reshape(lead + (n,) + rest)
  c = n // (2 * ring_size)
  x = x.reshape(lead + (ring_size, 2, c) + rest)
  first = lax.index_in_dim(x, 0, axis + 1, keepdims=False)     # chunks 0 .. P-1
  second = lax.rev(lax.index_in_dim(x, 1, axis + 1, keepdims=False), (axis,))  # P .. 2P-1
  return jnp.concatenate([first, second], axis=axis).reshape(lead + (n,) + rest)


def from_natural(x, layout: str, ring_size: int, axis: int):
  """x's rows along `axis`, in natural order, in the layout's order over `ring_size` devices
  (to_natural's inverse)."""
  if layout == "contiguous":
    return x
  n = x.shape[axis]
  lead, rest = x.shape[:axis], x.shape[axis + 1:]
  if layout == "striped":
    x = x.reshape(lead + (n // ring_size, ring_size) + rest)
    return jnp.swapaxes(x, axis, axis + 1).reshape(lead + (n,) + rest)
  c = n // (2 * ring_size)
  x = x.reshape(lead + (2, ring_size, c) + rest)
  first = lax.index_in_dim(x, 0, axis, keepdims=False)          # device i's first chunk
  second = lax.rev(lax.index_in_dim(x, 1, axis, keepdims=False), (axis,))
  return jnp.stack([first, second], axis=axis + 1).reshape(lead + (n,) + rest)


def device_positions(layout: str, index, ring_size: int, local_len: int, group: int = 1):
  """[local_len] int32 global positions of ring member `index` (traced inside shard_map);
  group as layout_positions."""
  index = jnp.asarray(index, jnp.int32)
  if group == 1:
    return _positions(jnp, layout, index, ring_size, local_len)
  run = local_len // group
  return jnp.concatenate([_positions(jnp, layout, index * group + u, ring_size * group, run)
                          for u in range(group)])


@dataclasses.dataclass(frozen=True)
class Lane:
  """One stream of K/V pieces around the ring.

  Every device starts a lane holding piece `part` of its own K/V rows. At step s it holds
  the piece of device (i - direction * s) mod P: direction +1 sends i -> i + 1, so device 2
  of 4 holds the pieces of 2, 1, 0, 3 at steps 0..3; direction -1 gives 2, 3, 0, 1. A lane
  computes at steps first..last and makes `last` transfers (none after its last step).

  Attributes:
    part: which piece of the local K/V rows (of RingPlan.parts equal pieces).
    direction: +1 or -1.
    first: first step computed.
    last: last step held and computed.
  """

  part: int
  direction: int
  first: int
  last: int

  def source(self, device, step, ring_size):
    """The device whose piece `device` holds at `step` (NumPy or traced ints)."""
    return (device - self.direction * step) % ring_size


@dataclasses.dataclass(frozen=True, eq=False)
class RingPlan:
  """The ring's static schedule and per-hop tile counts (from plan_ring).

  Attributes:
    layout, ring_size: as given.
    parts: K/V rows split into this many equal pieces (2: bidirectional ring, one per lane).
    lanes: the streams of K/V pieces (see Lane). Unidirectional full ring: one lane,
      direction +1, steps 0..P-1. Bidirectional: the first half of the rows travels +1,
      the second half -1, both P steps. Truncated by a window: all rows +1 for steps
      0..a (the a earlier neighbours) and, if keys of later devices are in the window, all
      rows -1 for steps 1..b.
    tiles: [P, P, parts] int: tiles[d, e, p] is the number of (query tile, key tile) pairs
      of device d's queries against piece p of device e's K/V that may hold a valid pair
      (base.ranges_may_have_work on the tiles' position ranges; exact for causal masks and,
      with contiguous rows, for windows).
  """

  layout: str
  ring_size: int
  parts: int
  lanes: tuple[Lane, ...]
  tiles: np.ndarray
  group: int = 1

  @property
  def steps(self) -> int:
    """Ring steps (the longest lane)."""
    return max(lane.last for lane in self.lanes) + 1

  @property
  def transfers(self) -> int:
    """K/V transfers of one forward pass, per device (the P - 1 of a full ring when < P)."""
    return sum(lane.last for lane in self.lanes)

  def lane_tiles(self, lane: Lane) -> np.ndarray:
    """[P, lane.last + 1] int32: tiles device d computes at step s of `lane` (0 if skipped)."""
    d = np.arange(self.ring_size)[:, None]
    s = np.arange(lane.last + 1)[None, :]
    counts = self.tiles[d, lane.source(d, s, self.ring_size), lane.part]
    return np.where(s >= lane.first, counts, 0).astype(np.int32)

  def work_per_device(self) -> np.ndarray:
    """[P] int: tiles each device computes over the whole forward ring."""
    return sum(self.lane_tiles(lane).sum(axis=1) for lane in self.lanes)


def _tile_ranges(pos: np.ndarray, block: int):
  """Smallest and largest position of each tile of `block` rows: [..., ceil(n / block)]
  each; a last tile of fewer rows where block does not divide n (the pallas_gpu and xla
  backends pad such a run with rows at its last position, kernels/base.fit_rows)."""
  short = -pos.shape[-1] % block
  if short:
    pos = np.concatenate([pos, np.repeat(pos[..., -1:], short, axis=-1)], axis=-1)
  tiles = pos.reshape(pos.shape[:-1] + (pos.shape[-1] // block, block))
  return tiles.min(axis=-1), tiles.max(axis=-1)


@functools.lru_cache(maxsize=256)
def plan_ring(layout: str, ring_size: int, q_len: int, kv_len: int, block_q: int,
              block_k: int, causal: bool, window: tuple[int, int] | None = None,
              bidirectional: bool = False, group: int = 1) -> RingPlan:
  """Which hops each device computes and how many tiles: the ring follows this plan.

  Hop choice. Let N be the set of offsets o (device d uses the K/V of device d - o mod P)
  with work on some device. The ring must visit every offset in N; a lane going +1 visits
  0, 1, ..., a; one going -1 visits P-1, ..., P-b. The plan takes the smallest a + b
  covering N. Without a window N is everything (or, contiguous causal, 0..P-1 anyway) and
  the full ring of P - 1 transfers runs. Contiguous, P = 8, L = 64 tokens per device,
  window (100, 0): device d needs devices d-1 and d-2 (keys down to 64d - 100), so
  N = {0, 1, 2}, a = 2, b = 0: two transfers instead of seven, and K/V never travel
  further. Window (100, 100): N = {0, 1, 2, 6, 7}, a = 2, b = 2.
  `bidirectional` splits K/V rows in two halves on opposite lanes of the full ring; when a
  window already truncates the ring, that schedule is kept (it uses both directions when
  the window reaches both ways).

  Tile counts are those of base.ranges_may_have_work on each tile's position range
  (counted without testing each pair, _tile_counts): the same test the kernels use to skip
  tiles, so the counts are the tiles the kernels compute (the xla kernel's exact per-tile
  mask can skip a few more for striped windows).

  Lengths and tiles are checked once, at the public boundary (ringflash/_validate.py).

  Args:
    layout: "contiguous", "zigzag" or "striped".
    ring_size: P.
    q_len, kv_len: LOCAL query and key lengths per device.
    block_q, block_k: tile sizes, which divide q_len and kv_len (kv_len / 2 when
      bidirectional) and the zigzag chunks (q_len / 2, kv_len / 2), so that no tile
      straddles two chunks, except where a backend pads a run its tiles do not divide
      (pallas_gpu at ring_attention_sharded's local lengths; xla's default tiles of a length
      without a divisor of 64-512 rows): there a tile may straddle two chunks and counts as
      the range of its real rows, which the kernel's range test also sees.
    causal: causal masking.
    window: None or (left, right).
    bidirectional: split K/V over two opposite lanes.
    group: devices whose rows one ring member holds (layout_positions; hybrid strategy).

  Returns:
    A RingPlan.
  """
  full_tiles = _tile_counts(layout, ring_size, q_len, kv_len, block_q, block_k, causal,
                            window, parts=1, group=group)
  p = ring_size
  offsets = np.arange(p)
  d = np.arange(p)[:, None]
  needed = full_tiles[d, (d - offsets[None, :]) % p, 0].sum(axis=0) > 0     # [P] by offset
  needed[0] = True
  # For each a (steps of the +1 lane), the -1 lane must reach back to the first needed
  # offset above a: b = P - that offset (0 if none). The smallest a + b, the first a on a tie,
  # and the full ring (P - 1, 0) unless something is shorter.
  first_above = np.minimum.accumulate(np.where(needed, offsets, p)[::-1])[::-1]
  first_above = np.append(first_above[1:], p)                  # the first needed o > a
  total = offsets + np.where(first_above < p, p - first_above, 0)
  a = int(np.argmin(total))
  a, b = (a, int(total[a]) - a) if total[a] < p - 1 else (p - 1, 0)
  if a + b < p - 1:
    lanes = (Lane(part=0, direction=1, first=0, last=a),)
    if b:
      lanes += (Lane(part=0, direction=-1, first=1, last=b),)
    return RingPlan(layout, p, 1, lanes, full_tiles, group)
  if bidirectional and p > 1:
    tiles = _tile_counts(layout, p, q_len, kv_len, block_q, block_k, causal, window, parts=2,
                         group=group)
    lanes = (Lane(part=0, direction=1, first=0, last=p - 1),
             Lane(part=1, direction=-1, first=0, last=p - 1))
    return RingPlan(layout, p, 2, lanes, tiles, group)
  return RingPlan(layout, p, 1, (Lane(part=0, direction=1, first=0, last=p - 1),),
                  full_tiles, group)


def _member_tile_ranges(layout, ring_size, local_len, block, group, parts):
  """[P, parts, ceil(local_len / parts / block)] int64 (lo, hi): the tile ranges of each
  ring member's rows (layout_positions' rows), one member's positions at a time, so that
  host memory holds one device's rows, not the whole sequence's."""
  devices, run = ring_size * group, local_len // group
  if group == 1:
    # A member's positions increase along its rows: a tile's range is the positions of
    # its first and last real row, and no other row's position is computed.
    piece = local_len // parts
    first = (np.arange(parts)[:, None] * piece
             + np.arange(0, piece, block, dtype=np.int64)[None, :])      # [parts, n]
    last = np.minimum(first - first[:, :1] + block, piece) - 1 + first[:, :1]
    members = np.arange(ring_size, dtype=np.int64)[:, None, None]
    return tuple(_positions(np, layout, members, ring_size, local_len, rows=r[None])
                 .astype(np.int64) for r in (first, last))
  los, his = [], []
  for member in range(ring_size):
    pos = np.concatenate([_positions(np, layout, member * group + u, devices, run)
                          for u in range(group)])
    lo, hi = _tile_ranges(pos.reshape(parts, local_len // parts), block)
    los.append(lo)
    his.append(hi)
  return np.stack(los).astype(np.int64), np.stack(his).astype(np.int64)


def _tile_counts(layout, ring_size, q_len, kv_len, block_q, block_k, causal, window, parts,
                 group=1):
  """[P, P, parts] tile counts (RingPlan.tiles), without visiting each pair of tiles.

  base.ranges_may_have_work(q, k) is k_lo <= a and k_hi >= b, with a = q_hi when causal,
  q_hi + right with a window (the smaller with both; else no bound), and b = q_lo - left
  with a window (else no bound).
  As left, right >= 0, a key tile with k_hi < b has k_lo <= k_hi < b <= q_lo <= q_hi <= a,
  so the count of key tiles with work is #(k_lo <= a) - #(k_hi < b): two binary searches
  per query tile in the sorted bounds. Pair by pair, a plan of 2^30 tokens on 8 devices in
  512-row tiles had 4 * 10^12 pairs to test (hours); this is seconds.
  """
  q_lo, q_hi = (x[:, 0] for x in _member_tile_ranges(layout, ring_size, q_len, block_q,
                                                       group, 1))         # [P, nq]
  k_lo, k_hi = _member_tile_ranges(layout, ring_size, kv_len, block_k, group, parts)
  most = np.iinfo(np.int64).max
  a, b = np.full_like(q_hi, most), np.full_like(q_lo, -most)
  if causal:
    a = q_hi
  if window is not None:
    left, right = window
    a, b = np.minimum(a, q_hi + right), q_lo - left
  tiles = np.zeros((ring_size, ring_size, parts), dtype=np.int64)
  for e in range(ring_size):
    for part in range(parts):
      seen = np.searchsorted(np.sort(k_lo[e, part]), a, side="right")
      behind = np.searchsorted(np.sort(k_hi[e, part]), b, side="left")
      tiles[:, e, part] = (seen - behind).sum(axis=1)
  return tiles


def _positive(**values) -> None:
  for name, value in values.items():
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def work_table(ring_size: int = 8, seq_len: int = 8192, block: int = 128, *,
               causal: bool = True, window: tuple[int, int] | None = None) -> dict:
  """Per-device tiles of each layout: {layout: [P] int array}, self-attention of seq_len.

  Block sizes: `block` for contiguous and striped; for zigzag the same `block` (it must
  divide the chunk seq_len / (2P)).

  Raises:
    ValueError: naming ring_size, seq_len, block, causal or window (as ring_attention's
      local_window_size: an int w or a pair (left, right) of ints >= 0).
  """
  from ringflash import _validate  # pylint: disable=g-import-not-at-top  (it imports this)
  _positive(ring_size=ring_size, seq_len=seq_len, block=block)
  causal = _validate.check_flag("causal", causal)
  window = _validate.check_window(window, seq_len, seq_len, name="window")
  if seq_len % (2 * ring_size):
    raise ValueError(f"seq_len={seq_len} must be divisible by 2 x ring_size = {2 * ring_size} "
                     f"(the zigzag layout's chunks)")
  if (seq_len // (2 * ring_size)) % block:
    raise ValueError(f"block={block} must divide the zigzag chunk seq_len / (2 x ring_size) = "
                     f"{seq_len // (2 * ring_size)}")
  out = {}
  for layout in LAYOUTS:
    local = seq_len // ring_size
    plan = plan_ring(layout, ring_size, local, local, block, block, causal, window)
    out[layout] = plan.work_per_device()
  return out


def balance_block(seq_len: int, ring_size: int, cap: int = 512) -> int:
  """A tile size that every layout's plan accepts: divides the zigzag chunk seq_len / 2P.

  Raises:
    ValueError: naming seq_len, ring_size or cap.
  """
  _positive(seq_len=seq_len, ring_size=ring_size, cap=cap)
  if seq_len < 2 * ring_size:
    raise ValueError(f"seq_len={seq_len} must be at least 2 x ring_size = {2 * ring_size} "
                     f"(a zigzag chunk of one token)")
  chunk = seq_len // (2 * ring_size)
  return max(d for d in range(1, min(cap, chunk) + 1) if chunk % d == 0)


@dataclasses.dataclass(frozen=True)
class RingSpec:
  """Everything static the ring needs, in one hashable value (a custom_vjp's nondiff arg).

  Attributes:
    kernel: the kernel spec (scale, masks, the backend's resolved tiles).
    backend: the kernel backend's name (kernels.BACKENDS).
    axis_name: the mesh axis of the ring.
    ring_size: P, devices along axis_name.
    layout: "contiguous", "zigzag" or "striped".
    bidirectional: split K/V in two halves travelling in opposite directions.
    group: devices whose rows each ring member holds (1; the hybrid strategy's Ulysses
      axis size, see layout_positions).
  """

  kernel: base.KernelSpec
  backend: str
  axis_name: str | tuple[str, ...]
  ring_size: int
  layout: str = "contiguous"
  bidirectional: bool = False
  group: int = 1

  def plan(self, q_len: int, kv_len: int) -> "RingPlan":
    """The plan for local lengths q_len, kv_len (cached)."""
    return plan_ring(self.layout, self.ring_size, q_len, kv_len, self.kernel.block_q,
                     self.kernel.block_k, self.kernel.causal, self.kernel.window,
                     self.bidirectional, self.group)


def held_positions(plan: "RingPlan", lane_index: int, step, axis_name: str,
                   kv_len: int):
  """[kv_len / parts] int32 global positions of the piece lane `lane_index` holds at `step`
  on this device (traced, inside shard_map over axis_name).

  Contiguous, P = 4, 16 keys per device, one part, lane +1: device 2 at step 1 holds device
  1's piece, positions 16..31; at step 3 device 3's, 48..63.
  """
  lane = plan.lanes[lane_index]
  origin = lane.source(lax.axis_index(axis_name), step, plan.ring_size)
  size = kv_len // plan.parts
  pos = device_positions(plan.layout, origin, plan.ring_size, kv_len, plan.group)
  return lax.slice_in_dim(pos, lane.part * size, (lane.part + 1) * size)
