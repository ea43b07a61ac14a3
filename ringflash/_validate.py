"""Input validation for the public API: one place, at trace time, before any collective."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ringflash import layouts
from ringflash.kernels import BACKENDS
from ringflash.kernels import base
from ringflash.kernels import get_backend
from ringflash.kernels import tiles
from ringflash.parallel.plan import RingSpec

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
  return_residual: bool = False


def _shape(x, name):
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  if shape is None or dtype is None:
    raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  return tuple(shape), jnp.dtype(dtype)


def check_flag(name: str, value) -> bool:
  """A Python (or NumPy) bool, as bool; anything else is a ValueError naming the argument
  (is_causal="false" must not mean causal)."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
  return bool(value)


def check_inputs(query, key, value, *, segment_ids, scale, backend, ring_size: int,
                 local: bool, layout: str = "contiguous", local_window_size=None,
                 bidirectional: bool = False, is_causal: bool = False,
                 return_residual: bool = False) -> Checked:
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
  for name, flag in (("is_causal", is_causal), ("return_residual", return_residual),
                     ("bidirectional", bidirectional)):
    check_flag(name, flag)
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
  local_s = s if local else s // ring_size
  if bidirectional and ring_size > 1 and local_s % 2:
    raise ValueError(f"bidirectional=True splits each device's keys in two halves; the local "
                     f"key length must be even, got {local_s}")
  return Checked(scale=scale, q_seg=q_seg, kv_seg=kv_seg, backend=backend, layout=layout,
                 window=window, bidirectional=bool(bidirectional),
                 return_residual=bool(return_residual))


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


def tile_units(layout: str, bidirectional: bool, ring_size: int, q_len: int,
               kv_len: int) -> tuple[int, int]:
  """The runs of rows that tiles must divide, from LOCAL lengths: (query, key).

  zigzag: each device's rows are two chunks, so tiles divide the half (local 64 -> 32);
  bidirectional: the keys travel in two halves, so key tiles divide the half.
  """
  if layout == "zigzag":
    return q_len // 2, kv_len // 2
  if bidirectional and ring_size > 1:
    return q_len, kv_len // 2
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


# Per platform, the backends "auto" tries, fastest first; it takes the first that supports
# the call (each backend's `unsupported`; README.md, "Backends", has the table).
AUTO_ORDER = {"tpu": ("pallas_tpu", "xla"), "gpu": ("pallas_gpu", "xla"), "cpu": ("xla",)}


def _major(compute_capability) -> int | None:
  try:
    return int(str(compute_capability).split(".")[0])
  except ValueError:
    return None


def resolve_backend(backend: str, problem: base.Problem) -> str:
  """The backend to run: `backend` itself, or for "auto" the fastest that supports the call.

  "auto" follows the platform of the devices the attention runs on (the mesh's), not
  jax.default_backend(): a CPU host compiling for TPU topology devices gets the TPU kernel.
  An explicitly named backend never falls back: it runs the call or raises.

  Raises:
    NotImplementedError: the named backend cannot run `problem` (naming it and the
      feature).
    RuntimeError: "auto" on a GPU whose compute capability cannot be read.
  """
  if backend != "auto":
    reason = get_backend(backend).unsupported(problem)
    if reason is not None:
      raise NotImplementedError(reason)
    return backend
  platform = "gpu" if problem.platform == "cuda" else problem.platform
  if platform == "gpu" and _major(problem.compute_capability) is None:
    raise RuntimeError(
        f"backend='auto' cannot read the compute capability of the GPU ({problem.device_kind!r}"
        f" reports {problem.compute_capability!r}); name the backend: 'pallas_gpu' (compute "
        f"capability >= 9.0) or 'xla'")
  reasons = []
  for name in AUTO_ORDER.get(platform, ("xla",)):
    reason = get_backend(name).unsupported(problem)
    if reason is None:
      return name
    reasons.append(reason)
  raise NotImplementedError("no backend runs this call: " + "; ".join(reasons))


def prepare(query, key, value, *, segment_ids, scale, backend: str, block_sizes, is_causal,
            layout: str, local_window_size, bidirectional, ring_size: int, local: bool,
            axis_name: str, platform: str, device,
            return_residual: bool = False) -> tuple[Checked, RingSpec]:
  """Everything both entry points check and resolve before the ring, once.

  Args:
    query, key, value, segment_ids, scale, backend, block_sizes, is_causal, layout,
      local_window_size, bidirectional: as the public API takes them.
    ring_size: devices along the ring axis.
    local: the arrays are per-device shards (ring_attention_sharded).
    axis_name: the ring's mesh axis.
    platform, device: where the attention runs (the mesh's devices).

  Returns:
    (Checked, the RingSpec the ring runs).

  Raises:
    ValueError: naming the argument, before any collective.
    NotImplementedError: the backend cannot run this call.
  """
  checked = check_inputs(query, key, value, segment_ids=segment_ids, scale=scale,
                         backend=backend, ring_size=ring_size, local=local, layout=layout,
                         local_window_size=local_window_size, bidirectional=bidirectional,
                         is_causal=is_causal, return_residual=return_residual)
  per_device = 1 if local else ring_size
  q_unit, kv_unit = tile_units(checked.layout, checked.bidirectional, ring_size,
                               query.shape[1] // per_device, key.shape[1] // per_device)
  problem = base.Problem(
      q_len=q_unit, kv_len=kv_unit, head_dim=query.shape[3], kv_heads=key.shape[2],
      group=query.shape[2] // key.shape[2], dtype=jnp.dtype(query.dtype), platform=platform,
      device_kind=getattr(device, "device_kind", "") or "",
      compute_capability=getattr(device, "compute_capability", None),
      causal=bool(is_causal), window=checked.window, segments=checked.q_seg is not None)
  name = resolve_backend(checked.backend, problem)
  spec = resolve_spec(get_backend(name), problem, scale=checked.scale,
                      block_sizes=block_sizes)
  ring = RingSpec(kernel=spec, backend=name, axis_name=axis_name, ring_size=ring_size,
                  layout=checked.layout, bidirectional=checked.bidirectional)
  return checked, ring


def resolve_spec(kernel, problem: base.Problem, *, scale: float,
                 block_sizes) -> base.KernelSpec:
  """The kernel spec: the backend's tiles (its defaults, or the user's, checked).

  Pallas backends run in interpret mode when the devices are CPUs.

  Raises:
    ValueError: naming block_sizes, when it is not the backend's configuration or its
      sizes do not tile the local lengths.
  """
  want = tiles.BY_BACKEND[kernel.NAME]
  if block_sizes is not None and not isinstance(block_sizes, want):
    raise ValueError(f"block_sizes must be a ringflash.{want.__name__} or None for backend "
                     f"{kernel.NAME!r}, got {type(block_sizes).__name__}")
  resolved = kernel.resolve_tiles(block_sizes, problem)
  return base.KernelSpec(scale=scale, causal=problem.causal, tiles=resolved,
                         interpret=kernel.NAME != "xla" and problem.interpret,
                         window=problem.window)
