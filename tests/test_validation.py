"""Every bad input gets a ValueError naming the argument, raised before anything runs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import helpers
import ringflash

B, T, N, K, H = 1, 64, 4, 2, 16
F32 = jnp.float32


def _arrays(t=T, s=T, n=N, k=K, h=H, dtype=F32, b=B, kb=None, kh=None, vdtype=None):
  q = jnp.zeros((b, t, n, h), dtype)
  key = jnp.zeros((kb or b, s, k, kh or h), dtype)
  v = jnp.zeros((kb or b, s, k, kh or h), vdtype or dtype)
  return q, key, v


BAD = [
    # (id, arrays kwargs, call kwargs, message fragment)
    ("query-rank", dict(), dict(query=jnp.zeros((T, H))), "query must have rank >= 3"),
    ("key-rank", dict(), dict(key=jnp.zeros((B, 1, T, K, H))), "key must have query's rank"),
    ("value-shape", dict(), dict(value=jnp.zeros((B, T, K + 1, H))), "value must have key's"),
    ("batch", dict(kb=2), dict(), "key batch"),
    ("head-dim", dict(kh=8), dict(), "head_dim"),
    ("dtype-mismatch", dict(vdtype=jnp.bfloat16), dict(), "share a dtype"),
    ("int-dtype", dict(dtype=jnp.int32), dict(), "query.dtype"),
    ("gqa", dict(n=4, k=3), dict(), "multiple of key heads"),
    ("kv-heads-zero", dict(k=0), dict(), "multiple of key heads"),   # not N % 0
    ("value-empty", dict(), dict(value=jnp.zeros((B, T, K, 0))), "must be non-empty"),
    ("layout", dict(), dict(layout="diagonal"), "layout must be one of"),
    ("sinks-shape", dict(), dict(sinks=jnp.zeros((K,))), "sinks must have shape [N]"),
    ("sinks-dtype", dict(), dict(sinks=jnp.zeros((N,), jnp.int32)), "sinks must have a floating"),
    ("softcap-neg", dict(), dict(logits_soft_cap=-1.0), "logits_soft_cap"),
    ("softcap-type", dict(), dict(logits_soft_cap="30"), "logits_soft_cap"),
    ("lengths-shape", dict(), dict(query_seq_lengths=jnp.zeros((B, 1), jnp.int32)),
     "query_seq_lengths must have the batch shape"),
    ("lengths-dtype", dict(), dict(key_value_seq_lengths=jnp.zeros((B,), jnp.float32)),
     "key_value_seq_lengths must have an integer dtype"),
    ("strategy", dict(), dict(strategy="tree"), "strategy"),
    ("axis", dict(), dict(axis_name="seq"), "axis_name must be a mesh axis"),
    ("axis-repeated", dict(), dict(axis_name=("sp", "sp")), "distinct mesh axes"),
    ("axis-unknown-in-tuple", dict(), dict(axis_name=("sp", "seq")), "distinct mesh axes"),
    ("seg-shape", dict(), dict(segment_ids=jnp.zeros((B, T + 8), jnp.int32)), "segment_ids"),
    ("seg-dtype", dict(), dict(segment_ids=jnp.zeros((B, T), jnp.float32)), "integer dtype"),
    ("seg-pair-len", dict(), dict(segment_ids=(jnp.zeros((B, T), jnp.int32),)), "pair"),
    ("seg-kv-shape", dict(s=128), dict(segment_ids=(jnp.zeros((B, T), jnp.int32),
                                                    jnp.zeros((B, T), jnp.int32))),
     "segment_ids (key/value)"),
    ("seg-one-cross", dict(s=128), dict(segment_ids=jnp.zeros((B, T), jnp.int32)), "T == S"),
    ("scale-nan", dict(), dict(scale=float("nan")), "scale"),
    ("scale-neg", dict(), dict(scale=-1.0), "scale"),
    ("scale-zero", dict(), dict(scale=0.0), "scale"),
    ("scale-type", dict(), dict(scale="1"), "scale"),
    ("backend", dict(), dict(backend="cuda"), "backend"),
    ("block-divides", dict(), dict(block_sizes=ringflash.XlaBlockSizes(3, 8)), "block_q"),
    ("block-type", dict(), dict(block_sizes=(8, 8)), "block_sizes"),
    ("mesh-type", dict(), dict(mesh="sp"), "mesh"),
    # values jax.jit cannot take at all (JAX's TypeError named ringflash's program)
    ("query-string", dict(), dict(query="q"), "query must be an array, got str"),
    ("sinks-string", dict(), dict(sinks="0.5"), "sinks must be an array, got str"),
    ("seg-pair-object", dict(), dict(segment_ids=(jnp.zeros((B, T), jnp.int32), object())),
     "segment_ids must be an array, got object"),
    ("lengths-string", dict(), dict(key_value_seq_lengths="64"),
     "key_value_seq_lengths must be an array, got str"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_value_error_naming_it(case):
  _, array_kw, call_kw, fragment = case
  q, key, v = _arrays(**array_kw)
  args = dict(query=q, key=key, value=v, mesh=helpers.mesh_of(8))
  args.update(call_kw)
  query, key, value = args.pop("query"), args.pop("key"), args.pop("value")
  with pytest.raises(ValueError, match=None) as info:
    ringflash.ring_attention(query, key, value, **args)
  assert fragment in str(info.value)


@pytest.mark.parametrize("cls", [ringflash.XlaBlockSizes, ringflash.TpuBlockSizes,
                                 ringflash.GpuBlockSizes])
def test_block_sizes_reject_non_positive(cls):
  with pytest.raises(ValueError, match="block_q"):
    cls(0, 64)
  with pytest.raises(ValueError, match="block_k"):
    cls(64, -1)
  with pytest.raises(ValueError, match="block_q"):
    cls(True, 64)


def test_block_sizes_of_another_backend_are_rejected_not_ignored():
  q, key, v = _arrays()
  with pytest.raises(ValueError, match="block_sizes must be a ringflash.XlaBlockSizes"):
    ringflash.ring_attention(q, key, v, mesh=helpers.mesh_of(8), backend="xla",
                             block_sizes=ringflash.TpuBlockSizes(8, 8))
  with pytest.raises(ValueError, match="block_sizes.block_q=96 must be a multiple of 64"):
    ringflash.GpuBlockSizes(96, 128)


@pytest.mark.parametrize("backend,why", [
    ("pallas_gpu", "runs on GPUs of compute capability >= 9.0 only"),     # CPU devices
])
def test_unsupported_combination_raises_not_implemented_naming_backend(backend, why):
  q, key, v = _arrays()
  with pytest.raises(NotImplementedError, match=why) as info:
    ringflash.ring_attention(q, key, v, mesh=helpers.mesh_of(8), backend=backend)
  assert backend in str(info.value)


def test_errors_come_before_any_collective():
  """Under jit, validation fails while tracing: before lowering, so no collective is ever
  built, compiled or run."""
  q, key, v = _arrays(t=60, s=60)
  mesh = helpers.mesh_of(8)
  with pytest.raises(ValueError, match="local_window_size"):
    jax.jit(lambda q, k, v: ringflash.ring_attention(
        q, k, v, mesh=mesh, layout="zigzag", local_window_size=-1)).trace(q, key, v)


def test_sharded_variant_validates_axis_and_shapes():
  q, key, v = _arrays()
  with pytest.raises(ValueError, match="axis_name 'sp'"):
    ringflash.ring_attention_sharded(q, key, v, axis_name="sp")
  mesh = helpers.mesh_of(4)
  fn = jax.shard_map(
      lambda q, k, v: ringflash.ring_attention_sharded(q, k, v, axis_name="sp", scale=-2.0),
      mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
  with pytest.raises(ValueError, match="scale"):
    fn(q, key, v)


def test_accepts_numpy_scale_and_integer_scale():
  q, key, v, _ = helpers.inputs(0, B, T, T, N, K, H, F32)
  for s in (np.float32(0.5), 2):
    out = ringflash.ring_attention(q, key, v, mesh=helpers.mesh_of(8), scale=s)
    ref, _ = helpers.oracle.attention(q, key, v, scale=float(s))
    assert helpers.max_err(out, ref) <= helpers.fp32_tol(ref), s


def _problem(platform, cc=None, head_dim=128, dtype=jnp.bfloat16):
  from ringflash.kernels import base  # pylint: disable=g-import-not-at-top
  return base.Problem(q_len=1024, kv_len=1024, head_dim=head_dim, kv_heads=4, group=4,
                      dtype=jnp.dtype(dtype), platform=platform, compute_capability=cc)


@pytest.mark.parametrize("platform,cc,head_dim,dtype,want", [
    ("tpu", None, 128, jnp.bfloat16, "pallas_tpu"),
    ("gpu", "9.0", 128, jnp.bfloat16, "pallas_gpu"),
    ("cuda", "10.0", 128, jnp.bfloat16, "pallas_gpu"),
    ("gpu", "8.0", 128, jnp.bfloat16, "xla"),          # before Hopper: the portable kernel
    ("gpu", "9.0", 96, jnp.float32, "xla"),            # a call pallas_gpu does not run
    ("gpu", "9.0", 128, jnp.float32, "xla"),
    ("cpu", None, 128, jnp.bfloat16, "xla")])
def test_auto_picks_the_fastest_backend_that_runs_the_call(platform, cc, head_dim, dtype,
                                                           want):
  from ringflash import _validate  # pylint: disable=g-import-not-at-top
  problem = _problem(platform, cc, head_dim, dtype)
  assert _validate.resolve_backend("auto", problem) == want
  assert _validate.resolve_backend("xla", problem) == "xla"


def test_a_named_backend_never_falls_back():
  from ringflash import _validate  # pylint: disable=g-import-not-at-top
  with pytest.raises(NotImplementedError, match="pallas_gpu.*float16"):
    _validate.resolve_backend("pallas_gpu", _problem("gpu", "9.0", dtype=jnp.float32))
  with pytest.raises(NotImplementedError, match="pallas_tpu.*TPU"):
    _validate.resolve_backend("pallas_tpu", _problem("gpu", "9.0"))


def test_a_gpu_whose_capability_cannot_be_read_is_an_error():
  from ringflash import _validate  # pylint: disable=g-import-not-at-top
  with pytest.raises(RuntimeError, match="compute capability"):
    _validate.resolve_backend("auto", _problem("gpu", None))


@pytest.mark.parametrize("flag", ["is_causal", "return_residual", "bidirectional"])
@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_flags_must_be_bools(flag, value):
  q, key, v = _arrays()
  with pytest.raises(ValueError, match=f"{flag} must be a bool"):
    ringflash.ring_attention(q, key, v, mesh=helpers.mesh_of(8), **{flag: value})


def test_forward_mode_is_a_clear_error_eager_and_under_jit():
  q, key, v = _arrays()
  mesh = helpers.mesh_of(8)

  def f(q):
    return ringflash.ring_attention(q, key, v, mesh=mesh)

  for run in (lambda: jax.jvp(f, (q,), (q,)), lambda: jax.jit(lambda q: jax.jvp(f, (q,), (q,)))(q)):
    with pytest.raises(NotImplementedError, match="forward mode"):
      run()


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_lengths_past_int32_mean_every_position_not_a_wrapped_one(backend):
  """Lengths of a wider dtype are clipped in that dtype before becoming int32: int64 2**32 + 3
  or uint32 2**31 + 5 used to wrap to 3 or to a negative length (a silently wrong answer)."""
  q, key, v, _ = helpers.inputs(1, 2, 16, 16, 2, 1, 8, F32)
  mesh = helpers.mesh_of(2)
  ref, _ = helpers.oracle.attention(q, key, v, q_lengths=np.array([16, 5]),
                                    kv_lengths=np.array([16, 7]))
  for q_len, kv_len in ((np.array([2**32 + 3, 5], np.int64), np.array([2**32, 7], np.uint64)),
                        (np.array([2**31 + 5, 5], np.uint32), np.array([2**40, 7]))):
    for lengths in ((q_len, kv_len), (jnp.asarray(q_len.astype(np.uint32)) if
                                       q_len.dtype == np.uint32 else q_len, kv_len)):
      out = ringflash.ring_attention(q, key, v, mesh=mesh, backend=backend,
                                     query_seq_lengths=lengths[0],
                                     key_value_seq_lengths=lengths[1])
      assert helpers.max_err(out, ref) <= helpers.fp32_tol(ref), (q_len, kv_len)


@pytest.mark.parametrize("ids", [
    np.array([[0] * 8 + [2**32] * 8], np.int64),          # would wrap onto id 0
    np.array([[2**31] * 16], np.uint32),                  # would wrap onto the padding id
    (np.zeros((1, 16), np.int32), np.full((1, 16), np.iinfo(np.int32).min, np.int32)),
    jnp.full((1, 16), 2**31, jnp.uint32),
])
def test_segment_ids_outside_int32_are_an_error_naming_them(ids):
  q, key, v = _arrays(t=16, s=16)
  for fn in (ringflash.ring_attention, ringflash.explain):    # explain raises as it would
    with pytest.raises(ValueError, match="segment_ids must lie strictly between"):
      fn(q, key, v, mesh=helpers.mesh_of(2), segment_ids=ids)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
@pytest.mark.parametrize("entry", ["ring_attention", "sharded"])
@pytest.mark.parametrize("bad", [np.iinfo(np.int32).min, np.iinfo(np.int32).max, 2**31])
def test_traced_segment_ids_outside_int32_make_their_batch_row_nan(bad, entry, backend):
  """Traced ids cannot be read before the call: at int32's ends (the padding ids) or past
  them (uint32 2**31 wraps onto the smallest) they gave a finite answer for segments the
  caller never gave (0.5 off where the queries saw the padding's keys). Now the batch row
  holding one is NaN, out and lse; the other row stays exact."""
  q, key, v, _ = helpers.inputs(3, 2, 16, 16, 2, 1, 8, F32)
  dtype = np.uint32 if bad > np.iinfo(np.int32).max else np.int32
  ids = np.array([[0] * 8 + [1] * 8, [0] * 8 + [bad] * 8]).astype(dtype)
  mesh = helpers.mesh_of(4)
  if entry == "ring_attention":
    fn = jax.jit(lambda q, k, v, ids: ringflash.ring_attention(
        q, k, v, mesh=mesh, segment_ids=ids, return_residual=True, backend=backend))
  else:      # interpreted Pallas kernels need check_vma off (ring_attention_sharded says so)
    fn = jax.jit(jax.shard_map(
        lambda q, k, v, ids: ringflash.ring_attention_sharded(
            q, k, v, axis_name="sp", segment_ids=ids, return_residual=True, backend=backend),
        mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(None, "sp"),),
        out_specs=(P(None, "sp"), P(None, None, "sp")), check_vma=backend == "xla"))
  out, lse = (np.asarray(x) for x in fn(q, key, v, jnp.asarray(ids)))
  ref, ref_lse = helpers.oracle.attention(q[:1], key[:1], v[:1], q_seg=ids[:1].astype(np.int32),
                                          kv_seg=ids[:1].astype(np.int32))
  assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
  assert helpers.max_err(out[:1], ref) <= helpers.fp32_tol(ref)
  assert helpers.max_err(lse[:1], ref_lse) <= helpers.fp32_tol(ref_lse)


def test_sharded_ids_varying_over_part_of_a_two_axis_ring_are_reduced_over_all_of_it():
  """Ids typed as varying over "a" of a ring over ("a", "b") (their local shard repeats over
  "b"): the check of their range was reduced over both axes, which JAX refuses for a value
  that does not vary over "b" (a ValueError from pmax). Valid ids give the exact answer."""
  q, key, v, _ = helpers.inputs(5, 2, 16, 16, 2, 1, 8, F32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "a", "b"))
  ids = np.zeros((2, 8), np.int32)
  ids[:, 4:] = 1
  fn = jax.jit(jax.shard_map(
      lambda q, k, v, ids: ringflash.ring_attention_sharded(q, k, v, axis_name=("a", "b"),
                                                            segment_ids=ids),
      mesh=mesh, in_specs=(P(None, ("a", "b")),) * 3 + (P(None, "a"),),
      out_specs=P(None, ("a", "b"))))
  out = fn(q, key, v, jnp.asarray(ids))
  # ring device a * 2 + b holds rows of ids' shard a
  seen = np.concatenate([ids[:, (r // 2) * 4:(r // 2 + 1) * 4] for r in range(4)], axis=1)
  ref, _ = helpers.oracle.attention(q, key, v, q_seg=jnp.asarray(seen), kv_seg=jnp.asarray(seen))
  assert helpers.max_err(out, ref) <= helpers.fp32_tol(ref)


@pytest.mark.parametrize("ring", [2, 4])
def test_sharded_entry_refuses_keys_replicated_over_the_ring(ring):
  """K/V replicated over axis_name (in_specs without it) were taken as each device's slice:
  a silently wrong answer on 2 devices, a raw scan TypeError on 4. Now one ValueError."""
  q, key, v = _arrays(t=16, s=16)
  for specs, name in (((P(None, "sp"), P(), P()), "key"), ((P(None, "sp"),) * 2 + (P(),),
                                                           "value")):
    fn = jax.shard_map(
        lambda q, k, v: ringflash.ring_attention_sharded(q, k, v, axis_name="sp"),
        mesh=helpers.mesh_of(ring), in_specs=specs, out_specs=P(None, "sp"))
    with pytest.raises(ValueError, match=f"{name} does not vary over mesh axis 'sp'"):
      fn(q, key, v)


@pytest.mark.parametrize("axis_name", [(), [], None, ("sp", "sp"), 3])
def test_sharded_entry_axis_name_must_name_axes(axis_name):
  """axis_name=() made a ring of one (the product of no sizes): each device attended to its
  own slice alone, a silently wrong answer; ("sp", "sp") was JAX's error, not naming it."""
  q, key, v = _arrays(t=16, s=16)
  fn = jax.shard_map(
      lambda q, k, v: ringflash.ring_attention_sharded(q, k, v, axis_name=axis_name),
      mesh=helpers.mesh_of(4), in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
  with pytest.raises(ValueError, match="axis_name must be a mesh axis name or a non-empty"):
    fn(q, key, v)


@pytest.mark.parametrize("name", ["sinks", "query_seq_lengths", "key_value_seq_lengths"])
def test_sharded_entry_refuses_whole_sequence_values_varying_over_the_ring(name):
  """Lengths of shape [4] sharded over a ring of 4 give each device a [1] array, the batch
  shape, holding another length: the ring merged blocks computed with different lengths (a
  silently wrong answer, 2.5 off). The same for sinks of shape [4 N]. Now one ValueError."""
  q, key, v = _arrays(t=16, s=16)
  value = (jnp.zeros((4 * N,), F32) if name == "sinks" else jnp.array([16, 16, 2, 2]))
  fn = jax.shard_map(
      lambda q, k, v, x: ringflash.ring_attention_sharded(q, k, v, axis_name="sp",
                                                          **{name: x}),
      mesh=helpers.mesh_of(4), in_specs=(P(None, "sp"),) * 3 + (P("sp"),),
      out_specs=P(None, "sp"))
  with pytest.raises(ValueError, match=f"{name} varies over mesh axis 'sp' of axis_name"):
    fn(q, key, v, value)


def test_sharded_entry_checks_every_axis_of_a_tuple():
  """A ring over ("a", "b"): keys split over "a" alone (replicated over "b", the tuple's
  second axis) and lengths that vary over "b" are refused by name, as over a single axis.
  The lengths' case ran (each device of "b" merging blocks computed with another length: a
  silently wrong answer) where only the tuple's first axis was checked."""
  q, key, v = _arrays(t=16, s=16)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  ring = P(None, ("a", "b"))
  fn = jax.shard_map(
      lambda q, k, v: ringflash.ring_attention_sharded(q, k, v, axis_name=("a", "b")),
      mesh=mesh, in_specs=(ring, P(None, "a"), P(None, "a")), out_specs=ring)
  with pytest.raises(ValueError, match="key does not vary over mesh axis 'b'"):
    fn(q, key, v)
  fn = jax.shard_map(
      lambda q, k, v, x: ringflash.ring_attention_sharded(
          q, k, v, axis_name=("a", "b"), key_value_seq_lengths=x),
      mesh=mesh, in_specs=(ring,) * 3 + (P("b"),), out_specs=ring)
  with pytest.raises(ValueError, match="key_value_seq_lengths varies over mesh axis 'b'"):
    fn(q, key, v, jnp.array([3, 16, 9, 12], jnp.int32))


def test_kv_heads_the_query_heads_sharding_does_not_divide_are_named():
  """Query heads sharded over a mesh axis "tp" of 4 devices with K = 2 kv heads: the kv heads
  cannot follow the query heads' sharding. A ValueError names the key heads and the axis."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("sp", "tp"))
  q, key, v = _arrays(t=16, s=16, n=4, k=2)
  q = jax.device_put(q, jax.sharding.NamedSharding(mesh, P(None, "sp", "tp")))
  key, v = (jax.device_put(x, jax.sharding.NamedSharding(mesh, P(None, "sp"))) for x in (key, v))
  with pytest.raises(ValueError, match="key heads K=2 must divide over the mesh axes tp"):
    ringflash.ring_attention(q, key, v, mesh=mesh, axis_name="sp", is_causal=True)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_huge_scores_stay_finite(backend):
  """Scores near 1e9 and beyond: the max and the exponent see one copy of the scores (XLA had
  recomputed the product in each consumer's fusion, rounded differently: NaN)."""
  q, key, v, _ = helpers.inputs(2, 1, 16, 16, 2, 1, 8, F32)
  mesh = helpers.mesh_of(1)
  for scale in (1e9, 1e20):
    ref, _ = helpers.oracle.attention(q, key, v, scale=scale)
    out, grad = jax.value_and_grad(lambda q: ringflash.ring_attention(
        q, key, v, mesh=mesh, scale=scale, backend=backend).sum())(q)
    got = ringflash.ring_attention(q, key, v, mesh=mesh, scale=scale, backend=backend)
    assert helpers.max_err(got, ref) <= helpers.fp32_tol(ref), scale
    assert np.isfinite(float(out)) and np.all(np.isfinite(np.asarray(grad))), scale


def test_numbers_past_float_and_unknown_explain_options_are_named():
  q, key, v = _arrays()
  mesh = helpers.mesh_of(2)
  for name in ("scale", "logits_soft_cap"):
    with pytest.raises(ValueError, match=f"{name} must be finite and > 0"):
      ringflash.ring_attention(q, key, v, mesh=mesh, **{name: 10**400})
  # Finite in Python, not in float32 (inf there, and finite inputs gave NaN); a soft-cap
  # past 1e30 (float32 flushed score / cap to 0: every score of a row 0 at 1e38).
  for name, value, message in (
      ("scale", 1e39, "scale must be at most 3.40282e+38 (float32's largest), got 1e+39"),
      ("logits_soft_cap", 1e39, "logits_soft_cap must be at most 1e+30 (float32 flushes"),
      ("logits_soft_cap", 1e38, "logits_soft_cap must be at most 1e+30 (float32 flushes")):
    with pytest.raises(ValueError, match=re.escape(message)):
      ringflash.ring_attention(q, key, v, mesh=mesh, **{name: value})
  with pytest.raises(TypeError, match="explain\\(\\) got an unexpected keyword argument 'foo'"):
    ringflash.explain(q, key, v, mesh=mesh, foo=1)


def test_mesh_none_takes_the_context_mesh_and_another_mesh_there_is_named():
  """Under jax.set_mesh (make_mesh: Explicit axes), mesh=None built an Auto mesh of every
  device and JAX's shard_map refused it ("The context mesh ... should match the mesh passed
  to shard_map"): mesh=None now takes the context mesh, eager, under jit and under grad; a
  mesh other than the context's (axis types count) is a ValueError naming mesh, for
  ring_attention and decode_attention alike."""
  q = jax.random.normal(jax.random.PRNGKey(0), (B, T, N, H))
  k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, T, K, H)) for i in (1, 2))

  def attn(q):
    return ringflash.ring_attention(q, k, v, is_causal=True)

  want = np.asarray(attn(q))
  want_grad = np.asarray(jax.grad(lambda q: attn(q).sum())(q))
  mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Explicit,))
  auto = jax.sharding.Mesh(np.array(jax.devices()), ("sp",))
  with jax.set_mesh(mesh):
    np.testing.assert_allclose(np.asarray(attn(q)), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(attn)(q)), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(lambda q: attn(q).sum())(q)), want_grad,
                               rtol=1e-6, atol=1e-6)
    for other in (auto, jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4],
                                      axis_types=(jax.sharding.AxisType.Explicit,))):
      with pytest.raises(ValueError, match="mesh=.* is not the context mesh.*or mesh=None"):
        ringflash.ring_attention(q, k, v, mesh=other)
    # decode_attention takes no mesh=None, and a cache has no mesh argument: the advice says
    # what each caller can do (it told both to pass mesh=None).
    with pytest.raises(ValueError, match=r"is not the context mesh .*: pass that mesh \(mesh="):
      ringflash.decode_attention(q[:, :1], k, v, cache_lengths=jnp.full((B,), T, jnp.int32),
                                 mesh=auto)
  cache = ringflash.KVCache.create(B, T, K, H, mesh=auto, dtype=jnp.float32)
  half = jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4])
  with jax.set_mesh(mesh):
    # create too: it made a cache that every later call refused (Explicit context axes), or
    # failed in JAX's jit (the context mesh on other devices, below)
    for use in (lambda: cache.prefill(k, v), lambda: cache.append(k[:, :1], v[:, :1]),
                lambda: cache.attention(q[:, :1]),
                lambda: ringflash.KVCache.create(B, T, K, H, mesh=auto, dtype=jnp.float32)):
      with pytest.raises(ValueError, match="is not the context mesh .*: that is the cache's "
                                           "mesh; create the cache on the context mesh"):
        use()
  with jax.set_mesh(half):
    for use in (lambda: cache.attention(q[:, :1]),
                lambda: ringflash.KVCache.create(B, T, K, H, mesh=auto, dtype=jnp.float32)):
      with pytest.raises(ValueError, match="is not the context mesh .*: that is the cache's "
                                           "mesh; create the cache on the context mesh"):
        use()


def test_second_derivatives_run_on_xla_and_name_the_pallas_backend_that_has_none():
  """jax.grad of jax.grad: the xla backend (jnp) differentiates its backward, and matches
  the oracle's second derivative; pallas_tpu raised pallas_call's NotImplementedError with
  no message, and now names itself and xla."""
  import oracle  # pylint: disable=g-import-not-at-top
  q, key, v = (jax.random.normal(jax.random.PRNGKey(i), (B, 16, 2, 8)) for i in range(3))
  mesh = helpers.mesh_of(2)

  def outer(attn):
    inner = jax.grad(lambda q: jnp.sum(attn(q) ** 2))
    return jax.grad(lambda q: jnp.sum(inner(q) ** 2))(q)

  want = outer(lambda q: oracle.attention(q, key, v, causal=True)[0])
  got = outer(lambda q: ringflash.ring_attention(q, key, v, mesh=mesh, is_causal=True,
                                                 backend="xla"))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
  with pytest.raises(NotImplementedError, match="backend 'pallas_tpu' computes first "
                                                "derivatives only.*backend='xla'"):
    outer(lambda q: ringflash.ring_attention(q, key, v, mesh=mesh, is_causal=True,
                                             backend="pallas_tpu"))


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_the_backward_is_linear_in_the_cotangent_where_it_is_zero(sinks):
  """The vjp of the vjp at a zero cotangent (a forward-mode derivative from reverse mode,
  which large models use where jax.jvp is refused), and J J^T u with rows of u zero: the xla
  backend matches the oracle. Rows whose cotangent was exactly 0 were taken as silent (lse
  -inf; the sinks' backward a 0 for g * x), so these derivatives were 0 there, silently."""
  import oracle  # pylint: disable=g-import-not-at-top
  q, key, v, tangent = (jax.random.normal(jax.random.PRNGKey(i), (B, 16, 2, 8))
                        for i in range(4))
  sink = jnp.array([0.5, -0.3], jnp.float32) if sinks else None
  mesh = helpers.mesh_of(2)

  def ours(q, key):
    return ringflash.ring_attention(q, key, v, mesh=mesh, is_causal=True, backend="xla",
                                    sinks=sink)

  def theirs(q, key):
    return oracle.attention(q, key, v, causal=True, sinks=sink)[0]

  def jvp_by_two_vjps(attn):
    _, pull = jax.vjp(lambda q: attn(q, key), q)
    _, pull_back = jax.vjp(pull, jnp.zeros((B, 16, 2, 8), jnp.float32))
    return pull_back((tangent,))[0]

  def gauss_newton(attn):          # d/du |J^T u|^2 = 2 J J^T u, J = d out / d key
    u = tangent.at[:, :6].set(0.0)
    _, pull = jax.vjp(lambda key: attn(q, key), key)
    return jax.grad(lambda u: jnp.sum(pull(u)[0] ** 2))(u)

  for how in (jvp_by_two_vjps, gauss_newton):
    want = how(theirs)
    assert float(jnp.max(jnp.abs(want))) > 0.1
    np.testing.assert_allclose(np.asarray(how(ours)), np.asarray(want), rtol=2e-4, atol=2e-4)


def test_sequences_past_int32_positions_are_refused_by_name():
  """A sequence of more than 2**30 tokens: its positions (int32) overflowed inside the ring's
  plan, an OverflowError naming nothing; now a ValueError naming the argument, for the
  whole sequence and for shards that make one over the ring."""
  mesh = helpers.mesh_of(2)
  long = jax.ShapeDtypeStruct((1, 2**31 + 8, 1, 8), jnp.bfloat16)
  short = jax.ShapeDtypeStruct((1, 64, 1, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"query sequence length must be at most 2\*\*30 = "
                                       r"1073741824 tokens .*got 2147483656"):
    jax.eval_shape(lambda q, k: ringflash.ring_attention(q, k, k, mesh=mesh), long, short)
  with pytest.raises(ValueError, match=r"key sequence length must be at most 2\*\*30"):
    jax.eval_shape(lambda q, k: ringflash.ring_attention(q, k, k, mesh=mesh), short, long)
  sharded = jax.shard_map(
      lambda q: ringflash.ring_attention_sharded(q, q, q, axis_name="sp"), mesh=mesh,
      in_specs=P(None, "sp"), out_specs=P(None, "sp"))
  with pytest.raises(ValueError, match=r"query sequence length .* got 1073741840 \(536870920 "
                                       r"on each of the 2 devices\)"):
    jax.eval_shape(sharded, jax.ShapeDtypeStruct((1, 2**30 + 16, 1, 8), jnp.bfloat16))


@pytest.mark.parametrize("dims", ["b", "8*u"])
def test_symbolic_sizes_of_jax_export_are_refused_by_name(dims):
  """jax.export with a shape-polymorphic batch or sequence failed inside JAX (an
  inconclusive dimension comparison, or a tracer made a bool) wherever a size first met a
  comparison; now the entry points name the argument and ask for concrete shapes."""
  from jax import export  # pylint: disable=g-import-not-at-top
  d, = export.symbolic_shape(dims)
  b, t = (d, T) if dims == "b" else (B, d)
  mesh = helpers.mesh_of(8)
  q, key, v = (jax.ShapeDtypeStruct((b, t, heads, H), jnp.float32) for heads in (N, K, K))
  message = rf"query has symbolic \(shape-polymorphic\) size\(s\) {re.escape(dims)} in shape"
  calls = [lambda q, key, v: ringflash.ring_attention(q, key, v, mesh=mesh, is_causal=True),
           lambda q, key, v: ringflash.ring_attention(q, key, v, mesh=mesh, backend="xla",
                                                      strategy="ring")]
  if dims == "b":
    calls.append(lambda q, key, v: ringflash.decode_attention(
        q[:, :1], key, v, cache_lengths=jnp.full((q.shape[0],), T, jnp.int32), mesh=mesh))
  for call in calls:
    with pytest.raises(NotImplementedError, match=message):
      export.export(jax.jit(call))(q, key, v)
  # concrete shapes export, and the exported call is ring attention
  seq = jax.sharding.NamedSharding(mesh, P(None, "sp"))   # an export for the 8 devices
  concrete = [jax.device_put(jax.random.normal(jax.random.PRNGKey(i), (B, T, heads, H)), seq)
              for i, heads in enumerate((N, K, K))]
  exported = export.export(jax.jit(calls[0]))(*concrete)
  np.testing.assert_allclose(np.asarray(exported.call(*concrete)),
                             np.asarray(calls[0](*concrete)), rtol=1e-6, atol=1e-6)


def test_introspection_names_its_bad_arguments():
  """ringflash.introspect (the programs' and scripts' interface): a device or step outside
  the ring wrapped around silently (device 9 of 8 gave device 1's source), and lengths
  that the tiles do not divide, a lane the plan lacks or no device ended in an
  AssertionError, IndexError, ZeroDivisionError or AttributeError."""
  from ringflash import introspect  # pylint: disable=g-import-not-at-top
  local = jax.ShapeDtypeStruct((1, 256, 2, 16), jnp.float32)
  ring = introspect.ring_spec(local, local, local, ring_size=8, device=jax.devices()[0],
                              block_sizes=ringflash.XlaBlockSizes(block_q=128, block_k=128))
  assert introspect.held_source(ring, 256, 256, device=2, step=1) == 1
  for kwargs, message in (
      ({"device": 8, "step": 0}, "device must be an int in 0 .. 7, got 8"),
      ({"device": -1, "step": 0}, "device must be an int in 0 .. 7, got -1"),
      ({"device": 0, "step": 8}, "step must be an int in 0 .. 7 (lane 0's steps), got 8"),
      ({"device": 0, "step": 0, "lane": 1}, "lane must be an int in 0 .. 0, got 1")):
    with pytest.raises(ValueError, match=re.escape(message)):
      introspect.held_source(ring, 256, 256, **kwargs)
  with pytest.raises(ValueError, match=re.escape("q_len must be a positive multiple of 128 "
                                                 "(the spec's tile of 128), got 100")):
    introspect.plan(ring, 100, 256)
  with pytest.raises(ValueError, match="device must be a jax Device"):
    introspect.ring_spec(local, local, local, ring_size=8, device=None)
  for call, message in (
      (lambda: introspect.balance_block(8, 8), "seq_len=8 must be at least 2 x ring_size"),
      (lambda: introspect.balance_block(64, 0), "ring_size must be an int >= 1, got 0"),
      (lambda: introspect.balance_block(64, 8, cap=0), "cap must be an int >= 1, got 0"),
      (lambda: introspect.work_table(8, 1000), "seq_len=1000 must be divisible by 2 x "
                                               "ring_size = 16"),
      (lambda: introspect.work_table(8, 1024, 128), "block=128 must divide the zigzag chunk "
                                                    "seq_len / (2 x ring_size) = 64"),
      # causal="no" was taken as causal, a window (-1, 0) counted tiles of work where no
      # key is valid, and an int window was a TypeError
      (lambda: introspect.work_table(4, 64, 8, causal="no"), "causal must be a bool, got 'no'"),
      (lambda: introspect.work_table(4, 64, 8, window=(-1, 0)),
       "window must be non-negative, got (-1, 0)"),
      (lambda: introspect.work_table(4, 64, 8, window=1.5), "window must be None, an int or a "
                                                            "pair (left, right) of ints"),
      # a negative length failed in NumPy naming nothing, and a bad group was named ring_size
      # with a value never passed (ring_size * group)
      (lambda: introspect.layout_positions("zigzag", 2, -8),
       "length must be an int in [0, 2**31 - 1] (positions are int32), got -8"),
      (lambda: introspect.layout_positions("contiguous", 2, 8, group=-1),
       "group must be an int >= 1, got -1"),
      (lambda: introspect.layout_positions("contiguous", 0, 8, group=2),
       "ring_size must be a positive int, got 0"),
      # an absurd ring size asked NumPy for terabytes (MemoryError)
      (lambda: ringflash.to_layout(np.zeros((1, 12)), "striped", 10**12),
       "ring_size=1000000000000: the striped layout orders 12 tokens as 1000000000000, past "
       "int32's positions")):
    with pytest.raises(ValueError, match=re.escape(message)):
      call()
  # an int window is (w, w), as ring_attention's local_window_size
  assert all(np.array_equal(a, b) for a, b in zip(
      introspect.work_table(4, 64, 8, window=3).values(),
      introspect.work_table(4, 64, 8, window=(3, 3)).values()))


def test_arrays_committed_to_other_devices_are_named():
  """An array committed to devices other than the mesh's: JAX's jit refused it naming
  ringflash's internal function, and a committed `sinks` as `query`; explain took a
  ShapeDtypeStruct on other devices as if it were on the mesh. Each is now a ValueError
  naming the argument; the same arrays on the mesh's devices, uncommitted arrays and
  closed-over arrays under jit (JAX moves those) still run."""
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  mesh = helpers.mesh_of(4)
  q, key, v = _arrays(t=64, s=64)
  sinks = jnp.zeros((N,))
  elsewhere = NamedSharding(Mesh(np.array(devices[4:8]), ("sp",)), P(None, "sp"))
  seq = NamedSharding(mesh, P(None, "sp"))
  cases = [("query", dict(query=jax.device_put(q, elsewhere))),
           ("query", dict(query=jax.device_put(q, devices[0]))),
           ("value", dict(value=jax.device_put(v, devices[5]))),
           ("sinks", dict(sinks=jax.device_put(sinks, devices[0]))),
           ("key_value_seq_lengths", dict(key_value_seq_lengths=jax.device_put(
               jnp.full((B,), 64), devices[6])))]
  for name, given in cases:
    args = {**dict(query=q, key=key, value=v), **given}
    with pytest.raises(ValueError, match=f"^{name} is committed to devices .*, not to the "
                                         f"mesh's \\[0, 1, 2, 3\\]: put it on the mesh"):
      ringflash.ring_attention(mesh=mesh, **args)
  shape = jax.ShapeDtypeStruct(q.shape, q.dtype, sharding=elsewhere)
  with pytest.raises(ValueError, match="^query is committed to devices \\[4, 5, 6, 7\\]"):
    ringflash.explain(shape, shape, shape, mesh=mesh)
  cache = jax.device_put(jnp.zeros((B, 64, K, H)), devices[7])
  with pytest.raises(ValueError, match="^key_cache is committed to devices \\[7\\]"):
    ringflash.decode_attention(q[:, :1], cache, cache, cache_lengths=jnp.full((B,), 8),
                               mesh=mesh)
  # on the mesh, uncommitted, or a constant under jit: they run
  ringflash.ring_attention(jax.device_put(q, seq), key, v, mesh=mesh,
                           sinks=jax.device_put(sinks, NamedSharding(mesh, P())))
  ringflash.explain(*(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=seq)
                      for x in (q, key, v)), mesh=mesh)
  placed = jax.device_put(sinks, devices[5])
  jax.jit(lambda q: ringflash.ring_attention(q, key, v, mesh=mesh, sinks=placed))(q)


def test_arrays_on_the_mesh_devices_in_another_order_are_named():
  """Arrays on the mesh's devices in another order (laid out with jax.make_mesh, whose order
  follows the topology, and called with a mesh of jax.devices(), or the reverse): JAX's jit
  refused them naming ringflash's internal function, and explain took them. Each entry
  point now names the argument; a mesh of another shape over the same order still runs."""
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  devices = np.array(jax.devices())
  mesh = Mesh(devices[[1, 0, 2, 3, 4, 5, 6, 7]], ("sp",))
  laid = NamedSharding(Mesh(devices, ("sp",)), P(None, "sp"))
  q, key, v = (jax.device_put(x, laid) for x in _arrays(t=64, s=64))
  message = ("^{} is committed to the mesh's devices in another order \\(device 0 at "
             "position 0 of its sharding, where the mesh has device 1\\): put it on the mesh")
  with pytest.raises(ValueError, match=message.format("query")):
    ringflash.ring_attention(q, key, v, mesh=mesh)
  with pytest.raises(ValueError, match=message.format("key")):
    ringflash.explain(jax.ShapeDtypeStruct(q.shape, q.dtype), key, v, mesh=mesh)
  with pytest.raises(ValueError, match=message.format("key_cache")):
    ringflash.decode_attention(jnp.zeros((B, 1, N, H)), key, v,
                               cache_lengths=jnp.full((B,), 8), mesh=mesh)
  sinks = jax.device_put(jnp.zeros((N,)), NamedSharding(Mesh(devices, ("sp",)), P()))
  with pytest.raises(ValueError, match=message.format("sinks")):
    ringflash.ring_attention(*_arrays(t=64, s=64), mesh=mesh, sinks=sinks)
  # the mesh's own order runs, and so does a 2-D mesh over the same order
  ringflash.ring_attention(*(jax.device_put(x, NamedSharding(mesh, P(None, "sp")))
                             for x in _arrays(t=64, s=64)), mesh=mesh)
  grid = Mesh(devices.reshape(2, 4), ("data", "sp"))
  ringflash.ring_attention(q, key, v, mesh=grid)


def test_calls_inside_a_shard_map_say_to_call_ring_attention_sharded():
  """ring_attention inside a caller's shard_map (manual over a data axis, or over all):
  with mesh=... the error said to pass mesh=None, and with mesh=None to pass the mesh.
  Each entry point that runs its own shard_map now says it cannot run inside one, and
  what to call there."""
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  grid = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "sp"))
  q, key, v = _arrays(b=2, t=64, s=64)
  cache = ringflash.KVCache.create(2, 64, K, H, mesh=grid, dtype=jnp.float32)
  calls = {
      "ring_attention, mesh=grid": lambda q, k, v: ringflash.ring_attention(q, k, v,
                                                                            mesh=grid),
      "ring_attention, mesh=None": lambda q, k, v: ringflash.ring_attention(q, k, v),
      "explain": lambda q, k, v: ringflash.explain(q, k, v) and q,
      "decode_attention": lambda q, k, v: ringflash.decode_attention(
          q[:, :1], k, v, cache_lengths=jnp.full((q.shape[0],), 8), mesh=grid),
      "KVCache.attention": lambda q, k, v: cache.attention(q[:, :1]),
      "KVCache.prefill": lambda q, k, v: cache.prefill(k, v).k,
      "KVCache.append": lambda q, k, v: cache.append(k[:, :1], v[:, :1]).k,
  }
  for manual in ({"data"}, {"data", "sp"}):
    for what, call in calls.items():
      f = jax.shard_map(call, mesh=grid, in_specs=P("data"), out_specs=P("data"),
                        axis_names=manual)
      with pytest.raises(NotImplementedError,
                         match=r"^called inside a shard_map \(the context mesh's axes "
                               r"\['data'.*\] are Manual\).*ring_attention_sharded"):
        jax.jit(f)(q, key, v)
