"""Attention on one block pair on one device: the kernel contract and its backends.

A backend is a module with NAME, `unsupported(problem)` (why it cannot run a call, or None),
`resolve_tiles(block_sizes, problem)` (its tile configuration, kernels/tiles.py, resolved),
`forward` and `backward` (kernels/base.py has the contract). Backends are imported on first
use, never at import time of ringflash.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ringflash.kernels.base import KernelSpec as KernelSpec
from ringflash.kernels.base import Problem as Problem
from ringflash.kernels.tiles import GpuBlockSizes as GpuBlockSizes
from ringflash.kernels.tiles import TpuBlockSizes as TpuBlockSizes
from ringflash.kernels.tiles import XlaBlockSizes as XlaBlockSizes

BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")


def get_backend(name: str) -> ModuleType:
  """The backend module called `name` (one of BACKENDS)."""
  if name not in BACKENDS:
    raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {name!r}")
  return importlib.import_module(f"ringflash.kernels.{name}")
