"""The ring: per-device code run inside shard_map over the sequence axis.

Worked example, contiguous layout, P = 4 devices, 1024 tokens, so 256 per device:
device 2 holds query positions 512..767 and, at step 0, its own keys 512..767. Before it
computes, it starts sending that K/V block to device 3 and receives device 1's (keys
256..511), which it uses at step 1; at step 2 it holds device 0's (0..255) and at step 3
device 3's (768..1023). With causal masking, step 3 gives device 2 only keys after its
queries, so its kernel call is skipped; device 0 skips steps 1..3, device 3 none.
The block held at the last step is not sent on: a forward ring makes P - 1 transfers.
In general at step s device i holds the K/V of device
(i - s) mod P, so every device sees every block after P - 1 transfers.

Backward: a second ring. dq accumulates at home; dk/dv accumulators travel with their K/V
block. After the last step one more transfer brings each accumulator to the device that
owns the block: at step s the block of origin (i - s) sits on device i; after step P - 1 it
sits on device i, with origin i + 1, and the final send i -> i + 1 delivers it home.

Everything carried across steps is float32; the output is cast to the input dtype once.
This module knows the kernel contract only (a backend module with forward/backward), never
a particular kernel.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ringflash.kernels import base
from ringflash.parallel.merge import merge


class Residuals(NamedTuple):
  """What the backward ring needs: inputs, the merged output and its fp32 lse."""

  q: jax.Array          # [B, T, N, H]
  k: jax.Array          # [B, S, K, H]
  v: jax.Array          # [B, S, K, H]
  out: jax.Array        # [B, T, N, H], input dtype
  lse: jax.Array        # [B, N, T], float32
  q_seg: jax.Array | None
  kv_seg: jax.Array | None


def _shift_perm(ring_size: int):
  """Device j sends to device j + 1 (mod P)."""
  return [(j, (j + 1) % ring_size) for j in range(ring_size)]


def local_positions(axis_name: str, length: int):
  """Global positions held by this device for the contiguous layout: [length] int32.

  Device i of the ring holds tokens i * length ... (i + 1) * length - 1.
  """
  return lax.axis_index(axis_name).astype(jnp.int32) * length + jnp.arange(length, dtype=jnp.int32)


def _forward(q, k, v, q_seg, kv_seg, spec, axis_name, ring_size, kernel):
  b, t, n, h = q.shape
  q_pos = local_positions(axis_name, t)
  kv_pos = local_positions(axis_name, k.shape[1])
  perm = _shift_perm(ring_size)

  refs = (q, k, v, q_pos, kv_pos, q_seg, kv_seg)

  def empty():
    return base.filled((b, t, n, h), 0.0, refs), base.filled((b, n, t), -jnp.inf, refs)

  def step(o, lse, kv):
    k_, v_, kp, ks = kv
    o_i, lse_i = lax.cond(
        base.block_may_have_work(q_pos, kp, spec, q_seg, ks),
        lambda: kernel.forward(q, k_, v_, q_pos, kp, q_seg, ks, spec),
        empty)
    return merge(o, lse, o_i, lse_i)

  def body(_, carry):
    o, lse, kv = carry
    # Start the transfer of the block held now before computing on it: the two are
    # independent, so the permute overlaps the kernel.
    nxt = lax.ppermute(kv, axis_name, perm)
    o, lse = step(o, lse, kv)
    return o, lse, nxt

  o, lse = empty()
  o, lse, kv = lax.fori_loop(0, ring_size - 1, body, (o, lse, (k, v, kv_pos, kv_seg)))
  o, lse = step(o, lse, kv)
  return o.astype(q.dtype), lse


def _backward(res: Residuals, dout, dlse, spec, axis_name, ring_size, kernel):
  q, k, v, out, lse, q_seg, kv_seg = res
  q_pos = local_positions(axis_name, q.shape[1])
  kv_pos = local_positions(axis_name, k.shape[1])
  perm = _shift_perm(ring_size)
  refs = (q, k, v, out, lse, dout, dlse, q_pos, kv_pos, q_seg, kv_seg)

  def grads(kv):
    k_, v_, kp, ks = kv

    def zeros():
      return tuple(base.filled(x.shape, 0.0, refs) for x in (q, k_, v_))

    return lax.cond(
        base.block_may_have_work(q_pos, kp, spec, q_seg, ks),
        lambda: kernel.backward(q, k_, v_, out, lse, dout, q_pos, kp, q_seg, ks, spec, dlse=dlse),
        zeros)

  def step(dq, kv, dkv):
    dq_i, dk_i, dv_i = grads(kv)
    dk, dv = dkv
    # The accumulators leave only once this step has added to them.
    return dq + dq_i, lax.ppermute((dk + dk_i, dv + dv_i), axis_name, perm)

  def body(_, carry):
    dq, kv, dkv = carry
    nxt = lax.ppermute(kv, axis_name, perm)
    dq, dkv = step(dq, kv, dkv)
    return dq, nxt, dkv

  zeros_kv = base.filled(k.shape, 0.0, refs)
  init = (base.filled(q.shape, 0.0, refs), (k, v, kv_pos, kv_seg), (zeros_kv, zeros_kv))
  dq, kv, dkv = lax.fori_loop(0, ring_size - 1, body, init)
  dq, (dk, dv) = step(dq, kv, dkv)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnames=("spec", "axis_name", "ring_size", "kernel"))
def ring_attention_local(q, k, v, q_seg, kv_seg, spec: base.KernelSpec, axis_name: str,
                         ring_size: int, kernel: ModuleType):
  """Exact attention of local queries against the keys of the whole ring.

  Runs per device inside shard_map (or the caller's shard_map) over `axis_name`.

  Args:
    q: [B, T, N, H] this device's queries (T = global length / ring_size).
    k, v: [B, S, K, H] this device's keys and values.
    q_seg: [B, T] int segment ids or None; kv_seg: [B, S] or None.
    spec: resolved kernel spec.
    axis_name: the ring's mesh axis.
    ring_size: number of devices along axis_name.
    kernel: backend module implementing the kernel contract.

  Returns:
    (out [B, T, N, H] in q's dtype, lse [B, N, T] float32).
  """
  return _forward(q, k, v, q_seg, kv_seg, spec, axis_name, ring_size, kernel)


def _vjp_fwd(q, k, v, q_seg, kv_seg, spec, axis_name, ring_size, kernel):
  out, lse = _forward(q, k, v, q_seg, kv_seg, spec, axis_name, ring_size, kernel)
  return (out, lse), Residuals(q, k, v, out, lse, q_seg, kv_seg)


def _vjp_bwd(spec, axis_name, ring_size, kernel, res: Residuals, cotangents):
  dout, dlse = cotangents
  dq, dk, dv = _backward(res, dout, dlse, spec, axis_name, ring_size, kernel)
  return dq, dk, dv, None, None


ring_attention_local.defvjp(_vjp_fwd, _vjp_bwd)
