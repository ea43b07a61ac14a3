"""ringflash: exact ring attention over sequences too long for one accelerator."""

from ringflash.api import ring_attention as ring_attention
from ringflash.api import ring_attention_sharded as ring_attention_sharded
from ringflash.kernels.base import BlockSizes as BlockSizes
from ringflash.layouts import from_layout as from_layout
from ringflash.layouts import to_layout as to_layout

__version__ = "0.1.0"
