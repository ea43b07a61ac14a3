"""Layouts (zigzag, striped), sliding windows and the bidirectional ring: the ring's plan,
the permutes of the compiled program, to_layout / from_layout, and bad arguments.

The numerical cases (each layout, windows, both directions, against the fp32 oracle after
from_layout, on every backend) are in tests/contract/.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import helpers
import oracle
import ringflash
from ringflash.cli import hlo as hlo_text
from ringflash.cli.demo import print_work_table
from ringflash.kernels import base
from ringflash.kernels.tiles import XlaBlockSizes
from ringflash.parallel import plan as ring_plan

N, H = 4, 32


# ---------------------------------------------------------------------------------------
# The compiled program: collective-permutes actually executed.


def _executed_permutes(hlo: str):
  """[(source_target_pairs, times executed)] of every collective-permute in an HLO module.

  A permute inside a while body runs once per iteration: its count is multiplied by the
  loop's known_trip_count (and by those of enclosing loops).
  """
  comps, entry = hlo_text.computations(hlo)

  def walk(comp, times, out):
    for line in comps[comp]:
      if re.search(r"collective-permute(-start)?\(", line):
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line).group(1) + "}"
        out.append((frozenset(re.findall(r"\{(\d+),(\d+)\}", pairs)), times))
      body = re.search(r"while\(.*body=%?([\w.\-]+)", line)
      if body:
        trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
        assert trip, f"while loop without a known trip count: {line[:200]}"
        walk(body.group(1), times * int(trip.group(1)), out)
      for called in re.findall(r"(?:calls|to_apply|true_computation|false_computation)="
                               r"%?([\w.\-]+)", line):
        if called in comps:
          walk(called, times, out)
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      if branches:
        for called in re.findall(r"%?([\w.\-]+)", branches.group(1)):
          walk(called, times, out)
    return out

  return walk(entry, 1, [])


def _shift_pairs(ring_size, shift):
  return frozenset((str(j), str((j + shift) % ring_size)) for j in range(ring_size))


@functools.lru_cache(maxsize=None)
def _forward_permutes(ring_size, window, bidirectional, causal=True):
  """Executed collective-permutes of a contiguous forward pass, T = 16 per device."""
  mesh = helpers.mesh_of(ring_size)
  q = jax.ShapeDtypeStruct((1, 16 * ring_size, N, H), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 16 * ring_size, 2, H), jnp.float32)
  fn = jax.jit(lambda q, k, v: ringflash.ring_attention(
      q, k, v, mesh=mesh, is_causal=causal, backend="xla", local_window_size=window,
      bidirectional=bidirectional, block_sizes=XlaBlockSizes(8, 8)))
  return _executed_permutes(fn.lower(q, kv, kv).compile().as_text())


def test_short_window_runs_fewer_permutes():
  # P = 8, 16 tokens per device, window (5, 0): device d needs only device d - 1's keys, so
  # the ring makes 1 transfer instead of 7 (of k, v and their positions each).
  full = _forward_permutes(8, None, False)
  short = _forward_permutes(8, (5, 0), False)
  n_full, n_short = sum(t for _, t in full), sum(t for _, t in short)
  assert n_full > 0 and n_short > 0
  assert n_short * 7 == n_full * 1, (n_short, n_full)
  # and never any further than the neighbour: every permute is the shift +1
  assert {pairs for pairs, _ in short} == {_shift_pairs(8, 1)}
  plan = ring_plan.plan_ring("contiguous", 8, 16, 16, 8, 8, True, (5, 0))
  assert plan.transfers == 1


def test_window_spanning_shards_runs_only_needed_hops():
  # window (40, 20), 16 per device: the keys of devices d-3..d+2 are needed (d*16 - 40 lies
  # in device d-3, d*16 + 15 + 20 in device d+2): 3 hops +1 and 2 hops -1 instead of 7.
  plan = ring_plan.plan_ring("contiguous", 8, 16, 16, 8, 8, False, (40, 20))
  assert [(lane.direction, lane.first, lane.last) for lane in plan.lanes] == [(1, 0, 3),
                                                                            (-1, 1, 2)]
  assert plan.transfers == 5
  # The program: k and v (one array) go 3 times +1 and 2 times -1, nothing else (positions
  # are computed where they are needed).
  executed = {}
  for pairs, times in _forward_permutes(8, (40, 20), False, causal=False):
    executed[pairs] = executed.get(pairs, 0) + times
  assert executed == {_shift_pairs(8, 1): 3, _shift_pairs(8, -1): 2}


def test_bidirectional_program_permutes_both_ways():
  uni = _forward_permutes(8, None, False)
  bidi = _forward_permutes(8, None, True)
  assert {pairs for pairs, _ in uni} == {_shift_pairs(8, 1)}
  directions = {pairs for pairs, _ in bidi}
  assert directions == {_shift_pairs(8, 1), _shift_pairs(8, -1)}
  # Same number of steps, twice the permutes, each of half the rows.
  assert sum(t for _, t in bidi) == 2 * sum(t for _, t in uni)


# ---------------------------------------------------------------------------------------
# The plan: balance, and agreement with the kernels' mask.


@pytest.mark.parametrize("ring_size", [2, 4, 8])
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
@pytest.mark.parametrize("local,block_q,block_k", [(64, 8, 8), (64, 16, 4), (32, 4, 16),
                                                   (1024, 128, 128)])
def test_causal_work_is_balanced(layout, ring_size, local, block_q, block_k):
  plan = ring_plan.plan_ring(layout, ring_size, local, local, block_q, block_k, True)
  work = plan.work_per_device()
  assert np.all(np.abs(work - work.mean()) <= 1.0), work
  contiguous = ring_plan.plan_ring("contiguous", ring_size, local, local, block_q, block_k,
                                 True).work_per_device()
  # The same attention: zigzag computes no more tiles in total than contiguous.
  if layout == "zigzag":
    assert work.sum() == contiguous.sum()
  # Contiguous is unbalanced: device P-1 does the most.
  assert contiguous.max() == contiguous[-1] > contiguous.mean()


def test_work_table_p8():
  table = print_work_table(ring_size=8, seq_len=8192, block=128)
  assert set(table) == set(ring_plan.LAYOUTS)
  assert table["zigzag"].max() == table["zigzag"].mean()
  assert table["striped"].max() == table["striped"].mean()
  assert table["contiguous"].max() / table["contiguous"].mean() > 1.8


def test_balance_block_is_the_largest_divisor_of_the_zigzag_chunk_up_to_the_cap():
  assert ring_plan.balance_block(8192, 8) == 512                # chunk 512: the cap itself
  assert ring_plan.balance_block(8192, 4) == 512                # chunk 1024, capped
  assert ring_plan.balance_block(8192, 8, cap=100) == 64        # 512's largest up to 100
  assert ring_plan.balance_block(48, 4) == 6                    # chunk 6, below the cap


@pytest.mark.parametrize("layout,causal,window", [
    ("contiguous", True, None), ("zigzag", True, None), ("striped", True, None),
    ("contiguous", False, (9, 3)), ("zigzag", True, (13, 0)), ("zigzag", False, (5, 21)),
])
def test_plan_counts_match_the_mask(layout, causal, window):
  # Tiles with a valid pair, found by the kernels' exact mask (base.mask) pair by pair.
  p, local, bq, bk = 4, 32, 4, 8
  spec = base.KernelSpec(scale=1.0, causal=causal, tiles=XlaBlockSizes(bq, bk), window=window)
  pos = ring_plan.layout_positions(layout, p, p * local)
  plan = ring_plan.plan_ring(layout, p, local, local, bq, bk, causal, window)
  for d in range(p):
    for e in range(p):
      valid = np.asarray(base.mask(jnp.asarray(pos[d]), jnp.asarray(pos[e]), None, None,
                                   spec))[0]
      tiles = valid.reshape(local // bq, bq, local // bk, bk).any(axis=(1, 3)).sum()
      assert plan.tiles[d, e, 0] == tiles, (d, e)


@pytest.mark.parametrize("causal,window", [
    (True, None), (False, (9, 3)), (True, (5, 0)), (False, (0, 7)), (False, (3, 3)),
])
def test_plan_counts_match_the_mask_where_the_tiles_do_not_divide(causal, window):
  """A last tile of fewer rows (the xla and pallas_gpu backends pad it with rows that see
  nothing) counts as the range of its real rows: a range taken over padding at another
  position would count tiles without a valid pair. Contiguous rows, so the count is exact."""
  p, local, bq, bk = 4, 30, 4, 8
  spec = base.KernelSpec(scale=1.0, causal=causal, tiles=XlaBlockSizes(bq, bk), window=window)
  pos = ring_plan.layout_positions("contiguous", p, p * local)
  plan = ring_plan.plan_ring("contiguous", p, local, local, bq, bk, causal, window)
  rows, cols = -local % bq, -local % bk
  for d in range(p):
    for e in range(p):
      valid = np.asarray(base.mask(jnp.asarray(pos[d]), jnp.asarray(pos[e]), None, None,
                                   spec))[0]
      valid = np.pad(valid, ((0, rows), (0, cols)))           # padding: no valid pair
      tiles = valid.reshape(-1, bq, valid.shape[1] // bk, bk).any(axis=(1, 3)).sum()
      assert plan.tiles[d, e, 0] == tiles, (d, e)


def test_plan_counts_striped_window_are_conservative():
  # Striped positions are not contiguous, so the range test may keep a tile without valid
  # pairs, never drop one with.
  p, local, bq, bk, window = 4, 32, 4, 4, (6, 0)
  spec = base.KernelSpec(scale=1.0, causal=True, tiles=XlaBlockSizes(bq, bk), window=window)
  pos = ring_plan.layout_positions("striped", p, p * local)
  plan = ring_plan.plan_ring("striped", p, local, local, bq, bk, True, window)
  for d in range(p):
    for e in range(p):
      valid = np.asarray(base.mask(jnp.asarray(pos[d]), jnp.asarray(pos[e]), None, None,
                                   spec))[0]
      exact = valid.reshape(local // bq, bq, local // bk, bk).any(axis=(1, 3)).sum()
      assert exact <= plan.tiles[d, e, 0]


def test_block_may_have_work_window():
  spec = base.KernelSpec(scale=1.0, causal=False, tiles=XlaBlockSizes(4, 4), window=(2, 1))
  q = jnp.arange(10, 14)
  assert not bool(base.block_may_have_work(q, jnp.arange(4, 8), spec))   # 7 < 10 - 2
  assert bool(base.block_may_have_work(q, jnp.arange(5, 9), spec))       # 10 sees 8
  assert bool(base.block_may_have_work(q, jnp.arange(14, 18), spec))     # 13 sees 14
  assert not bool(base.block_may_have_work(q, jnp.arange(15, 19), spec))


# ---------------------------------------------------------------------------------------
# to_layout / from_layout.


def test_layout_examples():
  x = np.arange(8)
  np.testing.assert_array_equal(ringflash.to_layout(x, "zigzag", 2, axis=0),
                                [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(ringflash.to_layout(x, "striped", 2, axis=0),
                                [0, 2, 4, 6, 1, 3, 5, 7])
  np.testing.assert_array_equal(ringflash.to_layout(x, "contiguous", 2, axis=0), x)
  # axes count from the end too, down to -rank
  np.testing.assert_array_equal(ringflash.to_layout(x, "zigzag", 2, axis=-1),
                                [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(
      ringflash.from_layout(ringflash.to_layout(x[None], "striped", 2, axis=-1), "striped", 2,
                            axis=-1), x[None])
  np.testing.assert_array_equal(ringflash.to_layout(x[:, None], "zigzag", 2, axis=-2)[:, 0],
                                [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(ring_plan.layout_positions("zigzag", 4, 16)[1], [2, 3, 12, 13])


@pytest.mark.parametrize("layout", ring_plan.LAYOUTS)
@pytest.mark.parametrize("ring_size", [1, 2, 4, 8])
def test_round_trip(layout, ring_size):
  x = jax.random.normal(jax.random.key(0), (2, 16 * ring_size, 3, 5))
  y = ringflash.to_layout(x, layout, ring_size)
  np.testing.assert_array_equal(ringflash.from_layout(y, layout, ring_size), x)
  seg = np.arange(2 * 16 * ring_size).reshape(2, -1) // 7
  np.testing.assert_array_equal(
      ringflash.from_layout(ringflash.to_layout(seg, layout, ring_size), layout, ring_size),
      seg)
  # any axis; slice i of the result holds device i's positions
  lse = np.arange(3 * 16 * ring_size).reshape(1, 3, -1) % (16 * ring_size)
  laid = ringflash.to_layout(lse, layout, ring_size, axis=-1)
  np.testing.assert_array_equal(
      laid[0, 0].reshape(ring_size, -1),
      ring_plan.layout_positions(layout, ring_size, 16 * ring_size))
  np.testing.assert_array_equal(ringflash.from_layout(laid, layout, ring_size, axis=2), lse)


@pytest.mark.parametrize("layout", ring_plan.LAYOUTS)
@pytest.mark.parametrize("ring_size", [1, 2, 4, 8])
def test_natural_order_of_gathered_rows(layout, ring_size):
  """to_natural puts a layout-ordered sequence (device 0's rows, then device 1's, ...) in
  natural order along any axis, from_natural puts it back, and neither is a gather: nothing
  of the permutation is kept for the transpose, so a rematerialized backward (jax.checkpoint
  with Ulysses or all-gather) has no index array to rebuild."""
  n = 4 * ring_size
  laid = ring_plan.layout_positions(layout, ring_size, n).reshape(-1)
  for axis, shape in ((0, (n,)), (1, (2, n, 3)), (2, (2, 3, n))):
    def along(row, axis=axis, shape=shape):      # row [n] placed along `axis` of `shape`
      return np.moveaxis(np.broadcast_to(row, shape[:axis] + shape[axis + 1:] + (n,)), -1, axis)

    x = along(laid)
    natural = ring_plan.to_natural(jnp.asarray(x), layout, ring_size, axis)
    np.testing.assert_array_equal(natural, along(np.arange(n)))
    np.testing.assert_array_equal(ring_plan.from_natural(natural, layout, ring_size, axis), x)

  def loss(x):
    y = ring_plan.to_natural(x, layout, ring_size, 1)
    return jnp.sum(ring_plan.from_natural(jnp.sin(y), layout, ring_size, 1) * x)

  jaxpr = str(jax.make_jaxpr(jax.grad(loss))(jnp.ones((2, n, 3))))
  assert not re.search(r"\b(gather|scatter-add|scatter_add|scatter)\b", jaxpr), jaxpr


def test_uneven_lengths_examples():
  # The layout of the next length that fits (zigzag: 8 for 7 tokens on 2 devices, 0 1 6 7 |
  # 2 3 4 5), the positions past the length left out.
  np.testing.assert_array_equal(ringflash.to_layout(np.arange(7), "zigzag", 2, axis=0),
                                [0, 1, 6, 2, 3, 4, 5])
  np.testing.assert_array_equal(ringflash.to_layout(np.arange(5), "zigzag", 2, axis=0),
                                [0, 1, 2, 3, 4])          # as 8: 0 1 6 7 | 2 3 4 5
  np.testing.assert_array_equal(ringflash.to_layout(np.arange(7), "striped", 3, axis=0),
                                [0, 3, 6, 1, 4, 2, 5])
  np.testing.assert_array_equal(ringflash.to_layout(np.arange(7), "contiguous", 3, axis=0),
                                np.arange(7))


@pytest.mark.parametrize("layout", ring_plan.LAYOUTS)
@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 8])
def test_uneven_round_trip(layout, ring_size):
  for n in range(1, 4 * ring_size + 2):
    order = ringflash.to_layout(np.arange(n), layout, ring_size, axis=0)
    assert sorted(order.tolist()) == list(range(n)), (n, order)
    x = jax.random.normal(jax.random.key(n), (2, n, 3))
    np.testing.assert_array_equal(
        ringflash.from_layout(ringflash.to_layout(x, layout, ring_size), layout, ring_size), x)
    parts = 2 * ring_size if layout == "zigzag" else ring_size
    if n % parts == 0:        # lengths that fit: device i's slice holds its positions
      np.testing.assert_array_equal(order.reshape(ring_size, -1),
                                    ring_plan.layout_positions(layout, ring_size, n))


@pytest.mark.parametrize("layout,ring_size,length,padded", [
    ("zigzag", 4, 36, 40), ("zigzag", 2, 7, 16), ("striped", 4, 37, 64)])
def test_padding_gathers_and_their_derivatives(layout, ring_size, length, padded):
  """padded_rows' gathers put each row of the user's sequence in the slot of its position in
  the padded layout (padding 0) and back; their derivatives, gathers written out, equal JAX's
  transposes of the same gathers (scatter-adds)."""
  from ringflash import _inputs  # pylint: disable=g-import-not-at-top
  positions = ring_plan.layout_positions(layout, ring_size, padded).reshape(-1)
  rows, back = _inputs.padded_rows(layout, ring_size, length, positions)
  user = ringflash.to_layout(np.arange(length), layout, ring_size, axis=0)
  x = jax.random.normal(jax.random.key(length), (2, length, 3))
  y = _inputs.regather(x, rows, back)
  np.testing.assert_array_equal(
      np.asarray(y)[:, positions < length],
      np.asarray(x)[:, np.argsort(user)[positions[positions < length]]])
  assert np.all(np.asarray(y)[:, positions >= length] == 0)
  np.testing.assert_array_equal(_inputs.regather(y, back, rows), x)
  for fn, arg, idx in ((lambda a: _inputs.regather(a, rows, back), x, rows),
                       (lambda a: _inputs.regather(a, back, rows), y, back)):
    g = jax.random.normal(jax.random.key(1), fn(arg).shape)
    plain = lambda a, idx=idx: jnp.take(a, jnp.asarray(idx), axis=1, mode="fill",  # noqa
                                        fill_value=0)
    np.testing.assert_array_equal(jax.vjp(fn, arg)[1](g)[0], jax.vjp(plain, arg)[1](g)[0])


@pytest.mark.parametrize("kw", [dict(layout="zigzag", t=36, is_causal=True),
                                dict(layout="striped", t=37, bidirectional=True,
                                     local_window_size=(9, 3)),
                                dict(layout="zigzag", t=33, bidirectional=True,
                                     is_causal=True)],
                         ids=["zigzag-36", "striped-37-bidi-window", "zigzag-33-bidi"])
def test_uneven_lengths_match_oracle(kw):
  """Lengths that do not fit the layout on 4 devices (36 and 33 for zigzag's 8 chunks, 37
  for striped), once refused, are padded inside; the output comes back in to_layout's order
  for the user's length."""
  layout, t = kw.pop("layout"), kw.pop("t")
  q, k, v, _ = helpers.inputs(3, 2, t, t, N, 2, H, jnp.float32)
  window = kw.get("local_window_size")
  ref = oracle.attention(q, k, v, causal=kw.get("is_causal", False), window=window)
  to = functools.partial(ringflash.to_layout, layout=layout, ring_size=4)
  out, lse = ringflash.ring_attention(to(q), to(k), to(v), mesh=helpers.mesh_of(4),
                                      layout=layout, backend="xla", return_residual=True,
                                      **kw)
  assert out.shape == q.shape and lse.shape == (2, N, t)
  for got, want in zip((ringflash.from_layout(out, layout, 4),
                        ringflash.from_layout(lse, layout, 4, axis=2)), ref):
    assert helpers.max_err(got, want) <= helpers.fp32_tol(want)


def test_padding_needs_ids_only_where_the_causal_mask_does_not_hide_it():
  from ringflash import _validate  # pylint: disable=g-import-not-at-top
  q, k = jnp.zeros((1, 63, N, H)), jnp.zeros((1, 63, 2, H))
  call = lambda **kw: _validate.check_call(q, k, k, ring_size=4, local=False, pads=True,  # noqa
                                           **kw)
  causal = call(is_causal=True)
  assert not _validate.padding_needs_ids(causal, 63, 63)           # no padding
  assert not _validate.padding_needs_ids(causal, 64, 64)           # keys past S >= T
  assert _validate.padding_needs_ids(causal, 80, 80)               # 17 rows > 63 / 16
  assert _validate.padding_needs_ids(call(), 64, 64)               # not causal: keys seen
  assert _validate.padding_needs_ids(call(is_causal=True, local_window_size=(4, 0)), 80, 80)
  cross = _validate.check_call(jnp.zeros((1, 63, N, H)), jnp.zeros((1, 60, 2, H)),
                               jnp.zeros((1, 60, 2, H)), ring_size=4, local=False,
                               pads=True, is_causal=True)
  assert _validate.padding_needs_ids(cross, 64, 64)                # S < T: row 60 sees 60


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_causal_padding_without_ids_keeps_the_nonfinite_rule(layout):
  """61 tokens on 4 devices, causal: padded to 64 without ids (the causal mask hides the
  padding keys), so the 3 padding rows see every key, a NaN value among them. The rows
  before the NaN key are exact, and a loss over them has finite, exact gradients: the
  padding rows, trimmed, carry nothing back."""
  t, j0 = 61, 40
  q, k, v, dout = helpers.inputs(5, 1, t, t, N, 2, H, jnp.float32)
  bad_v = v.at[0, j0, 0, 0].set(jnp.nan)
  to = functools.partial(ringflash.to_layout, layout=layout, ring_size=4)
  back = functools.partial(ringflash.from_layout, layout=layout, ring_size=4)
  keep = (jnp.arange(t) < j0)[None, :, None, None]

  def loss(attn):
    def f(q, k, v_):
      return jnp.sum(jnp.where(keep, attn(q, k, v_) * dout, 0.0))
    return f

  def ring(q, k, v_):
    return back(ringflash.ring_attention(to(q), to(k), to(v_), mesh=helpers.mesh_of(4),
                                         layout=layout, is_causal=True, backend="xla"))

  dense = lambda q, k, v_: oracle.attention(q, k, v_, causal=True)[0]  # noqa: E731
  out = ring(q, k, bad_v)
  assert bool(jnp.all(jnp.isfinite(out[:, :j0]))) and bool(jnp.all(jnp.isnan(out[:, j0:, :2])))
  assert helpers.max_err(out[:, :j0], dense(q, k, v)[:, :j0]) <= helpers.fp32_tol(out)
  got = jax.grad(loss(ring), argnums=(0, 1, 2))(q, k, bad_v)
  want = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    assert bool(jnp.all(jnp.isfinite(g)))
    assert helpers.max_err(g, w) <= helpers.fp32_tol(w)


# ---------------------------------------------------------------------------------------
# Bad inputs: ValueError naming the argument, raised while tracing, before any collective.


def _call(t=64, ring_size=4, **kw):
  mesh = helpers.mesh_of(ring_size)
  q = jnp.zeros((1, t, N, H))
  k = jnp.zeros((1, t, 2, H))
  return ringflash.ring_attention(q, k, k, mesh=mesh, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(layout="snake"), "layout"),
    (dict(layout="zigzag", block_sizes=XlaBlockSizes(16, 8)), "block_sizes.block_q"),
    (dict(local_window_size=-1), "local_window_size"),
    (dict(local_window_size=(3, 2, 1)), "local_window_size"),
    (dict(local_window_size=2.5), "local_window_size"),
    (dict(local_window_size=True), "local_window_size"),
    (dict(local_window_size=(4, -2)), "local_window_size"),
    (dict(bidirectional="yes"), "bidirectional"),
    (dict(bidirectional=True, block_sizes=XlaBlockSizes(8, 16)),
     "block_sizes.block_k"),
])
def test_bad_inputs(kw, match):
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda: _call(**kw)).lower()


def test_bad_layout_arguments():
  x = np.zeros((1, 12))
  with pytest.raises(ValueError, match="layout"):
    ringflash.to_layout(x, "diagonal", 2)
  with pytest.raises(ValueError, match="ring_size"):
    ringflash.to_layout(x, "zigzag", True)
  with pytest.raises(ValueError, match="ring_size"):
    ringflash.from_layout(x, "striped", 0)
  with pytest.raises(ValueError, match="axis"):
    ringflash.to_layout(x, "striped", 2, axis=2)
  with pytest.raises(ValueError, match="axis=-3 is out of range for an array of rank 2"):
    ringflash.to_layout(x, "striped", 2, axis=-3)
  for axis in (1.0, None, "1", True):          # each was a TypeError not naming axis
    with pytest.raises(ValueError, match="axis must be an int"):
      ringflash.to_layout(x, "striped", 2, axis=axis)


@pytest.mark.parametrize("explicit", [False, True])
def test_layouts_keep_the_sequence_sharded(explicit):
  """to_layout / from_layout of a sequence-sharded array keep it sharded: on a mesh of Auto
  axes the gather came out replicated (every device holding the whole sequence), on
  Explicit axes it was JAX's ShardingTypeError. Eagerly, and inside jit on Explicit axes
  (on Auto axes a tracer shows no sharding: the compiler chooses), with the values of the
  NumPy permutation."""
  from jax.sharding import AxisType, Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()[:8]), ("sp",),
              axis_types=(AxisType.Explicit if explicit else AxisType.Auto,))
  host = np.arange(2 * 64 * 3, dtype=np.float32).reshape(2, 64, 3)
  seq = NamedSharding(mesh, P(None, "sp"))
  x = jax.device_put(host, seq)
  for layout in ("zigzag", "striped"):
    want = ringflash.to_layout(host, layout, 8)
    jitted = jax.jit(ringflash.to_layout, static_argnums=(1, 2))
    for fn in (ringflash.to_layout,) + ((jitted,) if explicit else ()):
      y = fn(x, layout, 8)
      assert y.addressable_shards[0].data.shape == (2, 8, 3)
      np.testing.assert_array_equal(np.asarray(y), want)
      back = ringflash.from_layout(y, layout, 8)
      assert back.addressable_shards[0].data.shape == (2, 8, 3)
      np.testing.assert_array_equal(np.asarray(back), host)


@pytest.mark.parametrize("layout,t,bidirectional", [("zigzag", 12, False),
                                                     ("striped", 28, True)])
def test_padded_layouts_of_sequence_sharded_explicit_inputs(layout, t, bidirectional):
  """A zigzag or striped sequence whose length does not fit the layout (zigzag: not a
  multiple of 2P; striped bidirectional: odd local lengths) is padded by a gather along the
  sequence; inputs sequence-sharded on Explicit axes made it JAX's ShardingTypeError. Out
  and gradients against the oracle, eager and under jit, and a KVCache prefilled in that
  layout from such keys."""
  from jax.sharding import AxisType, NamedSharding  # pylint: disable=g-import-not-at-top
  ring = 4
  mesh = jax.make_mesh((ring,), ("sp",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:ring])
  q, k, v, dout = helpers.inputs(43, 1, t, t, 2, 2, 8, jnp.float32)
  pos = ringflash.to_layout(np.arange(t), layout, ring, axis=0)

  def ref_loss(q, k, v):
    return jnp.sum(oracle.attention(q, k, v, causal=True, q_pos=pos, kv_pos=pos)[0] * dout)

  def loss(q, k, v):
    out = ringflash.ring_attention(q, k, v, is_causal=True, layout=layout,
                                   bidirectional=bidirectional)
    return jnp.sum(out * dout), out

  want = oracle.attention(q, k, v, causal=True, q_pos=pos, kv_pos=pos)[0]
  want_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
  with jax.set_mesh(mesh):
    placed = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]
    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    for fn in (grad, jax.jit(grad)):
      grads, out = fn(*placed)
      assert helpers.max_err(out, want) <= helpers.fp32_tol(want)
      for got, ref in zip(grads, want_grads):
        assert helpers.max_err(got, ref) <= helpers.fp32_tol(ref)
    cache = ringflash.KVCache.create(1, 64, 2, 8, mesh=mesh, dtype=jnp.float32)
    cache = cache.prefill(placed[1], placed[2], layout=layout)
    assert np.asarray(cache.lengths).tolist() == [t]


def test_sharded_entry_with_layout():
  # Inside the caller's shard_map, shards in striped order: device i holds tokens i, i+4, ..
  mesh = helpers.mesh_of(4)
  q, k, v, _ = helpers.inputs(0, 1, 128, 128, N, 2, H, jnp.float32)

  def body(q, k, v):
    return ringflash.ring_attention_sharded(
        q, k, v, axis_name="sp", is_causal=True, layout="striped", local_window_size=(20, 0),
        backend="xla", block_sizes=XlaBlockSizes(8, 8))

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                             out_specs=P(None, "sp")))
  to = functools.partial(ringflash.to_layout, layout="striped", ring_size=4)
  out = ringflash.from_layout(fn(to(q), to(k), to(v)), "striped", 4)
  ref, _ = oracle.attention(q, k, v, causal=True, window=(20, 0))
  assert helpers.max_err(out, ref) <= helpers.fp32_tol(ref)


def test_sharded_entry_validates_layout():
  mesh = helpers.mesh_of(4)

  def body(q, k):
    return ringflash.ring_attention_sharded(q, k, k, axis_name="sp", layout="zigzag")

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sp"),) * 2,
                     out_specs=P(None, "sp"))
  q = jnp.zeros((1, 12, N, H))     # 3 per device: not two whole zigzag chunks
  with pytest.raises(ValueError, match="layout"):
    jax.jit(fn).lower(q, jnp.zeros((1, 12, 2, H)))


def _plan_pair_by_pair(layout, p, q_len, kv_len, bq, bk, causal, window, bidirectional, group):
  """The plan's tile counts and lanes as the planner first computed them: the range test on
  each pair of devices, then each +1 lane length a in turn."""
  def counts(parts):
    q_pos = ring_plan.layout_positions(layout, p, q_len * p, group)
    k_pos = ring_plan.layout_positions(layout, p, kv_len * p, group)
    k_pos = k_pos.reshape(p, parts, kv_len // parts)
    tiles = np.zeros((p, p, parts), np.int64)
    for d in range(p):
      q_lo, q_hi = ring_plan._tile_ranges(q_pos[d], bq)
      for e in range(p):
        for part in range(parts):
          k_lo, k_hi = ring_plan._tile_ranges(k_pos[e, part], bk)
          work = base.ranges_may_have_work(q_lo[:, None], q_hi[:, None], k_lo[None],
                                           k_hi[None], causal=causal, window=window)
          tiles[d, e, part] = np.broadcast_to(work, (len(q_lo), len(k_lo))).sum()
    return tiles

  full = counts(1)
  needed = [o == 0 or any(full[d, (d - o) % p, 0] for d in range(p)) for o in range(p)]
  best = (p - 1, 0)
  for a in range(p):
    later = [o for o in range(a + 1, p) if needed[o]]
    b = p - min(later) if later else 0
    if a + b < sum(best):
      best = (a, b)
  if sum(best) < p - 1:
    return full, best
  if bidirectional and p > 1:
    return counts(2), "both"
  return full, best


def test_plan_tile_counts_and_lanes_match_a_pair_by_pair_count():
  """The planner counts tiles by binary searches in the key tiles' sorted bounds (a pair of
  devices at a time took minutes at 4096 devices, a pair of tiles at a time hours at 2^30
  tokens) and picks lanes without a loop over every lane length: both as the pair-by-pair
  count with base.ranges_may_have_work gives them, over layouts, windows on either side,
  the bidirectional halves, the hybrid's groups and tiles that do not divide the rows."""
  ring_plan.plan_ring.cache_clear()
  rng = np.random.default_rng(7)
  cases = 0
  for layout in ring_plan.LAYOUTS:
    for p in (1, 2, 3, 5, 8, 12):
      for window in (None, (0, 0), (6, 0), (0, 9), (20, 3), (70, 70)):
        causal = bool(rng.integers(2))
        bidirectional = bool(rng.integers(2))
        group = int(rng.choice([1, 2]))
        q_len, kv_len = 8 * group * int(rng.integers(1, 4)), 8 * group * int(rng.integers(1, 4))
        bq, bk = int(rng.choice([2, 3, 4])), int(rng.choice([2, 4, 5]))
        plan = ring_plan.plan_ring(layout, p, q_len, kv_len, bq, bk, causal, window,
                                   bidirectional, group)
        tiles, lanes = _plan_pair_by_pair(layout, p, q_len, kv_len, bq, bk, causal, window,
                                          bidirectional, group)
        np.testing.assert_array_equal(plan.tiles, tiles)
        # The lanes visit each offset with work once, at steps they compute, so each device
        # computes every tile it has work in, once (a lane's steps before its first are held,
        # not computed).
        np.testing.assert_array_equal(plan.work_per_device(), tiles.sum(axis=(1, 2)))
        if lanes == "both":
          assert plan.parts == 2 and [l.direction for l in plan.lanes] == [1, -1]
        else:
          a, b = lanes
          assert plan.parts == 1 and plan.lanes[0].last == a
          assert (plan.lanes[1].last if len(plan.lanes) > 1 else 0) == b
        cases += 1
  assert cases == 108
