"""The ring: per-device code run inside shard_map over the sequence axis.

Worked example, contiguous layout, P = 4 devices, 1024 tokens, so 256 per device:
device 2 holds query positions 512..767 and, at step 0, its own keys 512..767. Before it
computes, it starts sending that K/V block to device 3 and receives device 1's (keys
256..511), which it uses at step 1; at step 2 it holds device 0's (0..255) and at step 3
device 3's (768..1023). With causal masking, step 3 gives device 2 only keys after its
queries: a dead hop, which costs no kernel work; device 0 has dead hops 1..3, device 3 none.
The block held at the last step is not sent on: a forward ring makes P - 1 transfers.
In general at step s device i holds the K/V of device
(i - s) mod P, so every device sees every block after P - 1 transfers.

Backward: a second ring. dq accumulates at home; dk/dv accumulators travel with their K/V
block. After the last step one more transfer brings each accumulator to the device that
owns the block: at step s the block of origin (i - s) sits on device i; after step P - 1 it
sits on device i, with origin i + 1, and the final send i -> i + 1 delivers it home.

Layouts, windows, both directions: the schedule comes from parallel/plan.py's plan_ring, a
static plan of "lanes" (streams of K/V pieces, each moving +1 or -1 per step) and of the
tiles each device computes at each hop (what the kernels skip; a lane past its last useful
step is neither computed nor sent).
Positions follow the layout (zigzag device 1 of 4, 16 tokens: 2 3 12 13), masks follow the
positions. With a window the plan may stop a lane early: contiguous, P = 8, 16 tokens per
device, window (5, 0): one lane +1 for steps 0..1, a single transfer, and the K/V never
travel further. Window (40, 20): lane +1 for steps 0..3 and lane -1 for steps 1..2 (the
keys of devices i-3..i+2). bidirectional=True on a full ring: the first half of each
device's K/V rows travels +1, the second half -1, P steps each; every step computes on
both halves, so both links of each device carry half the bytes.

Dead hops: the ring calls the kernel at every hop, and the kernel skips a block pair with no
valid entry whole (the xla backend with one conditional around it, the Pallas backends by
their per-tile flags: no DMA, no matrix work). The ring has no conditional of its own: on
TPU a conditional around the kernel keeps XLA's scheduler from starting the next K/V
transfer before it (seen in the compiled v5p schedule of the backward ring), and the
transfer must overlap the kernel.

Transfers: a piece's K and V travel as one array [2, B, S, K, H], and so do its dK/dV
accumulators, so each step's bulk transfer is a single collective-permute. Key positions
are not sent: each device computes those of the piece it holds from the step index. XLA's GPU
scheduler keeps one collective in flight by default; with K and V as two permutes only one
of them overlapped the kernel on two H200s (ringflash.options.GPU_XLA_OPTIONS raises the
limit for the backward, whose K/V and dK/dV transfers are in flight together from P = 3).

Everything carried across steps is float32; the output is cast to the input dtype once.
The dK/dV accumulators take their one cast before their last hop home, which no kernel
overlaps, so that hop moves half the bytes.
This module knows the kernel contract only (a backend module with forward/backward), never
a particular kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ringflash.kernels import base
from ringflash.kernels import get_backend
from ringflash.parallel import local
from ringflash.parallel import plan as ring_plan
from ringflash.parallel.merge import merge


Residuals = local.Residuals


def local_positions(axis_name, length: int, layout: str = "contiguous", group: int = 1):
  """Global positions held by this device: [length] int32 (see parallel/plan.py).

  Contiguous: device i of the ring holds tokens i * length ... (i + 1) * length - 1.
  """
  ring_size = lax.axis_size(axis_name)
  return ring_plan.device_positions(layout, lax.axis_index(axis_name), ring_size, length,
                                    group)


def _pieces(kv, parts: int):
  """Splits each array of kv = (k, v, kv_seg) into `parts` equal runs of rows.

  Rows are axis 1 of k, v [B, S, K, H] and kv_seg [B, S]. With parts = 2 and S = 8, piece 0
  holds rows 0..3 and piece 1 rows 4..7.
  """
  k, v, kv_seg = kv
  size = k.shape[1] // parts

  def cut(x, p):
    return None if x is None else lax.slice_in_dim(x, p * size, (p + 1) * size, axis=1)

  return [(cut(k, p), cut(v, p), cut(kv_seg, p)) for p in range(parts)]


def pack(k, v):
  """K and V as one array, so each step's bulk transfer is one collective-permute (module
  docstring, "Transfers"): [2, B, S, K, H] when they share a head dim, else [B, S, K, H + Hv]
  (value head dims of their own, e.g. MLA's 192 / 128). Also used for dK and dV."""
  if k.shape == v.shape:
    return jnp.stack([k, v])
  return jnp.concatenate([k, v], axis=-1)


def unpack(kv, head_dim: int):
  """pack's inverse; head_dim: K's (H)."""
  if kv.ndim == 5:
    return kv[0], kv[1]
  return kv[..., :head_dim], kv[..., head_dim:]


def _packed(piece):
  """(k, v, kv_seg) -> (kv, kv_seg), K and V packed."""
  k, v, kv_seg = piece
  return pack(k, v), kv_seg


def _unpacked(piece, head_dim: int):
  kv, kv_seg = piece
  return unpack(kv, head_dim) + (kv_seg,)


def _phases(plan):
  """Groups the ring's steps into runs with the same lanes moving and computing.

  Returns [(start, stop, moving, computing)], steps start..stop-1, lane index tuples.
  A lane moves its piece on at steps 0..last-1 and computes at steps first..last. Example,
  P = 8, window lanes (+1, first 0, last 2) and (-1, first 1, last 1): step 0 moves both
  and computes lane 0; step 1 moves lane 0 and computes both; step 2 computes lane 0.
  """
  out = []
  for s in range(plan.steps):
    moving = tuple(i for i, lane in enumerate(plan.lanes) if s < lane.last)
    computing = tuple(i for i, lane in enumerate(plan.lanes) if lane.first <= s <= lane.last)
    if out and out[-1][2:] == (moving, computing):
      out[-1] = (out[-1][0], s + 1, moving, computing)
    else:
      out.append((s, s + 1, moving, computing))
  return out


def _run_phases(plan, body, carry):
  """Runs body(step, carry, moving, computing) over every step of the plan.

  A run of one step is traced inline; longer runs become one fori_loop each, so the
  compiled program grows with the number of runs (at most 4), not with P.
  """
  for start, stop, moving, computing in _phases(plan):
    fn = functools.partial(body, moving=moving, computing=computing)
    if stop - start == 1:
      carry = fn(jnp.int32(start), carry)
    else:
      carry = lax.fori_loop(start, stop, fn, carry)
  return carry


def step(o, lse, kernel, spec: base.KernelSpec, q, k, v, q_pos, k_pos, q_seg, k_seg):
  """One ring step on one device: the kernel on the held block pair, merged into (o, lse).

  o [B, T, N, H] and lse [B, N, T] are the float32 running results; the kernel is any
  backend module. `ringflash bench --mode virtual|layouts` times this same step.
  """
  return merge(o, lse, *kernel.forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec))


def _forward(q, k, v, q_seg, kv_seg, ring: ring_plan.RingSpec):
  b, t, n, _ = q.shape
  spec, kernel, axis_name = ring.kernel, get_backend(ring.backend), ring.axis_name
  plan = ring.plan(t, k.shape[1])
  q_pos = local_positions(axis_name, t, ring.layout, ring.group)
  refs = (q, k, v, q_pos, q_seg, kv_seg)
  # The non-finite rule, once, before the pieces travel (kernels/base.py).
  k, v = base.guard_kv(k, v)
  q = base.guard_q(q, spec.softcap)
  pieces = _pieces((k, v, kv_seg), plan.parts)

  def body(s, carry, moving, computing):
    o, lse, kvs = carry
    # Start the transfers of the pieces held now before computing on them: the two are
    # independent, so the permutes overlap the kernels.
    nxt = list(kvs)
    for i in moving:
      nxt[i] = ring_plan.shift(kvs[i], axis_name, plan.lanes[i].direction)
    for i in computing:
      k_, v_, ks = _unpacked(kvs[i], k.shape[-1])
      kp = ring_plan.held_positions(plan, i, s, axis_name, k.shape[1])
      # No conditional here: a dead hop is skipped inside the kernel (module docstring).
      o, lse = step(o, lse, kernel, spec, q, k_, v_, q_pos, kp, q_seg, ks)
    return o, lse, tuple(nxt)

  init = (base.filled((b, t, n, v.shape[-1]), 0.0, refs),
          base.filled((b, n, t), -jnp.inf, refs))
  kvs = tuple(_packed(pieces[lane.part]) for lane in plan.lanes)
  o, lse, _ = _run_phases(plan, body, init + (kvs,))
  return o.astype(q.dtype), lse


def _backward(res: Residuals, dout, dlse, ring: ring_plan.RingSpec):
  q, k, v, out, lse, q_seg, kv_seg = res
  spec, kernel, axis_name = ring.kernel, get_backend(ring.backend), ring.axis_name
  ring_size = ring.ring_size
  plan = ring.plan(q.shape[1], k.shape[1])
  q_pos = local_positions(axis_name, q.shape[1], ring.layout, ring.group)
  refs = (q, k, v, out, lse, dout, dlse, q_pos, q_seg, kv_seg)
  # The non-finite rule, once, before the pieces travel (kernels/base.py).
  q, k, v, out, dout, lse, dlse = base.guard_backward(q, k, v, out, dout, lse, dlse)
  pieces = _pieces((k, v, kv_seg), plan.parts)

  def body(s, carry, moving, computing):
    dq, kvs, dkvs = carry
    nxt = list(kvs)
    dkvs = list(dkvs)
    for i in moving:
      nxt[i] = ring_plan.shift(kvs[i], axis_name, plan.lanes[i].direction)
    for i in computing:
      k_, v_, ks = _unpacked(kvs[i], k.shape[-1])
      kp = ring_plan.held_positions(plan, i, s, axis_name, k.shape[1])
      dq_i, dk_i, dv_i = kernel.backward(q, k_, v_, out, lse, dout, q_pos, kp, q_seg, ks,
                                         spec, dlse=dlse)
      dq = dq + dq_i
      dkvs[i] = dkvs[i] + pack(dk_i, dv_i)             # float32, packed as K and V
    # Each accumulator travels with its piece, leaving only once this step has added to it.
    for i in moving:
      dkvs[i] = ring_plan.shift(dkvs[i], axis_name, plan.lanes[i].direction)
    return dq, tuple(nxt), tuple(dkvs)

  kvs = tuple(_packed(pieces[lane.part]) for lane in plan.lanes)
  dkvs = tuple(base.filled(kv[0].shape, 0.0, refs) for kv in kvs)
  dq, _, dkvs = _run_phases(plan, body, (base.filled(q.shape, 0.0, refs), kvs, dkvs))

  # Send every accumulator home. After its last step a lane's accumulator on device i
  # belongs to device i - direction * last: full ring, P = 4, direction +1, last = 3:
  # device 2 holds device 3's (2 - 3 = -1 = 3 mod 4), one more hop +1 brings it home;
  # window lane with last = 2 on P = 8: device 5 holds device 3's and sends it 2 back.
  dk_parts = [None] * plan.parts
  dv_parts = [None] * plan.parts
  lanes_of_part = [sum(lane.part == p for lane in plan.lanes) for p in range(plan.parts)]
  for lane, dkv in zip(plan.lanes, dkvs):
    shift = (-lane.direction * lane.last) % ring_size
    if shift:
      if lanes_of_part[lane.part] == 1:
        # Complete: nothing is added to it any more, so its one cast to the input dtype
        # can come before this last hop, which then moves half the bytes of float32.
        dkv = dkv.astype(k.dtype)
      dkv = ring_plan.shift(dkv, axis_name, shift)
    dk_l, dv_l = unpack(dkv, k.shape[-1])
    p = lane.part
    dk_parts[p] = dk_l if dk_parts[p] is None else dk_parts[p] + dk_l
    dv_parts[p] = dv_l if dv_parts[p] is None else dv_parts[p] + dv_l
  dk = jnp.concatenate(dk_parts, axis=1) if plan.parts > 1 else dk_parts[0]
  dv = jnp.concatenate(dv_parts, axis=1) if plan.parts > 1 else dv_parts[0]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnames=("ring",))
def ring_attention_local(q, k, v, q_seg, kv_seg, ring: ring_plan.RingSpec):
  """Exact attention of local queries against the keys of the whole ring.

  Runs per device inside shard_map (or the caller's shard_map) over `ring.axis_name`.

  Args:
    q: [B, T, N, H] this device's queries (T = global length / ring_size).
    k, v: [B, S, K, H] this device's keys and values.
    q_seg: [B, T] int segment ids or None; kv_seg: [B, S] or None.
    ring: the static ring spec (kernel spec, backend, axis, size, layout, directions); the
      masks follow the positions of `ring.layout` (parallel/plan.py).

  Returns:
    (out [B, T, N, H] in q's dtype, lse [B, N, T] float32).
  """
  return _forward(q, k, v, q_seg, kv_seg, ring)


def _vjp_fwd(q, k, v, q_seg, kv_seg, ring):
  out, lse = _forward(q, k, v, q_seg, kv_seg, ring)
  res = local.named_residuals(Residuals(q, k, v, out, lse, q_seg, kv_seg))
  return (res.out, res.lse), res


def _vjp_bwd(ring, res: Residuals, cotangents):
  dout, dlse = cotangents
  dq, dk, dv = _backward(res, dout, dlse, ring)
  return dq, dk, dv, None, None


ring_attention_local.defvjp(_vjp_fwd, _vjp_bwd)
