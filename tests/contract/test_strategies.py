"""Every strategy (all-gather, Ulysses, hybrid) through the contract cases, on the xla
backend: the same cases, oracle and tolerances as tests/contract/base.py. The ring's own
cases are the backends' subclasses (test_xla.py, ...); here a subset of them runs once per
other strategy, so that each strategy meets every mask, layout and piece of vocabulary.

Hybrid runs on 2-D meshes: P devices as (P / 2, 2), the all-to-all over the second axis and
the ring over the first. Ulysses needs the N = 4 query heads to divide over the devices, so
its rings of 8 run on 4 devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding

import helpers
import oracle
import ringflash
from ringflash.parallel import ulysses

from contract import base
from contract import test_xla


def _named(cases, *names):
  """The cases of the base's lists (default and slow) with these names, every one found."""
  out = [c for c in cases if c.name in names]
  assert sorted(c.name for c in out) == sorted(names), names
  return out


STRATEGY_RING_CASES = _named(
    base.RING_CASES + base.SLOW_RING_CASES, "gqa-causal-seg-P8", "mqa-seg-P4",
    "cross-causal-T<S-P4", "zigzag-causal-P8", "striped-causal-seg-P4",
    "window-spanning-seg-P8", "low-precision-gqa-causal-P4")
STRATEGY_VOCAB_CASES = _named(
    base.VOCAB_CASES + base.SLOW_VOCAB_CASES, "sinks-softcap-window-zigzag-P4",
    "uneven-seg-P8", "batch-dims-2x2-P2", "zigzag-uneven-sinks-seg-P4")
SLOW_STRATEGY_VOCAB_CASES = _named(
    base.VOCAB_CASES + base.SLOW_VOCAB_CASES, "mla-192-128-P2", "everything-P4", "lengths-P4")


class _Strategy(test_xla.TestXla):
  """The xla contract with another strategy (not collected: the tests below drive it)."""

  __test__ = False

  def __init__(self, strategy: str):
    self.strategy = strategy

  def options(self):
    if self.strategy == "hybrid":
      return {"strategy": "hybrid", "axis_name": ("ring", "ulysses")}
    return {"strategy": self.strategy}

  def mesh(self, ring_size):
    devices = np.array(jax.devices()[:ring_size])
    if self.strategy == "hybrid":
      u = 2 if ring_size % 2 == 0 else 1
      return Mesh(devices.reshape(ring_size // u, u), ("ring", "ulysses"))
    return Mesh(devices, ("sp",))

  def adapt(self, case):
    if self.strategy != "hybrid":     # bidirectional is a schedule of the ring (refused here)
      case = dataclasses.replace(case, bidirectional=False)
    if self.strategy == "ulysses":
      return dataclasses.replace(case, ring_size=min(case.ring_size, base.N))
    return case


STRATEGIES = ["allgather", "ulysses", "hybrid"]


@pytest.mark.parametrize("case", STRATEGY_RING_CASES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ring_cases(strategy, case):
  _Strategy(strategy)._check_case(case)   # pylint: disable=protected-access


@pytest.mark.parametrize("case", STRATEGY_VOCAB_CASES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vocabulary_cases(strategy, case):
  _Strategy(strategy)._check_vocab(case)   # pylint: disable=protected-access


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_STRATEGY_VOCAB_CASES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vocabulary_cases_slow(strategy, case):
  _Strategy(strategy)._check_vocab(case)   # pylint: disable=protected-access


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_error_does_not_grow_with_ring_size(strategy):
  _Strategy(strategy).test_error_does_not_grow_with_ring_size()


@pytest.mark.parametrize("strategy,where", [
    # hybrid's "q" (115 s in a --durations run of the whole suite, 11 s run alone) runs with
    # the slow cases; its "q-inf-softcap" by default
    pytest.param(s, w, marks=[pytest.mark.slow] if w == "v" or (s, w) == ("hybrid", "q")
                 else [])
    for s in STRATEGIES for w in ("q", "q-inf-softcap", "v")])
def test_nonfinite_rule(strategy, where):
  if where == "q-inf-softcap":     # the strategy's own forward guards the query too
    _Strategy(strategy).test_nonfinite_values_a_row_sees_reach_it("q", 2.0, False, np.inf)
    return
  _Strategy(strategy).test_nonfinite_values_a_row_sees_reach_it(where, None, False, np.nan)
  _Strategy(strategy).test_nonfinite_values_a_row_does_not_see_never_reach_it(where, None, False)


@pytest.mark.parametrize("strategy", [pytest.param("allgather", marks=pytest.mark.slow),
                                      "ulysses",
                                      pytest.param("hybrid", marks=pytest.mark.slow)])
def test_nonfinite_rule_under_remat(strategy):
  """Ulysses' backward reads the inputs after its all-to-alls, which carry a name of their
  own (ringflash.RESIDUAL_NAMES)."""
  _Strategy(strategy).test_nonfinite_rule_holds_under_remat("names")


@pytest.mark.parametrize("strategy,sinks,causal", [
    # hybrid's sinks and unmasked cases (28-31 s each in a --durations run of the whole
    # suite, 5-6 s run alone) run with the slow cases; its plain one by default
    pytest.param(s, *v, id=f"{s}-{name}",
                 marks=[pytest.mark.slow] if s == "hybrid" and name != "plain" else [])
    for s in STRATEGIES
    for name, v in (("plain", (False, True)), ("sinks", (True, True)),
                    ("unmasked", (False, False)))])
def test_scores_below_float32(strategy, sinks, causal):
  _Strategy(strategy).test_scores_below_float32_make_their_row_nan_not_zero(4, sinks, causal)


@pytest.mark.parametrize("strategy,options,n,k,mesh_axes,says", [
    ("allgather", dict(bidirectional=True), 4, 2, ("sp",), "bidirectional=True.*'allgather'"),
    ("ulysses", dict(bidirectional=True), 4, 2, ("sp",), "bidirectional=True.*'ulysses'"),
    # 12 striped tokens on 4 devices: an odd local length, but no ring to split it for
    ("allgather", dict(bidirectional=True, layout="striped", t=12), 4, 2, ("sp",),
     "bidirectional=True.*'allgather'"),
    ("ulysses", {}, 6, 2, ("sp",), "N=6 query heads"),
    ("hybrid", {}, 4, 2, ("sp",), "'hybrid' needs axis_name to be a tuple"),
    ("hybrid", {}, 3, 1, ("r", "u"), "'hybrid' shards the N=3 query heads over the 2 devices "
     "of the last axis"),
    # over a tuple of axes Ulysses shards the heads over all of its devices, not the first axis'
    ("ulysses", {}, 2, 2, ("a", "b"), "N=2 query heads"),
])
def test_what_a_strategy_cannot_run_is_not_implemented_naming_it(strategy, options, n, k,
                                                                  mesh_axes, says):
  """Refused before anything runs, with the strategy's reason (never another strategy)."""
  mesh = Mesh(np.array(jax.devices()[:4]).reshape((4,) if len(mesh_axes) == 1 else (2, 2)),
              mesh_axes)
  options = dict(options)
  t = options.pop("t", 16)
  q, kv = jnp.zeros((1, t, n, 8)), jnp.zeros((1, t, k, 8))
  axis_name = mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
  with pytest.raises(NotImplementedError, match=says):
    jax.jit(lambda q, kv: ringflash.ring_attention(
        q, kv, kv, mesh=mesh, axis_name=axis_name, strategy=strategy, **options)).lower(q, kv)


def test_hybrid_shards_the_heads_over_its_last_axis_whatever_the_first():
  """Hybrid on ("r", "u"): Ulysses over "u", the last axis, so N = K = 2 heads run on a
  4 x 2 mesh (exact) and are refused on a 2 x 4 one, naming the last axis' 4 devices (the
  all-to-all's own error otherwise); the square meshes elsewhere cannot tell the axes apart."""
  q, k, v, _ = helpers.inputs(29, 1, 16, 16, 2, 2, 8, jnp.float32)
  for shape in ((4, 2), (2, 4)):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("r", "u"))
    attn = functools.partial(ringflash.ring_attention, mesh=mesh, axis_name=("r", "u"),
                             strategy="hybrid", is_causal=True, return_residual=True)
    if shape == (4, 2):
      _fwd_bwd_against_oracle(attn, q, k, v, causal=True)
    else:
      with pytest.raises(NotImplementedError, match="N=2 query heads over the 4 devices of "
                                                    "the last axis"):
        jax.jit(attn).lower(q, k, v)


def _fwd_bwd_against_oracle(fn, q, k, v, **oracle_options):
  """fn(q, k, v) -> (out, lse) against the oracle, forward and the vjp of a cos cotangent."""
  (out, lse), vjp = jax.vjp(fn, q, k, v)
  (ref, ref_lse), ref_vjp = jax.vjp(
      lambda q, k, v: oracle.attention(q, k, v, **oracle_options), q, k, v)
  got = (out, lse) + vjp((jnp.cos(out), jnp.zeros_like(lse)))
  want = (ref, ref_lse) + ref_vjp((jnp.cos(ref), jnp.zeros_like(ref_lse)))
  for g, r in zip(got, want):
    assert helpers.max_err(g, r) <= helpers.fp32_tol(r)


@pytest.mark.parametrize("strategy", ["ring", "hybrid"])
def test_a_tuple_of_axes_in_another_order_than_the_mesh(strategy):
  """axis_name's axes in an order other than the mesh's: the sequence is split over them in
  the order given, and the ring's permutes (which JAX takes in the mesh's order only) follow
  it. The ring raised JAX's RuntimeError; all-gather and Ulysses ran."""
  shape, names, axis_name = {"ring": ((2, 4), ("r", "u"), ("u", "r")),
                             "hybrid": ((2, 2, 2), ("a", "b", "u"), ("b", "a", "u"))}[strategy]
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names)
  q, k, v, _ = helpers.inputs(23, 1, 64, 64, 4, 2, 8, jnp.float32)

  def fn(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, axis_name=axis_name, is_causal=True,
                                    strategy=strategy, return_residual=True,
                                    bidirectional=strategy == "ring")

  _fwd_bwd_against_oracle(jax.jit(fn), q, k, v, causal=True)


def test_hybrid_bidirectional_halves_a_members_keys_not_a_devices():
  """Inside a caller's shard_map with 5 keys a device: a hybrid ring member holds the 10 of
  its Ulysses pair, which halve; it was refused as an odd local length."""
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("r", "u"))
  q, k, v, _ = helpers.inputs(29, 1, 20, 20, 4, 2, 8, jnp.float32)
  spec = jax.sharding.PartitionSpec(None, ("r", "u"))

  def local(q, k, v):
    return ringflash.ring_attention_sharded(q, k, v, axis_name=("r", "u"), strategy="hybrid",
                                            bidirectional=True, is_causal=True,
                                            return_residual=True)

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3,
                             out_specs=(spec, jax.sharding.PartitionSpec(None, None,
                                                                         ("r", "u")))))
  _fwd_bwd_against_oracle(fn, q, k, v, causal=True)
  with pytest.raises(ValueError, match="must be even, got 5"):
    jax.jit(jax.shard_map(
        lambda q, k, v: ringflash.ring_attention_sharded(q, k, v, axis_name=("r", "u"),
                                                         strategy="ring", bidirectional=True),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)).lower(q, k, v)


def test_kv_head_copies_are_summed_in_float32_and_rounded_once():
  """K < P: Ulysses (and hybrid's Ulysses axis) repeats each kv head P / K times; the
  gradients of the copies are summed in float32 and cast once. jnp.repeat's transpose added
  them in bfloat16, a rounding per copy: with K = 1 on P = 8, dK and dV of Ulysses were 1.6x
  and 1.8x as far from the oracle as the ring's (RMS)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 2, 8)).astype(jnp.bfloat16)
  g = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 16, 8)).astype(jnp.bfloat16)
  _, pullback = jax.vjp(lambda x: ulysses.repeat_kv(x, 2, 16), x)
  (got,) = pullback(g)
  want = g.astype(jnp.float32).reshape(2, 16, 2, 8, 8).sum(axis=3).astype(jnp.bfloat16)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert ulysses.repeat_kv(x, 4, 4) is x                       # K a multiple of P: no copy


def test_heads_split_over_another_axis_are_what_ulysses_divides():
  """Heads sharded over "model" (2) and Ulysses over "sp" (4): N = 4 leaves 2 heads a device,
  which do not divide over 4; that is a NotImplementedError saying so (it passed the check
  of N = 4 and failed inside JAX's all_to_all), and explain reports ulysses as not possible.
  N = 8 (4 a device) runs, exactly."""
  devices = np.array(jax.devices()[:8]).reshape(2, 4)
  mesh = Mesh(devices, ("model", "sp"))
  heads = NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sp", "model"))
  for n, runs in ((4, False), (8, True)):
    q, k, v, _ = helpers.inputs(31, 1, 32, 32, n, 2, 8, jnp.float32)
    q, k, v = (jax.device_put(x, heads) for x in (q, k, v))
    ulysses = next(e for e in ringflash.explain(q, k, v, mesh=mesh).estimates
                   if e.strategy == "ulysses")
    assert (ulysses.reason is None) == runs, ulysses

    def fn(q, k, v):
      return ringflash.ring_attention(q, k, v, mesh=mesh, strategy="ulysses",
                                      return_residual=True)

    if runs:
      _fwd_bwd_against_oracle(fn, q, k, v)
    else:
      with pytest.raises(NotImplementedError, match=r"N=2 query heads.*split over 2 devices"):
        fn(q, k, v)


def test_the_cost_model_sees_one_devices_batch_and_the_global_sequence(monkeypatch):
  """explain's estimates on a (data 2, sp 4) mesh with B = 2 split over data are those of
  B = 1 on 4 devices (the per-device program is the same; they were doubled), and
  ring_attention_sharded's "auto" asks the cost model with the global lengths (it gave it
  the local ones, as if the sequence were P times shorter)."""
  from ringflash.parallel import cost
  devices = np.array(jax.devices()[:8])
  wide = Mesh(devices.reshape(2, 4), ("data", "sp"))
  batch = NamedSharding(wide, jax.sharding.PartitionSpec("data", "sp"))
  shapes = [jax.ShapeDtypeStruct((2, 4096, 4, 64), jnp.bfloat16, sharding=batch)] * 3
  one = [jax.ShapeDtypeStruct((1, 4096, 4, 64), jnp.bfloat16)] * 3
  got = ringflash.explain(*shapes, mesh=wide, is_causal=True)
  want = ringflash.explain(*one, mesh=Mesh(devices[:4], ("sp",)), is_causal=True)
  assert got.estimates == want.estimates and got.common_bytes == want.common_bytes

  seen = []
  choose = cost.choose
  monkeypatch.setattr(cost, "choose", lambda call, *a, **kw: seen.append(call) or choose(
      call, *a, **kw))
  mesh = Mesh(devices[:4], ("sp",))
  spec = jax.sharding.PartitionSpec(None, "sp")
  x = jnp.zeros((1, 64, 4, 8))
  jax.jit(jax.shard_map(lambda q, k, v: ringflash.ring_attention_sharded(q, k, v,
                                                                         axis_name="sp"),
                        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)).lower(x, x, x)
  assert [(c.t, c.s) for c in seen] == [(64, 64)]


@pytest.mark.parametrize("window,steps", [(None, 8), ((64, 0), 2), ((0, 0), 1)])
def test_the_cost_model_charges_the_hops_the_ring_runs(window, steps):
  """A window truncates the contiguous ring (parallel/plan.py): window (0, 0) runs one step
  and moves nothing. The model charged P steps of K/V and dK/dV transfers whatever the
  window, and took a row's keys in a hop as a share of the whole sequence's, so on the GPU
  model "auto" took Ulysses (two all-to-alls) over a ring that moves nothing."""
  from ringflash import _validate, introspect  # pylint: disable=g-import-not-at-top
  from ringflash.parallel import cost  # pylint: disable=g-import-not-at-top
  p, t = 8, 8 * 4096
  x = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16)
  call = _validate.check_call(x, x, x, ring_size=p, local=False, pads=True,
                              local_window_size=window)
  assert cost._ring_steps(call, p) == steps  # pylint: disable=protected-access
  axes = _validate.SeqAxes(("sp",), (p,))
  local = jax.ShapeDtypeStruct((1, t // p, 8, 128), jnp.bfloat16)
  spec = introspect.ring_spec(local, local, local, ring_size=p, device=jax.devices()[0],
                              local_window_size=window)
  assert spec.plan(t // p, t // p).steps == steps       # the plan ring_attention runs
  plat = cost.PLATFORMS["gpu"]
  ring = cost.estimate("ring", call, axes, plat).seconds
  if window is not None:      # striped: every hop meets the window, the ring runs 8 steps
    striped = dataclasses.replace(call, layout="striped")
    assert cost._ring_steps(striped, p) == 8  # pylint: disable=protected-access
    assert ring < cost.estimate("ring", striped, axes, plat).seconds
  if steps == 1:     # nothing moves: "auto" takes the ring over Ulysses' two all-to-alls
    assert cost.choose(call, axes, platform="gpu").strategy == "ring"
    assert ring < cost.estimate("ulysses", call, axes, plat).seconds


def test_the_cost_model_takes_the_gpus_own_memory():
  """A GPU's memory is what its allocator says (memory_stats' bytes_limit), not the H200's
  139 GiB the model assumed for every GPU: on a card with less, a strategy that does not fit
  it is marked so and not chosen. A device that gives no figure keeps the model's."""
  from ringflash import _validate  # pylint: disable=g-import-not-at-top
  from ringflash.parallel import cost  # pylint: disable=g-import-not-at-top

  class Gpu:
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def __init__(self, limit):
      self.limit = limit

    def memory_stats(self):
      return {"bytes_limit": self.limit, "bytes_in_use": 0}

  p, t = 8, 8 * 131072
  x = jax.ShapeDtypeStruct((1, t, 32, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16)
  call = _validate.check_call(x, kv, kv, ring_size=p, local=False, pads=True, is_causal=True)
  axes = _validate.SeqAxes(("sp",), (p,))
  roomy = cost.choose(call, axes, platform="gpu", device=Gpu(2**50))
  assert all(e.fits for e in roomy.estimates)
  common = roomy.common_bytes
  extra = {e.strategy: e.extra_bytes for e in roomy.estimates}
  assert cost.choose(call, axes, platform="gpu", device=None).estimates == roomy.estimates
  # room for the smallest strategy's extra arrays and no more: it alone fits and is chosen
  least = min(extra, key=extra.get)
  assert sorted(extra.values())[1] > extra[least]
  tight = cost.choose(call, axes, platform="gpu", device=Gpu(common + extra[least]))
  assert [e.strategy for e in tight.estimates if e.fits] == [least]
  assert tight.strategy == least
  # The fastest strategy when it does not fit: 12 query heads (Ulysses cannot split them
  # over 8 devices), where the all-gather is estimated faster than the ring but holds twice
  # its extra bytes. With room for the ring's alone, the ring runs.
  x12, kv4 = (jax.ShapeDtypeStruct((1, t // 8, heads, 128), jnp.bfloat16) for heads in (12, 4))
  call = _validate.check_call(x12, kv4, kv4, ring_size=p, local=False, pads=True,
                              is_causal=False)
  roomy = cost.choose(call, axes, platform="gpu", device=Gpu(2**50))
  extra = {e.strategy: e.extra_bytes for e in roomy.estimates}
  assert roomy.strategy == "allgather" and extra["allgather"] > extra["ring"]
  tight = cost.choose(call, axes, platform="gpu",
                      device=Gpu(roomy.common_bytes + extra["ring"]))
  assert [e.strategy for e in tight.estimates if e.fits] == ["ring"]
  assert tight.strategy == "ring"
  assert cost.device_memory(Gpu(80 * 2**30)) == 80 * 2**30
  assert cost.device_memory(jax.devices()[0]) is None            # CPU devices give none


# strategy, backend, layout, P, T, block_q, block_k: tiles larger than a device's share (the
# contiguous case's 15 too, 60 tokens on 4 devices), which divide what the kernel sees.
SPANNING = [
    ("ulysses", "xla", "contiguous", 4, 60, 20, 30),
    ("ulysses", "xla", "zigzag", 2, 64, 64, 32),
    ("ulysses", "xla", "striped", 8, 64, 32, 16),
    ("allgather", "xla", "contiguous", 4, 60, 5, 20),
    ("allgather", "xla", "zigzag", 4, 64, 8, 32),
    ("allgather", "xla", "striped", 2, 64, 16, 64),
    ("ulysses", "pallas_tpu", "zigzag", 4, 64, 32, None),
    ("allgather", "pallas_tpu", "striped", 4, 64, 8, None),
]


@pytest.mark.parametrize("strategy,backend,layout,p,t,block_q,block_k", SPANNING, ids=str)
def test_tiles_may_span_the_shards_a_strategy_gathers(strategy, backend, layout, p, t,
                                                       block_q, block_k):
  """Ulysses' kernel sees the whole sequence and all-gather's the whole key sequence, both in
  natural order: tiles divide those lengths, not T / P, and span the shards they came from
  (pallas_tpu's key tile, None here, is the whole gathered length). They were refused as
  not dividing the local length. Causal with a window and packed documents; out, lse and
  the gradients of q, k, v against the oracle, and a NaN key's reach."""
  q, key, v, dout = helpers.inputs(61, 2, t, t, 8, 2, 16, jnp.float32)
  seg = jnp.asarray(helpers.packed_segments(2, t, seed=4))
  pos = np.arange(t) if layout == "contiguous" else ringflash.to_layout(np.arange(t), layout,
                                                                          p, axis=0)
  options = dict(is_causal=True, local_window_size=(40, 0), segment_ids=seg)
  if backend == "xla":
    tiles = ringflash.XlaBlockSizes(block_q=block_q, block_k=block_k)
  else:
    tiles = ringflash.TpuBlockSizes(block_q=block_q, block_k=block_k)

  def ours(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=helpers.mesh_of(p), layout=layout,
                                    strategy=strategy, backend=backend, block_sizes=tiles,
                                    return_residual=True, **options)

  def ref(q, k, v):
    return oracle.attention(q, k, v, causal=True, window=(40, 0), q_seg=seg, kv_seg=seg,
                            q_pos=pos, kv_pos=pos)

  for got, want in zip(ours(q, key, v), ref(q, key, v)):
    assert helpers.max_err(got, want) <= helpers.fp32_tol(want)
  # NaN in one key spanned by a tile: it reaches the rows that see it (the oracle's NaN
  # rows, window and documents included) and no other
  bad = key.at[:, t // 2 + 1, 1, 0].set(jnp.nan)
  for got, want in zip(ours(q, bad, v), ref(q, bad, v)):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(want).any() and not np.isnan(want).all()
    seen = np.isnan(want)
    assert helpers.max_err(np.where(seen, 0, got), np.where(seen, 0, want)) <= (
        helpers.fp32_tol(np.where(seen, 0, want)))
  grads = jax.grad(lambda *a: jnp.sum(ours(*a)[0] * dout), argnums=(0, 1, 2))(q, key, v)
  want_grads = jax.grad(lambda *a: jnp.sum(ref(*a)[0] * dout), argnums=(0, 1, 2))(q, key, v)
  for got, want in zip(grads, want_grads):
    assert helpers.max_err(got, want) <= helpers.fp32_tol(want)


@pytest.mark.parametrize("strategy,tiles,message", [
    ("ulysses", ringflash.XlaBlockSizes(block_q=128),
     "block_sizes.block_q=128 must divide the local length 96 (backend 'xla'); under strategy "
     "'ulysses' a kernel call tiles 96 query rows (the whole sequence) and 96 key rows (the "
     "whole sequence, gathered)"),
    ("allgather", ringflash.XlaBlockSizes(block_q=32),
     "block_sizes.block_q=32 must divide the local length 12 (backend 'xla'); under strategy "
     "'allgather' a kernel call tiles 12 query rows (a zigzag chunk of a device's share) and "
     "96 key rows (the whole sequence, gathered)"),
    ("ulysses", ringflash.TpuBlockSizes(block_q=32),     # not about rows: no rows said
     "block_sizes must be a ringflash.XlaBlockSizes or None for backend 'xla', got "
     "TpuBlockSizes"),
    ("ring", ringflash.XlaBlockSizes(block_q=48),
     "block_sizes.block_q=48 must divide the local length 12 (backend 'xla'); under strategy "
     "'ring' a kernel call tiles 12 query rows (a zigzag chunk of a device's share) and 12 "
     "key rows (a zigzag chunk of a device's share)"),
])
def test_tiles_that_do_not_fit_what_a_strategys_kernel_sees_are_refused(strategy, tiles,
                                                                         message):
  """The lengths a refusal of block_sizes quotes are often no argument's (the gathered
  sequence, a zigzag chunk): the message says which rows they are."""
  q, key, v, _ = helpers.inputs(62, 1, 96, 96, 4, 2, 8, jnp.float32)
  with pytest.raises(ValueError) as err:
    ringflash.ring_attention(q, key, v, mesh=helpers.mesh_of(4), strategy=strategy,
                             backend="xla", block_sizes=tiles, layout="zigzag")
  assert str(err.value).splitlines()[0] == message
