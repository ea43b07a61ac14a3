"""Attention on one block pair on one device: the kernel contract and its backends.

Backends are modules with `forward`, `backward` and `resolve_block_sizes`; they are
imported on first use, never at import time of ringflash.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ringflash.kernels.base import BlockSizes as BlockSizes
from ringflash.kernels.base import KernelSpec as KernelSpec

BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")


def get_backend(name: str) -> ModuleType:
  """The backend module called `name` (one of BACKENDS)."""
  if name not in BACKENDS:
    raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {name!r}")
  return importlib.import_module(f"ringflash.kernels.{name}")
