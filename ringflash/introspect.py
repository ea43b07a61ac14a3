"""The one internal interface of ringflash's programs (ringflash/cli, launch/, scripts/).

The public API (ring_attention, ...) hides what it resolves per call; the benchmark, the
planner and the profiling scripts need to see it and to run pieces of it alone. Everything
they use beyond the public API is here, so no program imports a private name of another
folder and none copies the ring's code:

  ring_spec(q, k, v, ring_size=..., device=..., **options)   what a call would run: the
      validated, resolved RingSpec (backend, kernel spec with its tiles, layout, plan);
  device_steps(ring, q_len, kv_len)   one device's ring steps, on one device: the kernel and
      the LSE merge exactly as parallel/ring.py runs them (parallel.ring.step), the device's
      own K/V standing in for the block it would hold at each step;
  plan, held_source, layout_positions, work_table   the ring's static schedule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ringflash import _validate
from ringflash.kernels import BACKENDS as _BACKENDS
from ringflash.kernels import get_backend
from ringflash.parallel import ring as _ring
from ringflash.parallel.plan import RingPlan as RingPlan
from ringflash.parallel.plan import RingSpec as RingSpec
from ringflash.parallel.plan import balance_block as balance_block
from ringflash.parallel.plan import layout_positions as layout_positions
from ringflash.parallel.plan import work_table as work_table

BACKENDS = ("auto",) + _BACKENDS


def ring_spec(query, key, value, *, ring_size: int, device, axis_name: str = "sp",
              segment_ids=None, scale=None, backend: str = "auto", block_sizes=None,
              is_causal: bool = False, layout: str = "contiguous", local_window_size=None,
              bidirectional: bool = False) -> RingSpec:
  """The RingSpec that ring_attention_sharded would run on local shards of these shapes.

  Args:
    query, key, value: LOCAL shards (arrays or jax.ShapeDtypeStruct): [B, T, N, H] and
      [B, S, K, H] per device.
    ring_size: P, devices of the ring.
    device: a device of the ring (its platform and kind choose the backend and tiles).
    axis_name, segment_ids, scale, backend, block_sizes, is_causal, layout,
      local_window_size, bidirectional: as ring_attention_sharded.

  Raises:
    ValueError, NotImplementedError: as ring_attention_sharded.
  """
  if not hasattr(device, "platform"):
    raise ValueError(f"device must be a jax Device (one of the ring's), got "
                     f"{type(device).__name__}")
  call = _validate.check_call(
      query, key, value, segment_ids=segment_ids, scale=scale, backend=backend,
      ring_size=ring_size, local=True, layout=layout, local_window_size=local_window_size,
      bidirectional=bidirectional, is_causal=is_causal)
  axes = _validate.SeqAxes((axis_name,), (ring_size,))
  ring = _validate.prepare(call, block_sizes=block_sizes, axes=axes, local=True,
                           platform=device.platform, device=device, strategy="ring").spec
  return ring


def plan(ring: RingSpec, q_len: int, kv_len: int) -> RingPlan:
  """The ring's static plan for local lengths (lanes, steps, tiles per hop).

  Raises:
    ValueError: q_len or kv_len is not a multiple of the spec's tiles (of twice them where
      the zigzag layout's chunks, or the bidirectional ring's K/V halves, split the shard).
  """
  for name, length, block, halves in (
      ("q_len", q_len, ring.kernel.block_q, ring.layout == "zigzag"),
      ("kv_len", kv_len, ring.kernel.block_k, ring.layout == "zigzag" or ring.bidirectional)):
    unit = block * (2 if halves else 1)
    if not _is_int(length) or length < 1 or length % unit:
      raise ValueError(f"{name} must be a positive multiple of {unit} (the spec's tile of "
                       f"{block}{', in each half of the shard' if halves else ''}), got "
                       f"{length!r}")
  return ring.plan(q_len, kv_len)


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def held_source(ring: RingSpec, q_len: int, kv_len: int, device: int, step: int,
                lane: int = 0) -> int:
  """The ring index of the device whose K/V `device` holds at `step` on lane `lane`.

  Raises:
    ValueError: naming device (0 .. P - 1), lane (one of the plan's) or step (0 .. the
      lane's last step), or as plan.
  """
  ring_plan = plan(ring, q_len, kv_len)
  for name, value, upper, what in (("device", device, ring.ring_size, ""),
                                   ("lane", lane, len(ring_plan.lanes), ""),
                                   ("step", step, None, f" (lane {lane}'s steps)")):
    upper = ring_plan.lanes[lane].last + 1 if upper is None else upper   # lane checked first
    if not _is_int(value) or not 0 <= value < upper:
      raise ValueError(f"{name} must be an int in 0 .. {upper - 1}{what}, got {value!r}")
  return int(ring_plan.lanes[lane].source(device, step, ring.ring_size))


def device_steps(ring: RingSpec):
  """Jitted (q, k, v, q_pos [T], k_pos [steps, S]) -> (o float32, lse): one device's ring
  steps run on one device, kernel and merge as parallel/ring.py runs them; at step s the
  K/V stand in for the block held there, with positions k_pos[s]. No segment ids.

  k and v: [B, S, K, H] held at every step, or [B, steps * S, K, H], whose block s (keys
  s * S .. s * S + S - 1) is held at step s, as a ring's device holds another block at each
  step. Give the latter to time the steps: with one block at every step a step whose
  result does not depend on its positions (non-causal, no window) is the same computation
  each time, and XLA computes it once, outside the loop.

  Raises (when called):
    ValueError: naming k, when its length is neither S nor steps * S.
  """
  kernel = get_backend(ring.backend)

  @jax.jit
  def steps(q, k, v, q_pos, k_pos):
    b, t, n, _ = q.shape
    count, s_len = k_pos.shape
    if k.shape[1] not in (s_len, count * s_len) or v.shape[1] != k.shape[1]:
      raise ValueError(f"k and v must hold S={s_len} keys (k_pos's) or steps x S = "
                       f"{count * s_len}, got k {k.shape[1]} and v {v.shape[1]}")
    blocks = k.shape[1] != s_len

    def held(x, s):
      return jax.lax.dynamic_slice_in_dim(x, s * s_len, s_len, axis=1) if blocks else x

    def body(s, carry):
      return _ring.step(*carry, kernel, ring.kernel, q, held(k, s), held(v, s), q_pos,
                        k_pos[s], None, None)

    init = (jnp.zeros((b, t, n, v.shape[-1]), jnp.float32),
            jnp.full((b, n, t), -jnp.inf, jnp.float32))
    return jax.lax.fori_loop(0, k_pos.shape[0], body, init)

  return steps


__all__ = ["BACKENDS", "RingPlan", "RingSpec", "balance_block", "device_steps", "held_source",
           "layout_positions", "plan", "ring_spec", "work_table"]
