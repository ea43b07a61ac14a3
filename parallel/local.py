"""Attention of one device's queries against keys it holds whole: one kernel call, exact.

The all-gather and Ulysses strategies bring the keys a device needs to it first and then
attend in one go; this module is that last step, with its gradient: a custom_vjp whose
forward is the kernel's forward and whose backward is the kernel's backward from the final
(out, lse), as in the ring but without hops. Inputs are guarded by the non-finite rule
(kernels/base.py) as in the ring.

Example, Ulysses on 4 devices, 1024 tokens, 16 query heads: after its all-to-all, device 2
holds query heads 8..11 of all 1024 positions and the kv heads they use; it calls
attend(q [B, 1024, 4, H], k, v, q_pos = k_pos = 0..1023, ...) once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name

from ringflash.kernels import base
from ringflash.kernels import get_backend


@dataclasses.dataclass(frozen=True)
class LocalSpec:
  """The kernel spec and the backend's name: the static part of one local attention."""

  kernel: base.KernelSpec
  backend: str


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Static part of a strategy that moves whole sequences over a mesh axis (all-gather,
  Ulysses: each subclasses it).

  Attributes:
    local: the kernel spec and backend (LocalSpec).
    axis_name: the mesh axis (or axes, first major) the sequence is sharded over.
    size: devices along it.
    layout: "contiguous", "zigzag" or "striped".
  """

  local: LocalSpec
  axis_name: str | tuple[str, ...]
  size: int
  layout: str = "contiguous"


class Residuals(NamedTuple):
  """What a strategy's backward needs: its inputs, the output and its fp32 lse."""

  q: jax.Array          # [B, T, N, H]
  k: jax.Array          # [B, S, K, H]
  v: jax.Array          # [B, S, K, Hv]
  out: jax.Array        # [B, T, N, Hv], input dtype
  lse: jax.Array        # [B, N, T], float32
  q_seg: jax.Array | None
  kv_seg: jax.Array | None


# The names (jax.ad_checkpoint.checkpoint_name) of what every strategy's forward keeps for
# its backward: the output, its lse, and the inputs as the strategy's kernels see them (q, k,
# v and the segment ids and positions; under Ulysses after its all-to-alls). Under
# jax.checkpoint the backward runs the forward again to rebuild them (every hop and kernel of
# the ring, or the gathers and the kernel), unless the policy saves them by name:
# jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES) keeps per device what a
# plain (not rematerialized) backward keeps, and runs nothing of the attention again.
RESIDUAL_NAMES = ("ringflash_out", "ringflash_lse", "ringflash_inputs")


def named_output(out, lse):
  """(out, lse) named as RESIDUAL_NAMES' first two, for jax.checkpoint's policies (no effect
  elsewhere)."""
  return checkpoint_name(out, RESIDUAL_NAMES[0]), checkpoint_name(lse, RESIDUAL_NAMES[1])


def named_residuals(res):
  """`res` (a strategy's residuals, a NamedTuple with fields out and lse) with out and lse
  named as named_output names them and every other array as the kernels' inputs."""
  named = {f: None if x is None else checkpoint_name(x, RESIDUAL_NAMES[2])
           for f, x in zip(res._fields, res) if f not in ("out", "lse")}
  named["out"], named["lse"] = named_output(res.out, res.lse)
  return type(res)(**named)


class _Residuals(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  out: jax.Array
  lse: jax.Array
  q_pos: jax.Array
  k_pos: jax.Array
  q_seg: jax.Array | None
  k_seg: jax.Array | None


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: LocalSpec):
  """(out in q's dtype, lse float32): the kernel's forward on guarded Q, K and V."""
  k, v = base.guard_kv(k, v)
  q = base.guard_q(q, spec.kernel.softcap)
  o, lse = get_backend(spec.backend).forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec.kernel)
  return o.astype(q.dtype), lse


def backward(q, k, v, out, lse, dout, dlse, q_pos, k_pos, q_seg, k_seg, spec: LocalSpec):
  """(dq, dk, dv) float32: the kernel's backward from the final out and lse, guarded."""
  q, k, v, out, dout, lse, dlse = base.guard_backward(q, k, v, out, dout.astype(q.dtype), lse,
                                                      dlse)
  return get_backend(spec.backend).backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg,
                                            k_seg, spec.kernel, dlse=dlse)


@functools.partial(jax.custom_vjp, nondiff_argnames=("spec",))
def attend(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: LocalSpec):
  """Exact attention of q against k, v on this device.

  Args:
    q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv]; q_pos [T], k_pos [S] int32 global
    positions; q_seg [B, T], k_seg [B, S] int or None; spec: LocalSpec.

  Returns:
    (out [B, T, N, Hv] in q's dtype, lse [B, N, T] float32).
  """
  return forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec)


def _fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, spec):
  out, lse = forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec)
  res = named_residuals(_Residuals(q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg))
  return (res.out, res.lse), res


def _bwd(spec, res: _Residuals, cotangents):
  dout, dlse = cotangents
  dq, dk, dv = backward(res.q, res.k, res.v, res.out, res.lse, dout, dlse, res.q_pos,
                        res.k_pos, res.q_seg, res.k_seg, spec)
  return (dq.astype(res.q.dtype), dk.astype(res.k.dtype), dv.astype(res.v.dtype), None, None,
          None, None)


attend.defvjp(_fwd, _bwd)
