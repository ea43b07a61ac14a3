"""Shared test helpers: inputs, meshes, and one compiled forward+backward per case."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import oracle
import ringflash


def load_script(name: str):
  """scripts/NAME.py as a module (scripts/ is not a package), registered in sys.modules so
  that its dataclasses can find their module."""
  path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(name, path)
  script = importlib.util.module_from_spec(spec)
  sys.modules[name] = script
  spec.loader.exec_module(script)
  return script


def hopper_devices():
  """The GPUs of compute capability >= 9.0 (Hopper and later), which pallas_gpu's Mosaic GPU
  kernels need."""
  out = []
  for d in jax.devices():
    try:
      if d.platform == "gpu" and int(str(d.compute_capability).split(".")[0]) >= 9:
        out.append(d)
    except (AttributeError, ValueError):
      pass
  return out


def mesh_of(ring_size: int, axis_name: str = "sp") -> Mesh:
  devices = jax.devices()
  if len(devices) < ring_size:
    raise RuntimeError(f"needs {ring_size} devices, have {len(devices)}")
  return Mesh(np.array(devices[:ring_size]), (axis_name,))


def inputs(seed, b, t, s, n, k, h, dtype):
  """Random q [B, T, N, H], k/v [B, S, K, H] and an output cotangent, O(1) values."""
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (b, t, n, h), jnp.float32).astype(dtype)
  key = jax.random.normal(kk, (b, s, k, h), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, s, k, h), jnp.float32).astype(dtype)
  dout = jax.random.normal(kd, (b, t, n, h), jnp.float32).astype(dtype)
  return q, key, v, dout


def packed_segments(b, t, seed=0, docs=3):
  """[B, T] int32 ids of `docs` packed documents of random lengths per row (sorted)."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(b):
    cuts = np.sort(rng.choice(np.arange(1, t), size=docs - 1, replace=False))
    rows.append(np.searchsorted(cuts, np.arange(t), side="right"))
  return jnp.asarray(np.stack(rows), jnp.int32)




def ring_fwd_bwd(q, k, v, dout, *, mesh, causal=False, segment_ids=None, block_sizes=None,
                 backend="xla", scale=None):
  """ringflash forward (out, lse) and the vjp of out with cotangent dout."""
  seg = segment_ids
  if seg is None:
    seg_args = ()
  elif isinstance(seg, tuple):
    seg_args = seg
  else:
    seg_args = (seg,)

  def attn(q, k, v, *segs):
    ids = None if not segs else segs[0] if len(segs) == 1 else tuple(segs)
    return ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal, segment_ids=ids,
                                    return_residual=True, backend=backend,
                                    block_sizes=block_sizes, scale=scale)

  @jax.jit
  def run(q, k, v, dout, *segs):
    (out, lse), vjp = jax.vjp(lambda a, b_, c: attn(a, b_, c, *segs), q, k, v)
    dq, dk, dv = vjp((dout, jnp.zeros_like(lse)))
    return out, lse, dq, dk, dv

  return run(q, k, v, dout, *seg_args)


def oracle_fwd_bwd(q, k, v, dout, *, causal=False, segment_ids=None, upcast=True, scale=None):
  """The dense reference's (out, lse) and the vjp of out with cotangent dout."""
  if segment_ids is None:
    q_seg = kv_seg = None
  elif isinstance(segment_ids, tuple):
    q_seg, kv_seg = segment_ids
  else:
    q_seg = kv_seg = segment_ids

  def attn(q, k, v):
    return oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg, upcast=upcast,
                            scale=scale)

  (out, lse), vjp = jax.vjp(attn, q, k, v)
  ct = dout.astype(out.dtype)
  dq, dk, dv = vjp((ct, jnp.zeros_like(lse)))
  return out, lse, dq, dk, dv


FP32_TOL = 1e-4


def fp32_tol(ref):
  """~1e-4 absolute on O(1) values; gradients summed over many rows are larger, scale with
  them. The scale is over finite entries: an lse of -inf (a row without keys) made the
  bound infinite, and every other row's lse went unchecked."""
  r = np.abs(np.asarray(jnp.asarray(ref, jnp.float32)))
  return FP32_TOL * max(1.0, float(np.max(r[np.isfinite(r)], initial=0.0)))


def check(got, ref, plain=None):
  """got/ref/plain: (out, lse, dq, dk, dv). fp32: absolute tolerance fp32_tol; bf16:
  FlashAttention's criterion, error vs the fp32 oracle <= 2x (outputs) or 3x (gradients) the
  error of a plain low-precision dense implementation. lse is float32 for every input dtype,
  computed from the same rounded inputs as the oracle's: fp32_tol always (the bf16 criterion
  allowed 0.05 where the error is 5e-7)."""
  for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
    err = max_err(got[i], ref[i])
    assert np.isfinite(err), f"{name}: non-finite error"
    if plain is None or name == "lse":
      assert err <= fp32_tol(ref[i]), f"{name}: error {err:.3g} > {fp32_tol(ref[i]):.3g}"
    else:
      factor = 2.0 if i < 2 else 3.0
      base_err = max_err(plain[i], ref[i])
      assert err <= factor * base_err, (
          f"{name}: error {err:.3g} > {factor} x plain low-precision error {base_err:.3g}")


def max_err(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32))
  b = np.asarray(jnp.asarray(b, jnp.float32))
  both_inf = np.isneginf(a) & np.isneginf(b)
  return float(np.max(np.abs(np.where(both_inf, 0.0, a) - np.where(both_inf, 0.0, b))))
