"""ringflash: exact ring attention over sequences too long for one accelerator."""

import os as _os

# kernels/, parallel/ and launch/ are installed as ringflash.kernels, ... (pyproject.toml's
# package-dir). When ringflash is imported straight from a source tree instead (the
# repository root on sys.path: an older setuptools' editable install, or python run from
# the root), they sit beside this folder: let the package find them there.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "kernels")) and _os.path.isfile(
    _os.path.join(_root, "kernels", "base.py")):
  __path__.append(_root)  # noqa: F821  (__path__ is defined for packages)

from ringflash.api import ring_attention as ring_attention
from ringflash.api import ring_attention_sharded as ring_attention_sharded
from ringflash.kernels.base import BlockSizes as BlockSizes
from ringflash.layouts import from_layout as from_layout
from ringflash.layouts import to_layout as to_layout

__version__ = "0.1.0"
