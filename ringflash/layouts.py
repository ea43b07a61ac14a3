"""Sequence layouts over the ring: the public permutations to_layout and from_layout.

A layout says which global positions each device of a ring of P devices holds (the table,
with examples, opens ringflash/parallel/plan.py: contiguous, zigzag, striped); masks are
functions of global positions, so a layout changes nothing but those positions.

Which to use: with causal masking the contiguous layout gives device P-1 about P/2 times the
mean work (it sees every earlier block, device 0 only its own), and the ring runs at the
pace of its busiest device. zigzag and striped give every device the same work to within a
tile (ringflash.parallel.plan.plan_ring counts them; `ringflash demo` prints the table).
zigzag keeps runs of c consecutive tokens together, so whole tiles on the diagonal chunks
are skipped and block sizes stay free;
striped spreads every tile over the whole sequence, so almost no causal tile is skipped
outright but each is half masked. Prefer zigzag for causal training; striped when T / P is
too short to cut in two chunks of whole tiles; contiguous for non-causal attention and for
sliding windows, where it lets the ring stop after the hops the window needs.

The caller permutes once, outside the model: a data loader applies `to_layout` to the
tokens, labels and segment ids of each batch (as Llama 3's context parallelism does), every
attention layer runs with `layout=...`, and `from_layout` restores natural order where it
matters (e.g. for inspection). Per-token operations (embeddings, MLPs, the loss) do not care
about the order; position embeddings must use the true positions, `layout_positions`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

from ringflash.parallel.plan import LAYOUTS as LAYOUTS
from ringflash.parallel.plan import check_layout as check_layout
from ringflash.parallel.plan import layout_order
from ringflash.parallel.plan import layout_positions as layout_positions


def to_layout(x, layout: str, ring_size: int, axis: int = 1):
  """Permutes a natural-order array into `layout` on a ring of `ring_size` devices.

  When the length n fits the layout (a multiple of P, of 2P for zigzag), the result split
  into P equal slices along `axis` gives device i its positions: slice i is x at
  layout_positions(layout, P, n)[i]. zigzag, P = 2, n = 8: natural 0..7 becomes
  0 1 6 7 | 2 3 4 5. Any other length is ordered as the smallest length that fits, with the
  positions past n left out (zigzag, P = 2, n = 7: 0 1 6 2 3 4 5); ring_attention takes
  such a sequence as it is and pads it inside. to_layout(np.arange(n), layout, P, axis=0)
  gives the positions of the rows (for position embeddings).

  Args:
    x: array (jax or NumPy) with the sequence along `axis`: q/k/v [B, T, N, H], segment ids
      [B, T], tokens [B, T].
    layout: "contiguous", "zigzag" or "striped".
    ring_size: P, the size of the mesh axis the sequence is sharded over.
    axis: the sequence axis.

  Returns:
    An array of x's shape and type, permuted along `axis`.

  Raises:
    ValueError: unknown layout, a ring_size that is not a positive int, or an axis out of
      range.
  """
  order = layout_order(layout, ring_size, _axis_len(x, axis))
  return _take(x, order, axis, layout)


def from_layout(y, layout: str, ring_size: int, axis: int = 1):
  """Inverse of to_layout: from_layout(to_layout(x, L, P), L, P) == x, for any length.

  Args:
    y: array in `layout` order along `axis` (e.g. ring_attention's output [B, T, N, H]).
    layout, ring_size, axis: as given to to_layout.

  Returns:
    y in natural order.

  Raises:
    ValueError: as to_layout.
  """
  order = layout_order(layout, ring_size, _axis_len(y, axis))
  # order[r] is the natural position of layout row r, so the row holding position t is
  # argsort(order)[t].
  return _take(y, np.argsort(order), axis, layout)


def _axis_len(x, axis):
  shape = getattr(x, "shape", None)
  if shape is None:
    raise ValueError(f"x must be an array, got {type(x).__name__}")
  if not isinstance(axis, (int, np.integer)) or isinstance(axis, (bool, np.bool_)):
    raise ValueError(f"axis must be an int, got {axis!r}")
  if not -len(shape) <= axis < len(shape):
    raise ValueError(f"axis={axis} is out of range for an array of rank {len(shape)}")
  return shape[axis]


def _take(x, order, axis, layout):
  """x permuted along axis by `order`, keeping x's sharding where it is visible (a concrete
  array's NamedSharding; a tracer's on a mesh of Explicit axes): a gather along a sharded
  axis would otherwise come out replicated (every device holding the whole sequence), or be
  refused on Explicit axes."""
  if layout == "contiguous":
    return x
  if isinstance(x, np.ndarray):
    return np.take(x, order, axis=axis)
  index = np.asarray(order, np.int32)

  def take(x):
    return jnp.take(x, index, axis=axis)

  if isinstance(x, jax.core.Tracer):
    sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and any(
        t == AxisType.Explicit for t in getattr(sharding.mesh, "axis_types", ())):
      return jax.sharding.auto_axes(take, out_sharding=sharding)(x)
    return take(x)
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return take(x)
  if any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
    return jax.jit(jax.sharding.auto_axes(take, out_sharding=sharding))(x)
  return jax.jit(take, out_shardings=sharding)(x)
