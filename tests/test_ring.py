"""The public entry points on simulated CPU meshes: jit and grad compose, default mesh and
scale, the sharding of the output, other mesh axes. The numerical cases of the contract, on
every backend, are in tests/contract/."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import helpers
import ringflash


def test_jit_grad_compose_and_output_is_sequence_sharded():
  b, t, n, h = 1, 64, 2, 32
  q, key, v, _ = helpers.inputs(6, b, t, t, n, n, h, jnp.float32)
  mesh = helpers.mesh_of(8)

  def loss(q, k, v):
    return jnp.sum(ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=True) ** 2)

  g = jax.jit(jax.grad(loss))(q, key, v)
  g_ref = jax.grad(lambda q, k, v: jnp.sum(
      helpers.oracle.attention(q, k, v, causal=True)[0] ** 2))(q, key, v)
  assert helpers.max_err(g, g_ref) <= helpers.fp32_tol(g_ref)
  out = ringflash.ring_attention(q, key, v, mesh=mesh)
  assert isinstance(out.sharding, NamedSharding)
  assert out.sharding.spec[1] == "sp"
  assert out.sharding.shard_shape(out.shape) == (b, t // 8, n, h)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_hops_whose_scores_lie_past_exps_range_apart_merge_exactly(layout):
  """The first device's keys score 120 against every query, the others about +-2: the
  partial results of the hops differ in lse by more than exp's range (88), and the ring's
  merges must shift by the larger one. Forward and backward against the oracle, causal,
  on 8 devices."""
  q, k, v, dout = helpers.inputs(5, 1, 64, 64, 4, 2, 16, jnp.float32)
  q = jnp.ones_like(q)
  k = k.at[:, :8].set(30.0)                 # q.k / sqrt(16) = 120 for the first 8 keys
  mesh = helpers.mesh_of(8)
  q_l, k_l, v_l, dout_l = (ringflash.to_layout(x, layout, 8) for x in (q, k, v, dout))

  def attn(a, b_, c):
    return ringflash.ring_attention(a, b_, c, mesh=mesh, is_causal=True, layout=layout,
                                    return_residual=True)

  (out, lse), vjp = jax.vjp(jax.jit(attn), q_l, k_l, v_l)
  got = [ringflash.from_layout(out, layout, 8), ringflash.from_layout(lse, layout, 8, axis=2)]
  got += [ringflash.from_layout(g, layout, 8) for g in vjp((dout_l, jnp.zeros_like(lse)))]
  for x in got:
    assert bool(jnp.all(jnp.isfinite(x)))
  helpers.check(got, helpers.oracle_fwd_bwd(q, k, v, dout, causal=True))


def test_default_mesh_and_scale():
  b, t, n, h = 1, 64, 2, 16
  q, key, v, _ = helpers.inputs(7, b, t, t, n, n, h, jnp.float32)
  out = ringflash.ring_attention(q, key, v, scale=0.3)      # mesh=None: all 8 devices
  ref, _ = helpers.oracle.attention(q, key, v, scale=0.3)
  assert helpers.max_err(out, ref) <= helpers.FP32_TOL
  assert out.sharding.shard_shape(out.shape)[1] == t // len(jax.devices())


def _padded(spec, rank=4):
  """A PartitionSpec as a tuple of `rank` entries (trailing None entries are implicit)."""
  return tuple(spec) + (None,) * (rank - len(tuple(spec)))


@pytest.mark.parametrize("outer", ["data", "model"])
def test_other_mesh_axes_keep_their_sharding(outer):
  """Batch on a data axis or heads on a model axis stay there; nothing is all-gathered.

  Inside jit the inputs' sharding is visible on meshes with explicit axes."""
  devices = np.array(jax.devices()).reshape(2, 4)
  mesh = Mesh(devices, (outer, "sp"), axis_types=(AxisType.Explicit,) * 2)
  b, t, n, k, h = 2, 64, 4, 2, 32
  q, key, v, _ = helpers.inputs(8, b, t, t, n, k, h, jnp.float32)
  spec = P(outer, "sp") if outer == "data" else P(None, "sp", outer)
  ref, _ = helpers.oracle.attention(q, key, v, causal=True)
  host = (q, key, v)
  q, key, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in host)
  fn = jax.jit(lambda q, k, v: ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=True))
  out = fn(q, key, v)
  assert _padded(out.sharding.spec) == _padded(spec)
  assert helpers.max_err(out, ref) <= helpers.FP32_TOL
  text = fn.lower(q, key, v).compile().as_text()
  assert "all-gather" not in text and "all-to-all" not in text
  # Eagerly, on a mesh with Auto axes, the arrays' own NamedSharding is read.
  auto_mesh = Mesh(devices, (outer, "sp"))
  q, key, v = (jax.device_put(x, NamedSharding(auto_mesh, spec)) for x in host)
  out = ringflash.ring_attention(q, key, v, mesh=auto_mesh, is_causal=True)
  assert _padded(out.sharding.spec) == _padded(spec)
  assert helpers.max_err(out, ref) <= helpers.FP32_TOL


@pytest.mark.parametrize("strategy,backend", [("ring", "xla"), ("ulysses", "xla"),
                                              ("ring", "pallas_tpu")])
@pytest.mark.parametrize("t,spec", [(64, P("data", "sp")), (61, P("data"))],
                         ids=["segments-lengths-sinks", "uneven-length"])
def test_explicit_mesh_axes_with_the_arrays_ringflash_builds(t, spec, strategy, backend):
  """On a mesh of Explicit axes shard_map does not reshard its inputs: the segment ids the
  user passes unsharded, the ids built from lengths, the padded rows of a length that does
  not divide over the ring, and the output trimmed back to that length must each be laid
  out by ringflash (were JAX sharding errors). Forward and gradients, jit, against the
  oracle; the output keeps the batch on the data axis. The layout is the entry point's, not
  a kernel's: xla for both strategies, interpreted pallas_tpu for the ring."""
  devices = np.array(jax.devices()).reshape(2, 4)
  mesh = Mesh(devices, ("data", "sp"), axis_types=(AxisType.Explicit,) * 2)
  b, n, k, h = 2, 4, 2, 16
  q, key, v, dout = helpers.inputs(21, b, t, t, n, k, h, jnp.float32)
  segments = jnp.asarray(np.arange(t)[None] >= np.array([[20], [37]]), jnp.int32)
  q_len, kv_len = jnp.array([t, t - 9], jnp.int32), jnp.array([t - 3, t - 20], jnp.int32)
  sinks = jnp.linspace(-1.0, 1.5, n, dtype=jnp.float32)
  extra = dict(segment_ids=segments, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)

  def loss(q, k, v, sinks):
    out = ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=True, strategy=strategy,
                                   backend=backend, sinks=sinks, **extra)
    return jnp.sum(out * dout), out

  def oracle_loss(q, k, v, sinks):
    out, _ = helpers.oracle.attention(q, k, v, causal=True, sinks=sinks, q_seg=segments,
                                      kv_seg=segments, q_lengths=q_len, kv_lengths=kv_len)
    return jnp.sum(out * dout), out

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, key, v)]
  (_, out), grads = jax.jit(grad)(*placed, sinks)
  (_, ref), refs = jax.value_and_grad(oracle_loss, argnums=(0, 1, 2, 3), has_aux=True)(
      q, key, v, sinks)
  assert out.shape == (b, t, n, h) and _padded(out.sharding.spec)[0] == "data"
  for got, want in zip((out,) + grads, (ref,) + refs):
    assert helpers.max_err(got, want) <= helpers.fp32_tol(want)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_explicit_mesh_heads_sharded_sinks_gradient(backend):
  """Heads on a model axis of Explicit axes, sinks replicated: the sinks' gradient, summed
  over rows, kept the heads' sharding, and every jax.grad through the call failed (a custom
  VJP's cotangent must have its primal's type). Forward and gradients against the oracle,
  eager and under jit."""
  devices = np.array(jax.devices()).reshape(2, 4)
  mesh = Mesh(devices, ("model", "sp"), axis_types=(AxisType.Explicit,) * 2)
  b, t, n, k, h = 1, 32, 4, 2, 16
  q, key, v, dout = helpers.inputs(23, b, t, t, n, k, h, jnp.float32)
  sinks = jnp.linspace(-1.0, 1.5, n, dtype=jnp.float32)

  def loss(q, k, v, sinks):
    out = ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=True, backend=backend,
                                   sinks=sinks)
    return jnp.sum(out * dout)

  def oracle_loss(q, k, v, sinks):
    return jnp.sum(helpers.oracle.attention(q, k, v, causal=True, sinks=sinks)[0] * dout)

  refs = jax.grad(oracle_loss, argnums=(0, 1, 2, 3))(q, key, v, sinks)
  placed = [jax.device_put(x, NamedSharding(mesh, P(None, "sp", "model")))
            for x in (q, key, v)]
  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  with jax.set_mesh(mesh):
    for grads in (grad(*placed, sinks), jax.jit(grad)(*placed, sinks)):
      for got, want in zip(grads, refs):
        assert helpers.max_err(got, want) <= helpers.fp32_tol(want)
  # Under jit without jax.set_mesh the replicated sinks are typed on no mesh, and resharding
  # their gradient to that type was refused (JAX: "Reshard should only be used with ... a
  # non-empty mesh").
  for got, want in zip(jax.jit(grad)(*placed, sinks), refs):
    assert helpers.max_err(got, want) <= helpers.fp32_tol(want)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("lead,spec", [
    ((3, 2), P(None, "data", "sp")),                        # order (1, 0)
    ((2, 3, 2), P(None, None, "data", "sp")),               # order (2, 0, 1): not its inverse
    ((2, 3, 2), P("data", None, "model", "sp")),            # two sharded, one between
])
def test_several_batch_dims_sharded_on_a_later_one(axis_type, lead, spec):
  """[B1, B2, T, N, H] with only B2 sharded over "data": flattening them in their own order
  is a reshape Explicit axes refuse (JAX's ShardingTypeError), and on Auto axes the output
  came back sharded on B1. The sharded dims are now flattened first: output, lse and
  gradients against the oracle (segment ids and lengths follow the rows), the output
  sharded as the input was. On Auto axes a trace shows no sharding, so there the eager call
  is the case that flattens in another order; it is checked against the oracle too."""
  seq = spec[len(lead)]
  mesh_axes = ("data", "model", "sp") if "model" in tuple(spec) else ("data", "sp")
  shape = (2, 2, 2) if len(mesh_axes) == 3 else (2, 4)
  mesh = Mesh(np.array(jax.devices()).reshape(shape), mesh_axes,
              axis_types=(axis_type,) * len(mesh_axes))
  rows = int(np.prod(lead))
  t, n, h = 32, 2, 16
  q, key, v, dout = (x.reshape(lead + x.shape[1:])
                     for x in helpers.inputs(31, rows, t, t, n, n, h, jnp.float32))
  seg = jnp.asarray(helpers.packed_segments(rows, t, seed=4).reshape(lead + (t,)))
  lengths = jnp.asarray(np.random.default_rng(5).integers(1, t + 1, rows), jnp.int32
                        ).reshape(lead)
  placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, key, v)]

  def loss(attn, q, k, v):
    out, lse = attn(q, k, v)
    return jnp.sum(out * dout), (out, lse)

  def ours(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, axis_name=seq, is_causal=True,
                                    segment_ids=seg, query_seq_lengths=lengths,
                                    return_residual=True)

  def oracle(q, k, v):
    flat = [x.reshape((rows,) + x.shape[len(lead):]) for x in (q, k, v)]
    out, lse = helpers.oracle.attention(*flat, causal=True, q_seg=seg.reshape(rows, t),
                                        kv_seg=seg.reshape(rows, t),
                                        q_lengths=lengths.reshape(rows))
    return out.reshape(lead + out.shape[1:]), lse.reshape(lead + lse.shape[1:])

  def check(out, lse):
    assert helpers.max_err(out, want_out) <= helpers.fp32_tol(want_out)
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite],
                               rtol=1e-5, atol=1e-5)

  grad = jax.grad(loss, argnums=(1, 2, 3), has_aux=True)
  want_grads, (want_out, want_lse) = grad(oracle, q, key, v)
  with jax.set_mesh(mesh):
    for fn in (grad, jax.jit(grad, static_argnums=0)):
      got_grads, (out, lse) = fn(ours, *placed)
      check(out, lse)
      for got, want in zip(got_grads, want_grads):
        assert helpers.max_err(got, want) <= helpers.fp32_tol(want)
    out, lse = ours(*placed)
    check(out, lse)
    assert tuple(out.sharding.spec)[:len(lead) + 1] == tuple(spec), out.sharding.spec


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("q_spec,kv_spec", [
    (P(None, None, "sp"), P(None, "data", "sp")),           # keys sharded where q is not
    (P(None, "data", "sp"), P("data", None, "sp")),         # over the same axis, another dim
    (None, P(None, "data", "sp")),                          # the query a NumPy array
])
def test_batch_dims_of_keys_sharded_unlike_the_query(axis_type, q_spec, kv_spec):
  """[B1, B2, T, N, H] whose keys, values, key segment ids and key lengths are sharded on
  their batch dims unlike the query (or the query on no mesh): flattening them was a reshape
  Explicit axes refuse (JAX's ShardingTypeError, eager and under jit). They are now
  flattened into the query's batch sharding. Output, lse and gradients against the oracle,
  eager and under jit."""
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "sp"),
              axis_types=(axis_type,) * 2)
  lead, t, n, h = (2, 2), 32, 2, 16
  rows = int(np.prod(lead))
  q, key, v, dout = (x.reshape(lead + x.shape[1:])
                     for x in helpers.inputs(37, rows, t, t, n, n, h, jnp.float32))
  q_seg = np.asarray(helpers.packed_segments(rows, t, seed=6))
  kv_seg = np.where(np.arange(t) % 5 == 0, q_seg + 1, q_seg)   # some keys of no query's
  kv_len = np.random.default_rng(7).integers(1, t + 1, rows).astype(np.int32)
  on = lambda x, spec: (np.asarray(x) if spec is None else
                        jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec)))
  placed_q = on(q, q_spec)
  placed_kv = [on(x, kv_spec) for x in (key, v)]
  seg = (on(q_seg.reshape(lead + (t,)), q_spec and P(*tuple(q_spec)[:3])),
         on(kv_seg.reshape(lead + (t,)), P(*tuple(kv_spec)[:3])))
  lengths = on(kv_len.reshape(lead), P(*tuple(kv_spec)[:2]))

  def loss(attn, q, k, v):
    out, lse = attn(q, k, v)
    return jnp.sum(out * dout), (out, lse)

  def ours(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, axis_name="sp", is_causal=True,
                                    segment_ids=seg, key_value_seq_lengths=lengths,
                                    return_residual=True)

  def oracle(q, k, v):
    flat = [x.reshape((rows,) + x.shape[len(lead):]) for x in (q, k, v)]
    out, lse = helpers.oracle.attention(*flat, causal=True, q_seg=q_seg, kv_seg=kv_seg,
                                        kv_lengths=kv_len)
    return out.reshape(lead + out.shape[1:]), lse.reshape(lead + lse.shape[1:])

  grad = jax.grad(loss, argnums=(1, 2, 3), has_aux=True)
  want_grads, (want_out, want_lse) = grad(oracle, q, key, v)
  finite = np.isfinite(np.asarray(want_lse))
  with jax.set_mesh(mesh):
    for fn in (grad, jax.jit(grad, static_argnums=0)):
      got_grads, (out, lse) = fn(ours, placed_q, *placed_kv)
      assert helpers.max_err(out, want_out) <= helpers.fp32_tol(want_out)
      np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
      np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite],
                                 rtol=1e-5, atol=1e-5)
      for got, want in zip(got_grads, want_grads):
        assert helpers.max_err(got, want) <= helpers.fp32_tol(want)


@pytest.mark.parametrize("layout,block_q", [("contiguous", 4), ("zigzag", None)])
def test_vmap_over_an_explicit_batch_with_gqa_and_several_query_tiles(layout, block_q):
  """jax.vmap of ring_attention on an Explicit ("data", "sp") mesh, the batch sharded over
  "data", GQA: with more than one query tile a device (small tiles, or zigzag's two
  chunks) the xla kernel's reshape merging two pairs of dims was JAX's ShardingTypeError.
  Output and gradients against the oracle, with and without spmd_axis_name."""
  mesh = jax.make_mesh((2, 4), ("data", "sp"), axis_types=(AxisType.Explicit,) * 2)
  q, key, v, dout = helpers.inputs(47, 2, 32, 32, 4, 2, 8, jnp.float32)
  pos = ringflash.to_layout(np.arange(32), layout, 4, axis=0)
  tiles = None if block_q is None else ringflash.XlaBlockSizes(block_q=block_q)

  def ref_loss(q, k, v):
    return jnp.sum(helpers.oracle.attention(q, k, v, q_pos=pos, kv_pos=pos)[0] * dout)

  def f(q, k, v):
    return ringflash.ring_attention(q, k, v, layout=layout, block_sizes=tiles, backend="xla")

  want = helpers.oracle.attention(q, key, v, q_pos=pos, kv_pos=pos)[0]
  want_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(q, key, v)
  with jax.set_mesh(mesh):
    placed = [jax.device_put(x, NamedSharding(mesh, P("data", "sp"))) for x in (q, key, v)]
    for mapped in (jax.vmap(f), jax.vmap(f, spmd_axis_name="data")):
      out = mapped(*placed)
      assert helpers.max_err(out, want) <= helpers.fp32_tol(want)
      grads = jax.grad(lambda q, k, v: jnp.sum(mapped(q, k, v) * dout),  # pylint: disable=cell-var-from-loop
                       argnums=(0, 1, 2))(*placed)
      for got, ref in zip(grads, want_grads):
        assert helpers.max_err(got, ref) <= helpers.fp32_tol(ref)


@pytest.mark.parametrize("case", ["sinks_over_data", "ids_and_lengths_over_data",
                                  "batch_dim_over_the_ring_axis"])
def test_explicit_inputs_sharded_unlike_the_rows(case):
  """On Explicit axes, arrays sharded in ways the rows are not were JAX's errors: sinks over
  "data" (FSDP-style) where the batch is over "data" or replicated (an axis twice in the
  sink's weight; a cotangent of another type); segment ids sharded along the sequence over
  "data" with lengths over "data" on the batch (an axis twice in their mask); a later batch
  dim sharded over the ring's own axis (a reshape refused). Output and gradients (of q, k,
  v, sinks) against the oracle, eager and under jit."""
  mesh = jax.make_mesh((2, 4), ("data", "sp"), axis_types=(AxisType.Explicit,) * 2)
  put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
  b, t, n, h = 8 if case == "batch_dim_over_the_ring_axis" else 4, 16, 4, 8
  q, key, v, dout = helpers.inputs(53, b, t, t, n, 2, h, jnp.float32)
  sinks = jnp.array([0.3, -0.5, 1.0, 0.0], jnp.float32)
  seg = np.asarray(helpers.packed_segments(b, t, seed=8))
  lengths = np.array([16, 3, 9, 12], np.int32)
  options, ref_options, specs = {}, {}, [P(None, "sp")]
  if case == "sinks_over_data":
    options, ref_options = {"sinks": put(sinks, P("data"))}, {"sinks": sinks}
    specs = [P("data", "sp"), P(None, "sp")]
  elif case == "ids_and_lengths_over_data":
    options = {"segment_ids": put(seg, P(None, "data")),
               "query_seq_lengths": put(lengths, P("data"))}
    ref_options = {"q_seg": seg, "kv_seg": seg, "q_lengths": lengths}
  lead = (2, 4) if case == "batch_dim_over_the_ring_axis" else (b,)

  def ours(q, k, v, sinks=None):
    extra = dict(options, **({"sinks": sinks} if sinks is not None else {}))
    return ringflash.ring_attention(q, k, v, axis_name="sp", is_causal=True, backend="xla",
                                    **extra)

  def loss(fn, q, k, v, *rest):
    return jnp.sum(fn(q, k, v, *rest) * dout.reshape(lead + dout.shape[1:]))

  def oracle_out(q, k, v, sinks=None):
    flat = [x.reshape((b,) + x.shape[len(lead):]) for x in (q, k, v)]
    extra = dict(ref_options, **({"sinks": sinks} if sinks is not None else {}))
    out = helpers.oracle.attention(*flat, causal=True, **extra)[0]
    return out.reshape(lead + out.shape[1:])

  args = [x.reshape(lead + x.shape[1:]) for x in (q, key, v)]
  rest = (sinks,) if case == "sinks_over_data" else ()
  nargs = tuple(range(3 + len(rest)))
  want = oracle_out(*args, *rest)
  want_grads = jax.grad(lambda *a: loss(oracle_out, *a), argnums=nargs)(*args, *rest)
  for spec in specs:
    placed = [put(x, spec) for x in args] + [put(r, P("data")) for r in rest]
    with jax.set_mesh(mesh):
      grad = jax.grad(lambda *a: loss(ours, *a), argnums=nargs)
      for fn, g in ((ours, grad), (jax.jit(ours), jax.jit(grad))):
        out = fn(*placed)
        assert helpers.max_err(out, want) <= helpers.fp32_tol(want), spec
        for got, ref in zip(g(*placed), want_grads):
          assert helpers.max_err(got, ref) <= helpers.fp32_tol(ref), spec


def test_repeated_eager_calls_reuse_one_compiled_program(monkeypatch):
  """The README calls ring_attention eagerly: the same shapes and options trace (and
  compile) once; other options get their own program; the cache of programs is bounded."""
  from ringflash import _validate  # pylint: disable=g-import-not-at-top
  from ringflash import api  # pylint: disable=g-import-not-at-top
  traces = []
  prepare = _validate.prepare
  monkeypatch.setattr(_validate, "prepare", lambda *a, **kw: traces.append(1) or prepare(
      *a, **kw))
  q, key, v, _ = helpers.inputs(11, 1, 16, 16, 2, 2, 8, jnp.float32)
  mesh = helpers.mesh_of(8)
  first = ringflash.ring_attention(q, key, v, mesh=mesh, is_causal=True)
  for _ in range(3):
    again = ringflash.ring_attention(q, key, v, mesh=mesh, is_causal=True)
  assert len(traces) == 1
  np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
  ringflash.ring_attention(q, key, v, mesh=mesh, is_causal=False)
  ringflash.ring_attention(q, key, v, mesh=mesh, is_causal=True, local_window_size=[3, 0])
  ringflash.ring_attention(q, key, v, mesh=mesh, is_causal=True, local_window_size=(3, 0))
  assert len(traces) == 3                 # a list window and its tuple share a program
  assert api._program.cache_info().maxsize == 64   # pylint: disable=protected-access


def test_sharded_entry_in_a_shard_map_manual_over_the_ring_alone():
  """A shard_map manual over "sp" alone, "data" left Explicit: local arrays sharded over
  "data" failed inside the kernels with JAX's own errors (cond branches of unequal types on
  xla, a sharded ref on pallas_tpu), and so did replicated ones on pallas_tpu (its
  interpreter) and in allgather's backward (a reduce-scatter's lowering). Now a
  NotImplementedError names the axis, whatever the arrays' sharding; with "data" Auto the
  call runs, against the oracle, forward and backward."""
  q, key, v, dout = helpers.inputs(41, 2, 32, 32, 2, 2, 16, jnp.float32)
  want = helpers.oracle.attention(q, key, v, causal=True)[0]
  want_grads = jax.grad(lambda *a: jnp.sum(helpers.oracle.attention(*a, causal=True)[0] * dout),
                        argnums=(0, 1, 2))(q, key, v)

  def call(axis_type, spec, backend="xla", strategy="ring"):
    mesh = jax.make_mesh((2, 4), ("data", "sp"), axis_types=(axis_type,) * 2)
    fn = jax.shard_map(
        lambda a, b, c: ringflash.ring_attention_sharded(
            a, b, c, axis_name="sp", is_causal=True, backend=backend, strategy=strategy),
        in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"), axis_names={"sp"},
        check_vma=backend == "xla")
    with jax.set_mesh(mesh):
      args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, key, v)]
      grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * dout), argnums=(0, 1, 2)))(*args)
      return jax.jit(fn)(*args), grads

  for strategy in ("ring", "allgather"):
    out, grads = call(AxisType.Auto, P("data", "sp"), strategy=strategy)
    assert helpers.max_err(out, want) <= helpers.fp32_tol(want)
    for got, ref in zip(grads, want_grads):
      assert helpers.max_err(got, ref) <= helpers.fp32_tol(ref)
  for spec, backend, strategy in ((P("data", "sp"), "xla", "ring"),
                                  (P("data", "sp"), "pallas_tpu", "ring"),
                                  (P(None, "sp"), "pallas_tpu", "ring"),
                                  (P(None, "sp"), "xla", "allgather")):
    with pytest.raises(NotImplementedError, match="mesh axis 'data' is Explicit and not manual"):
      call(AxisType.Explicit, spec, backend, strategy)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_sharded_entry_cross_attention_with_key_lengths(layout):
  """ring_attention_sharded on cross attention (T = 16, S = 32 on 8 devices, causal) with
  key_value_seq_lengths: the keys' positions, which the lengths are read against, are the
  key shard's (over S), not the query's. Forward and gradients against the oracle."""
  q, key, v, dout = helpers.inputs(43, 1, 16, 32, 2, 2, 8, jnp.float32)
  kv_len = jnp.array([20], jnp.int32)
  to = functools.partial(ringflash.to_layout, layout=layout, ring_size=8)
  back = functools.partial(ringflash.from_layout, layout=layout, ring_size=8)
  fn = jax.shard_map(
      lambda a, b, c: ringflash.ring_attention_sharded(
          a, b, c, axis_name="sp", is_causal=True, layout=layout,
          key_value_seq_lengths=kv_len),
      mesh=helpers.mesh_of(8), in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))

  def ours(q, k, v):
    return back(fn(to(q), to(k), to(v)))

  def dense(q, k, v):
    return helpers.oracle.attention(q, k, v, causal=True, kv_lengths=kv_len)[0]

  def run(f):
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * dout), argnums=(0, 1, 2))
    return (jax.jit(f)(q, key, v),) + jax.jit(grads)(q, key, v)

  for got, want in zip(run(ours), run(dense)):
    assert helpers.max_err(got, want) <= helpers.fp32_tol(want)


def test_sharded_entry_on_interpreted_pallas_tpu_says_what_to_set():
  """Pallas interpret mode (CPU devices) cannot run under shard_map's mesh-axis typing: a
  ringflash error naming check_vma, not a JAX-internal one; with it off, the call works."""
  q, key, v, _ = helpers.inputs(12, 1, 64, 64, 2, 2, 32, jnp.float32)
  mesh = helpers.mesh_of(4)

  def local(q, k, v):
    return ringflash.ring_attention_sharded(q, k, v, axis_name="sp", backend="pallas_tpu")

  spec = P(None, "sp")
  with pytest.raises(ValueError, match="check_vma=False"):
    jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, key, v)
  out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                              check_vma=False))(q, key, v)
  ref, _ = helpers.oracle.attention(q, key, v)
  assert helpers.max_err(out, ref) <= helpers.fp32_tol(ref)


def test_sharded_entry_sinks_with_batch_and_heads_sharded_too():
  """ring_attention_sharded in a caller's shard_map over (batch, sequence, heads) axes, sinks
  split with the heads: each sink's gradient is summed over the batch and sequence devices
  only, as the oracle's."""
  q, key, v, _ = helpers.inputs(13, 2, 32, 32, 4, 2, 8, jnp.float32)
  sinks = jnp.array([0.5, -0.3, 1.0, 0.1], jnp.float32)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "sp", "tp"))
  spec = P("dp", "sp", "tp")

  def local(q, k, v, s):
    return ringflash.ring_attention_sharded(q, k, v, axis_name="sp", sinks=s, backend="xla",
                                            is_causal=True)

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (P("tp"),),
                             out_specs=spec))
  out, vjp = jax.vjp(fn, q, key, v, sinks)
  ref, ref_vjp = jax.vjp(
      lambda q, k, v, s: helpers.oracle.attention(q, k, v, causal=True, sinks=s)[0],
      q, key, v, sinks)
  assert helpers.max_err(out, ref) <= helpers.fp32_tol(ref)
  for g, r in zip(vjp(jnp.cos(out)), ref_vjp(jnp.cos(ref))):
    assert helpers.max_err(g, r) <= helpers.fp32_tol(r)
