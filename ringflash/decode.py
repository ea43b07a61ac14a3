"""decode_attention: a few new tokens against a KV cache sharded over a ring of devices.

The cache stays where it is: each device attends its own slots with the flash kernel and the
partial results combine exactly through their log-sum-exp in one reduction
(ringflash/parallel/decode.py has the worked example). ringflash.KVCache (ringflash/kvcache.py)
keeps such a cache: prefill from the ring, balanced appends, positions per slot.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.interpreters import ad
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ringflash import _inputs
from ringflash import _mesh
from ringflash import _validate
from ringflash.kernels import BACKENDS
from ringflash.kernels import base
from ringflash.kernels import get_backend
from ringflash.parallel import decode as decode_parallel

STRATEGIES = decode_parallel.STRATEGIES
# A device's share of the cache in a multiple of this many slots tiles on every backend (the
# GPU kernel's key tiles are 64, a TPU's local lengths multiples of 8), and lets split-KV cut
# it into runs.
SLOT_MULTIPLE = 128

_FORWARD_ONLY = ("decode_attention is forward only (decoding needs no gradient): it cannot be "
                 "differentiated")


def decode_attention(query, key_cache, value_cache, *, cache_lengths, mesh: Mesh,
                     axis_name: str = "sp", scale: float | None = None, sinks=None,
                     logits_soft_cap: float | None = None,
                     local_window_size: int | tuple[int, int] | None = None,
                     backend: str = "auto", block_sizes=None, cache_positions=None,
                     return_residual: bool = False, strategy: str = "reduce"):
  """Attention of t new tokens to a KV cache whose sequence is sharded over `axis_name`.

  Each device runs the kernel on the cache slots it holds; the per-device (out, lse) combine
  exactly in float32 through one max and one sum reduction over the axis. The cache is never
  moved. Masks: the new tokens sit at positions cache_lengths - t .. cache_lengths - 1 and see
  the cache causally (and within the window); a shard with nothing in range is skipped.

  Args:
    query: [B, t, N, H], t small; replicated over axis_name (batch and heads may be sharded
      over other mesh axes, as the caches' are).
    key_cache: [B, S_max, K, H], N % K == 0 (GQA/MQA), S_max divisible by the devices of
      axis_name; sharded along S over axis_name (device i holds slots i * S_max / P ...).
    value_cache: [B, S_max, K, Hv].
    cache_lengths: [B] int: valid length of each row, the new tokens included (their K/V
      are already in the cache). A row of length < t has queries at negative positions: they
      see nothing. Any int32; a wider value past int32's ends counts as that end.
    mesh: the device mesh.
    axis_name: the mesh axis (or tuple of axes, first major) the cache's sequence is sharded
      over.
    scale: multiplier of q.k; default 1/sqrt(H).
    sinks: None or [N] float: a per-head logit in every row's softmax denominator, no value.
    logits_soft_cap: None or cap > 0: scores become cap * tanh(scale * q.k / cap).
    local_window_size: None, int w or (left, right): query i sees keys i - left .. i (the
      right side is cut by causality).
    backend: "auto" (the fastest that runs the call on the mesh's devices), "xla",
      "pallas_tpu", "pallas_gpu" (named: runs or raises NotImplementedError).
    block_sizes: the backend's tile configuration (ringflash.XlaBlockSizes, ...), or None.
    cache_positions: None (slot s holds position s) or [B, S_max] int: the position of each
      slot, sharded like the caches; a free slot holds a position >= its row's length
      (ringflash.KVCache keeps this array). Positions at or past 2**30 count as free; a
      wider dtype's position below int32's smallest counts as it.
    return_residual: also return lse [B, N, t] float32 (with sinks: including them).
    strategy: "reduce" (the above), or the baselines "allgather" (every device gathers the
      whole cache) and "ring" (shards rotate around the ring), same result.

  Returns:
    out [B, t, N, Hv] in query's dtype, replicated over axis_name; with return_residual,
    (out, lse).

  Raises:
    ValueError: an invalid argument, naming it, before any collective runs.
    NotImplementedError: the backend cannot run the call; or differentiation (forward only).
  """
  options = _Options(axis_name=_mesh.frozen(axis_name), scale=scale,
                     logits_soft_cap=logits_soft_cap,
                     local_window_size=_mesh.frozen(local_window_size),
                     backend=backend, block_sizes=block_sizes,
                     return_residual=return_residual, strategy=strategy, guarded=False)
  return run(query, key_cache, value_cache, cache_lengths, cache_positions, sinks, mesh=mesh,
             options=options)


@dataclasses.dataclass(frozen=True)
class _Options:
  """decode_attention's keyword options, part of the key of the cache of compiled programs.
  guarded: the cache's K/V went through base.guard_kv when written (ringflash.KVCache), so
  the per-call guard, a pass over the whole shard, is left out."""

  axis_name: object
  scale: float | None
  logits_soft_cap: float | None
  local_window_size: object
  backend: str
  block_sizes: object
  return_residual: bool
  strategy: str
  guarded: bool


def _clipped_lengths(cache_lengths):
  """cache_lengths as int32 (_validate.int32_clipped: a wider value past int32's ends counts
  as that end); the mask (parallel/decode.visibility) takes any int32."""
  return _validate.int32_clipped(cache_lengths, _validate.INT32_MIN, _validate.INT32_MAX)


def _clipped_positions(cache_positions):
  """cache_positions as int32, a position at or past EMPTY counting as EMPTY (free)."""
  return _validate.int32_clipped(cache_positions, _validate.INT32_MIN, decode_parallel.EMPTY)


def run(query, key_cache, value_cache, cache_lengths, cache_positions, sinks, *, mesh,
        options: _Options, batch_axis=False, remedy="pass that mesh (mesh=...)"):
  """decode_attention with its options gathered (also what KVCache.attention calls).

  batch_axis: the mesh axes the batch is sharded over, when the caller knows them (a
  KVCache does); False: read off key_cache's sharding, as ring_attention does (inside jit
  on a mesh of Auto axes nothing is visible, and the batch is taken as unsharded).
  remedy: the advice of the error when mesh is not jax.set_mesh's context mesh.
  """
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  _mesh.check_context(mesh, remedy)
  named = dict(query=query, key_cache=key_cache, value_cache=value_cache,
               cache_lengths=cache_lengths, cache_positions=cache_positions, sinks=sinks)
  _validate.check_jit_arguments(**named)
  _mesh.check_placed(mesh, **named)
  _mesh.seq_axes(mesh.shape, options.axis_name)
  if any(isinstance(x, ad.JVPTracer) for x in jax.tree.leaves(
      (query, key_cache, value_cache, sinks))):
    raise NotImplementedError(_FORWARD_ONLY)
  if batch_axis is False:
    batch, heads = _mesh.outer_axes(key_cache, mesh, options.axis_name)
  else:
    batch, heads = batch_axis, None
  try:
    fn = _program(mesh, batch, heads, options, _validate.option_types(options))
  except TypeError:         # an unhashable option: no cache; validation names it
    fn = functools.partial(_decode, mesh=mesh, batch=batch, heads=heads, options=options)
  try:
    return fn(query, key_cache, value_cache, _clipped_lengths(cache_lengths),
              _clipped_positions(cache_positions), sinks)
  except TypeError as err:
    if "forward-mode" not in str(err):
      raise
    raise NotImplementedError(_FORWARD_ONLY) from None


@functools.lru_cache(maxsize=64)
def _program(mesh, batch, heads, options: _Options, types):
  del types                 # part of the key only
  return jax.jit(functools.partial(_decode, mesh=mesh, batch=batch, heads=heads,
                                   options=options))


@dataclasses.dataclass(frozen=True)
class _Call:
  """One decode call, checked."""

  b: int
  t: int
  n: int
  k: int
  h: int
  hv: int
  s_max: int
  dtype: jnp.dtype
  scale: float
  softcap: float | None
  window_left: int | None


def _array(x, name):
  return _validate.array_shape(x, name)


def check(query, key_cache, value_cache, cache_lengths, cache_positions, sinks, *,
          ring_size: int, options: _Options) -> _Call:
  """Every argument of decode_attention, checked, before any work.

  Raises:
    ValueError: naming the argument, with expected vs got.
  """
  _validate.check_flag("return_residual", options.return_residual)
  (qs, qd), (ks, kd), (vs, vd) = (_array(query, "query"), _array(key_cache, "key_cache"),
                                  _array(value_cache, "value_cache"))
  for name, shape, form in (("query", qs, "[B, t, N, H]"), ("key_cache", ks, "[B, S_max, K, H]"),
                            ("value_cache", vs, "[B, S_max, K, Hv]")):
    if len(shape) != 4:
      raise ValueError(f"{name} must have rank 4 {form}, got shape {shape}")
    if min(shape) == 0:
      raise ValueError(f"{name} must be non-empty, got shape {shape}")
  for name, dtype in (("query", qd), ("key_cache", kd), ("value_cache", vd)):
    if dtype not in _validate.FLOAT_DTYPES:
      raise ValueError(f"{name}.dtype must be float32, bfloat16 or float16, got {dtype}")
  if kd != qd or vd != qd:
    raise ValueError(f"query, key_cache and value_cache must share a dtype, got query={qd}, "
                     f"key_cache={kd}, value_cache={vd}")
  b, t, n, h = qs
  _, s_max, k, hk = ks
  if ks[0] != b or vs[0] != b:
    raise ValueError(f"key_cache and value_cache must have query's batch B={b}, got "
                     f"key_cache={ks}, value_cache={vs}")
  if vs[:3] != ks[:3]:
    raise ValueError(f"value_cache must have key_cache's shape but for its head dim "
                     f"([B, S_max, K, Hv]), got key_cache={ks}, value_cache={vs}")
  if hk != h:
    raise ValueError(f"key_cache head_dim must equal query head_dim: expected {h}, got {hk}")
  if n % k:
    raise ValueError(f"query heads N must be a multiple of key_cache heads K (GQA/MQA), got "
                     f"N={n}, K={k}")
  if s_max % ring_size:
    raise ValueError(f"key_cache length S_max={s_max} must be divisible by the {ring_size} "
                     f"devices of axis_name {options.axis_name!r}")
  if s_max >= decode_parallel.EMPTY:
    raise ValueError(f"key_cache length S_max={s_max} must be below {decode_parallel.EMPTY}")
  if t > s_max:
    raise ValueError(f"query has t={t} new tokens, more than the cache holds (S_max={s_max})")
  shape, dtype = _array(cache_lengths, "cache_lengths")
  if shape != (b,):
    raise ValueError(f"cache_lengths must have shape [B] = ({b},), got {shape}")
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"cache_lengths must have an integer dtype, got {dtype}")
  if cache_positions is not None:
    shape, dtype = _array(cache_positions, "cache_positions")
    if shape != (b, s_max):
      raise ValueError(f"cache_positions must have shape [B, S_max] = ({b}, {s_max}), got "
                       f"{shape}")
    if not jnp.issubdtype(dtype, jnp.integer):
      raise ValueError(f"cache_positions must have an integer dtype, got {dtype}")
  _validate.check_sinks(sinks, n)
  scale = 1.0 / h ** 0.5 if options.scale is None else _validate.positive_number(
      "scale", options.scale)
  softcap = _validate.soft_cap(options.logits_soft_cap)
  # A query's distance to a key it sees is below 2**32 (positions are any int32, not slots):
  # lefts past it change nothing.
  window = _validate.check_window(options.local_window_size, 2**32 - 1, s_max)
  if options.backend != "auto" and options.backend not in BACKENDS:
    raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {options.backend!r}")
  if options.strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {options.strategy!r}")
  return _Call(b=b, t=t, n=n, k=k, h=h, hv=vs[3], s_max=s_max, dtype=qd, scale=scale,
               softcap=softcap, window_left=None if window is None else window[0])


def prepare(call: _Call, *, options: _Options, ring_size: int, device) -> (
    decode_parallel.DecodeSpec):
  """The backend ("auto": the first of the platform's order that runs the call), its tiles
  for the core and band calls (query rows padded to its LENGTH_MULTIPLE), the static spec.

  Raises:
    NotImplementedError: the named backend (or, for "auto", every candidate) cannot run it.
    ValueError: naming block_sizes, when its sizes do not fit.
  """
  platform = device.platform
  device_kind = getattr(device, "device_kind", "") or ""
  cc = getattr(device, "compute_capability", None)
  group = call.n // call.k
  kv_len = call.s_max if options.strategy == "allgather" else call.s_max // ring_size
  reasons = []
  for name in _validate.candidates(options.backend, platform, cc, device_kind):
    kernel = get_backend(name)
    multiple = getattr(kernel, "LENGTH_MULTIPLE", 1)
    rows_core = decode_parallel.padded_rows(call.t * group, multiple)
    rows_band = decode_parallel.padded_rows(group, multiple)

    def problem(rows, keys):
      return base.Problem(q_len=rows, kv_len=keys, head_dim=call.h, kv_heads=call.k,
                          group=1, dtype=call.dtype, platform=platform,
                          device_kind=device_kind, compute_capability=cc, causal=False,
                          window=None, segments=True, head_dim_v=call.hv,
                          softcap=call.softcap)

    # split-KV: the shard's keys as runs of chunk_len, each a batch row of the kernel call
    chunks = decode_parallel.split_count(platform, getattr(device, "core_count", None),
                                         call.b * call.k * -(-rows_core // 128), kv_len)

    def why(keys, kernel=kernel):
      return kernel.unsupported(problem(rows_core, keys)) or (
          kernel.unsupported(problem(rows_band, keys)) if call.t > 1 else None)

    reason = why(kv_len // chunks)
    if reason is not None:
      if why(SLOT_MULTIPLE) is None:      # the length of the cache's shards is what it refuses
        reason = (f"backend {name!r} cannot tile a device's share of the cache: key_cache "
                  f"holds {call.s_max} slots a row, {kv_len} for each device's kernel; a "
                  f"cache of max_len a multiple of {SLOT_MULTIPLE} x the devices suits every "
                  f"backend (the kernel: {reason})")
      reasons.append(reason)
      continue

    def spec(rows, what, kernel=kernel, chunks=chunks):
      try:
        return _validate.resolve_spec(kernel, problem(rows, kv_len // chunks),
                                      scale=call.scale, block_sizes=options.block_sizes)
      except ValueError as err:
        # The lengths it names are the kernel's, which no argument states.
        raise ValueError(f"{err}; in decoding, the kernel's query rows are {what} and its "
                         f"keys a device's {kv_len} cache slots in {chunks} run(s) of "
                         f"{kv_len // chunks}") from None

    core_rows = f"t x N / K = {call.t} x {group}, {rows_core} with padding"
    band_rows = f"N / K = {group}, {rows_band} with padding"
    return decode_parallel.DecodeSpec(
        core=spec(rows_core, core_rows),
        band=spec(rows_band, band_rows) if call.t > 1 else None, backend=name,
        axis_name=options.axis_name, size=ring_size, t=call.t, group=group,
        rows_core=rows_core, rows_band=rows_band, window_left=call.window_left,
        strategy=options.strategy, guard=not options.guarded, chunks=chunks)
  if options.backend != "auto":
    raise NotImplementedError(reasons[0])
  raise NotImplementedError("no backend runs this call: " + "; ".join(reasons))


def _decode(query, key_cache, value_cache, cache_lengths, cache_positions, sinks, *,
            mesh: Mesh, batch, heads, options: _Options):
  """decode_attention's body: validate, resolve, the strategy under shard_map, sinks."""
  axes = _mesh.seq_axes(mesh.shape, options.axis_name)
  call = check(query, key_cache, value_cache, cache_lengths, cache_positions, sinks,
               ring_size=axes.size, options=options)
  bs, hs = _mesh.check_divisible(call.b, call.k, mesh, batch, heads)
  # The kernel's problem is one device's: batch and heads split over the other axes.
  spec = prepare(dataclasses.replace(call, b=call.b // bs, n=call.n // hs, k=call.k // hs),
                 options=options, ring_size=axes.size, device=mesh.devices.flat[0])
  cache_spec = P(batch, options.axis_name, heads, None)
  q_spec = P(batch, None, heads, None)
  row_spec = P(batch)
  lengths = jnp.asarray(_clipped_lengths(cache_lengths))
  positions = (None if cache_positions is None
               else jnp.asarray(_clipped_positions(cache_positions)))
  local = functools.partial(decode_parallel.decode_local, spec=spec)
  # Pallas interpret mode (CPU devices) cannot type values by mesh axes; the baselines'
  # results are the same on every device but typed as varying over the axis.
  check_vma = not spec.core.interpret and options.strategy == "reduce"
  shard_map = functools.partial(jax.shard_map, mesh=mesh, check_vma=check_vma,
                                out_specs=(q_spec, P(batch, heads, None)))
  if sinks is not None and call.softcap is None:   # under a cap the strategies guard q
    query = base.nan_query_rows(query)
  specs = (q_spec, cache_spec, cache_spec, row_spec)
  args = (query, key_cache, value_cache, lengths)
  if positions is None:
    fn = shard_map(lambda q, k, v, n: local(q, k, v, n, None), in_specs=specs)
  else:
    specs += (P(batch, options.axis_name),)
    args += (positions,)
    fn = shard_map(local, in_specs=specs)
  args = tuple(_mesh.place(x, mesh, spec) for x, spec in zip(args, specs))

  # Every differentiable input, sinks too, enters here, so a gradient of any of them raises.
  @jax.custom_vjp
  def attend(args, sinks):
    out, lse = fn(*args)
    if sinks is not None:
      out, lse = _inputs.add_sinks(out, lse, sinks)
    return _inputs.overflowed_rows(out, lse)

  def attend_fwd(args, sinks):
    return attend(args, sinks), None

  def attend_bwd(res, cotangents):
    del res, cotangents
    raise NotImplementedError(_FORWARD_ONLY)

  attend.defvjp(attend_fwd, attend_bwd)
  out, lse = attend(args, sinks)
  out = out.astype(call.dtype)
  return (out, lse) if options.return_residual else out
