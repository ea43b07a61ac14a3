"""The contract cases on the xla backend (tests/contract/base.py), with small tiles so that
every block pair spans several tiles."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import helpers
import oracle
import ringflash
from contract import base


class TestXla(base.ContractTests):
  BACKEND = "xla"

  def block_sizes(self, q_len, kv_len):
    # 8 x 8 tiles where they divide the unit the ring tiles (zigzag chunks and bidirectional
    # halves of 16 tokens: 8).
    return ringflash.XlaBlockSizes(block_q=math.gcd(8, q_len), block_k=math.gcd(8, kv_len),
                                   block_q_bwd=math.gcd(4, q_len),
                                   block_k_bwd=math.gcd(8, kv_len))


def test_default_tiles_of_a_length_without_a_large_divisor_are_padded():
  """A local length whose divisors up to 512 are all small (1031, a prime: 1 and 1031) gets
  near-equal tiles of at most 512 rows, the last one padded inside the kernels with rows
  that see nothing, not tiles of one row (1031^2 loop steps of one score each). Through the
  ring of 2 with default tiles, causal, with segment ids: out, lse and the gradients meet
  the oracle; a NaN key reaches exactly the rows that see it."""
  from ringflash.kernels import xla
  assert [xla.default_block(n) for n in (1031, 2062, 1000, 1088, 300, 4093)] == [
      344, 416, 500, 272, 300, 512]
  p, local = 2, 1031
  n_tok = p * local
  q, k, v, dout = helpers.inputs(5, 1, n_tok, n_tok, 4, 2, 32, jnp.float32)
  seg = jnp.asarray(helpers.packed_segments(1, n_tok, seed=2))
  mesh = helpers.mesh_of(p)

  @jax.jit
  def ours(q, k, v):
    (out, lse), vjp = jax.vjp(lambda *a: ringflash.ring_attention(
        *a, mesh=mesh, axis_name="sp", is_causal=True, segment_ids=seg, backend="xla",
        return_residual=True), q, k, v)
    return (out, lse) + vjp((dout, jnp.zeros_like(lse)))

  @jax.jit
  def want(q, k, v):
    (out, lse), vjp = jax.vjp(lambda *a: oracle.attention(*a, causal=True, q_seg=seg,
                                                          kv_seg=seg), q, k, v)
    return (out, lse) + vjp((dout, jnp.zeros_like(lse)))

  got, ref = ours(q, k, v), want(q, k, v)
  for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
    assert helpers.max_err(g, w) <= helpers.fp32_tol(w), name
  j = 1500                                        # a key in the padded tile of device 1
  out_n = ours(q, k.at[:, j].set(jnp.nan), v)[0]
  rows = np.arange(n_tok)
  segs = np.asarray(seg)[0]
  sees = (rows >= j) & (segs == segs[j])
  out_n = np.asarray(out_n)[0]
  assert np.all(np.isnan(out_n[sees])) and np.all(np.isfinite(out_n[~sees]))
  np.testing.assert_allclose(out_n[~sees], np.asarray(got[0])[0, ~sees], rtol=1e-6, atol=1e-6)
