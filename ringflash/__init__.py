"""ringflash: exact ring attention over sequences too long for one accelerator."""

import importlib.metadata as _metadata

from ringflash.api import explain as explain
from ringflash.api import ring_attention as ring_attention
from ringflash.api import ring_attention_sharded as ring_attention_sharded
from ringflash.decode import decode_attention as decode_attention
from ringflash.flax import flax_attention_fn as flax_attention_fn
from ringflash.kernels.tiles import GpuBlockSizes as GpuBlockSizes
from ringflash.kernels.tiles import TpuBlockSizes as TpuBlockSizes
from ringflash.kernels.tiles import XlaBlockSizes as XlaBlockSizes
from ringflash.kvcache import KVCache as KVCache
from ringflash.layouts import from_layout as from_layout
from ringflash.layouts import to_layout as to_layout
from ringflash.options import GPU_XLA_OPTIONS as GPU_XLA_OPTIONS
from ringflash.parallel.local import RESIDUAL_NAMES as RESIDUAL_NAMES

try:
  __version__ = _metadata.version("ringflash")
except _metadata.PackageNotFoundError:      # imported from a tree that was never installed
  __version__ = "0+unknown"
