"""Input validation for the public API: one place, at trace time, before any collective."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ringflash.kernels import BACKENDS
from ringflash.kernels import base

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Checked:
  """What validation resolved: everything the ring needs, static."""

  scale: float
  q_seg: jax.Array | None
  kv_seg: jax.Array | None
  backend: str


def _shape(x, name):
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  if shape is None or dtype is None:
    raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  return tuple(shape), jnp.dtype(dtype)


def check_inputs(query, key, value, *, segment_ids, scale, backend, ring_size: int,
                 local: bool) -> Checked:
  """Checks shapes, dtypes, options; returns resolved values.

  Args:
    query, key, value: the arrays as given ([B, T, N, H], [B, S, K, H], [B, S, K, H]).
    segment_ids: None, one [B, T] int array, or a pair ([B, T], [B, S]).
    scale: None or a positive finite number.
    backend: "auto" or one of kernels.BACKENDS.
    ring_size: devices along the ring axis.
    local: True when the arrays are per-device shards (ring_attention_sharded): then the
      sequence lengths are local and need not divide by the ring size.

  Raises:
    ValueError: naming the argument, with expected vs got.
  """
  (qs, qd), (ks, kd), (vs, vd) = (_shape(query, "query"), _shape(key, "key"),
                                  _shape(value, "value"))
  for name, shape in (("query", qs), ("key", ks), ("value", vs)):
    if len(shape) != 4:
      layout = "[B, T, N, H]" if name == "query" else "[B, S, K, H]"
      raise ValueError(f"{name} must have rank 4 {layout}, got shape {shape}")
  for name, dtype in (("query", qd), ("key", kd), ("value", vd)):
    if dtype not in _FLOAT_DTYPES:
      raise ValueError(f"{name}.dtype must be float32, bfloat16 or float16, got {dtype}")
  if kd != qd or vd != qd:
    raise ValueError(f"query, key and value must share a dtype, got query={qd}, key={kd}, "
                     f"value={vd}")
  if ks != vs:
    raise ValueError(f"key and value must have the same shape [B, S, K, H], got key={ks}, "
                     f"value={vs}")
  b, t, n, h = qs
  _, s, k, hk = ks
  if ks[0] != b:
    raise ValueError(f"key batch must equal query batch: expected {b}, got {ks[0]}")
  if hk != h:
    raise ValueError(f"key head_dim must equal query head_dim: expected {h}, got {hk}")
  if k == 0 or n % k:
    raise ValueError(f"query heads N must be a multiple of key heads K (GQA/MQA), got "
                     f"N={n}, K={k}")
  if min(qs) == 0 or min(ks) == 0:
    raise ValueError(f"query and key must be non-empty, got query={qs}, key={ks}")
  if not local:
    for name, length in (("query", t), ("key", s)):
      if length % ring_size:
        raise ValueError(f"{name} sequence length {length} must be divisible by the ring "
                         f"size {ring_size}")

  if scale is None:
    scale = 1.0 / math.sqrt(h)
  else:
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
      raise ValueError(f"scale must be a Python number, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
      raise ValueError(f"scale must be finite and > 0, got {scale}")

  q_seg, kv_seg = _check_segments(segment_ids, b, t, s)

  if backend != "auto" and backend not in BACKENDS:
    raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {backend!r}")
  return Checked(scale=scale, q_seg=q_seg, kv_seg=kv_seg, backend=backend)


def _check_segments(segment_ids, b, t, s):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(f"segment_ids must be one [B, T] array or a pair (q_ids [B, T], "
                       f"kv_ids [B, S]), got a sequence of {len(segment_ids)}")
    q_ids, kv_ids = segment_ids
  else:
    if t != s:
      raise ValueError(f"segment_ids as one array needs T == S (self-attention); with T={t}, "
                       f"S={s} pass a pair (q_ids [B, T], kv_ids [B, S])")
    q_ids = kv_ids = segment_ids
  for name, ids, expected in (("segment_ids (query)", q_ids, (b, t)),
                              ("segment_ids (key/value)", kv_ids, (b, s))):
    shape, dtype = _shape(ids, name)
    if shape != expected:
      raise ValueError(f"{name} must have shape {expected}, got {shape}")
    if not jnp.issubdtype(dtype, jnp.integer):
      raise ValueError(f"{name} must have an integer dtype, got {dtype}")
  return q_ids, kv_ids


def resolve_backend(backend: str, platform: str, device=None) -> str:
  """The backend to run: `backend` itself, or for "auto" the one native to `platform`.

  "auto" follows the platform of the devices the attention runs on (the mesh's), not
  jax.default_backend(): a CPU host compiling for TPU topology devices gets the TPU kernel.
  """
  if backend != "auto":
    return backend
  if platform == "tpu":
    return "pallas_tpu" if _available("pallas_tpu") else "xla"
  if platform in ("gpu", "cuda"):
    cc = getattr(device, "compute_capability", None)
    try:
      major = int(str(cc).split(".")[0])
    except ValueError:
      major = 0
    return "pallas_gpu" if major >= 9 and _available("pallas_gpu") else "xla"
  return "xla"


def _available(name: str) -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top
  return importlib.util.find_spec(f"ringflash.kernels.{name}") is not None


def resolve_spec(kernel, *, scale: float, causal: bool, block_sizes, q_len: int, kv_len: int,
                 head_dim: int, dtype, platform: str, device_kind: str) -> base.KernelSpec:
  """The kernel spec: tile sizes from the backend (its defaults, or the user's, checked).

  Pallas backends run in interpret mode when the devices are CPUs.
  """
  if block_sizes is None:
    block_sizes = base.BlockSizes()
  elif not isinstance(block_sizes, base.BlockSizes):
    raise ValueError(f"block_sizes must be a ringflash.BlockSizes or None, got "
                     f"{type(block_sizes).__name__}")
  bq, bk = kernel.resolve_block_sizes(block_sizes, q_len, kv_len, head_dim=head_dim,
                                      dtype=jnp.dtype(dtype), device_kind=device_kind)
  interpret = kernel.NAME != "xla" and platform == "cpu"
  return base.KernelSpec(scale=scale, causal=causal, block_q=bq, block_k=bk,
                         interpret=interpret)
