"""Public entry points: ring_attention (global arrays on a mesh) and ring_attention_sharded."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect

import jax
import numpy as np
from jax import lax
from jax.interpreters import ad
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ringflash import _inputs
from ringflash import _mesh
from ringflash import _validate
from ringflash.parallel.plan import device_positions
from ringflash.parallel.plan import layout_positions
from ringflash.parallel import strategies


def ring_attention(query, key, value, *, mesh: Mesh | None = None, axis_name: str = "sp",
                   is_causal: bool = False, scale: float | None = None, segment_ids=None,
                   return_residual: bool = False, backend: str = "auto",
                   block_sizes=None, layout: str = "contiguous",
                   local_window_size: int | tuple[int, int] | None = None,
                   bidirectional: bool = False, sinks=None,
                   logits_soft_cap: float | None = None, query_seq_lengths=None,
                   key_value_seq_lengths=None, strategy: str = "auto"):
  """Exact attention with the sequence sharded over a ring of devices.

  Semantics of `jax.nn.dot_product_attention` (BTNH layout with no, one or several leading
  batch dims, GQA/MQA when N % K == 0, `*_seq_lengths`, `local_window_size`), except that a
  query row with no valid key gives 0 (lse -inf, zero gradients). With `is_causal` and
  T != S, query i sees keys j <= i (jax.nn's top-left alignment).

  Args:
    query: [..., T, N, H]; T and S at most 2**30 tokens (int32 positions).
    key: [..., S, K, H], N % K == 0, the same leading dims.
    value: [..., S, K, Hv]; Hv may differ from H (e.g. MLA's 192 / 128).
    mesh: the device mesh; None takes the mesh of jax.set_mesh where one is set, else
      builds a 1-D mesh over jax.devices() named `axis_name`.
    axis_name: the mesh axis the sequence is sharded over, or a tuple of axes (the sequence
      sharded over their product, first axis major; "hybrid" runs Ulysses over the last and
      the ring over the others). Other mesh axes are honoured: batch and heads keep the
      sharding the inputs carry (visible on concrete arrays and, inside jit, on meshes with
      explicit axes); the output keeps it.
    is_causal: mask keys after the query position.
    scale: multiplier of q.k; default 1/sqrt(H).
    segment_ids: [..., T] int (self-attention, T == S) or a pair (q_ids [..., T],
      kv_ids [..., S]); a query attends only keys of its own segment id. Ids must lie
      strictly between the smallest and the largest int32 (those two mark padding):
      concrete ids outside are a ValueError, traced ones make their batch row NaN.
    return_residual: also return lse [..., N, T] float32 (with sinks: including them).
    backend: "auto" (the fastest backend that runs the call on the mesh's devices), "xla",
      "pallas_tpu", "pallas_gpu" (a named backend never falls back).
    block_sizes: the running backend's tile configuration (ringflash.XlaBlockSizes,
      TpuBlockSizes or GpuBlockSizes); None for its defaults.
    layout: how the sequence axis of every input (and segment ids, and the output) is laid
      out over the ring: "contiguous" (natural order), "zigzag" or "striped" (permute with
      ringflash.to_layout, restore with from_layout; see ringflash/layouts.py). zigzag and
      striped balance causal work over the devices.
    local_window_size: None, int w or (left, right): query i sees keys j with
      i - left <= j <= i + right (jax.nn's meaning; w means (w, w)). With the contiguous
      layout the ring stops after the hops the window reaches.
    bidirectional: split K/V in two halves that travel around the ring in opposite
      directions (both links of a bidirectional ring busy, half the bytes on each); same
      result. A window that already shortens the ring keeps its own schedule.
    sinks: None or [N] float: per query head, a logit that joins every row's softmax
      denominator once and carries no value (gpt-oss); differentiable. A sink of +inf makes
      every row with a key NaN; -inf is no sink.
    logits_soft_cap: None or cap > 0: scores become cap * tanh(scale * q.k / cap) before
      masking (Gemma 2).
    query_seq_lengths, key_value_seq_lengths: None or [...] int per batch row: keys at or
      past the length are masked, query rows at or past it give 0; whole tiles and ring
      hops past the lengths are skipped. Clipped to [0, 2**31 - 1] in their own dtype
      before they become int32.
    strategy: "auto" (ringflash.explain shows the choice), "ring" (K/V blocks around the
      devices, overlapped with the kernels), "allgather" (all K/V gathered, one kernel call),
      "ulysses" (all-to-all sequence <-> heads, needs N divisible by the devices) or
      "hybrid" (Ulysses over the last axis of a tuple axis_name, the ring over the others).

  A sequence whose length does not fit the layout on the ring (not divisible by the ring
  size, by twice it for zigzag) is padded inside (the padding masked as keys past the
  length, trimmed from the output): in the zigzag and striped layouts the arrays are in the
  order ringflash.to_layout gives for their length, and so is the output.

  Returns:
    out [..., T, N, Hv] in query's dtype, sequence-sharded over `axis_name`; with
    return_residual, (out, lse).

  Raises:
    ValueError: on any invalid argument, naming it, before any collective runs.
    NotImplementedError: the backend cannot run this call (naming it and the feature),
      forward-mode differentiation, or a call inside a shard_map (there:
      ring_attention_sharded).
  """
  mesh, axis_name, _ = _mesh_and_axes(mesh, axis_name)
  batch, heads = _mesh.outer_axes(query, mesh, axis_name)
  order = _mesh.lead_order(query, mesh, axis_name)
  options = _Options(axis_name=axis_name, is_causal=is_causal, scale=scale,
                     return_residual=return_residual, backend=backend,
                     block_sizes=block_sizes, layout=layout,
                     local_window_size=_mesh.frozen(local_window_size),
                     bidirectional=bidirectional, logits_soft_cap=logits_soft_cap,
                     strategy=strategy)
  named = dict(query=query, key=key, value=value, segment_ids=segment_ids,
               query_seq_lengths=query_seq_lengths,
               key_value_seq_lengths=key_value_seq_lengths, sinks=sinks)
  _validate.check_jit_arguments(**named)
  _validate.check_segment_values(segment_ids)
  _mesh.check_placed(mesh, **named)
  arrays = (query, key, value, segment_ids, _validate.int32_clipped(query_seq_lengths),
            _validate.int32_clipped(key_value_seq_lengths), sinks)
  try:
    fn = _program(mesh, batch, heads, order, options, _validate.option_types(options))
  except TypeError:       # an unhashable option: no cache; validation names it
    fn = functools.partial(_ring_attention, mesh=mesh, batch=batch, heads=heads,
                           lead_order=order, options=options)
  with _forward_mode_error(query, key, value, sinks):
    return fn(*arrays)


def explain(query, key, value, *, mesh: Mesh | None = None, axis_name="sp", **options):
  """What ring_attention would run for these arrays and options, and why.

  Takes the arguments of ring_attention (arrays or jax.ShapeDtypeStruct; only shapes and
  dtypes are read) and returns the cost model's choice (parallel/cost.py): the strategy,
  the backend and its tiles, and every strategy's estimated forward+backward time and
  memory per device, or why it cannot run. `print(ringflash.explain(...))` shows a table.

  Raises:
    ValueError, NotImplementedError: as ring_attention would.
  """
  from ringflash.parallel import cost  # pylint: disable=g-import-not-at-top
  unknown = sorted(set(options) - set(inspect.signature(ring_attention).parameters))
  if unknown:
    raise TypeError(f"explain() got an unexpected keyword argument {unknown[0]!r} (it takes "
                    f"ring_attention's)")
  mesh, axis_name, axes = _mesh_and_axes(mesh, axis_name)
  device = mesh.devices.flat[0]
  block_sizes = options.pop("block_sizes", None)
  _validate.check_segment_values(options.get("segment_ids"))
  _mesh.check_placed(mesh, query=query, key=key, value=value, **{
      name: options.get(name) for name in ("segment_ids", "query_seq_lengths",
                                           "key_value_seq_lengths", "sinks")})
  call = _validate.check_call(query, key, value, ring_size=axes.size, local=False, pads=True,
                              **options)
  shards = _mesh.check_divisible(call.batch, call.k, mesh,
                                 *_mesh.outer_axes(query, mesh, axis_name))
  choice = cost.choose(_validate.per_device(call, shards), axes, platform=device.platform,
                       device=device)
  strategy = call.strategy if call.strategy != "auto" else choice.strategy
  prepared = _validate.prepare(call, block_sizes=block_sizes, axes=axes, local=False,
                               platform=device.platform, device=device, strategy=strategy,
                               shards=shards)
  return dataclasses.replace(choice, strategy=strategy, backend=prepared.backend,
                             tiles=prepared.kernel.tiles)


@dataclasses.dataclass(frozen=True)
class _Options:
  """ring_attention's keyword options (all but the arrays), as given (validated when traced):
  part of the key of the cache of compiled programs."""

  axis_name: str
  is_causal: bool
  scale: float | None
  return_residual: bool
  backend: str
  block_sizes: object
  layout: str
  local_window_size: object
  bidirectional: bool
  logits_soft_cap: float | None
  strategy: str


@functools.lru_cache(maxsize=1)
def _default_mesh(axis_name: str) -> Mesh:
  return Mesh(np.array(jax.devices()), (axis_name,))


def _mesh_and_axes(mesh, axis_name):
  """(mesh, axis_name, its SeqAxes), checked: mesh=None is the mesh of jax.set_mesh where
  one is set, else a 1-D mesh of every device.

  Under jax.set_mesh a shard_map must run on the context mesh (axis types included):
  mesh=None takes it; another mesh, or mesh=None where only an abstract context mesh is
  known (jax.sharding.use_abstract_mesh), is refused naming `mesh`, not left to shard_map's
  error. Inside a caller's shard_map (Manual context axes) nothing runs: ring_attention
  is not a call for there.

  Raises:
    ValueError: naming mesh or axis_name.
    NotImplementedError: inside a shard_map.
  """
  axis_name = _mesh.frozen(axis_name)
  _mesh.check_not_in_shard_map()
  if mesh is None:
    context, abstract = _mesh.context_mesh()
    if context is not None:
      mesh = context
    elif abstract is not None:
      raise ValueError(f"mesh=None under an abstract context mesh ({abstract}) with no "
                       f"devices: pass the mesh (mesh=...)")
  if mesh is None:
    if not isinstance(axis_name, str):
      raise ValueError(f"mesh=None builds a 1-D mesh; axis_name must then be one name, got "
                       f"{axis_name!r}")
    mesh = _default_mesh(axis_name)
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
  _mesh.check_context(mesh)
  return mesh, axis_name, _mesh.seq_axes(mesh.shape, axis_name)


@functools.lru_cache(maxsize=64)
def _program(mesh: Mesh, batch, heads, lead_order, options: _Options, types):
  """The jitted program of one set of options on one mesh.

  Eager calls with the same options reuse it: jax.jit traces and compiles once per input
  shapes and dtypes and then dispatches in microseconds, where an eager shard_map would
  trace and compile the ring again at every call. At most 64 option sets are kept (least
  recently used first out); each keeps JAX's own cache of compiled executables. Inside a
  caller's jit the program is inlined as any jitted function is.
  """
  del types           # part of the key only
  return jax.jit(functools.partial(_ring_attention, mesh=mesh, batch=batch, heads=heads,
                                   lead_order=lead_order, options=options))


_FORWARD_MODE = ("ringflash attention supports reverse-mode differentiation (jax.grad, "
                 "jax.vjp, jax.value_and_grad) only; forward mode (jax.jvp, jax.jacfwd) is "
                 "not implemented (jax.linearize returns, but its linear function fails)")


@contextlib.contextmanager
def _forward_mode_error(*arrays):
  """Forward-mode differentiation is an error that says so: at once when the inputs are
  jvp tracers, and JAX's own error (raised while it differentiates a custom_vjp) turned
  into ours where it reaches this frame. (jax.jvp of a caller's jit around the call still
  gets JAX's message, "can't apply forward-mode autodiff (jvp) to a custom_vjp function".)
  """
  if any(isinstance(x, ad.JVPTracer) for x in jax.tree.leaves(arrays)):
    raise NotImplementedError(_FORWARD_MODE)
  try:
    yield
  except TypeError as err:
    if "forward-mode" not in str(err):
      raise
    raise NotImplementedError(_FORWARD_MODE) from None


def _ring_attention(query, key, value, segment_ids, query_seq_lengths,
                    key_value_seq_lengths, sinks, *, mesh: Mesh, batch, heads, lead_order,
                    options: _Options):
  """ring_attention's body: validate, map onto [B, T, N, H], the strategy under shard_map.

  batch, heads: the mesh axes sharding them (_mesh.outer_axes); lead_order: the order of
  flattening several leading dims (_mesh.lead_order)."""
  axis_name = options.axis_name
  axes = _mesh.seq_axes(mesh.shape, axis_name)
  ring_size = axes.size
  device = mesh.devices.flat[0]
  call = _validate.check_call(
      query, key, value, segment_ids=segment_ids, scale=options.scale,
      backend=options.backend, ring_size=ring_size, local=False, layout=options.layout,
      local_window_size=options.local_window_size, bidirectional=options.bidirectional,
      is_causal=options.is_causal, return_residual=options.return_residual, sinks=sinks,
      logits_soft_cap=options.logits_soft_cap, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, strategy=options.strategy, pads=True)
  shards = _mesh.check_divisible(call.batch, call.k, mesh, batch, heads)
  prepared = _validate.prepare(call, block_sizes=options.block_sizes, axes=axes, local=False,
                               platform=device.platform, device=device, shards=shards)
  t_len, s_len = prepared.t_local * ring_size, prepared.s_local * ring_size
  q_pos = k_pos = q_rows = k_rows = None
  if call.layout != "contiguous":       # rows in layout order: their natural positions
    q_pos = layout_positions(call.layout, ring_size, t_len).reshape(-1)
    k_pos = layout_positions(call.layout, ring_size, s_len).reshape(-1)
    if t_len != call.t:
      q_rows = _inputs.padded_rows(call.layout, ring_size, call.t, q_pos)
    if s_len != call.s:
      k_rows = _inputs.padded_rows(call.layout, ring_size, call.s, k_pos)
  q, k, v, q_seg, kv_seg, bad_ids = _inputs.canonical(
      call, query, key, value, segment_ids, query_seq_lengths, key_value_seq_lengths,
      t_len=t_len, s_len=s_len, q_pos=q_pos, k_pos=k_pos, q_rows=q_rows, k_rows=k_rows,
      lead_order=lead_order)

  x_spec = P(batch, axis_name, heads, None)
  seg_spec = P(batch, axis_name)
  local = functools.partial(strategies.attention_local, spec=prepared.spec)
  out_specs = (x_spec, P(batch, heads, axis_name))
  # Pallas interpret mode evaluates kernels untyped by mesh axes: it needs check_vma off.
  # It has to be the shard_map's flag: interpret mode evaluates the kernel body when the
  # program is lowered, outside any context the kernel could set while tracing (tried:
  # "dynamic_slice requires varying manual axes to match").
  shard_map = functools.partial(jax.shard_map, mesh=mesh, out_specs=out_specs,
                                check_vma=not prepared.kernel.interpret)
  q, k, v = (_mesh.place(x, mesh, x_spec) for x in (q, k, v))
  if q_seg is None:
    fn = shard_map(lambda q, k, v: local(q, k, v, None, None), in_specs=(x_spec,) * 3)
    out, lse = fn(q, k, v)
  else:
    q_seg, kv_seg = (_mesh.place(x, mesh, seg_spec) for x in (q_seg, kv_seg))
    fn = shard_map(local, in_specs=(x_spec,) * 3 + (seg_spec,) * 2)
    out, lse = fn(q, k, v, q_seg, kv_seg)
  if t_len != call.t:
    # Padded inside: the user's length does not divide over the ring, so the trimmed output
    # cannot stay split along it (on Explicit axes the slice would be refused).
    out = _mesh.place(out, mesh, P(batch, None, heads, None))
    lse = _mesh.place(lse, mesh, P(batch, heads, None))
  return _inputs.finish(call, out, lse, sinks, rows=q_rows, lead_order=lead_order,
                        bad_ids=bad_ids)


def ring_attention_sharded(query, key, value, *, axis_name: str, is_causal: bool = False,
                           scale: float | None = None, segment_ids=None,
                           return_residual: bool = False, backend: str = "auto",
                           block_sizes=None, layout: str = "contiguous",
                           local_window_size: int | tuple[int, int] | None = None,
                           bidirectional: bool = False, sinks=None,
                           logits_soft_cap: float | None = None, query_seq_lengths=None,
                           key_value_seq_lengths=None, strategy: str = "auto"):
  """ring_attention on local shards, for use inside the caller's shard_map.

  The caller's shard_map must map `axis_name` with the sequence (the axis before heads of
  every array) split over it in device order: device i's shard is slice i of the
  (layout-ordered) sequence, natural order for the contiguous layout; batch and heads may
  be split over other axes as the caller likes.

  Args:
    query: [..., T_local, N, H] this device's shard.
    key: [..., S_local, K, H]; value: [..., S_local, K, Hv].
    axis_name: the manual mesh axis forming the ring, or a tuple of them in the order the
      caller's in_specs split the sequence over them (P(None, ("a", "b")) needs
      ("a", "b")): inside a shard_map that order cannot be read, only which axes q varies
      over, so another order is not refused and gives the shards wrong positions.
    is_causal, scale, segment_ids, return_residual, backend, block_sizes, layout,
      local_window_size, bidirectional, sinks, logits_soft_cap, query_seq_lengths,
      key_value_seq_lengths, strategy: as ring_attention, with local shapes (zigzag needs
      even local lengths; window bounds and sequence lengths are global). Sinks and
      sequence lengths must be the same on every device of the ring (not sharded over
      axis_name).

  Returns:
    out [..., T_local, N, Hv] (and lse [..., N, T_local] float32 with return_residual).

  Raises:
    ValueError: on any invalid argument, or when axis_name is not a bound mesh axis.
    NotImplementedError: as ring_attention.
  """
  axis_name = _mesh.frozen(axis_name)
  names = _mesh.axis_names(axis_name)
  if names is None:
    raise ValueError(f"axis_name must be a mesh axis name or a non-empty tuple of distinct "
                     f"ones, got {axis_name!r}")
  try:
    sizes = tuple(lax.axis_size(a) for a in names)
  except NameError as err:
    raise ValueError(f"axis_name {axis_name!r} is not a bound mesh axis here; call "
                     f"ring_attention_sharded inside shard_map over it") from err
  axes = _validate.SeqAxes(names, sizes)
  ring_size = axes.size
  _validate.check_segment_values(segment_ids)
  _mesh.check_sequence_sharded(names, query=query, key=key, value=value)
  _mesh.check_same_on_ring(names, sinks=sinks, query_seq_lengths=query_seq_lengths,
                           key_value_seq_lengths=key_value_seq_lengths)
  _mesh.check_no_explicit_axes()
  platform, device = _mesh.current_platform()
  call = _validate.check_call(
      query, key, value, segment_ids=segment_ids, scale=scale, backend=backend,
      ring_size=ring_size, local=True, layout=layout, local_window_size=local_window_size,
      bidirectional=bidirectional, is_causal=is_causal, return_residual=return_residual,
      sinks=sinks, logits_soft_cap=logits_soft_cap, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, strategy=strategy)
  prepared = _validate.prepare(call, block_sizes=block_sizes, axes=axes, local=True,
                               platform=platform, device=device)
  if prepared.kernel.interpret and _mesh.varying(query):
    raise ValueError(
        f"backend {prepared.backend!r} runs its Pallas kernels in interpret mode on CPU devices, "
        f"which cannot check mesh-axis types: call ring_attention_sharded inside "
        f"jax.shard_map(..., check_vma=False) there (on TPUs and GPUs the default works)")
  index = lax.axis_index(axis_name)
  q_pos = device_positions(call.layout, index, ring_size, call.t)
  k_pos = device_positions(call.layout, index, ring_size, call.s)
  q, k, v, q_seg, kv_seg, bad_ids = _inputs.canonical(
      call, query, key, value, segment_ids, query_seq_lengths, key_value_seq_lengths,
      t_len=call.t, s_len=call.s, q_pos=q_pos, k_pos=k_pos)
  if bad_ids is not None:     # a device's keys reach every device's rows
    bad_ids = lax.pmax(bad_ids.astype(np.int32), names) > 0
  with _forward_mode_error(query, key, value, sinks):
    out, lse = strategies.attention_local(q, k, v, q_seg, kv_seg, spec=prepared.spec)
  return _inputs.finish(call, out, lse, sinks, bad_ids=bad_ids)


