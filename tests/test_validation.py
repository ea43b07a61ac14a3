"""Every bad input gets a ValueError naming the argument, raised before anything runs."""

from __future__ import annotations

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
    ("query-rank", dict(), dict(query=jnp.zeros((B, T, H))), "query must have rank 4"),
    ("key-rank", dict(), dict(key=jnp.zeros((B, T, K))), "key must have rank 4"),
    ("batch", dict(kb=2), dict(), "key batch"),
    ("head-dim", dict(kh=8), dict(), "head_dim"),
    ("dtype-mismatch", dict(vdtype=jnp.bfloat16), dict(), "share a dtype"),
    ("int-dtype", dict(dtype=jnp.int32), dict(), "query.dtype"),
    ("gqa", dict(n=4, k=3), dict(), "multiple of key heads"),
    ("seq-ring", dict(t=60, s=60), dict(), "divisible by the ring size 8"),
    ("kv-seq-ring", dict(s=68), dict(), "key sequence length 68"),
    ("axis", dict(), dict(axis_name="seq"), "axis_name 'seq'"),
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
    ("block-divides", dict(), dict(block_sizes=ringflash.BlockSizes(3, 8)), "block_q"),
    ("block-type", dict(), dict(block_sizes=(8, 8)), "block_sizes"),
    ("mesh-type", dict(), dict(mesh="sp"), "mesh"),
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


def test_block_sizes_reject_non_positive():
  with pytest.raises(ValueError, match="block_q"):
    ringflash.BlockSizes(0, 8)
  with pytest.raises(ValueError, match="block_k"):
    ringflash.BlockSizes(8, -1)


def test_errors_come_before_any_collective():
  """Under jit, validation fails while tracing: before lowering, so no collective is ever
  built, compiled or run."""
  q, key, v = _arrays(t=60, s=60)
  mesh = helpers.mesh_of(8)
  with pytest.raises(ValueError, match="divisible"):
    jax.jit(lambda q, k, v: ringflash.ring_attention(q, k, v, mesh=mesh)).trace(q, key, v)


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


@pytest.mark.parametrize("platform,cc,want", [
    ("tpu", None, "pallas_tpu"), ("gpu", "9.0", "pallas_gpu"), ("cuda", "10.0", "pallas_gpu"),
    ("gpu", "8.0", "xla"), ("gpu", None, "xla"), ("cpu", None, "xla")])
def test_auto_backend_follows_the_devices_platform(platform, cc, want):
  from ringflash import _validate  # pylint: disable=g-import-not-at-top

  class Device:
    compute_capability = cc

  assert _validate.resolve_backend("auto", platform, Device()) == want
  assert _validate.resolve_backend("xla", platform, Device()) == "xla"
