"""Input validation for the public API: one place, at trace time, before any collective."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ringflash import layouts
from ringflash.kernels import BACKENDS
from ringflash.kernels import get_backend
from ringflash.kernels import base

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Checked:
  """What validation resolved: everything the ring needs, static."""

  scale: float
  q_seg: jax.Array | None
  kv_seg: jax.Array | None
  backend: str
  layout: str = "contiguous"
  window: tuple[int, int] | None = None
  bidirectional: bool = False


def _shape(x, name):
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  if shape is None or dtype is None:
    raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  return tuple(shape), jnp.dtype(dtype)


def check_inputs(query, key, value, *, segment_ids, scale, backend, ring_size: int,
                 local: bool, layout: str = "contiguous", local_window_size=None,
                 bidirectional: bool = False) -> Checked:
  """Checks shapes, dtypes, options; returns resolved values.

  Args:
    query, key, value: the arrays as given ([B, T, N, H], [B, S, K, H], [B, S, K, H]).
    segment_ids: None, one [B, T] int array, or a pair ([B, T], [B, S]).
    scale: None or a positive finite number.
    backend: "auto" or one of kernels.BACKENDS.
    ring_size: devices along the ring axis.
    local: True when the arrays are per-device shards (ring_attention_sharded): then the
      sequence lengths are local and need not divide by the ring size.
    layout: "contiguous", "zigzag" or "striped"; zigzag needs global lengths divisible by
      2 * ring_size (local lengths even).
    local_window_size: None, int w (meaning (w, w)) or (left, right), non-negative.
    bidirectional: bool; True needs an even local key length.

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

  scale_t = ring_size if local else 1        # local lengths -> global lengths
  for name, length in (("query", t), ("key", s)):
    layouts.check_layout(layout, ring_size, length * scale_t,
                         length_name=f"{name} sequence length" + (
                             f" ({length} per device)" if local else ""))
  window = _check_window(local_window_size, t * scale_t, s * scale_t)
  if not isinstance(bidirectional, (bool, np.bool_)):
    raise ValueError(f"bidirectional must be a bool, got {bidirectional!r}")
  local_s = s if local else s // ring_size
  if bidirectional and ring_size > 1 and local_s % 2:
    raise ValueError(f"bidirectional=True splits each device's keys in two halves; the local "
                     f"key length must be even, got {local_s}")
  return Checked(scale=scale, q_seg=q_seg, kv_seg=kv_seg, backend=backend, layout=layout,
                 window=window, bidirectional=bool(bidirectional))


def _check_window(local_window_size, t: int, s: int):
  """(left, right) from jax.nn's local_window_size (int w means (w, w)), or None.

  Bounds beyond the sequence change nothing (every query i < t, key j < s, so i - j lies in
  (-s, t)); they are clipped to left <= t, right <= s so positions +- bounds stay in int32
  and equal windows share one compiled program.
  """
  if local_window_size is None:
    return None

  def is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))

  if is_int(local_window_size):
    pair = (local_window_size, local_window_size)
  elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2 and all(
      is_int(x) for x in local_window_size):
    pair = tuple(local_window_size)
  else:
    raise ValueError(f"local_window_size must be None, an int or a pair (left, right) of "
                     f"ints, got {local_window_size!r}")
  if min(pair) < 0:
    raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
  return (int(min(pair[0], t)), int(min(pair[1], s)))


def block_units(block_sizes, layout: str, bidirectional: bool, ring_size: int, q_len: int,
                kv_len: int) -> tuple[int, int]:
  """The row runs that tiles must not straddle, from LOCAL lengths: (query, key).

  zigzag: each device's rows are two chunks, so tiles divide the half (local 64 -> 32);
  bidirectional: the keys travel in two halves, so key tiles divide the half.

  Raises:
    ValueError: naming block_sizes, when a given size does not divide its run.
  """
  why_q = why_k = None
  if layout == "zigzag":
    q_len, kv_len = q_len // 2, kv_len // 2
    why_q = why_k = "zigzag chunk (local length / 2)"
  elif bidirectional and ring_size > 1:
    kv_len //= 2
    why_k = "bidirectional half (local key length / 2)"
  if isinstance(block_sizes, base.BlockSizes):
    for name, given, run, why in (("block_q", block_sizes.block_q, q_len, why_q),
                                  ("block_k", block_sizes.block_k, kv_len, why_k)):
      if why is not None and given is not None and run % given:
        raise ValueError(f"block_sizes.{name}={given} must divide the {why} {run}")
  return q_len, kv_len


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
    return "pallas_tpu"
  if platform in ("gpu", "cuda"):
    cc = getattr(device, "compute_capability", None)
    try:
      major = int(str(cc).split(".")[0])
    except ValueError:
      major = 0
    return "pallas_gpu" if major >= 9 else "xla"
  return "xla"


def prepare(query, key, value, *, segment_ids, scale, backend: str, block_sizes, is_causal,
            layout: str, local_window_size, bidirectional, ring_size: int, local: bool,
            platform: str, device):
  """Everything both entry points do before the ring: check, pick the backend, resolve tiles.

  Args:
    query, key, value, segment_ids, scale, backend, block_sizes, is_causal, layout,
      local_window_size, bidirectional: as the public API takes them.
    ring_size: devices along the ring axis.
    local: the arrays are per-device shards (ring_attention_sharded).
    platform, device: where the attention runs (the mesh's devices).

  Returns:
    (Checked, the backend module, the KernelSpec).

  Raises:
    ValueError: naming the argument, before any collective.
  """
  checked = check_inputs(query, key, value, segment_ids=segment_ids, scale=scale,
                         backend=backend, ring_size=ring_size, local=local, layout=layout,
                         local_window_size=local_window_size, bidirectional=bidirectional)
  kernel = get_backend(resolve_backend(checked.backend, platform, device))
  per_device = 1 if local else ring_size
  q_unit, kv_unit = block_units(block_sizes, checked.layout, checked.bidirectional, ring_size,
                                query.shape[1] // per_device, key.shape[1] // per_device)
  spec = resolve_spec(
      kernel, scale=checked.scale, causal=bool(is_causal), block_sizes=block_sizes,
      q_len=q_unit, kv_len=kv_unit, head_dim=query.shape[3], kv_heads=key.shape[2],
      group=query.shape[2] // key.shape[2], dtype=query.dtype, platform=platform,
      device_kind=getattr(device, "device_kind", ""), window=checked.window)
  return checked, kernel, spec


def resolve_spec(kernel, *, scale: float, causal: bool, block_sizes, q_len: int, kv_len: int,
                 head_dim: int, kv_heads: int, group: int, dtype, platform: str,
                 device_kind: str,
                 window: tuple[int, int] | None = None) -> base.KernelSpec:
  """The kernel spec: tile sizes from the backend (its defaults, or the user's, checked).

  q_len, kv_len: the runs tiles must divide (local lengths, or block_units of them).
  kv_heads, group: K and N // K; kernels stacking a group's scores, or several kv heads per
  block, size tiles by them.
  Pallas backends run in interpret mode when the devices are CPUs.
  """
  if block_sizes is None:
    block_sizes = base.BlockSizes()
  elif not isinstance(block_sizes, base.BlockSizes):
    raise ValueError(f"block_sizes must be a ringflash.BlockSizes or None, got "
                     f"{type(block_sizes).__name__}")
  bq, bk = kernel.resolve_block_sizes(block_sizes, q_len, kv_len, head_dim=head_dim,
                                      kv_heads=kv_heads, group=group, dtype=jnp.dtype(dtype),
                                      device_kind=device_kind)
  interpret = kernel.NAME != "xla" and platform == "cpu"
  return base.KernelSpec(scale=scale, causal=causal, block_q=bq, block_k=bk,
                         interpret=interpret, window=window)
