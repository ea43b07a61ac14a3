"""Decode attention over a sequence-sharded KV cache, and ringflash.KVCache, against the dense
oracle (tests/oracle.py) on CPU meshes of 1, 2, 4 and 8 devices."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import helpers
import oracle
import ringflash
from ringflash import decode
from ringflash.kvcache import EMPTY


def _inputs(seed, b, t, s, n, k, h, hv=None, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, t, n, h), jnp.float32).astype(dtype)
  key = jax.random.normal(kk, (b, s, k, h), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, s, k, hv or h), jnp.float32).astype(dtype)
  return q, key, v


def _sharded(mesh, *arrays):
  seq = NamedSharding(mesh, P(None, "sp"))
  return [jax.device_put(x, seq) for x in arrays]


def _reference(q, k, v, lengths, *, positions=None, window=None, softcap=None, sinks=None,
               scale=None):
  """The oracle, row by row: the t new tokens of row b at lengths[b] - t .., keys at their
  positions (default: slot index), unseen past the row's length (causal)."""
  t, s = q.shape[1], k.shape[1]
  outs, lses = [], []
  for b, length in enumerate(np.asarray(lengths)):
    kv_pos = np.arange(s) if positions is None else np.asarray(positions)[b]
    o, lse = oracle.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=True, scale=scale,
                              q_pos=jnp.arange(length - t, length), kv_pos=kv_pos,
                              window=window, softcap=softcap, sinks=sinks)
    outs.append(o)
    lses.append(lse)
  return jnp.concatenate(outs), jnp.concatenate(lses)


def _close(got, ref):
  for g, r in zip(got, ref):
    assert helpers.max_err(g, r) <= helpers.fp32_tol(r), helpers.max_err(g, r)


# (N, K, t, window, soft-cap, sinks): MHA, GQA with t > 1 (band calls), MQA with a soft-cap.
CASES = {"mha": (2, 2, 1, None, None, False),
         "gqa_window_sinks": (4, 2, 3, 5, None, True),
         "mqa_softcap": (4, 1, 2, None, 20.0, False)}


@pytest.mark.parametrize("ring", [1, 2, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches_the_oracle(ring, case):
  """Rows of lengths t (one device holds keys, the others are empty), 37 and 64 (full)."""
  n, k, t, window, softcap, with_sinks = CASES[case]
  mesh = helpers.mesh_of(ring)
  q, key, v = _inputs(0, 3, t, 64, n, k, 16)
  lengths = jnp.array([t, 37, 64], jnp.int32)
  sinks = jnp.linspace(-1.0, 1.0, n) if with_sinks else None
  key_s, v_s = _sharded(mesh, key, v)
  got = ringflash.decode_attention(q, key_s, v_s, cache_lengths=lengths, mesh=mesh,
                                   local_window_size=window, logits_soft_cap=softcap,
                                   sinks=sinks, return_residual=True)
  _close(got, _reference(q, key, v, lengths, window=window, softcap=softcap, sinks=sinks))


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_baseline_strategies_match_the_oracle(strategy):
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(1, 2, 3, 64, 4, 2, 16)
  lengths = jnp.array([9, 50], jnp.int32)
  got = ringflash.decode_attention(q, *_sharded(mesh, key, v), cache_lengths=lengths,
                                   mesh=mesh, local_window_size=6, strategy=strategy,
                                   return_residual=True)
  _close(got, _reference(q, key, v, lengths, window=6))


@pytest.mark.parametrize("strategy", ["reduce", "allgather", "ring"])
def test_vmap_over_cache_lengths_matches_the_oracle(strategy):
  """jax.vmap over the lengths (a batch of 2 sets of lengths over the same cache): the
  "reduce" strategy died in JAX (pvary of a value already varying over the ring, in the
  kernel's tile-skipping cond turned into a select by the batching)."""
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(3, 2, 3, 64, 4, 2, 16)
  lengths = jnp.array([[40, 5], [30, 9]], jnp.int32)
  kc, vc = _sharded(mesh, key, v)
  got = jax.vmap(lambda n: ringflash.decode_attention(
      q, kc, vc, cache_lengths=n, mesh=mesh, strategy=strategy, backend="xla",
      return_residual=True))(lengths)
  for i in range(2):
    _close(jax.tree.map(lambda x, i=i: x[i], got), _reference(q, key, v, lengths[i]))


@pytest.mark.parametrize("ring", [1, 4])
def test_pallas_tpu_backend_interpreted(ring):
  mesh = helpers.mesh_of(ring)
  q, key, v = _inputs(2, 2, 2, 512, 4, 2, 32)
  lengths = jnp.array([2, 300], jnp.int32)
  sinks = jnp.array([0.5, -1.0, 0.0, 2.0])
  got = ringflash.decode_attention(q, *_sharded(mesh, key, v), cache_lengths=lengths,
                                   mesh=mesh, backend="pallas_tpu", local_window_size=100,
                                   logits_soft_cap=30.0, sinks=sinks, return_residual=True)
  _close(got, _reference(q, key, v, lengths, window=100, softcap=30.0, sinks=sinks))


@pytest.mark.parametrize("t", [1, 3])
def test_split_kv_runs_merge_exactly(t, monkeypatch):
  """Split-KV (GPUs): each device's 512 slots as 4 runs of 128, merged by their LSE; forced
  here on CPU devices. Row 0 has keys in one run of one device only."""
  from ringflash import decode as decode_api
  from ringflash.parallel import decode as decode_parallel
  monkeypatch.setattr(decode_parallel, "split_count", lambda *args: 4)
  decode_api._program.cache_clear()          # programs compiled without the split
  mesh = helpers.mesh_of(2)
  q, key, v = _inputs(13, 2, t, 1024, 4, 2, 16)
  lengths = jnp.array([t + 2, 700], jnp.int32)
  try:
    got = ringflash.decode_attention(q, *_sharded(mesh, key, v), cache_lengths=lengths,
                                     mesh=mesh, local_window_size=300, return_residual=True)
  finally:
    decode_api._program.cache_clear()
  _close(got, _reference(q, key, v, lengths, window=300))


def test_split_kv_fills_a_gpu_twice_over():
  from ringflash.parallel.decode import split_count
  assert split_count("gpu", 132, 4, 524288) == 64         # runs of 8192 keys
  assert split_count("gpu", 132, 16, 524288) == 16
  assert split_count("gpu", 132, 4, 2048) == 2            # runs of at least 1024 keys
  assert split_count("gpu", 132, 4, 1000) == 1            # not whole tiles of 128
  assert split_count("gpu", 132, 512, 524288) == 1        # enough tiles already
  assert split_count("cpu", None, 4, 524288) == 1


def test_bfloat16_within_twice_the_error_of_plain_bf16():
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(3, 2, 1, 256, 4, 2, 32, dtype=jnp.bfloat16)
  lengths = jnp.array([100, 256], jnp.int32)
  got = ringflash.decode_attention(q, *_sharded(mesh, key, v), cache_lengths=lengths,
                                   mesh=mesh)
  ref, _ = _reference(q, key, v, lengths)
  plain = jnp.concatenate([oracle.attention(
      q[b:b + 1], key[b:b + 1], v[b:b + 1], causal=True, upcast=False,
      q_pos=jnp.arange(n - 1, n))[0] for b, n in enumerate(np.asarray(lengths))])
  assert got.dtype == jnp.bfloat16
  assert helpers.max_err(got, ref) <= 2 * helpers.max_err(plain, ref)


def test_rows_without_a_key_give_zero():
  """Length 0 (queries at negative positions) and a window that reaches no key: no device
  holds a key of the row: output 0, lse -inf, no NaN."""
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(4, 2, 1, 32, 2, 1, 8)
  out, lse = ringflash.decode_attention(q, *_sharded(mesh, key, v),
                                        cache_lengths=jnp.array([0, 20], jnp.int32),
                                        mesh=mesh, return_residual=True)
  assert bool(jnp.all(out[0] == 0)) and bool(jnp.all(lse[0] == -jnp.inf))
  assert bool(jnp.all(jnp.isfinite(out[1])))


@pytest.mark.parametrize("t,message", [
    (1, "block_sizes.block_q=2 must divide the local length 3 (backend 'xla'); in decoding, "
        "the kernel's query rows are t x N / K = 1 x 3, 3 with padding and its keys a "
        "device's 16 cache slots in 1 run(s) of 16"),
    (3, "the kernel's query rows are N / K = 3, 3 with padding"),
])
def test_block_sizes_that_do_not_fit_name_the_kernels_lengths(t, message):
  """The kernel's lengths in decoding (query rows t x N / K, keys a device's share of the
  cache) are no argument's: the error quoted "the local length 3" and said nothing else."""
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(5, 2, t, 64, 6, 2, 8)
  sizes = ringflash.XlaBlockSizes(block_q=2 if t == 1 else 9, block_k=8)
  with pytest.raises(ValueError, match=re.escape(message)):
    ringflash.decode_attention(q, *_sharded(mesh, key, v), mesh=mesh, backend="xla",
                               cache_lengths=jnp.array([20, 64], jnp.int32), block_sizes=sizes)


def test_lengths_and_positions_past_int32_keep_their_meaning():
  """cache_lengths of int64 2**32 + 20 or uint32 2**31 + 20 mean "every slot" (they wrapped to
  20 or below 0); a cache position of int64 2**32 + 3 is a free slot (it wrapped to 3, a slot
  the row then saw)."""
  mesh = helpers.mesh_of(2)
  q, key, v = _inputs(11, 2, 1, 32, 2, 1, 8)
  ref = _reference(q, key, v, jnp.array([32, 32]))
  for lengths in (np.array([2**32 + 20, 32], np.int64), np.array([2**31 + 20, 2**32 - 1],
                                                                 np.uint32)):
    _close(ringflash.decode_attention(q, *_sharded(mesh, key, v), cache_lengths=lengths,
                                      mesh=mesh, return_residual=True), ref)
  positions = np.tile(np.arange(32, dtype=np.int64), (2, 1))
  positions[:, 5] = 2**32 + 3
  lengths = jnp.array([20, 20])
  got = ringflash.decode_attention(q, *_sharded(mesh, key, v), cache_lengths=lengths,
                                   cache_positions=positions, mesh=mesh, return_residual=True)
  _close(got, _reference(q, key, v, lengths, positions=np.where(positions > 40, 99, positions)))


@pytest.mark.parametrize("strategy", ["reduce", "ring", "allgather"])
def test_a_window_reaches_past_the_cache_size(strategy):
  """A query sits more than S_max past keys it sees: a rolling cache (slot s holds position
  1000 + s) and natural positions with a length past S_max. The window was clipped to S_max,
  as if queries and keys were both slots: the query at 1051 with a window of 40 saw 1019..
  instead of 1011.. (t = 2: core and bands)."""
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(17, 2, 2, 32, 2, 1, 8)
  rolling = np.tile(1000 + np.arange(32, dtype=np.int32), (2, 1))
  for lengths, positions in ((np.array([1052, 1045], np.int32), rolling),
                             (np.array([60, 45], np.int32), None)):
    got = ringflash.decode_attention(q, *_sharded(mesh, key, v), cache_lengths=lengths,
                                     cache_positions=positions, mesh=mesh,
                                     local_window_size=40, strategy=strategy,
                                     return_residual=True)
    _close(got, _reference(q, key, v, lengths, positions=positions, window=40))


@pytest.mark.parametrize("strategy", ["reduce", "ring"])
def test_a_tuple_of_axes_in_another_order_than_the_mesh(strategy):
  """The cache split over ("u", "r") on a mesh ("r", "u"): slot order follows the tuple, and
  the ring strategy's permutes (JAX takes them in the mesh's order only) follow it too."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("r", "u"))
  q, key, v = _inputs(37, 2, 2, 64, 4, 2, 8)
  lengths = jnp.array([50, 23])
  seq = NamedSharding(mesh, P(None, ("u", "r")))
  got = ringflash.decode_attention(q, *(jax.device_put(x, seq) for x in (key, v)),
                                   cache_lengths=lengths, mesh=mesh, axis_name=("u", "r"),
                                   strategy=strategy, local_window_size=30,
                                   return_residual=True)
  _close(got, _reference(q, key, v, lengths, window=30))


def test_a_window_of_any_int32_distance_is_exact():
  """Keys near INT32_MIN and a query near 2**30 are 3 * 2**30 apart: a window of 2**32 - 1
  sees them, one of 2**31 - 1 does not (its lower edge is below INT32_MIN: no overflow)."""
  mesh = helpers.mesh_of(2)
  q, key, v = _inputs(19, 1, 1, 16, 2, 2, 8)
  far = np.arange(16, dtype=np.int64) + np.iinfo(np.int32).min    # stands for 0 .. 15
  positions = np.where(np.arange(16) < 8, far, np.arange(16) + 2**30 - 20)[None]
  lengths = np.array([2**30], np.int32)                           # the query at 2**30 - 1
  near = np.where(np.arange(16) < 8, 99, np.arange(16))[None]   # 2**30 - 20 + x -> x
  for window, seen in ((2**32 - 1, np.where(np.arange(16) < 8, np.arange(16), near[0])[None]),
                       (2**31 - 1, near)):
    got = ringflash.decode_attention(q, *_sharded(mesh, key, v), cache_lengths=lengths,
                                     cache_positions=positions.astype(np.int32), mesh=mesh,
                                     local_window_size=window, return_residual=True)
    _close(got, _reference(q, key, v, np.array([20]), positions=seen))


@pytest.mark.parametrize("strategy,backend", [("reduce", "xla"), ("ring", "xla"),
                                              ("allgather", "xla"), ("reduce", "pallas_tpu")])
def test_lengths_near_int32_ends_are_exact(strategy, backend):
  """Lengths were clipped to +-2**30 before the mask: row 0's queries at 2**31 - 3 and - 2
  moved to 2**30 - 2 and - 1, into a window of 2**30 + 100 of the keys at 0 .. 15 (a finite
  answer where nothing is seen); row 1's at -2**31 + 8 and + 9 moved to -2**30 - 2 and - 1,
  after keys at -2**31 + 20 .. (seen although later). Now both as the definition says."""
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(23, 2, 2, 16, 2, 1, 8)
  low = np.iinfo(np.int32).min
  positions = np.stack([np.arange(16), low + np.array([5] + list(range(20, 35)))])
  lengths = np.array([2**31 - 1, low + 10], np.int64)
  window = 2**30 + 100
  got = ringflash.decode_attention(
      q, *_sharded(mesh, key, v), cache_lengths=lengths.astype(np.int32),
      cache_positions=_sharded(mesh, positions.astype(np.int32))[0], mesh=mesh,
      local_window_size=window, strategy=strategy, backend=backend, return_residual=True)
  ref = _reference(q, key, v, lengths.astype(np.int32), positions=positions.astype(np.int32),
                   window=window)
  assert np.all(np.asarray(ref[0][0]) == 0) and np.all(np.isneginf(np.asarray(ref[1][0])))
  _close(got, ref)


@pytest.mark.parametrize("strategy", ["reduce", "ring", "allgather"])
def test_scores_below_float32_make_their_token_nan_not_zero(strategy):
  """A query of -1e38 against positive keys: every score it sees is below float32's range
  (-inf from finite inputs). That token's heads become NaN, out and lse, not 0 as a token
  without keys; with sinks (which then take all the weight) 0 and lse the sink, as the oracle
  gives. Other tokens are exact."""
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(7, 2, 2, 64, 4, 2, 16)
  key = jnp.abs(key) + 0.5
  lengths = jnp.array([30, 64], jnp.int32)
  q = q.at[0, 1, 1].set(-1e38)
  sinks = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
  kv = _sharded(mesh, key, v)
  keep = np.ones((2, 2, 4), bool)
  keep[0, 1, 1] = False
  for s in (None, sinks):
    out, lse = ringflash.decode_attention(q, *kv, cache_lengths=lengths, mesh=mesh, sinks=s,
                                          strategy=strategy, return_residual=True)
    ref = _reference(q, key, v, lengths, sinks=s)
    if s is None:
      assert bool(jnp.all(jnp.isnan(out[0, 1, 1]))) and bool(jnp.isnan(lse[0, 1, 1]))
      assert helpers.max_err(out[keep], ref[0][keep]) <= helpers.fp32_tol(ref[0][keep])
      assert helpers.max_err(jnp.swapaxes(lse, 1, 2)[keep],
                             jnp.swapaxes(ref[1], 1, 2)[keep]) <= helpers.fp32_tol(ref[1])
    else:
      assert bool(jnp.all(out[0, 1, 1] == 0)) and float(lse[0, 1, 1]) == -1.0
      _close((out, lse), ref)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_infinite_query_with_sinks_makes_its_token_nan(softcap):
  """A query entry of -Inf against keys positive in its component: every score it sees is
  -inf, as if below float32's range, yet the Inf is a non-finite value the token sees, so its
  head is NaN, out and lse, with sinks too (which would otherwise take the weight and give
  0). Was 0 and lse the sink without a cap. Other tokens are exact."""
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(7, 2, 2, 64, 4, 2, 16)
  key = jnp.abs(key) + 0.5
  lengths = jnp.array([30, 64], jnp.int32)
  sinks = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
  bad = q.at[0, 1, 1, 3].set(-jnp.inf)
  out, lse = ringflash.decode_attention(bad, *_sharded(mesh, key, v), cache_lengths=lengths,
                                        mesh=mesh, sinks=sinks, logits_soft_cap=softcap,
                                        return_residual=True)
  ref = _reference(q, key, v, lengths, sinks=sinks, softcap=softcap)
  assert bool(jnp.all(jnp.isnan(out[0, 1, 1]))) and bool(jnp.isnan(lse[0, 1, 1]))
  keep = np.ones((2, 2, 4), bool)
  keep[0, 1, 1] = False
  assert helpers.max_err(out[keep], ref[0][keep]) <= helpers.fp32_tol(ref[0][keep])
  assert helpers.max_err(jnp.swapaxes(lse, 1, 2)[keep],
                         jnp.swapaxes(ref[1], 1, 2)[keep]) <= helpers.fp32_tol(ref[1])


def test_non_finite_in_an_unseen_slot_never_reaches_a_token():
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(5, 2, 1, 64, 4, 2, 16)
  lengths = jnp.array([30, 64], jnp.int32)
  ref = _reference(q, key, v, lengths, window=8)
  # Row 0: NaN past its length (slot 40, another device's) and before its window (slot 5);
  # an Inf value in row 1 before its window.
  bad_k = key.at[0, 40].set(jnp.nan).at[0, 5, 1].set(jnp.nan)
  bad_v = v.at[0, 40].set(jnp.nan).at[1, 10, 0].set(jnp.inf)
  got = ringflash.decode_attention(q, *_sharded(mesh, bad_k, bad_v), cache_lengths=lengths,
                                   mesh=mesh, local_window_size=8, return_residual=True)
  _close(got, ref)
  # A NaN value in a slot row 0 sees: the query heads of that kv head (1: heads 2, 3) turn
  # NaN, the others and row 1 do not.
  seen = ringflash.decode_attention(q, *_sharded(mesh, key, v.at[0, 27, 1, 3].set(jnp.nan)),
                                    cache_lengths=lengths, mesh=mesh, local_window_size=8)
  assert bool(jnp.all(jnp.isnan(seen[0, :, 2:]))) and bool(jnp.all(jnp.isfinite(seen[0, :, :2])))
  assert bool(jnp.all(jnp.isfinite(seen[1])))


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_non_finite_query_reaches_its_token_under_a_soft_cap(value):
  """cap * tanh would turn an infinite score into a finite cap: the token whose query holds
  a NaN or Inf still gets non-finite output and lse (its other heads and tokens do not)."""
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(6, 2, 2, 64, 4, 2, 16)
  lengths = jnp.array([30, 64], jnp.int32)
  bad_q = q.at[0, 1, 2, 5].set(value)
  out, lse = ringflash.decode_attention(bad_q, *_sharded(mesh, key, v), cache_lengths=lengths,
                                        mesh=mesh, logits_soft_cap=5.0, return_residual=True)
  assert bool(jnp.all(~jnp.isfinite(out[0, 1, 2]))) and not bool(jnp.isfinite(lse[0, 2, 1]))
  ref = _reference(q, key, v, lengths, softcap=5.0)
  keep = np.ones(out.shape[:3], bool)
  keep[0, 1, 2] = False
  assert helpers.max_err(out[keep], ref[0][keep]) <= helpers.fp32_tol(ref[0])


def _collectives(text):
  return re.findall(r"\b(all-gather|all-to-all|all-reduce|reduce-scatter|"
                    r"collective-permute)(?:-start)?\(", text)


@pytest.mark.parametrize("t", [1, 3])
def test_the_cache_never_moves_one_max_and_one_sum(t):
  """The compiled program of the "reduce" strategy: no all-gather, all-to-all or permute of
  the cache; two all-reduces (the max of lse, the sum of weighted outputs and weights), each
  of [B, t, N] or [B, t, N, Hv + 1] floats."""
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(6, 2, t, 256, 4, 2, 16)
  key, v = _sharded(mesh, key, v)
  lengths = jnp.array([100, 256], jnp.int32)
  fn = jax.jit(lambda q, k, v, n: ringflash.decode_attention(q, k, v, cache_lengths=n,
                                                              mesh=mesh))
  text = fn.lower(q, key, v, lengths).compile().as_text()
  assert sorted(_collectives(text)) == ["all-reduce", "all-reduce"], _collectives(text)
  gather = jax.jit(lambda q, k, v, n: ringflash.decode_attention(
      q, k, v, cache_lengths=n, mesh=mesh, strategy="ring")).lower(q, key, v, lengths)
  assert "collective-permute" in set(_collectives(gather.compile().as_text()))


# ----------------------------------------------------------------------------------- KVCache


def _new_tokens(x, lengths, t):
  return jnp.stack([x[b, n:n + t] for b, n in enumerate(np.asarray(lengths))])


@pytest.mark.parametrize("ring", [2, 8])
def test_cache_prefill_and_appends_under_jit_with_donation(ring):
  """Prefill 16 tokens (row 1 holds 13: a padded batch), then appends of 1 and 3 tokens in a
  jitted, donating step; after each, attention equals the oracle on the same tokens, and
  every device holds as many of row 0's slots as the others, to within one."""
  mesh = helpers.mesh_of(ring)
  n, k, h, t0, s_max = 4, 2, 16, 16, 48
  q, key, v = _inputs(7, 2, 28, 28, n, k, h)
  cache = ringflash.KVCache.create(2, s_max, k, h, mesh=mesh, dtype=jnp.float32)
  cache = cache.prefill(*_sharded(mesh, key[:, :t0], v[:, :t0]), jnp.array([t0, t0 - 3]))

  @jax.jit
  def attend(c, q):
    return c.attention(q, local_window_size=6, return_residual=True)

  step = jax.jit(lambda c, kn, vn: c.append(kn, vn), donate_argnums=0)
  lengths = np.array([t0, t0 - 3])
  for t in (1, 3):
    before = cache.k
    cache = step(cache, _new_tokens(key, lengths, t), _new_tokens(v, lengths, t))
    assert before.is_deleted()                          # donated: updated in place
    lengths = lengths + t
    qn = _new_tokens(q, lengths - t, t)
    ref = _reference(qn, key[:, :lengths.max()], v[:, :lengths.max()], lengths, window=6)
    _close(attend(cache, qn), ref)
  np.testing.assert_array_equal(cache.lengths, lengths)
  filled = np.sum(np.asarray(cache.positions)[0].reshape(ring, -1) != EMPTY, axis=1)
  assert filled.max() - filled.min() <= 1, filled


@pytest.mark.parametrize("ring", [1, 4])
def test_cache_overflow_under_jit_makes_the_attention_nan(ring):
  """An append past max_len under jit cannot raise: the tokens past the capacity are not
  written. The later attention was a finite answer without them; it is now NaN (out and
  lse, every token of every row past its capacity). Slots count per row as `used` (a
  prefill's padding fills slots too): both rows here fill every slot at the second append,
  which is no overflow (the oracle's answer), and overflow at the third."""
  mesh = helpers.mesh_of(ring)
  n, k, h, s_max = 4, 2, 8, 16
  q, key, v = _inputs(9, 2, 20, 20, n, k, h)
  cache = ringflash.KVCache.create(2, s_max, k, h, mesh=mesh, dtype=jnp.float32)
  cache = cache.prefill(*_sharded(mesh, key[:, :12], v[:, :12]), jnp.array([12, 7]))
  step = jax.jit(lambda c, kn, vn: c.append(kn, vn))
  attend = jax.jit(lambda c, q: c.attention(q, return_residual=True))
  lengths = np.array([12, 7])
  for t, overflows in ((3, False), (1, False), (2, True)):   # 15, 16 and 18 of 16 slots
    cache = step(cache, _new_tokens(key, lengths, t), _new_tokens(v, lengths, t))
    lengths = lengths + t
    qn = _new_tokens(q, lengths - 2, 2)
    out, lse = attend(cache, qn)
    if overflows:
      assert bool(jnp.all(jnp.isnan(out))) and bool(jnp.all(jnp.isnan(lse)))
    else:
      top = int(lengths.max())
      _close((out, lse), _reference(qn, key[:, :top], v[:, :top], lengths))
  # eagerly, such an append is refused
  with pytest.raises(ValueError, match="appending t=3 tokens overflows the cache: a row has "
                                       "18 of its max_len=16 slots filled"):
    cache.append(_new_tokens(key, lengths - 3, 3), _new_tokens(v, lengths - 3, 3))


def test_cache_positions_follow_the_slot_order():
  """P = 4, prefill of 8 tokens: device 1 holds 2, 3; tokens 8..12 go to devices 0, 1, 2, 3, 0
  (the worked example of ringflash/kvcache.py)."""
  mesh = helpers.mesh_of(4)
  _, key, v = _inputs(8, 1, 1, 13, 2, 1, 8)
  cache = ringflash.KVCache.create(1, 32, 1, 8, mesh=mesh, dtype=jnp.float32)
  cache = cache.prefill(*_sharded(mesh, key[:, :8], v[:, :8]))
  for i in range(8, 13):
    cache = cache.append(key[:, i:i + 1], v[:, i:i + 1])
  per_device = np.asarray(cache.positions)[0].reshape(4, 8)
  np.testing.assert_array_equal(per_device[:, :4], [[0, 1, 8, 12], [2, 3, 9, EMPTY],
                                                    [4, 5, 10, EMPTY], [6, 7, 11, EMPTY]])
  np.testing.assert_array_equal(np.asarray(cache.k)[0].reshape(4, 8, 1, 8)[1, 2], key[0, 9])


def test_cache_prefill_lengths_are_clipped_to_the_prompt():
  """Prefill lengths count as 0 .. T: a negative one no longer gives the next token a
  negative position, and one past int32 no longer wraps."""
  mesh = helpers.mesh_of(2)
  _, key, v = _inputs(12, 3, 1, 8, 2, 1, 8)
  cache = ringflash.KVCache.create(3, 16, 1, 8, mesh=mesh, dtype=jnp.float32)
  cache = cache.prefill(*_sharded(mesh, key, v),
                        lengths=np.array([-1, 2**32 + 3, 5], np.int64))
  np.testing.assert_array_equal(np.asarray(cache.lengths), [0, 8, 5])
  cache = cache.append(key[:, :1], v[:, :1])
  np.testing.assert_array_equal(np.asarray(cache.lengths), [1, 9, 6])
  assert np.asarray(cache.positions).min() >= 0


def test_cache_prefill_in_the_zigzag_layout():
  mesh = helpers.mesh_of(2)
  q, key, v = _inputs(9, 1, 10, 10, 2, 2, 8)
  zig = [ringflash.to_layout(x, "zigzag", 2) for x in (key[:, :8], v[:, :8])]
  cache = ringflash.KVCache.create(1, 16, 2, 8, mesh=mesh, dtype=jnp.float32)
  cache = cache.prefill(*_sharded(mesh, *zig), layout="zigzag")
  cache = cache.append(key[:, 8:10], v[:, 8:10])
  got = cache.attention(q[:, 8:10], return_residual=True)
  _close(got, _reference(q[:, 8:10], key, v, jnp.array([10])))
  # without a window the queries see every prefilled key, so prefilled positions mixed up
  # (contiguous for zigzag) gave the same answer; with one, each sees a part of them
  got = cache.attention(q[:, 8:10], return_residual=True, local_window_size=(4, 0))
  _close(got, _reference(q[:, 8:10], key, v, jnp.array([10]), window=(4, 0)))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_cache_prefill_of_a_length_that_does_not_fit_the_layout(layout):
  """13 tokens on 4 devices (row 1 holds 10), in to_layout's order for 13, as ring_attention
  returns them: padded inside to 16 (zigzag's 8 chunks of 2, striped's and contiguous' 4 of
  4), the padding's slots free; appends continue the slot order after the 16."""
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(12, 2, 16, 16, 2, 1, 8)
  laid = [ringflash.to_layout(x[:, :13], layout, 4) for x in (key, v)]
  cache = ringflash.KVCache.create(2, 24, 1, 8, mesh=mesh, dtype=jnp.float32)
  cache = cache.prefill(*laid, jnp.array([13, 10]), layout=layout)
  np.testing.assert_array_equal(cache.used, [16, 16])
  positions = np.asarray(cache.positions)
  held = positions[0][positions[0] != EMPTY]
  np.testing.assert_array_equal(np.sort(held), np.arange(13))
  np.testing.assert_array_equal(np.sort(positions[1][positions[1] != EMPTY]), np.arange(10))
  lengths = np.array([13, 10])
  cache = cache.append(_new_tokens(key, lengths, 2), _new_tokens(v, lengths, 2))
  lengths = lengths + 2
  qn = _new_tokens(q, lengths - 2, 2)
  _close(cache.attention(qn, return_residual=True),
         _reference(qn, key[:, :15], v[:, :15], lengths))


def test_cache_nan_written_in_a_slot_is_seen_only_by_who_sees_the_slot():
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(10, 1, 12, 12, 2, 1, 8)
  cache = ringflash.KVCache.create(1, 16, 1, 8, mesh=mesh, dtype=jnp.float32)
  cache = cache.prefill(*_sharded(mesh, key[:, :8], v[:, :8].at[0, 2].set(jnp.nan)))
  cache = cache.append(key[:, 8:9], v[:, 8:9])
  clean = cache.attention(q[:, 8:9], local_window_size=4, return_residual=True)  # keys 4..8
  _close(clean, _reference(q[:, 8:9], key[:, :9], v[:, :9], jnp.array([9]), window=4))
  assert bool(jnp.all(jnp.isnan(cache.attention(q[:, 8:9]))))                 # sees key 2


def test_cache_checks_its_arguments():
  mesh = helpers.mesh_of(4)
  with pytest.raises(ValueError, match="max_len"):
    ringflash.KVCache.create(1, 30, 1, 8, mesh=mesh)
  with pytest.raises(ValueError, match="batch_axis"):
    ringflash.KVCache.create(1, 32, 1, 8, mesh=mesh, batch_axis="sp")
  grid = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "sp"))
  with pytest.raises(ValueError, match=re.escape(
      "batch=3 must be divisible by the 2 devices of batch_axis 'data'")):
    ringflash.KVCache.create(3, 32, 1, 8, mesh=grid, batch_axis="data")
  for dtype in ("foo", jnp.int32):        # "foo" was NumPy's TypeError, not naming dtype
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16"):
      ringflash.KVCache.create(1, 32, 1, 8, mesh=mesh, dtype=dtype)
  cache = ringflash.KVCache.create(1, 16, 1, 8, mesh=mesh, dtype=jnp.float32)
  with pytest.raises(ValueError, match="more than the cache"):
    cache.prefill(jnp.zeros((1, 20, 1, 8)), jnp.zeros((1, 20, 1, 8)))
  with pytest.raises(ValueError, match="k must have shape"):
    cache.prefill(jnp.zeros((1, 8, 2, 8)), jnp.zeros((1, 8, 2, 8)))
  with pytest.raises(ValueError, match="layout"):
    cache.prefill(jnp.zeros((1, 12, 1, 8)), jnp.zeros((1, 12, 1, 8)), layout="diagonal")
  wide = ringflash.KVCache.create(1, 20, 1, 8, mesh=mesh, dtype=jnp.float32)
  with pytest.raises(ValueError, match="zigzag layout pads to 24 on 4 devices, more than"):
    wide.prefill(jnp.zeros((1, 17, 1, 8)), jnp.zeros((1, 17, 1, 8)), layout="zigzag")
  full = cache.prefill(jnp.zeros((1, 16, 1, 8)), jnp.zeros((1, 16, 1, 8)))
  with pytest.raises(ValueError, match="overflows the cache"):
    full.append(jnp.zeros((1, 1, 1, 8)), jnp.zeros((1, 1, 1, 8)))
  # an append that fills the last slots is not an overflow
  filled = cache.prefill(jnp.zeros((1, 12, 1, 8)), jnp.zeros((1, 12, 1, 8))).append(
      jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)))
  np.testing.assert_array_equal(filled.lengths, [16])
  # the query in the cache's terms: decode_attention's messages name key_cache / value_cache
  two_heads = ringflash.KVCache.create(1, 16, 2, 8, mesh=mesh, dtype=jnp.float32)
  for held, query, message in (
      (full, jnp.zeros((1, 1, 2, 8), jnp.bfloat16), "query dtype bfloat16 must be the cache's "
                                                    "dtype float32 (set by KVCache.create("),
      (full, jnp.zeros((2, 1, 2, 8)), "query batch B=2 must be the cache's batch 1"),
      (full, jnp.zeros((1, 1, 2, 4)), "query head_dim 4 must be the cache's head_dim 8"),
      (two_heads, jnp.zeros((1, 1, 3, 8)), "query heads N=3 must be a multiple of the cache's "
                                           "kv heads K=2")):
    with pytest.raises(ValueError, match=re.escape(message)):
      held.attention(query)


# -------------------------------------------------------------------------------- errors


def _call(**change):
  mesh = helpers.mesh_of(4)
  q, key, v = _inputs(11, 2, 1, 32, 4, 2, 8)
  args = dict(query=q, key_cache=key, value_cache=v, cache_lengths=jnp.array([3, 32]),
              mesh=mesh)
  args.update(change)
  return ringflash.decode_attention(args.pop("query"), args.pop("key_cache"),
                                    args.pop("value_cache"), **args)


@pytest.mark.parametrize("change,names", [
    ({"query": jnp.zeros((2, 4, 8))}, "query must have rank 4"),
    ({"query": jnp.zeros((2, 1, 4, 8), jnp.bfloat16)}, "share a dtype"),
    ({"query": jnp.zeros((2, 1, 3, 8))}, "multiple of key_cache heads"),
    ({"query": jnp.zeros((3, 1, 4, 8))}, "batch"),
    ({"query": jnp.zeros((2, 1, 4, 16))}, "head_dim"),
    ({"query": jnp.zeros((2, 40, 4, 8))}, "more than the cache holds"),
    ({"key_cache": jnp.zeros((2, 30, 2, 8)), "value_cache": jnp.zeros((2, 30, 2, 8))},
     "S_max=30 must be divisible by the 4 devices"),
    ({"value_cache": jnp.zeros((2, 32, 1, 8))}, "value_cache must have key_cache's shape"),
    ({"cache_lengths": jnp.array([3])}, "cache_lengths must have shape"),
    ({"cache_lengths": jnp.array([3.0, 4.0])}, "cache_lengths must have an integer dtype"),
    ({"cache_lengths": [3, 32]}, "cache_lengths must be an array"),
    ({"cache_lengths": "3"}, "cache_lengths must be an array, got str"),
    ({"query": "q"}, "query must be an array, got str"),
    ({"sinks": object()}, "sinks must be an array, got object"),
    ({"cache_positions": jnp.zeros((2, 16), jnp.int32)}, "cache_positions must have shape"),
    ({"sinks": jnp.zeros((2,))}, "sinks must have shape"),
    ({"scale": -1.0}, "scale must be finite and > 0"),
    ({"logits_soft_cap": 0.0}, "logits_soft_cap must be finite and > 0"),
    ({"scale": 1e39}, "scale must be at most 3.40282e+38 (float32's largest)"),
    ({"logits_soft_cap": 1e38}, "logits_soft_cap must be at most 1e+30 (float32 flushes"),
    ({"local_window_size": -1}, "local_window_size must be non-negative"),
    ({"backend": "cuda"}, "backend must be one of"),
    ({"strategy": "tree"}, "strategy must be one of"),
    ({"return_residual": "yes"}, "return_residual must be a bool"),
    ({"mesh": None}, "mesh must be a jax.sharding.Mesh"),
    ({"axis_name": "x"}, "axis_name"),
])
def test_a_bad_argument_is_a_value_error_naming_it(change, names):
  with pytest.raises(ValueError, match=re.escape(names)):
    _call(**change)


def test_a_named_backend_never_falls_back():
  with pytest.raises(NotImplementedError, match="pallas_gpu"):
    _call(backend="pallas_gpu")


@pytest.mark.parametrize("platform,kind,cc,backend,s_max,ring,kernel_says", [
    ("tpu", "TPU v5", None, "pallas_tpu", 4 * 60, 4, "multiples of 8")])
def test_a_cache_shard_the_kernel_cannot_tile_is_named_as_the_cache(
    platform, kind, cc, backend, s_max, ring, kernel_says):
  """A named backend refusing the length of a device's share of the cache says so in the
  cache's terms (slots a row and a device, the max_len that suits), not as the padded query
  rows and keys of its kernel call; no fallback. (pallas_gpu pads any share to whole tiles:
  the next test.)"""
  call = decode._Call(b=1, t=2, n=4, k=2, h=64, hv=64, s_max=s_max, dtype=jnp.dtype(jnp.bfloat16),
                      scale=0.125, softcap=None, window_left=None)
  options = decode._Options(axis_name="sp", scale=None, logits_soft_cap=None,
                            local_window_size=None, backend=backend, block_sizes=None,
                            return_residual=False, strategy="reduce", guarded=False)
  device = types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability=cc,
                                 core_count=132)
  with pytest.raises(NotImplementedError) as err:
    decode.prepare(call, options=options, ring_size=ring, device=device)
  message = str(err.value)
  assert message.startswith(f"backend {backend!r} cannot tile a device's share of the cache")
  assert f"holds {s_max} slots a row, {s_max // ring} for each device's kernel" in message
  assert "max_len a multiple of 128 x the devices" in message and kernel_says in message
  # The same call on a cache of such a max_len is accepted.
  fine = decode.prepare(dataclasses.replace(call, s_max=128 * ring), options=options,
                        ring_size=ring, device=device)
  assert fine.backend == backend


@pytest.mark.parametrize("s_max,ring", [(1000, 1), (4 * 200, 4)])
def test_pallas_gpu_takes_a_cache_shard_no_tile_divides(s_max, ring):
  """pallas_gpu pads a device's share of the cache up to whole key tiles inside its kernel
  call (kernels/pallas_gpu.py), so a share of 1000 or 200 slots is accepted, not refused
  (tests/test_pallas_gpu.py runs such a cache on the GPU)."""
  call = decode._Call(b=1, t=2, n=4, k=2, h=64, hv=64, s_max=s_max, dtype=jnp.dtype(jnp.bfloat16),
                      scale=0.125, softcap=None, window_left=None)
  options = decode._Options(axis_name="sp", scale=None, logits_soft_cap=None,
                            local_window_size=None, backend="pallas_gpu", block_sizes=None,
                            return_residual=False, strategy="reduce", guarded=False)
  device = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200",
                                 compute_capability="9.0", core_count=132)
  assert decode.prepare(call, options=options, ring_size=ring, device=device).backend == (
      "pallas_gpu")


def test_decoding_is_forward_only():
  mesh = helpers.mesh_of(2)
  q, key, v = _inputs(12, 1, 1, 16, 2, 1, 8)
  lengths = jnp.array([9])

  sinks = jnp.array([0.1, 0.2])

  def f(q, sinks=None):
    return jnp.sum(ringflash.decode_attention(q, key, v, cache_lengths=lengths, mesh=mesh,
                                              sinks=sinks))

  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(f)(q)
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.jvp(f, (q,), (q,))
  # The sinks are differentiable inputs too (they were added outside the guarded program).
  for grad in (jax.grad, lambda fn, **kw: jax.jit(jax.grad(fn, **kw))):
    with pytest.raises(NotImplementedError, match="forward only"):
      grad(f, argnums=1)(q, sinks)
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.jvp(lambda s: f(q, s), (sinks,), (sinks,))


# --------------------------------------------------------------------------------- bench


def test_bench_decode_mode_runs_at_tiny_sizes(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", RINGFLASH_DEVICES_PER_PROCESS="2")
  cmd = [sys.executable, "-m", "ringflash.cli", "bench", "--mode=decode",
         "--cache_lens=256,512", "--heads=2", "--kv_heads=1", "--head_dim=16", "--warmup=0",
         "--iters=2", f"--out={tmp_path}"]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  rows = json.load(open(tmp_path / "bench_decode.json"))["rows"]
  assert [(r["S"], r["P"], r["S_local"]) for r in rows] == [(256, 2, 128), (512, 2, 256)]
  for r in rows:
    assert all(r[f"{name}_ms"] > 0 and r[f"{name}_bytes"] > 0
               for name in ("reduce", "cache", "allgather", "ring"))
    # the gathered cache is temporary memory only all-gather needs
    assert r["allgather_temp_bytes"] > r["cache_temp_bytes"]
  bad = subprocess.run(cmd[:5] + ["--cache_lens=255"], env=env, capture_output=True,
                       text=True, timeout=300)
  assert bad.returncode == 2 and "--cache_lens" in bad.stderr and "Traceback" not in bad.stderr
