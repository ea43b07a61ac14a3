"""Tile configurations, one per backend: frozen, validated, carrying only what the backend uses.

`ring_attention(..., block_sizes=...)` takes the configuration of the backend that runs
(None: that backend's defaults); a configuration of another backend is an error, so no field
is ever silently ignored. Unset fields (None) are resolved per call by the backend's
`resolve_tiles` (its per-hardware defaults, checked against the local lengths); the kernel
spec carries the resolved configuration, every size an int.

This module imports nothing heavy, so `ringflash` can export the classes while the backends
themselves are imported on first use.
"""

from __future__ import annotations

import dataclasses


def check_tile_fields(config) -> None:
  """__post_init__ of every configuration here: each set field is a positive int.

  Raises:
    ValueError: naming the field.
  """
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"block_sizes.{field.name} must be a positive int or None, got "
                       f"{value!r} ({type(config).__name__})")


@dataclasses.dataclass(frozen=True)
class XlaBlockSizes:
  """Tiles of the xla backend. None: the largest divisor of the length that is at most 512,
  or, where that is below 64 rows and not the length itself, near-equal tiles of at most 512
  rows whose last one the kernels pad (kernels/xla.default_block). A given size must divide
  its length.

  Attributes:
    block_q, block_k: the forward's query and key rows per tile.
    block_q_bwd, block_k_bwd: the backward's (default: the forward's).
  """

  block_q: int | None = None
  block_k: int | None = None
  block_q_bwd: int | None = None
  block_k_bwd: int | None = None

  def __post_init__(self):
    check_tile_fields(self)


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
  """Tiles of the pallas_tpu kernels; None leaves a size to the per-generation default.

  Every size must divide its local length and be a multiple of the sublanes (16 for 2-byte
  dtypes, 8 for 4-byte ones) where those divide the length, else of 8 where 8 does (a
  bfloat16 length of 520 takes 104), or be the whole length. 128 key rows (a lane count:
  key positions are a [1, bk] row) are preferred, not needed.

  Attributes:
    block_q, block_k: the forward kernel's tiles.
    block_q_dkv, block_k_dkv: the dK/dV kernel's (default: the forward's).
    block_q_dq, block_k_dq: the dQ kernel's (default: the forward's).
  """

  block_q: int | None = None
  block_k: int | None = None
  block_q_dkv: int | None = None
  block_k_dkv: int | None = None
  block_q_dq: int | None = None
  block_k_dq: int | None = None

  def __post_init__(self):
    check_tile_fields(self)


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
  """Tiles of the Mosaic GPU forward; None leaves a size to the default (block_q 64; block_k
  128 where the padded head dims allow it, Hv <= 128 and H <= 192, else 64).

  One compute warpgroup owns `block_q` query rows (a CUDA block covers 2 * block_q), the
  memory warpgroup streams `block_k` key rows per step through `stages` shared-memory slots.
  The backward's tiles are fixed at 64 x 64 (registers bound them).

  Attributes:
    block_q, block_k: multiples of 64; block_k at most 256.
    stages: K/V pipeline depth, at least 2.
  """

  block_q: int | None = None
  block_k: int | None = None
  stages: int | None = None

  def __post_init__(self):
    check_tile_fields(self)
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if value is not None and value % 64:
        raise ValueError(f"block_sizes.{name}={value} must be a multiple of 64 (backend "
                         f"'pallas_gpu')")
    if self.block_k is not None and self.block_k > 256:
      # Q K^T of a step is one wgmma of N = block_k columns, which Hopper bounds at 256.
      raise ValueError(f"block_sizes.block_k={self.block_k} must be at most 256 (one wgmma "
                       f"of N = block_k columns; backend 'pallas_gpu')")
    if self.stages is not None and self.stages < 2:
      raise ValueError(f"block_sizes.stages={self.stages} must be at least 2 (backend "
                       f"'pallas_gpu')")


BY_BACKEND = {"xla": XlaBlockSizes, "pallas_tpu": TpuBlockSizes, "pallas_gpu": GpuBlockSizes}
