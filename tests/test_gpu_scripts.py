"""The parsing half of scripts/gpu_resources.py, on ptxas text as the H200 printed it."""

from __future__ import annotations

import importlib.util
import pathlib

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_resources.py"

# Abridged from run 12 (docs/GPU_NOTES.md): the causal backward, then a forward.
_INJECTED = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line {} by "
             "compiler to allow use of registers in GMMA in function 'entry_mosaic_gpu_kernel'\n")
_BACKWARD = _INJECTED.format(494) + _INJECTED.format(1855) + (
    "ptxas warning : Registers are spilled to local memory in function "
    "'entry_mosaic_gpu_kernel', 376 bytes spill stores, 480 bytes spill loads\n"
    "ptxas info    : Function properties for entry_mosaic_gpu_kernel\n"
    "    176 bytes stack frame, 376 bytes spill stores, 480 bytes spill loads\n"
    "ptxas info    : Used 168 registers, used 16 barriers, 176 bytes cumulative stack size, "
    "1 bytes smem\n")
_FORWARD = """\
ptxas info    : Function properties for entry_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
"""


def test_resources_report_reads_ptxas_output(tmp_path, capsys):
  spec = importlib.util.spec_from_file_location("gpu_resources", _SCRIPT)
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  for i, (ptxas, ptx, smem) in enumerate([(_FORWARD, "cp.async.bulk.tensor", 166912),
                                          (_BACKWARD, "cp.reduce.async.bulk.tensor", 197632)]):
    (tmp_path / f"entry_{i}.ptxas").write_text(ptxas)
    (tmp_path / f"entry_{i}.ptx").write_text(ptx)
    (tmp_path / f"entry_{i}.resources.txt").write_text(f"Resources(smem_scratch_bytes={smem})")
  script._report(tmp_path)  # pylint: disable=protected-access
  forward, backward = capsys.readouterr().out.splitlines()
  assert forward.split()[:2] == ["entry_0", "forward"]
  assert "spill stores    0 B" in forward and "injected waits  0" in forward
  assert "smem 163 KiB" in forward
  assert backward.split()[:2] == ["entry_1", "backward"]
  assert "registers  168" in backward and "spill stores  376 B" in backward
  assert "loads  480 B" in backward and "stack  176 B" in backward
  assert "injected waits  2" in backward and "smem 193 KiB" in backward
