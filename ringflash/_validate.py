"""Input validation for the public API: one place, at trace time, before any collective.

`check_call` checks the arrays and options as the user gives them ([..., T, N, H], lengths,
sinks, ...) and says how they map onto the canonical [B, T, N, H] problem (`Call`);
`prepare` then resolves the backend, its tiles and the strategy's static spec. Lower layers
assert; they do not check again.
"""

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
from ringflash.parallel import plan as ring_plan
from ringflash.parallel import strategies
from ringflash.parallel.allgather import GatherSpec
from ringflash.parallel.hybrid import HybridSpec
from ringflash.parallel.local import LocalSpec
from ringflash.parallel.plan import RingSpec
from ringflash.parallel.ulysses import UlyssesSpec

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
STRATEGIES = ("auto", "ring", "allgather", "ulysses", "hybrid")


@dataclasses.dataclass(frozen=True)
class Call:
  """One call, checked: how the user's arrays map onto the canonical problem, and options.

  Attributes:
    lead: the leading batch dims of query ((): the arrays have no batch dim).
    t, s: query and key lengths as given (global for ring_attention, local for
      ring_attention_sharded).
    n, k, h, hv: query heads, kv heads, query/key head dim, value head dim.
    scale, softcap, window: resolved scores options.
    layout, bidirectional, is_causal, return_residual: as given, checked.
    segments, lengths, sinks: which optional arrays were given (q_lengths, kv_lengths).
  """

  lead: tuple[int, ...]
  t: int
  s: int
  n: int
  k: int
  h: int
  hv: int
  dtype: jnp.dtype
  scale: float
  softcap: float | None
  window: tuple[int, int] | None
  layout: str
  bidirectional: bool
  is_causal: bool
  return_residual: bool
  segments: bool
  q_lengths: bool
  kv_lengths: bool
  sinks: bool
  backend: str
  strategy: str
  head_shards: int = 1      # per_device's view: the devices of other axes the heads split over

  @property
  def batch(self) -> int:
    return int(np.prod(self.lead, dtype=np.int64)) if self.lead else 1

  @property
  def masked_by_ids(self) -> bool:
    """Whether the kernels see segment ids (user segments, lengths, or padding)."""
    return self.segments or self.q_lengths or self.kv_lengths


def check_flag(name: str, value) -> bool:
  """A Python (or NumPy) bool, as bool; anything else is a ValueError naming the argument
  (is_causal="false" must not mean causal)."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
  return bool(value)


def array_shape(x, name):
  """(shape, dtype) of an array argument, its sizes concrete.

  Raises:
    ValueError: `x` is not an array.
    NotImplementedError: a size is symbolic (jax.export's shape polymorphism): tiles, ring
      steps and padding are chosen from the sizes, so each must be known when tracing.
  """
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  if shape is None or dtype is None:
    raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  shape = tuple(shape)
  symbolic = [str(d) for d in shape if not isinstance(d, (int, np.integer))]
  if symbolic:
    raise NotImplementedError(
        f"{name} has symbolic (shape-polymorphic) size(s) {', '.join(symbolic)} in shape "
        f"({', '.join(map(str, shape))}): ringflash chooses tiles, ring steps and padding from "
        f"the sizes, so it needs concrete ones; export with concrete shapes")
  return shape, jnp.dtype(dtype)


def check_jit_arguments(**arrays) -> None:
  """Each array argument (None where it is optional; a tuple or list of them, as segment_ids'
  pair) must be something jax.jit takes: an array or a number. Validation names the rest
  when it traces, but a value jit cannot take at all (a string, an arbitrary object) was
  JAX's TypeError, naming ringflash's internal program before the argument's path.

  Raises:
    ValueError: naming the first argument that holds such a value, before anything runs.
  """
  for name, x in arrays.items():
    for leaf in jax.tree.leaves(x):
      try:
        jax.typeof(leaf)
      except TypeError:
        raise ValueError(f"{name} must be an array, got {type(leaf).__name__}") from None


INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
# The longest sequence ring_attention takes (whole, over the ring): its positions are int32,
# and a length that does not fit the ring or the tiles is padded up past it.
MAX_TOKENS = 2**30


def int32_clipped(x, lower: int = 0, upper: int = INT32_MAX):
  """An integer array of lengths or positions as int32, clipped to [lower, upper] in its own
  dtype first, so that a value past int32's range (int64, uint32) keeps its meaning (a
  length past int32 still means "every position") instead of the wrapped value that a plain
  conversion gives: jnp.asarray wraps NumPy's int64 without a word, and so does a jit
  boundary. NumPy arrays and scalars are clipped on the host, before anything converts
  them; anything that is not an integer array is returned as it is, for validation to name.
  With the default bounds, negative lengths mean 0, as in jax.nn."""
  if isinstance(x, (np.ndarray, np.generic)):
    if not np.issubdtype(x.dtype, np.integer):
      return x
    info = np.iinfo(x.dtype)
    return np.clip(x, max(info.min, lower), min(info.max, upper)).astype(np.int32)
  if getattr(x, "dtype", None) is None or not jnp.issubdtype(x.dtype, jnp.integer):
    return x
  info = jnp.iinfo(x.dtype)
  return jnp.clip(x, max(info.min, lower), min(info.max, upper)).astype(jnp.int32)


# The largest scale and soft-cap: float32's largest finite number (the kernels compute scores
# in float32; a larger Python float becomes inf there, and finite inputs then gave NaN).
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The largest soft-cap. The kernels divide each score by the cap in float32, whose denormals
# are flushed to zero: a score below cap * 1.2e-38 becomes 0 (tanh(0) = 0). Up to 1e30 that
# is below 1.2e-8, far under a score's rounding; at 1e38 every score of a row became 0, a
# uniform softmax. A cap this large has no effect on any score: pass None.
SOFT_CAP_MAX = 1e30


def positive_number(name, value, upper: float = FLOAT32_MAX, why: str = "float32's largest"):
  if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
    raise ValueError(f"{name} must be a Python number, got {type(value).__name__}")
  try:
    value = float(value)
  except OverflowError:                     # an int past float's range
    raise ValueError(f"{name} must be finite and > 0, got an integer of "
                     f"{int(value).bit_length()} bits") from None
  if not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be finite and > 0, got {value}")
  if value > upper:
    raise ValueError(f"{name} must be at most {upper:g} ({why}), got {value:g}")
  return value


def soft_cap(value):
  """logits_soft_cap checked: None, or a number in (0, SOFT_CAP_MAX]."""
  if value is None:
    return None
  return positive_number("logits_soft_cap", value, SOFT_CAP_MAX,
                         "float32 flushes score / cap to 0 below cap * 1.2e-38; a cap past "
                         "it changes no score: pass None")


def check_call(query, key, value, *, segment_ids=None, scale=None, backend="auto",
               ring_size: int, local: bool, layout: str = "contiguous",
               local_window_size=None, bidirectional=False, is_causal=False,
               return_residual=False, sinks=None, logits_soft_cap=None,
               query_seq_lengths=None, key_value_seq_lengths=None, strategy="auto",
               pads: bool = False) -> Call:
  """Checks the arrays and options as the user gives them.

  Args:
    query: [..., T, N, H] (no, one or several leading batch dims, as jax.nn accepts).
    key: [..., S, K, H]; value: [..., S, K, Hv], the same leading dims; N % K == 0.
    segment_ids: None, one [..., T] int array (T == S), or a pair ([..., T], [..., S]).
    scale, logits_soft_cap: None or a finite number > 0.
    backend: "auto" or one of kernels.BACKENDS.
    ring_size: devices along the ring axis.
    local: the arrays are per-device shards (ring_attention_sharded): lengths are local.
    layout: "contiguous", "zigzag" or "striped".
    local_window_size: None, int w (meaning (w, w)) or (left, right), non-negative.
    bidirectional, is_causal, return_residual: bools.
    sinks: None or a [N] float array.
    query_seq_lengths, key_value_seq_lengths: None or [...] int arrays (the leading dims).
    strategy: one of STRATEGIES.
    pads: the caller pads a sequence that does not fit the layout on the ring (a length
      not divisible by the ring size, by twice it for zigzag): ring_attention does;
      ring_attention_sharded takes shards as they are.

  Raises:
    ValueError: naming the argument, with expected vs got.
  """
  for name, flag in (("is_causal", is_causal), ("return_residual", return_residual),
                     ("bidirectional", bidirectional)):
    check_flag(name, flag)
  (qs, qd), (ks, kd), (vs, vd) = (array_shape(query, "query"), array_shape(key, "key"),
                                  array_shape(value, "value"))
  if len(qs) < 3:
    raise ValueError(f"query must have rank >= 3 [..., T, N, H], got shape {qs}")
  for name, shape, form in (("key", ks, "[..., S, K, H]"), ("value", vs, "[..., S, K, Hv]")):
    if len(shape) != len(qs):
      raise ValueError(f"{name} must have query's rank {len(qs)} {form}, got shape {shape}")
  for name, dtype in (("query", qd), ("key", kd), ("value", vd)):
    if dtype not in FLOAT_DTYPES:
      raise ValueError(f"{name}.dtype must be float32, bfloat16 or float16, got {dtype}")
  if kd != qd or vd != qd:
    raise ValueError(f"query, key and value must share a dtype, got query={qd}, key={kd}, "
                     f"value={vd}")
  lead, (t, n, h) = qs[:-3], qs[-3:]
  s, k, hk = ks[-3:]
  hv = vs[-1]
  if ks[:-3] != lead:
    raise ValueError(f"key batch dims must equal query's: expected {lead}, got {ks[:-3]}")
  if vs[:-1] != ks[:-1]:
    raise ValueError(f"value must have key's shape but for its head dim ([..., S, K, Hv]), "
                     f"got key={ks}, value={vs}")
  if hk != h:
    raise ValueError(f"key head_dim must equal query head_dim: expected {h}, got {hk}")
  if k == 0 or n % k:
    raise ValueError(f"query heads N must be a multiple of key heads K (GQA/MQA), got "
                     f"N={n}, K={k}")
  if min(qs) == 0 or min(ks) == 0 or hv == 0:
    raise ValueError(f"query, key and value must be non-empty, got query={qs}, key={ks}, "
                     f"value={vs}")
  for name, length in (("query", t), ("key", s)):
    whole = length * (ring_size if local else 1)
    if whole > MAX_TOKENS:
      raise ValueError(
          f"{name} sequence length must be at most 2**30 = {MAX_TOKENS} tokens (positions "
          f"are int32, with room for the padding), got {whole}" + (
              f" ({length} on each of the {ring_size} devices)" if local else ""))
  scale = 1.0 / math.sqrt(h) if scale is None else positive_number("scale", scale)
  softcap = soft_cap(logits_soft_cap)
  segments = _check_segments(segment_ids, lead, t, s)
  for name, lengths in (("query_seq_lengths", query_seq_lengths),
                        ("key_value_seq_lengths", key_value_seq_lengths)):
    if lengths is None:
      continue
    shape, dtype = array_shape(lengths, name)
    if shape != lead:
      raise ValueError(f"{name} must have the batch shape {lead}, got {shape}")
    if not jnp.issubdtype(dtype, jnp.integer):
      raise ValueError(f"{name} must have an integer dtype, got {dtype}")
  check_sinks(sinks, n)
  if backend != "auto" and backend not in BACKENDS:
    raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {backend!r}")
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")

  scale_t = ring_size if local else 1        # local lengths -> global lengths
  for name, length in (("query", t), ("key", s)):
    if pads:
      layouts.check_layout(layout, 1, 0)
      continue
    layouts.check_layout(layout, ring_size, length * scale_t,
                         length_name=f"{name} sequence length" + (
                             f" ({length} per device)" if local else ""))
  window = check_window(local_window_size, t * scale_t, s * scale_t)
  return Call(lead=lead, t=t, s=s, n=n, k=k, h=h, hv=hv, dtype=qd, scale=scale,
              softcap=softcap, window=window, layout=layout,
              bidirectional=bool(bidirectional), is_causal=bool(is_causal),
              return_residual=bool(return_residual), segments=segments,
              q_lengths=query_seq_lengths is not None,
              kv_lengths=key_value_seq_lengths is not None, sinks=sinks is not None,
              backend=backend, strategy=strategy)


def check_sinks(sinks, n: int) -> None:
  """None, or a [N] floating array: one sink logit per query head.

  Raises:
    ValueError: naming sinks.
  """
  if sinks is None:
    return
  shape, dtype = array_shape(sinks, "sinks")
  if shape != (n,):
    raise ValueError(f"sinks must have shape [N] = ({n},), one logit per query head, got "
                     f"{shape}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"sinks must have a floating dtype, got {dtype}")


def check_window(local_window_size, t: int, s: int, name: str = "local_window_size"):
  """(left, right) from jax.nn's local_window_size (int w means (w, w)), or None; errors
  name the argument `name`.

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
    raise ValueError(f"{name} must be None, an int or a pair (left, right) of ints, got "
                     f"{local_window_size!r}")
  if min(pair) < 0:
    raise ValueError(f"{name} must be non-negative, got {local_window_size!r}")
  return (int(min(pair[0], t)), int(min(pair[1], s)))


def _check_segments(segment_ids, lead, t, s) -> bool:
  if segment_ids is None:
    return False
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(f"segment_ids must be one [..., T] array or a pair (q_ids [..., T], "
                       f"kv_ids [..., S]), got a sequence of {len(segment_ids)}")
    q_ids, kv_ids = segment_ids
  else:
    if t != s:
      raise ValueError(f"segment_ids as one array needs T == S (self-attention); with T={t}, "
                       f"S={s} pass a pair (q_ids [..., T], kv_ids [..., S])")
    q_ids = kv_ids = segment_ids
  for name, ids, expected in (("segment_ids (query)", q_ids, lead + (t,)),
                              ("segment_ids (key/value)", kv_ids, lead + (s,))):
    shape, dtype = array_shape(ids, name)
    if shape != expected:
      raise ValueError(f"{name} must have shape {expected}, got {shape}")
    if not jnp.issubdtype(dtype, jnp.integer):
      raise ValueError(f"{name} must have an integer dtype, got {dtype}")
  return True


def check_segment_values(segment_ids) -> None:
  """Segment ids the caller holds concretely must lie strictly inside int32's range (its two
  ends mark padding, and a wider dtype would wrap on conversion, merging segments): checked
  for NumPy arrays, and for concrete JAX arrays of a dtype wider than int32 (a copy to the
  host, only for those). Traced ids cannot be read; the docstring states the rule."""
  pairs = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids,)
  for ids in pairs:
    if isinstance(ids, (np.ndarray, np.generic)):
      host = ids
    elif (isinstance(ids, jax.Array) and not isinstance(ids, jax.core.Tracer)
          and jnp.issubdtype(ids.dtype, jnp.integer)
          and jnp.iinfo(ids.dtype).bits >= 32 and ids.dtype != jnp.int32
          and ids.is_fully_addressable):
      host = np.asarray(ids)
    else:
      continue
    if not np.issubdtype(host.dtype, np.integer) or host.size == 0:
      continue                                          # named by _check_segments
    low, high = int(host.min()), int(host.max())
    if low <= INT32_MIN or high >= INT32_MAX:
      raise ValueError(f"segment_ids must lie strictly between {INT32_MIN} and {INT32_MAX} "
                       f"(the ends of int32 mark padding), got ids from {low} to {high}")


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


# Per platform, the backends "auto" tries, fastest first; it takes the first that supports
# the call (each backend's `unsupported`; README.md, "Backends", has the table).
AUTO_ORDER = {"tpu": ("pallas_tpu", "xla"), "gpu": ("pallas_gpu", "xla"), "cpu": ("xla",)}


def _major(compute_capability) -> int | None:
  try:
    return int(str(compute_capability).split(".")[0])
  except ValueError:
    return None


def candidates(backend: str, platform: str, compute_capability, device_kind: str = ""):
  """The backends to try, in order: the named one alone, or "auto"'s order.

  Raises:
    RuntimeError: "auto" on a GPU whose compute capability cannot be read.
  """
  if backend != "auto":
    return (backend,)
  platform = "gpu" if platform == "cuda" else platform
  if platform == "gpu" and _major(compute_capability) is None:
    raise RuntimeError(
        f"backend='auto' cannot read the compute capability of the GPU ({device_kind!r} "
        f"reports {compute_capability!r}); name the backend: 'pallas_gpu' (compute "
        f"capability >= 9.0) or 'xla'")
  return AUTO_ORDER.get(platform, ("xla",))


def resolve_backend(backend: str, problem: base.Problem) -> str:
  """The backend to run: `backend` itself, or for "auto" the fastest that supports the call.

  "auto" follows the platform of the devices the attention runs on (the mesh's), not
  jax.default_backend(): a CPU host compiling for TPU topology devices gets the TPU kernel.
  An explicitly named backend never falls back: it runs the call or raises.

  Raises:
    NotImplementedError: no candidate can run `problem` (naming each and the feature).
    RuntimeError: "auto" on a GPU whose compute capability cannot be read.
  """
  reasons = []
  for name in candidates(backend, problem.platform, problem.compute_capability,
                         problem.device_kind):
    reason = get_backend(name).unsupported(problem)
    if reason is None:
      return name
    reasons.append(reason)
  if backend != "auto":
    raise NotImplementedError(reasons[0])
  raise NotImplementedError("no backend runs this call: " + "; ".join(reasons))


def local_lengths(call: Call, ring_size: int, kernel, local: bool):
  """The (query, key) lengths per device to try for `kernel`, in order.

  ring_attention_sharded (local) runs the shards as given. ring_attention pads a sequence
  at its end where its length does not fit the layout on the ring or the backend's
  kernels: the contiguous layout always rounds each device's share up to the backend's
  LENGTH_MULTIPLE (the smallest local length its kernels tile); zigzag and striped try the
  even split first, where there is one, and then the padded one (a zigzag chunk, half a
  device's share, a multiple of LENGTH_MULTIPLE), so that "auto" keeps the native kernel
  where padding lets it run. The bidirectional ring halves each device's keys: an even split
  with an odd share (6 striped tokens on 2 devices: 3 each) is no candidate, only the padded
  one (4 each).
  """
  if local:
    return [(call.t, call.s)]
  multiple = getattr(kernel, "LENGTH_MULTIPLE", 1)
  if call.layout == "zigzag":
    multiple *= 2
  if call.bidirectional and ring_size > 1:
    multiple = math.lcm(multiple, 2)
  padded = (padded_local(call.t, ring_size, multiple),
            padded_local(call.s, ring_size, multiple))
  fits = all(ring_plan.fitting_length(call.layout, ring_size, n) == n
             for n in (call.t, call.s))
  if call.layout == "contiguous" or not fits:
    return [padded]
  even = (call.t // ring_size, call.s // ring_size)
  if call.bidirectional and ring_size > 1 and even[1] % 2:
    return [padded]
  return [even] if even == padded else [even, padded]


def padding_needs_ids(call: Call, t_len: int, s_len: int) -> bool:
  """Whether the padding of a sequence run at global lengths (t_len, s_len) must be masked by
  segment ids (PAD_Q / PAD_K, ringflash/_inputs.py): not where the causal mask hides it.

  Padding keys lie at positions >= S (call.s), which no real query (positions < T <= S)
  reaches under a causal mask; padding query rows are trimmed, and their zero cotangents carry
  nothing back (kernels/base.guard_backward), also where they saw a NaN. Without ids the
  kernels skip their id masks and the tile plans computed from ids at run time (6% of the
  causal forward at T = 16379 on the H200, docs/GPU_NOTES.md run 96), at the price of the
  padding rows' own work, so only while they are at most a sixteenth of T.
  """
  if t_len == call.t and s_len == call.s:
    return False
  hidden = call.is_causal and call.s >= call.t and 16 * (t_len - call.t) <= call.t
  return not hidden


def padded_local(length: int, ring_size: int, multiple: int) -> int:
  """The per-device length a contiguous sequence of `length` tokens is padded to: the
  smallest multiple of `multiple` with ring_size of them covering it."""
  per = -(-length // ring_size)
  return -(-per // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What `prepare` resolved: the strategy's static spec and the padded local lengths."""

  spec: strategies.Spec
  t_local: int              # per device, after padding (ring_attention_sharded: as given)
  s_local: int

  @property
  def backend(self) -> str:
    return strategies.backend_of(self.spec)

  @property
  def strategy(self) -> str:
    return strategies.name_of(self.spec)

  @property
  def kernel(self) -> base.KernelSpec:
    return strategies.kernel_spec(self.spec)


@dataclasses.dataclass(frozen=True)
class SeqAxes:
  """The mesh axes the sequence is sharded over: names (first major) and sizes."""

  names: tuple[str, ...]
  sizes: tuple[int, ...]

  @property
  def size(self) -> int:
    return int(np.prod(self.sizes))

  @property
  def axis_name(self):
    """What collectives take: the name, or the tuple of names."""
    return self.names[0] if len(self.names) == 1 else self.names


def strategy_problem(strategy: str, call: Call, axes: SeqAxes, t_local: int, s_local: int):
  """(q rows, key rows, kv heads, query heads per kv head) the strategy's kernel calls see on
  one device, and the run of rows tiles must divide: ((q_len, kv_len), kv_heads, group).

  ring: the local shard against each piece (halved for zigzag chunks or bidirectional
  halves); allgather: the local shard (halved for zigzag chunks) against the whole
  sequence; ulysses: the whole sequence, N / P query heads; hybrid: the ring over the runs
  gathered by the Ulysses axis, N / U query heads. allgather's keys and ulysses' rows are
  put in natural order before the kernel (parallel.plan.to_natural), so tiles may span
  the shards they were gathered from: their sizes divide the gathered length, not T / P.
  """
  p, k, g = axes.size, call.k, call.n // call.k
  chunk = 2 if call.layout == "zigzag" else 1
  if strategy == "ring":
    units = tile_units(call.layout, call.bidirectional, p, t_local, s_local)
    return units, k, g
  if strategy == "allgather":
    return (t_local // chunk, s_local * p), k, g
  size = p if strategy == "ulysses" else axes.sizes[-1]
  kv_heads = max(k // size, 1)
  group = (call.n // size) // kv_heads
  if strategy == "ulysses":
    return (t_local * p, s_local * p), kv_heads, group
  ring_size = p // size
  units = tile_units(call.layout, call.bidirectional, ring_size, t_local * size,
                     s_local * size)
  if call.layout == "zigzag":      # the gathered run holds 2 U chunks
    units = (t_local // 2, s_local // 2)
  return units, kv_heads, group


def _tiled_rows(strategy: str, units: tuple[int, int], local: tuple[int, int]) -> str | None:
  """Which rows a kernel call tiles, for a refusal of block_sizes that quotes their lengths:
  None where they are a device's share, and under hybrid (not described)."""
  if strategy == "hybrid" or (strategy == "ring" and units == local):
    return None

  chunk = "a zigzag chunk of a device's share"
  q = ("the whole sequence" if strategy == "ulysses" else
       chunk if units[0] < local[0] else "a device's share")
  if strategy != "ring":
    k = "the whole sequence, gathered"
  elif units[0] < local[0]:
    k = chunk
  else:
    k = "half a device's share, as the bidirectional ring passes it"
  return f"a kernel call tiles {units[0]} query rows ({q}) and {units[1]} key rows ({k})"


def _strategy_spec(strategy: str, kernel_spec: base.KernelSpec, backend: str, call: Call,
                   axes: SeqAxes):
  local_spec = LocalSpec(kernel=kernel_spec, backend=backend)
  if strategy == "ring":
    return RingSpec(kernel=kernel_spec, backend=backend, axis_name=axes.axis_name,
                    ring_size=axes.size, layout=call.layout, bidirectional=call.bidirectional)
  if strategy == "allgather":
    return GatherSpec(local=local_spec, axis_name=axes.axis_name, size=axes.size,
                      layout=call.layout)
  if strategy == "ulysses":
    return UlyssesSpec(local=local_spec, axis_name=axes.axis_name, size=axes.size,
                       layout=call.layout)
  ring_names = axes.names[:-1]
  ring = RingSpec(kernel=kernel_spec, backend=backend,
                  axis_name=ring_names[0] if len(ring_names) == 1 else ring_names,
                  ring_size=axes.size // axes.sizes[-1], layout=call.layout,
                  bidirectional=call.bidirectional, group=axes.sizes[-1])
  return HybridSpec(ring=ring, ulysses_axis=axes.names[-1], ulysses_size=axes.sizes[-1])


def per_device(call: Call, shards: tuple[int, int] = (1, 1), *, ring_size: int = 1) -> Call:
  """The call as one group of the sequence axes runs it, with global lengths: the batch and
  the heads divided by the devices of the other mesh axes that split them (shards: batch,
  heads; _mesh.check_divisible), and local lengths (ring_attention_sharded's) times the
  ring. What the strategies' head rules and the cost model read."""
  bs, hs = shards
  return dataclasses.replace(
      call, lead=call.lead if bs == 1 else (call.batch // bs,), n=call.n // hs,
      k=call.k // hs, t=call.t * ring_size, s=call.s * ring_size,
      head_shards=call.head_shards * hs)


def prepare(call: Call, *, block_sizes, axes: SeqAxes, local: bool, platform: str,
            device, strategy: str | None = None,
            shards: tuple[int, int] = (1, 1)) -> Prepared:
  """Resolves the strategy, the backend (the fastest that runs the call, or the named one),
  its tiles, the padding of the sequence (local_lengths) and the strategy's static spec,
  once.

  Args:
    strategy: the strategy to run (a name); None: the call's (resolved by `choose` for
      "auto").
    shards: the devices of other mesh axes that the batch and the heads are split over
      (ring_attention's; inside a caller's shard_map the shapes are already per device).

  Raises:
    ValueError: naming block_sizes, when its sizes do not fit; naming the key length, when
      bidirectional=True cannot halve a ring member's keys.
    NotImplementedError: the strategy or the backend cannot run this call.
  """
  call = per_device(call, shards)
  strategy = strategy or call.strategy
  if strategy == "auto":
    from ringflash.parallel import cost  # pylint: disable=g-import-not-at-top
    strategy = cost.choose(per_device(call, ring_size=axes.size if local else 1), axes,
                           platform=platform, device=device).strategy
  why = strategies.unsupported(strategy, call, axes)
  if why is not None:
    raise NotImplementedError(why)
  p = axes.size
  if local and call.bidirectional and strategy in ("ring", "hybrid"):
    # a ring member holds the device's keys (hybrid: those of its Ulysses group)
    member = call.s * (axes.sizes[-1] if strategy == "hybrid" else 1)
    if p > (axes.sizes[-1] if strategy == "hybrid" else 1) and member % 2:
      raise ValueError(f"bidirectional=True splits each ring member's keys in two halves; the "
                       f"local key length must be even, got {call.s}" + (
                           f" ({member} in a member of the hybrid ring)"
                           if strategy == "hybrid" else ""))
  device_kind = getattr(device, "device_kind", "") or ""
  cc = getattr(device, "compute_capability", None)
  reasons = []
  for name in candidates(call.backend, platform, cc, device_kind):
    kernel = get_backend(name)
    reason = None
    for t_local, s_local in local_lengths(call, p, kernel, local):
      (q_unit, kv_unit), kv_heads, group = strategy_problem(strategy, call, axes, t_local,
                                                            s_local)
      pad_ids = not local and padding_needs_ids(call, t_local * p, s_local * p)
      problem = base.Problem(
          q_len=q_unit, kv_len=kv_unit, head_dim=call.h, kv_heads=kv_heads, group=group,
          dtype=call.dtype, platform=platform, device_kind=device_kind,
          compute_capability=cc, causal=call.is_causal, window=call.window,
          segments=call.masked_by_ids or pad_ids, head_dim_v=call.hv, softcap=call.softcap)
      reason = kernel.unsupported(problem)
      if reason is None:
        try:
          kernel_spec = resolve_spec(kernel, problem, scale=call.scale, block_sizes=block_sizes)
        except ValueError as err:
          rows = _tiled_rows(strategy, (q_unit, kv_unit), (t_local, s_local))
          if rows is None or not isinstance(block_sizes, tiles.BY_BACKEND[name]):
            raise
          # The lengths it names are not the arguments' (gathered, halved): say which rows.
          raise ValueError(f"{err}; under strategy {strategy!r} {rows}") from None
        return Prepared(spec=_strategy_spec(strategy, kernel_spec, name, call, axes),
                        t_local=t_local, s_local=s_local)
    reasons.append(reason)
  if call.backend != "auto":
    raise NotImplementedError(reasons[0])
  raise NotImplementedError("no backend runs this call: " + "; ".join(reasons))


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
                         window=problem.window, softcap=problem.softcap)


def option_types(options) -> tuple:
  """The types of a frozen dataclass of options, for the key of a cache of compiled programs:
  0 == False and 5 == 5.0 in Python, but is_causal=0 and local_window_size=5.0 are errors,
  not the programs of False and 5."""
  def of(x):
    return tuple(of(e) for e in x) if isinstance(x, tuple) else type(x)
  return tuple(of(getattr(options, f.name)) for f in dataclasses.fields(options))
