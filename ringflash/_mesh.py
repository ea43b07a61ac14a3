"""Mesh facts the public entry points share: which axes shard the sequence, what other axes
the inputs' batch and heads are sharded over, the platform inside a caller's shard_map."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ringflash import _validate


reshard = getattr(jax, "reshard", None) or jax.sharding.reshard   # older jax


def frozen(x):
  """Lists as tuples, so that equal options hash equal (a window may be given as a list)."""
  return tuple(frozen(e) for e in x) if isinstance(x, (list, tuple)) else x


def context_mesh() -> tuple[Mesh | None, object]:
  """(the concrete mesh of jax.set_mesh, or None; the abstract context mesh, or None).

  jax.sharding.get_mesh reads the concrete mesh only where no trace is under way (under
  jit, grad or vmap it raises ValueError); the mesh itself is JAX's context value, which
  get_mesh returns, read where the public function refuses (jax._src.mesh, looked up
  defensively: None where a JAX lacks it, and then only the abstract mesh is known).
  """
  abstract = jax.sharding.get_abstract_mesh()
  if abstract.empty:
    return None, None
  try:
    concrete = jax.sharding.get_mesh()
  except ValueError:            # a trace is under way
    from jax._src import mesh as jax_mesh  # pylint: disable=g-import-not-at-top
    read = getattr(jax_mesh, "get_concrete_mesh", None)
    concrete = read() if read is not None else None
  if not isinstance(concrete, Mesh) or concrete.empty:
    concrete = None
  return concrete, abstract


def check_context(mesh: Mesh, remedy: str = "pass that mesh, or mesh=None to use it") -> None:
  """Under jax.set_mesh a shard_map must run on the context mesh, axis types included.

  remedy: what the caller can do instead (callers without mesh=None say so).

  Raises:
    ValueError: naming mesh, when it is not the context mesh.
  """
  check_not_in_shard_map()
  abstract = jax.sharding.get_abstract_mesh()
  if not abstract.empty and mesh.abstract_mesh != abstract:
    raise ValueError(f"mesh={mesh} is not the context mesh ({abstract}, of jax.set_mesh; "
                     f"axis types count): {remedy}")


def check_not_in_shard_map() -> None:
  """ring_attention, explain, decode_attention and a KVCache's methods run a shard_map of
  their own over the whole mesh; inside a caller's shard_map (the context mesh has Manual
  axes) they cannot. Refused here with what to call instead: the checks of the context mesh
  that follow told such a caller to pass the mesh, and then to pass mesh=None, in turn.

  Raises:
    NotImplementedError: naming the Manual axes.
  """
  abstract = jax.sharding.get_abstract_mesh()
  if abstract.empty:
    return
  manual = [name for name, kind in zip(abstract.axis_names, abstract.axis_types)
            if kind == AxisType.Manual]
  if manual:
    raise NotImplementedError(
        f"called inside a shard_map (the context mesh's axes {manual} are Manual): this "
        f"call runs a shard_map of its own over the whole mesh; inside a shard_map, call "
        f"ringflash.ring_attention_sharded on the local blocks, or make this call outside")


def check_placed(mesh: Mesh, **arrays) -> None:
  """Each array committed to devices (a jax.Array placed with device_put, or a
  ShapeDtypeStruct with a sharding) must be on the mesh's devices, as JAX's jit requires.

  JAX's own error named ringflash's internal function, and at times another argument than
  the one misplaced (a committed `sinks` reported as `query`). Uncommitted arrays, tracers
  and abstract shardings are left to JAX (it moves uncommitted arrays itself), and so is
  everything under a trace: there JAX moves concrete arrays as the program's constants.

  Raises:
    ValueError: naming the first array on other devices, before any collective runs.
  """
  from jax._src import core  # pylint: disable=g-import-not-at-top
  clean = getattr(core, "trace_state_clean", None)
  if clean is None or not clean():
    return
  in_order = tuple(mesh.devices.flat)          # once a call, not once an array
  devices = set(in_order)
  for name, x in arrays.items():
    sharding = getattr(x, "sharding", None)
    if sharding is None:
      continue
    if isinstance(x, jax.Array) and not getattr(x, "committed", getattr(x, "_committed", True)):
      continue
    try:
      placed = set(sharding.device_set)
    except (AttributeError, RuntimeError, ValueError):   # a sharding on an abstract mesh
      continue
    if placed != devices:
      raise ValueError(
          f"{name} is committed to devices {sorted(d.id for d in placed)}, not to the mesh's "
          f"{sorted(d.id for d in devices)}: put it on the mesh (jax.device_put with a "
          f"NamedSharding of mesh)")
    # jit also wants the devices in the mesh's order (the order of jax.make_mesh, which
    # follows the topology, is not that of jax.devices()); a sharding of one device has
    # no order to differ in.
    order = tuple(getattr(sharding, "_device_assignment", None) or ())
    if len(order) > 1 and order != in_order:
      at = next(i for i, (a, b) in enumerate(zip(order, in_order)) if a != b)
      raise ValueError(
          f"{name} is committed to the mesh's devices in another order (device "
          f"{order[at].id} at position {at} of its sharding, where the mesh has device "
          f"{in_order[at].id}): put it on the mesh (jax.device_put with a "
          f"NamedSharding of mesh), or build the mesh in its order ({name}.sharding.mesh)")


def axis_names(axis_name):
  """axis_name as a tuple of names, or None where it is not one name or a non-empty tuple of
  distinct names."""
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  if (not isinstance(names, tuple) or not names or len(set(names)) != len(names)
      or not all(isinstance(a, str) for a in names)):
    return None
  return names


def seq_axes(shape, axis_name) -> _validate.SeqAxes:
  """The mesh axes the sequence is sharded over, checked against the mesh's axes."""
  names = axis_names(axis_name)
  if names is None or not all(a in shape for a in names):
    raise ValueError(f"axis_name must be a mesh axis or a tuple of distinct mesh axes; got "
                     f"{axis_name!r}, the mesh's axes are {tuple(shape)}")
  return _validate.SeqAxes(tuple(names), tuple(int(shape[a]) for a in names))


def varying_axes(x) -> frozenset:
  """The mesh axes x is typed as varying over (empty outside shard_map, or with
  check_vma=False, where nothing is typed)."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
  return frozenset(vma)


def varying(x) -> bool:
  """Whether x is typed by the mesh axes it varies over (shard_map with check_vma=True)."""
  return bool(varying_axes(x))


def check_sequence_sharded(names: tuple[str, ...], **arrays) -> None:
  """Inside shard_map with check_vma=True, each array must vary over every sequence axis: a
  key replicated over the ring (in_specs without the axis) would be taken as each device's
  own slice of the sequence, and the result would be silently wrong. Nothing is typed with
  check_vma=False, and nothing is checked."""
  typed = {name: varying_axes(x) for name, x in arrays.items()}
  if not any(typed.values()):
    return
  for name, axes in typed.items():
    missing = [a for a in names if a not in axes]
    if missing:
      raise ValueError(
          f"{name} does not vary over mesh axis {missing[0]!r} of axis_name: "
          f"ring_attention_sharded takes each device's own slice of the sequence, so "
          f"shard_map's in_specs must shard {name}'s sequence dim over axis_name")


def check_same_on_ring(names: tuple[str, ...], **arrays) -> None:
  """Inside shard_map with check_vma=True, sinks and sequence lengths are the whole
  sequence's: every device of the ring must hold the same ones. One typed as varying over a
  ring axis (in_specs sharding it over axis_name) may give each device other values, and the
  ring would merge blocks computed with different lengths or sinks into a silently wrong
  result; its values cannot be read here, so the type decides, and the message says how to
  make equal values invariant. Nothing is typed with check_vma=False: nothing is checked."""
  for name, x in arrays.items():
    if x is None or not isinstance(x, jax.Array):
      continue
    ring = [a for a in names if a in varying_axes(x)]
    if ring:
      raise ValueError(
          f"{name} varies over mesh axis {ring[0]!r} of axis_name: it applies to the whole "
          f"sequence, so every device of the ring must hold the same {name}; shard_map's "
          f"in_specs must not shard it over axis_name, and one computed inside the shard_map "
          f"must be typed invariant over it (where every device holds the same values, "
          f"jax.lax.pmax over axis_name makes it so)")


def check_no_explicit_axes() -> None:
  """Inside a shard_map manual over the ring's axis alone, other mesh axes may stay
  Explicit. Per-device kernels and collectives cannot run on arrays typed on such a mesh,
  sharded over those axes or not (JAX refuses the kernels' branches and refs, Pallas's
  interpreter, a reduce-scatter's lowering), so it is refused by name: the caller makes the
  shard_map manual over those axes too, or calls ring_attention on the global arrays."""
  mesh = jax.sharding.get_abstract_mesh()
  explicit = [a for a, t in zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ()))
              if t == jax.sharding.AxisType.Explicit]
  if explicit:
    raise NotImplementedError(
        f"ring_attention_sharded: mesh axis {explicit[0]!r} is Explicit and not manual in the "
        f"enclosing shard_map; make the shard_map manual over every Explicit axis "
        f"(axis_names, or leave axis_names unset), or call ring_attention on the global "
        f"arrays")


def current_platform():
  """Platform of the devices of the enclosing shard_map's mesh, and one such device."""
  abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  platform = getattr(abstract, "platform", None) or jax.default_backend()
  matching = [d for d in jax.devices() if d.platform == platform] if platform in (
      "cpu", "gpu", "cuda", "tpu") else []
  return platform, (matching[0] if matching else abstract)


def outer_axes(query, mesh: Mesh, axis_name: str):
  """Mesh axes that query's batch and heads are sharded over, where the sharding is visible.

  Concrete arrays carry a NamedSharding; inside jit, tracers show theirs on meshes with
  explicit axes (jax.sharding.AxisType.Explicit, jax.make_mesh's default). Inside jit on a
  mesh with Auto axes nothing is visible: batch and heads are then taken as unsharded over
  the other axes (the compiler reshards to match); use an explicit mesh there, or call
  ring_attention_sharded inside your own shard_map. The ring axis is never taken for batch
  or heads. Several leading batch dims are flattened into one, the sharded ones first
  (lead_order), major first: their axes together shard it.
  """
  entries = _visible_entries(query, mesh, axis_name)
  if entries is None:
    return None, None

  def entry_of(axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes

  batch = tuple(a for e in entries[:-3] for a in e)
  return entry_of(batch), entry_of(entries[-2])


def lead_order(query, mesh: Mesh, axis_name) -> tuple[int, ...] | None:
  """The order in which query's leading batch dims are flattened into one: those sharded
  over mesh axes first (in their order), then the rest; None where that is their own order.

  [B1, B2] with only B2 sharded over "data" flattens, in its own order, into a batch whose
  rows are not split by "data" in blocks (a reshape that Explicit axes refuse, and that
  Auto axes answer by moving the sharding onto B1); taken as [B2, B1] it is one batch
  sharded over "data". The rows of a batch are independent, so any order is exact; the
  output is put back in the user's.
  """
  # The ring's own axes count here: a batch dim sharded over them (a layout the strategy
  # reshards) is merged by the same reshape.
  entries = _visible_entries(query, mesh, ())
  if entries is None or len(entries) < 5:
    return None
  lead = entries[:-3]
  order = tuple(sorted(range(len(lead)), key=lambda i: not lead[i]))
  return None if order == tuple(range(len(lead))) else order


def _visible_entries(query, mesh: Mesh, axis_name):
  """query's partition spec entries, one per dim, each the tuple of mesh axes other than
  axis_name's that shard it; None where no sharding is visible (see outer_axes)."""
  spec = None
  sharding = getattr(query, "sharding", None) if not isinstance(query, jax.core.Tracer) else None
  if isinstance(sharding, NamedSharding) and sharding.mesh.shape == mesh.shape:
    spec = sharding.spec
  else:
    try:
      typed = jax.typeof(query).sharding
    except (AttributeError, TypeError):
      typed = None
    if typed is not None and tuple(getattr(typed.mesh, "axis_names", ())) == tuple(
        mesh.axis_names):
      spec = typed.spec
  rank = len(getattr(query, "shape", ()))
  if spec is None or rank < 3:
    return None
  entries = tuple(spec) + (None,) * (rank - len(tuple(spec)))
  seq = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)

  def names(entry):
    if entry is None:
      return ()
    return tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in seq)

  return tuple(names(e) for e in entries)


def check_divisible(b: int, k: int, mesh: Mesh, batch, heads) -> tuple[int, int]:
  """The devices the batch and the heads are split over (outer_axes' entries), checked: b
  (the batch, leading dims flattened) and k (kv heads) must divide over them.

  Raises:
    ValueError: naming the query batch or the key heads.
  """
  def size(entry):
    if entry is None:
      return 1
    names = (entry,) if isinstance(entry, str) else entry
    return int(np.prod([mesh.shape[a] for a in names]))

  if b % size(batch):
    raise ValueError(f"query batch {b} must divide over mesh axes {batch} "
                     f"({size(batch)} devices)")
  if k % size(heads):
    raise ValueError(f"key heads K={k} must divide over the mesh axes {heads} "
                     f"({size(heads)} devices) that query's heads are sharded over, so that "
                     f"each device keeps whole GQA groups")
  return size(batch), size(heads)


def place(x, mesh: Mesh, spec: P):
  """x laid out as a shard_map's in_spec `spec` wants it. On a mesh with Explicit axes (the
  type carries the sharding, and shard_map does not reshard: an array the caller did not lay
  out so, or one ringflash built, such as segment ids from lengths, would be refused) that
  is a jax.reshard; on Auto axes shard_map reshards by itself."""
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    return reshard(x, NamedSharding(mesh, spec))
  return x
