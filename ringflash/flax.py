"""Flax NNX: ring attention as the `attention_fn` of `flax.nnx.MultiHeadAttention`.

    mha = nnx.MultiHeadAttention(
        num_heads=16, in_features=2048, decode=False, rngs=nnx.Rngs(0),
        attention_fn=ringflash.flax_attention_fn(mesh=mesh, axis_name="sp", is_causal=True))
    y = mha(x)        # x [B, T, F], its sequence axis sharded over "sp"

MultiHeadAttention projects x [..., T, F] to query [..., T, N, H] and key, value
[..., S, K, H] (per token, so the sequence sharding of x carries over), then calls
`attention_fn(query, key, value, mask=..., dropout_rng=..., dropout_rate=...,
broadcast_dropout=..., deterministic=..., dtype=..., precision=..., module=...,
is_causal=...)`, adding `input_positions=...` when its call is given them. The function
returned here takes the arguments of `flax.nnx.dot_product_attention` (and
input_positions) and maps each onto ring_attention, or refuses it with NotImplementedError
where ring attention cannot honour it:

  mask            a dense boolean [..., N|1, T, S] array: exactly the [T, S] matrix the ring
                  never builds. None only; give the pattern as options of flax_attention_fn
                  instead (is_causal, local_window_size). decode=True also builds such a
                  mask (of the key-value cache), so decoding is not supported.
  bias            None only (a dense [..., N, T, S] array as well).
  dropout         of the attention weights: dropout_rate > 0 with deterministic=False is
                  refused; dropout_rng and broadcast_dropout are then unused.
  module          (MultiHeadAttention's sow_weights=True) would sow the [..., N, T, S]
                  weights: None only.
  input_positions (RoPE through nnx.dot_product_attention_with_rope) None only; rotate
                  query and key in a wrapper of your own before calling this function.
  dtype           as flax: query, key and value are promoted by `promote_dtype` (flax's
                  `flax.nnx.nn.dtypes.promote_dtype` unless given) to `dtype`, or to their
                  common type when it is None; the output has that dtype.
  precision       accepted and met: every backend multiplies float32 blocks at
                  lax.Precision.HIGHEST and 16-bit blocks natively, accumulating in float32.
  is_causal       the call's flag (`mha(x, is_causal=True)`) and the option of
                  flax_attention_fn: causal when either is True.

Per-call arrays other than query, key and value (segment ids, sequence lengths) cannot pass
through MultiHeadAttention, which calls attention_fn with a fixed set of arguments: for
packed documents, call `ringflash.ring_attention(..., segment_ids=...)` in a module of your
own. flax (>= 0.12.10, the first that runs on jax 0.11.2) is an optional dependency:
`pip install ringflash[flax]`; flax_attention_fn imports it when called, `import ringflash`
never does.
"""

from __future__ import annotations

import functools

from jax.sharding import Mesh

from ringflash import _validate
from ringflash.api import ring_attention


def flax_attention_fn(*, mesh: Mesh | None = None, axis_name: str = "sp",
                      is_causal: bool = False, scale: float | None = None,
                      backend: str = "auto", block_sizes=None, layout: str = "contiguous",
                      local_window_size: int | tuple[int, int] | None = None,
                      bidirectional: bool = False, sinks=None,
                      logits_soft_cap: float | None = None, strategy: str = "auto"):
  """An `attention_fn` for `flax.nnx.MultiHeadAttention` that runs ring_attention.

  Args:
    mesh: the device mesh; None takes the mesh of jax.set_mesh where one is set, else a
      1-D mesh over jax.devices() named `axis_name` (as ring_attention's mesh=None).
    axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
    is_causal: mask keys after the query position (also when a call passes is_causal=True).
    scale, backend, block_sizes, local_window_size, bidirectional, logits_soft_cap,
      strategy: as ring_attention.
    layout: as ring_attention: with "zigzag" or "striped" the module's inputs [..., T, F]
      must already be in that order (ringflash.to_layout on the tokens), and so is its
      output.
    sinks: None or a fixed [N] float array (as ring_attention, but a constant of the
      function: a learned sink belongs to a module that calls ring_attention itself).

  Options are validated by ring_attention when the function is first called (traced), with
  its ValueError and NotImplementedError messages.

  Returns:
    attention_fn(query [..., T, N, H], key [..., S, K, H], value [..., S, K, Hv], *,
    bias=None, mask=None, broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0,
    deterministic=False, dtype=None, precision=None, module=None, promote_dtype=None,
    is_causal=False, input_positions=None) -> [..., T, N, Hv], the keywords of
    flax.nnx.dot_product_attention.

  Raises:
    ValueError: is_causal is not a bool.
    ImportError: flax is not installed.
  """
  is_causal = _validate.check_flag("is_causal", is_causal)
  flax_promote_dtype = _flax_promote_dtype()
  ring = functools.partial(
      ring_attention, mesh=mesh, axis_name=axis_name, scale=scale, backend=backend,
      block_sizes=block_sizes, layout=layout, local_window_size=local_window_size,
      bidirectional=bidirectional, sinks=sinks, logits_soft_cap=logits_soft_cap,
      strategy=strategy)
  causal_option = is_causal

  def attention_fn(query, key, value, *, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, promote_dtype=None, is_causal=False,
                   input_positions=None):
    """ring_attention called as flax.nnx.dot_product_attention; see ringflash/flax.py."""
    del broadcast_dropout, dropout_rng, precision     # dropout refused; precision met
    _refuse(bias=bias, mask=mask, dropout_rate=dropout_rate, deterministic=deterministic,
            module=module, input_positions=input_positions)
    is_causal = _validate.check_flag("is_causal", is_causal)
    promote = flax_promote_dtype if promote_dtype is None else promote_dtype
    query, key, value = promote((query, key, value), dtype=dtype)
    return ring(query, key, value, is_causal=causal_option or is_causal)

  return attention_fn


def _refuse(*, bias, mask, dropout_rate, deterministic, module, input_positions):
  """NotImplementedError for every argument of flax's attention that the ring cannot honour,
  before any work."""
  if mask is not None:
    raise NotImplementedError(
        "ringflash.flax_attention_fn: a dense attention mask (mask=, shape "
        f"{getattr(mask, 'shape', '?')}) is not supported: ring attention never builds the "
        "[T, S] matrix. Give the pattern as options instead, "
        "flax_attention_fn(is_causal=True, local_window_size=...), and call the module "
        "without mask= (MultiHeadAttention builds a mask itself with decode=True, which is "
        "not supported either)")
  if bias is not None:
    raise NotImplementedError(
        "ringflash.flax_attention_fn: an attention bias (bias=) is not supported: ring "
        "attention never builds the [T, S] matrix it would be added to")
  if not 0.0 <= dropout_rate < 1.0:          # flax's own rule (NaN fails it too)
    raise ValueError(f"dropout_rate must be in the range [0, 1), got {dropout_rate!r}")
  if dropout_rate > 0.0 and not deterministic:
    raise NotImplementedError(
        f"ringflash.flax_attention_fn: dropout of the attention weights ({dropout_rate=}, "
        f"{deterministic=}) is not supported; use dropout_rate=0.0 or deterministic=True")
  if module is not None:
    raise NotImplementedError(
        "ringflash.flax_attention_fn: sowing the attention weights (module=, "
        "MultiHeadAttention's sow_weights=True) is not supported: ring attention never "
        "builds the [T, S] weights")
  if input_positions is not None:
    raise NotImplementedError(
        "ringflash.flax_attention_fn: input_positions= (RoPE) is not supported; rotate "
        "query and key in an attention_fn of your own, then call this function")


def _flax_promote_dtype():
  """flax's promote_dtype, the one flax.nnx.dot_product_attention applies by default."""
  try:
    from flax.nnx.nn import dtypes  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    raise ImportError("ringflash.flax_attention_fn needs flax: pip install "
                      "'ringflash[flax]'") from err
  return dtypes.promote_dtype
