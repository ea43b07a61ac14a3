"""Conformance of the pallas_gpu backend against the fp32 oracle (tests/oracle.py).

The Mosaic GPU kernels need a Hopper GPU to run: with the installed jax they cannot run in
interpret mode on CPU (the HLO interpreter rejects run_scoped over the warpgroup axis, and the
GPU interpreter cannot lower wgmma). So the numerical cases run only where a GPU of compute
capability >= 9.0 is present (JAX_PLATFORMS=cuda). On CPU: the tile plan, the Triton backward
kernels (Pallas interpret mode), and the lowering of both Mosaic GPU kernels for CUDA, alone
and inside shard_map as the ring calls them, which runs Mosaic GPU's layout inference and
shared-memory budget check on this machine.

bf16 criterion: error vs the fp32 oracle <= 2x the error of plain bf16 dense attention
(3x for gradients); max absolute error over all elements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import ringflash
from ringflash.kernels import base
from ringflash.kernels import pallas_gpu
from ringflash.kernels import pallas_gpu_common as common
from ringflash.kernels import pallas_gpu_mosaic_bwd
from ringflash.kernels import pallas_gpu_triton_bwd
import helpers
import oracle


def _hopper_devices():
  out = []
  for d in jax.devices():
    if d.platform != "gpu":
      continue
    try:
      major = int(str(getattr(d, "compute_capability", "0")).split(".")[0])
    except ValueError:
      major = 0
    if major >= 9:
      out.append(d)
  return out


needs_hopper = pytest.mark.skipif(not _hopper_devices(),
                                  reason="needs a GPU of compute capability >= 9.0")


def _segments(b, t, s, with_empty):
  """Packed documents; with_empty gives query rows an id no key has (rows with no key)."""
  q_ids = np.zeros((b, t), np.int32)
  kv_ids = np.zeros((b, s), np.int32)
  q_ids[:, t // 3:] = 1
  kv_ids[:, s // 3:] = 1
  q_ids[:, 2 * t // 3:] = 2
  kv_ids[:, 2 * s // 3:] = 2
  if with_empty:
    q_ids[:, t - t // 8:] = 7
  return jnp.asarray(q_ids), jnp.asarray(kv_ids)


def _max_err(x, ref):
  return float(jnp.max(jnp.abs(x.astype(jnp.float32) - ref.astype(jnp.float32))))


# ----------------------------------------------------------------------------- CPU: plan


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("causal,segs,window", [(True, False, None), (False, True, None),
                                                (True, True, None), (False, False, (100, 30)),
                                                (True, True, (200, 0))])
def test_tile_plan_is_conservative(causal, segs, window, transposed):
  """The forward's plan (per query tile, over key tiles of 128) and, transposed, the Mosaic
  backward's (per key tile of 64, over query tiles of 64) skip only tiles with no valid pair
  and run unmasked only over tiles whose every pair is valid."""
  t = s = 512
  b_ = pallas_gpu_mosaic_bwd.BLOCK
  bq, bk = (b_, b_) if transposed else (64, 128)
  rng = np.random.default_rng(0)
  # zigzag-like positions: two chunks per device, sorted within each
  q_pos = jnp.asarray(np.concatenate([np.arange(0, 256), np.arange(768, 1024)]), jnp.int32)
  k_pos = jnp.asarray(np.concatenate([np.arange(256, 512), np.arange(512, 768)]), jnp.int32)
  q_seg = k_seg = None
  if segs:
    q_seg = jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1), jnp.int32)
    k_seg = jnp.asarray(np.sort(rng.integers(0, 4, (2, s)), axis=1), jnp.int32)
  spec = base.KernelSpec(scale=1.0, causal=causal, tiles=ringflash.GpuBlockSizes(bq, bk, 2),
                         window=window)
  work, full = common.tile_flags(q_pos, k_pos, q_seg, k_seg, spec, bq, bk)
  valid = np.asarray(base.mask(q_pos, k_pos, q_seg, k_seg, spec))         # [B|1, T, S]
  tiles = valid.reshape(valid.shape[0], t // bq, bq, s // bk, bk)
  any_valid = tiles.any(axis=(2, 4))
  all_valid = tiles.all(axis=(2, 4))
  if transposed:  # rows: key tiles; as pallas_gpu_mosaic_bwd.backward builds its plan
    work, full = jnp.swapaxes(work, -1, -2), jnp.swapaxes(full, -1, -2)
    any_valid, all_valid = np.swapaxes(any_valid, -1, -2), np.swapaxes(all_valid, -1, -2)
  plan = np.asarray(common.tile_plan(work, full))
  nb = max(plan.shape[0], any_valid.shape[0])
  for bi in range(nb):
    p = plan[min(bi, plan.shape[0] - 1)]
    for i in range(p.shape[0]):
      u_lo, lo, flo, fhi, hi, u_hi = p[i, :6]
      assert u_lo <= lo <= flo <= fhi <= hi <= u_hi
      j_valid = np.nonzero(any_valid[min(bi, any_valid.shape[0] - 1), i])[0]
      assert all(lo <= j < hi for j in j_valid), (bi, i, p[i], j_valid)
      for j in range(flo, fhi):
        assert all_valid[min(bi, all_valid.shape[0] - 1), i, j], (bi, i, j, p[i])
      # the two query tiles of one CUDA block share the union range
      other = p[i ^ 1]
      assert (u_lo, u_hi) == (other[0], other[5])


# ----------------------------------------------------------------------------- CPU: bwd


@pytest.mark.parametrize("causal,segs,n,kh,window", [(True, False, 4, 2, None),
                                                     (False, True, 2, 1, (20, 5))])
def test_backward_kernels_interpret(causal, segs, n, kh, window):
  """The Triton backward kernels in interpret mode, from the oracle's out and lse."""
  b, t, h = 1, 128, 64
  q, k, v, do = helpers.inputs(1, b, t, t, n, kh, h, jnp.bfloat16)
  q_seg, kv_seg = _segments(b, t, t, with_empty=True) if segs else (None, None)
  pos = jnp.arange(t, dtype=jnp.int32)
  spec = base.KernelSpec(scale=h ** -0.5, causal=causal,
                         tiles=ringflash.GpuBlockSizes(64, 64, 2), interpret=True, window=window)

  def dense(upcast, q, k, v):
    return oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg,
                            upcast=upcast, window=window)[0]

  out, lse = oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg,
                              window=window)
  got = pallas_gpu_triton_bwd.backward(q, k, v, out.astype(q.dtype), lse, do, pos, pos, q_seg,
                                kv_seg, spec)
  _, vjp32 = jax.vjp(lambda *a: dense(True, *a), q, k, v)
  want = vjp32(do.astype(jnp.float32))
  _, vjp16 = jax.vjp(lambda *a: dense(False, *a), q, k, v)
  plain = vjp16(do)
  for name, g, w, p in zip(("dq", "dk", "dv"), got, want, plain):
    assert g.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert _max_err(g, w) <= 3 * _max_err(p, w), (name, _max_err(g, w), _max_err(p, w))
  if segs:  # rows with no valid key: zero dq
    assert float(jnp.abs(got[0][:, t - t // 8:]).max()) == 0.0


# ----------------------------------------------------------------------------- CPU: lowering


def _problem(t, s, h, kh, group):
  return base.Problem(q_len=t, kv_len=s, head_dim=h, kv_heads=kh, group=group,
                      dtype=jnp.dtype(jnp.bfloat16), platform="gpu", device_kind="NVIDIA H200",
                      compute_capability="9.0")


def _lower_for_cuda(fn, *shapes):
  """Lowers fn for CUDA on this machine: Pallas -> Mosaic GPU, with its layout inference."""
  return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


LOWER_CASES = [
    # which, causal, segs, window, n, kh, h, t
    ("forward", True, False, None, 4, 2, 128, 512),
    ("forward", False, True, (40, 20), 4, 1, 64, 256),
    ("forward", True, False, None, 2, 2, 256, 256),
    ("backward", False, False, None, 4, 4, 128, 512),
    ("backward", True, True, None, 8, 2, 128, 512),
    ("backward", False, False, (40, 20), 2, 1, 128, 256),
    ("backward", True, True, None, 4, 1, 64, 256),
]


def _in_shard_map(fn, seq_dims, out_dims):
  """fn inside shard_map over a one-device mesh with each array's sequence dimension mapped,
  as the ring calls the kernels: there, positions and bounds read from such arrays carry the
  mesh axis in their type, and every loop carry inside the kernel must agree with it."""
  def seq(d):
    return jax.sharding.PartitionSpec(*([None] * d + ["sp"]))

  return jax.shard_map(fn, mesh=Mesh(np.array(jax.devices()[:1]), ("sp",)),
                       in_specs=tuple(map(seq, seq_dims)), out_specs=tuple(map(seq, out_dims)))


@pytest.mark.parametrize("in_ring", [False, True], ids=["alone", "in_shard_map"])
@pytest.mark.parametrize("which,causal,segs,window,n,kh,h,t", LOWER_CASES)
def test_mosaic_kernels_lower_for_cuda(which, causal, segs, window, n, kh, h, t, in_ring):
  b = 2 if segs else 1
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
  pos = jax.ShapeDtypeStruct((t,), jnp.int32)
  seg = jax.ShapeDtypeStruct((b, t), jnp.int32) if segs else None
  tiles = pallas_gpu.resolve_tiles(None, _problem(t, t, h, kh, n // kh))
  spec = base.KernelSpec(scale=h ** -0.5, causal=causal, tiles=tiles, window=window)
  if which == "forward":
    fn = lambda q, k, v, p, s: pallas_gpu.forward(q, k, v, p, p, s, s, spec)
    args, seq_dims, out_dims = [q, kv, kv, pos, seg], [1, 1, 1, 0, 1], [1, 2]
  else:
    assert h in pallas_gpu.MOSAIC_BWD_HEAD_DIMS
    o = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32)
    lse = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
    fn = lambda q, k, v, o, lse, do, p, s: pallas_gpu.backward(q, k, v, o, lse, do, p, p, s,
                                                               s, spec)
    args = [q, kv, kv, o, lse, q, pos, seg]
    seq_dims, out_dims = [1, 1, 1, 1, 2, 1, 0, 1], [1, 1, 1]
  if in_ring:
    fn = _in_shard_map(fn, seq_dims, out_dims)
  text = _lower_for_cuda(fn, *args)
  # the kernel is a Mosaic GPU custom call, not a fallback
  assert "mosaic_gpu" in text
  assert "triton" not in text.lower()


def test_forward_tiles_beyond_shared_memory_raise():
  """bk = 128 at head dim 256 needs 320 KiB: a ValueError naming block_sizes, not a failed
  compile."""
  with pytest.raises(ValueError, match="block_sizes"):
    pallas_gpu.resolve_tiles(ringflash.GpuBlockSizes(64, 128), _problem(512, 512, 256, 1, 1))
  tiles = pallas_gpu.resolve_tiles(ringflash.GpuBlockSizes(64, 128),
                                   _problem(512, 512, 128, 1, 1))
  assert (tiles.block_q, tiles.block_k, tiles.stages) == (64, 128, 2)


# ----------------------------------------------------------------------------- H200


def _dense_grads(dense, q, k, v, do):
  """Gradients of the dense oracle: fp32 (the reference) and plain low precision, jitted."""

  @jax.jit
  def grads(q, k, v, do):
    _, vjp32 = jax.vjp(lambda *a: dense(True, *a), q, k, v)
    _, vjp16 = jax.vjp(lambda *a: dense(False, *a), q, k, v)
    return vjp32(do.astype(jnp.float32)), vjp16(do)

  return grads(q, k, v, do)


def _mesh():
  return Mesh(np.array(_hopper_devices()[:1]), ("sp",))


# Head dims 128 and 256 (the contract cases, tests/contract/, run head dim 64).
CASES = [
    # causal, segs, n, kh, h, t, dtype, grads
    (True, True, 4, 4, 128, 512, jnp.bfloat16, True),      # rows with no valid key
    (True, False, 8, 2, 128, 512, jnp.bfloat16, True),     # GQA 4:1
    (True, False, 2, 2, 256, 256, jnp.bfloat16, False),    # head dim 256: forward
    (False, False, 2, 1, 128, 1024, jnp.bfloat16, True),
]


@needs_hopper
@pytest.mark.parametrize("causal,segs,n,kh,h,t,dtype,grads", CASES)
def test_ring_one_gpu_matches_oracle(causal, segs, n, kh, h, t, dtype, grads):
  b = 2 if segs else 1
  q, k, v, do = helpers.inputs(2, b, t, t, n, kh, h, dtype)
  q_seg, kv_seg = _segments(b, t, t, with_empty=True) if segs else (None, None)
  seg_arg = (q_seg, kv_seg) if segs else None
  mesh = _mesh()

  def ours(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal, segment_ids=seg_arg,
                                    backend="pallas_gpu", return_residual=True)

  def dense(upcast, q, k, v):
    return oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg,
                            upcast=upcast)[0]

  # Everything under jit: run eagerly, each operation of the ring and of the oracle would be
  # compiled on its own, which takes minutes per case on the GPU.
  (out, lse), vjp = jax.jit(lambda *a: jax.vjp(ours, *a))(q, k, v)
  want, want_lse = jax.jit(lambda *a: oracle.attention(*a, causal=causal, q_seg=q_seg,
                                                       kv_seg=kv_seg))(q, k, v)
  plain = jax.jit(lambda *a: dense(False, *a))(q, k, v)
  assert out.dtype == dtype
  assert _max_err(out, want) <= 2 * _max_err(plain, want)
  finite = jnp.isfinite(want_lse)
  assert bool(jnp.all(jnp.isfinite(lse) == finite))
  assert float(jnp.max(jnp.where(finite, jnp.abs(lse - want_lse), 0.0))) < 2e-2
  if not grads:
    return
  got = jax.jit(vjp)((do, jnp.zeros_like(lse)))
  want_g, plain_g = _dense_grads(dense, q, k, v, do)
  for name, g, w, p in zip(("dq", "dk", "dv"), got, want_g, plain_g):
    assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), name
    assert _max_err(g, w) <= 3 * _max_err(p, w), (name, _max_err(g, w), _max_err(p, w))


BWD_CASES = [
    # causal, segs, window, n, kh, h, t, s
    (False, False, None, 4, 2, 128, 512, 512),
    (True, False, None, 4, 2, 128, 512, 512),
    (True, True, None, 4, 4, 128, 512, 512),           # rows with no valid key
    (False, False, (40, 20), 2, 2, 128, 512, 512),     # sliding window
    (True, False, None, 8, 2, 64, 256, 512),           # GQA 4:1, T < S, head dim 64
    (False, True, None, 4, 1, 64, 384, 256),           # MQA, T > S
]


@needs_hopper
@pytest.mark.parametrize("causal,segs,window,n,kh,h,t,s", BWD_CASES)
def test_mosaic_backward_matches_oracle(causal, segs, window, n, kh, h, t, s):
  """The fused Mosaic GPU backward alone, from the oracle's out and lse (bf16 criterion)."""
  b = 2 if segs else 1
  q, k, v, do = helpers.inputs(3, b, t, s, n, kh, h, jnp.bfloat16)
  q_seg, kv_seg = _segments(b, t, s, with_empty=True) if segs else (None, None)
  q_pos = jnp.arange(t, dtype=jnp.int32)
  k_pos = jnp.arange(s, dtype=jnp.int32)
  spec = base.KernelSpec(scale=h ** -0.5, causal=causal,
                         tiles=ringflash.GpuBlockSizes(64, 128, 2), window=window)

  def dense(upcast, q, k, v):
    return oracle.attention(q, k, v, causal=causal, q_seg=q_seg, kv_seg=kv_seg,
                            upcast=upcast, window=window)[0]

  out, lse = jax.jit(lambda *a: oracle.attention(*a, causal=causal, q_seg=q_seg,
                                                 kv_seg=kv_seg, window=window))(q, k, v)
  got = jax.jit(lambda *a: pallas_gpu_mosaic_bwd.backward(*a, spec))(
      q, k, v, out, lse, do, q_pos, k_pos, q_seg, kv_seg)
  want, plain = _dense_grads(dense, q, k, v, do)
  for name, g, w, p in zip(("dq", "dk", "dv"), got, want, plain):
    assert g.dtype == jnp.float32 and g.shape == w.shape, name
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert _max_err(g, w) <= 3 * _max_err(p, w), (name, _max_err(g, w), _max_err(p, w))
  if segs:  # rows with no valid key: zero dq
    assert float(jnp.abs(got[0][:, t - t // 8:]).max()) == 0.0


@needs_hopper
def test_auto_picks_pallas_gpu():
  from ringflash import introspect  # pylint: disable=g-import-not-at-top
  d = _hopper_devices()[0]
  shape = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
  assert introspect.ring_spec(shape, shape, shape, ring_size=1, device=d).backend == "pallas_gpu"
