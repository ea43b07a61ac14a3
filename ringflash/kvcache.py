"""ringflash.KVCache: a KV cache sharded over the sequence axis, for decode_attention.

Slots, not positions, are what the devices hold. Every row fills its slots in one order, the
same for all rows: slot counter n (the n-th slot a row fills) is local slot n // P of device
n mod P, so every device holds the same number of a row's slots, to within one. A prefill of
T tokens, sharded as the ring computed them, fills local slots 0 .. T/P - 1 of every device
where it lies: no data moves (a T that does not fit the layout is padded first, as
ring_attention pads it, its padding's slots left free). Example, P = 4 devices, max_len 32
(8 slots each), prefill of T = 8 tokens (contiguous layout): device 1 holds positions 2, 3
in slots 0, 1; used = 8. The appended tokens 8, 9, 10, 11, 12 go to devices 0, 1, 2, 3, 0,
local slots 2, 2, 2, 2, 3. Device 1 then holds 2 3 9 and device 0 holds 0 1 8 12.

Since a slot's position is not its index, the cache keeps positions[B, max_len] int32 beside
K and V (sharded like them; EMPTY = 2**30 marks a free slot, never seen): masks are computed
from positions, so they stay exact. K and V pass through the non-finite guard
(kernels/base.py) when they are written, so attention reads them as they are:
a NaN in a slot a token does not see never reaches it, and no pass over the cache precedes
each decode step.

A KVCache is a pytree (arrays: k, v, positions, lengths, used; static: mesh, axis_name,
batch_axis): pass it through jit and donate it (`jax.jit(step, donate_argnums=...)`); prefill
and append update its arrays in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ringflash import _inputs
from ringflash import _mesh
from ringflash import _validate
from ringflash import decode
from ringflash.parallel import decode as decode_parallel
from ringflash.parallel import plan as ring_plan

EMPTY = decode_parallel.EMPTY
# max_len a multiple of this x the devices: a share every backend's kernel tiles.
SLOT_MULTIPLE = decode.SLOT_MULTIPLE


@jax.tree_util.register_pytree_node_class
class KVCache:
  """A sequence-sharded KV cache: create, prefill, append, attention.

  Attributes:
    k: [B, max_len, K, H], v: [B, max_len, K, Hv]: sequence sharded over axis_name (batch
      over batch_axis, if any).
    positions: [B, max_len] int32 the position of each slot's token, EMPTY if free.
    lengths: [B] int32 tokens of each row (the position the next token gets).
    used: [B] int32 slots each row has filled (its next slot counter).
    mesh, axis_name, batch_axis: where it lives (static).
  """

  def __init__(self, k, v, positions, lengths, used, *, mesh: Mesh, axis_name="sp",
               batch_axis=None):
    self.k, self.v, self.positions, self.lengths, self.used = k, v, positions, lengths, used
    self.mesh, self.axis_name, self.batch_axis = mesh, axis_name, batch_axis

  def tree_flatten(self):
    return ((self.k, self.v, self.positions, self.lengths, self.used),
            (self.mesh, self.axis_name, self.batch_axis))

  @classmethod
  def tree_unflatten(cls, aux, children):
    mesh, axis_name, batch_axis = aux
    return cls(*children, mesh=mesh, axis_name=axis_name, batch_axis=batch_axis)

  def __repr__(self):
    return (f"KVCache(k={getattr(self.k, 'shape', None)}, v={getattr(self.v, 'shape', None)}, "
            f"axis_name={self.axis_name!r}, batch_axis={self.batch_axis!r})")

  @property
  def max_len(self) -> int:
    return self.k.shape[1]

  @property
  def ring_size(self) -> int:
    return _ring_size(self.mesh, self.axis_name)

  @classmethod
  def create(cls, batch: int, max_len: int, kv_heads: int, head_dim: int, *, mesh: Mesh,
             axis_name="sp", dtype=jnp.bfloat16, value_head_dim: int | None = None,
             batch_axis=None) -> "KVCache":
    """An empty cache (every slot free, every length 0), placed on the mesh.

    Args:
      batch: B. max_len: slots per row, divisible by the devices of axis_name (a multiple
        of 128 x the devices suits every backend's kernel: the GPU kernel tiles a device's
        slots by 64; with other shares backend "auto" runs xla there, and a named
        "pallas_gpu" refuses them).
      kv_heads: K. head_dim: H. value_head_dim: Hv (default H).
      mesh: the device mesh. axis_name: the mesh axis (or tuple) the sequence is sharded
        over. batch_axis: None, or the mesh axis (or tuple) the batch is sharded over.
      dtype: of K and V (float32, bfloat16 or float16).

    Raises:
      ValueError: naming the argument.
    """
    if not isinstance(mesh, Mesh):
      raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    # As every method checks it: a cache made here under another context mesh would fail
    # in JAX's jit below (other devices), or be refused by each later call (Explicit axes).
    _mesh.check_context(mesh, _CONTEXT_REMEDY)
    axis_name = _mesh.frozen(axis_name)
    batch_axis = _mesh.frozen(batch_axis)
    p = _ring_size(mesh, axis_name)
    hv = head_dim if value_head_dim is None else value_head_dim
    for name, value in (("batch", batch), ("max_len", max_len), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("value_head_dim", hv)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if max_len % p:
      raise ValueError(f"max_len={max_len} must be divisible by the {p} devices of axis_name "
                       f"{axis_name!r}")
    if max_len >= EMPTY:
      raise ValueError(f"max_len={max_len} must be below {EMPTY}")
    try:
      known = jnp.dtype(dtype)
    except TypeError:
      known = None
    if known not in _validate.FLOAT_DTYPES:
      raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if batch_axis is not None:
      names = (batch_axis,) if isinstance(batch_axis, str) else batch_axis
      seq = (axis_name,) if isinstance(axis_name, str) else axis_name
      if not all(isinstance(a, str) and a in mesh.shape and a not in seq for a in names):
        raise ValueError(f"batch_axis must be None or mesh axes other than axis_name, got "
                         f"{batch_axis!r}; the mesh's axes are {tuple(mesh.shape)}")
      size = int(np.prod([mesh.shape[a] for a in names]))
      if batch % size:
        raise ValueError(f"batch={batch} must be divisible by the {size} devices of "
                         f"batch_axis {batch_axis!r}")
    shard = _Shardings(mesh, axis_name, batch_axis)

    def make():
      return (jnp.zeros((batch, max_len, kv_heads, head_dim), dtype),
              jnp.zeros((batch, max_len, kv_heads, hv), dtype),
              jnp.full((batch, max_len), EMPTY, jnp.int32),
              jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32))

    arrays = jax.jit(make, out_shardings=(shard.seq, shard.seq, shard.slots, shard.rows,
                                          shard.rows))()
    return cls(*arrays, mesh=mesh, axis_name=axis_name, batch_axis=batch_axis)

  def prefill(self, k, v, lengths=None, *, layout: str = "contiguous") -> "KVCache":
    """The cache holding a prompt's K/V as the ring computed them (any earlier content is
    dropped): device i's shard of k, v goes into its own first slots, where it lies.

    Args:
      k: [B, T, K, H], v: [B, T, K, Hv], the sequence sharded over axis_name in `layout`
        (ring_attention's inputs and outputs are); T <= max_len. Cast to the cache's dtype.
        A T that does not fit the layout (a multiple of the ring size, twice it for zigzag)
        is in ringflash.to_layout's order for T, as ring_attention takes and returns it, and
        is padded inside to the next length that fits (which must fit max_len); the
        padding's slots stay free.
      lengths: None (every row has T tokens) or [B] int: tokens of each row (a padded
        batch); slots at or past a row's length stay free. Values above T count as T, negative
        ones as 0.
      layout: "contiguous", "zigzag" or "striped": which positions device i's rows are.

    Returns:
      The new cache: lengths as given, T slots used per row (T padded, where it is).

    Raises:
      ValueError: naming the argument.
    """
    _mesh.check_not_in_shard_map()   # before the shapes: there they are local blocks
    b, _, kh, h = self.k.shape
    hv = self.v.shape[-1]
    (ks, kd), (vs, vd) = _validate.array_shape(k, "k"), _validate.array_shape(v, "v")
    if len(ks) != 4 or ks[0] != b or ks[2:] != (kh, h):
      raise ValueError(f"k must have shape [B, T, K, H] = [{b}, T, {kh}, {h}], got {ks}")
    t = ks[1]
    if vs != (b, t, kh, hv):
      raise ValueError(f"v must have shape [B, T, K, Hv] = {(b, t, kh, hv)}, got {vs}")
    for name, dtype in (("k", kd), ("v", vd)):
      if dtype not in _validate.FLOAT_DTYPES:
        raise ValueError(f"{name}.dtype must be float32, bfloat16 or float16, got {dtype}")
    if t > self.max_len:
      raise ValueError(f"k holds T={t} tokens, more than the cache's max_len={self.max_len}")
    p = self.ring_size
    ring_plan.check_layout(layout, p, 0)
    padded = ring_plan.fitting_length(layout, p, t)
    if padded > self.max_len:
      raise ValueError(f"k holds T={t} tokens, which the {layout} layout pads to {padded} on "
                       f"{p} devices, more than the cache's max_len={self.max_len}")
    if lengths is None:
      lengths = jnp.full((b,), t, jnp.int32)
    else:
      shape, dtype = _validate.array_shape(lengths, "lengths")
      if shape != (b,) or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"lengths must be a [B] = ({b},) integer array, got {shape} {dtype}")
      lengths = _validate.int32_clipped(lengths, 0, t)
    _mesh.check_context(self.mesh, _CONTEXT_REMEDY)
    fn = _prefill_program(self.mesh, self.axis_name, self.batch_axis, layout, t, padded)
    return fn(self, k, v, lengths)

  def append(self, k_new, v_new) -> "KVCache":
    """The cache with t new tokens per row at positions lengths .. lengths + t - 1, each in
    the next slot of the row's order (device n mod P, local slot n // P for counter n).

    Args:
      k_new: [B, t, K, H], v_new: [B, t, K, Hv] (replicated over axis_name); cast to the
        cache's dtype.

    Returns:
      The new cache: lengths and used grown by t.

    Raises:
      ValueError: naming the argument; also, outside jit, when a row would fill more than
        max_len slots. Inside jit that cannot be seen: tokens past the capacity are not
        written, `used` records them, and every later attention of that row gives NaN
        (never a finite answer that silently lacks those tokens).
    """
    _mesh.check_not_in_shard_map()   # before the shapes: there they are local blocks
    b, _, kh, h = self.k.shape
    hv = self.v.shape[-1]
    (ks, kd), (vs, vd) = (_validate.array_shape(k_new, "k_new"),
                          _validate.array_shape(v_new, "v_new"))
    if len(ks) != 4 or ks[0] != b or ks[2:] != (kh, h) or ks[1] < 1:
      raise ValueError(f"k_new must have shape [B, t, K, H] = [{b}, t, {kh}, {h}], got {ks}")
    t = ks[1]
    if vs != (b, t, kh, hv):
      raise ValueError(f"v_new must have shape [B, t, K, Hv] = {(b, t, kh, hv)}, got {vs}")
    for name, dtype in (("k_new", kd), ("v_new", vd)):
      if dtype not in _validate.FLOAT_DTYPES:
        raise ValueError(f"{name}.dtype must be float32, bfloat16 or float16, got {dtype}")
    if not isinstance(self.used, jax.core.Tracer):
      most = int(np.max(np.asarray(jax.device_get(self.used))))
      if most + t > self.max_len:
        raise ValueError(f"appending t={t} tokens overflows the cache: a row has {most} of "
                         f"its max_len={self.max_len} slots filled")
    _mesh.check_context(self.mesh, _CONTEXT_REMEDY)
    fn = _append_program(self.mesh, self.axis_name, self.batch_axis)
    return fn(self, k_new, v_new)

  def attention(self, query, *, scale: float | None = None, sinks=None,
                logits_soft_cap: float | None = None, local_window_size=None,
                backend: str = "auto", block_sizes=None, return_residual: bool = False,
                strategy: str = "reduce"):
    """decode_attention of query [B, t, N, H] (its t tokens the last t appended) against
    this cache; the options as decode_attention's. K/V were guarded when written, so no
    pass over the cache precedes the kernels.

    Returns:
      out [B, t, N, Hv] in query's dtype (and lse [B, N, t] with return_residual). NaN in
      every token of a row that lost tokens to an append past max_len under jit (its `used`
      exceeds max_len): the cache no longer holds what the row has seen.
    """
    _mesh.check_not_in_shard_map()
    self._check_query(query)
    options = decode._Options(
        axis_name=self.axis_name, scale=scale, logits_soft_cap=logits_soft_cap,
        local_window_size=_mesh.frozen(local_window_size),
        backend=backend, block_sizes=block_sizes, return_residual=return_residual,
        strategy=strategy, guarded=True)
    result = decode.run(query, self.k, self.v, self.lengths, self.positions, sinks,
                        mesh=self.mesh, options=options, batch_axis=self.batch_axis,
                        remedy=_CONTEXT_REMEDY)
    lost = self.used > self.max_len                  # [B]

    def spoiled(x):                                  # out and lse lead with the batch
      return jnp.where(lost.reshape(lost.shape + (1,) * (x.ndim - 1)),
                       jnp.asarray(jnp.nan, x.dtype), x)

    return tuple(map(spoiled, result)) if return_residual else spoiled(result)

  def _check_query(self, query) -> None:
    """query against the cache, in the cache's terms (decode_attention's own check would
    name key_cache and value_cache, arguments a KVCache user never passed)."""
    qs, qd = _validate.array_shape(query, "query")
    if len(qs) != 4:
      return                          # decode_attention's check names the rank
    b, _, kh, h = self.k.shape
    if qd != self.k.dtype:
      raise ValueError(f"query dtype {qd} must be the cache's dtype {self.k.dtype} (set by "
                       f"KVCache.create(dtype=...))")
    if qs[0] != b:
      raise ValueError(f"query batch B={qs[0]} must be the cache's batch {b}")
    if qs[3] != h:
      raise ValueError(f"query head_dim {qs[3]} must be the cache's head_dim {h}")
    if qs[2] % kh:
      raise ValueError(f"query heads N={qs[2]} must be a multiple of the cache's kv heads "
                       f"K={kh} (GQA/MQA)")


# Under jax.set_mesh of another mesh: the cache's own mesh is the one named.
_CONTEXT_REMEDY = ("that is the cache's mesh; create the cache on the context mesh "
                   "(KVCache.create(..., mesh=...)) or use it outside jax.set_mesh")


def _ring_size(mesh: Mesh, axis_name) -> int:
  return _mesh.seq_axes(mesh.shape, axis_name).size


class _Shardings:
  """The cache's shardings: K/V and positions sequence-sharded, per-row arrays by batch."""

  def __init__(self, mesh: Mesh, axis_name, batch_axis):
    self.seq_spec = P(batch_axis, axis_name, None, None)
    self.slot_spec = P(batch_axis, axis_name)
    self.row_spec = P(batch_axis)
    self.seq = NamedSharding(mesh, self.seq_spec)
    self.slots = NamedSharding(mesh, self.slot_spec)
    self.rows = NamedSharding(mesh, self.row_spec)


@functools.lru_cache(maxsize=32)
def _prefill_program(mesh: Mesh, axis_name, batch_axis, layout: str, t: int, padded: int):
  """The prefill of T = t tokens, padded to `padded` (the layout's multiple) inside."""
  shard = _Shardings(mesh, axis_name, batch_axis)
  p = _ring_size(mesh, axis_name)
  rows = None
  if padded != t:       # the padded layout's slots past t stay free (lengths <= t)
    positions = ring_plan.layout_positions(layout, p, padded).reshape(-1)
    rows = _inputs.padded_rows(layout, p, t, positions)
  body = functools.partial(decode_parallel.prefill_local, axis_name=axis_name, size=p,
                           layout=layout)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(shard.seq_spec,) * 4 + (shard.row_spec,),
                     out_specs=(shard.seq_spec, shard.seq_spec, shard.slot_spec))

  def prefill(cache: KVCache, k, v, lengths):
    lengths = jnp.asarray(_validate.int32_clipped(lengths, 0, t))
    if rows is not None:
      k, v = (_inputs.regather(x, *rows) for x in (k, v))
    args = (cache.k, cache.v, k, v, lengths)
    specs = (shard.seq_spec,) * 4 + (shard.row_spec,)
    ck, cv, positions = fn(*(_mesh.place(x, mesh, s) for x, s in zip(args, specs)))
    used = jnp.full(cache.used.shape, padded, jnp.int32)
    return KVCache(ck, cv, positions, lengths, used, mesh=mesh, axis_name=axis_name,
                   batch_axis=batch_axis)

  return jax.jit(prefill)


@functools.lru_cache(maxsize=32)
def _append_program(mesh: Mesh, axis_name, batch_axis):
  shard = _Shardings(mesh, axis_name, batch_axis)
  p = _ring_size(mesh, axis_name)
  body = functools.partial(decode_parallel.append_local, axis_name=axis_name, size=p)
  new_spec = P(batch_axis, None, None, None)
  fn = jax.shard_map(body, mesh=mesh,
                     in_specs=(shard.seq_spec, shard.seq_spec, shard.slot_spec,
                               shard.row_spec, shard.row_spec, new_spec, new_spec),
                     out_specs=(shard.seq_spec, shard.seq_spec, shard.slot_spec))

  def append(cache: KVCache, k_new, v_new):
    t = k_new.shape[1]
    args = (cache.k, cache.v, cache.positions, cache.lengths, cache.used, k_new, v_new)
    specs = (shard.seq_spec, shard.seq_spec, shard.slot_spec, shard.row_spec, shard.row_spec,
             new_spec, new_spec)
    ck, cv, positions = fn(*(_mesh.place(x, mesh, s) for x, s in zip(args, specs)))
    return KVCache(ck, cv, positions, cache.lengths + t, cache.used + t, mesh=mesh,
                   axis_name=axis_name, batch_axis=batch_axis)

  return jax.jit(append)
