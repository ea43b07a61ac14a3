"""The parsing halves of scripts/gpu_resources.py and scripts/gpu_stalls.py, on text in the
formats ptxas and Nsight Compute printed on the H200, and scripts/gpu_tests.py's dealing of
cases to processes."""

from __future__ import annotations

import pytest

import helpers

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
_SERIALIZED = (
    "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are "
    "serialized due to non wgmma instructions defining accumulator registers of a wgmma "
    "between start and end of the pipeline stage in the function 'entry_mosaic_gpu_kernel'\n")
_FORWARD = """\
ptxas info    : Function properties for entry_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
"""


def test_resources_report_reads_ptxas_output(tmp_path, capsys):
  script = helpers.load_script("gpu_resources")
  for i, (ptxas, ptx, smem) in enumerate([(_FORWARD, "cp.async.bulk.tensor", 166912),
                                          (_BACKWARD, "cp.reduce.async.bulk.tensor", 197632)]):
    (tmp_path / f"entry_{i}.ptxas").write_text(ptxas)
    (tmp_path / f"entry_{i}.ptx").write_text(ptx)
    (tmp_path / f"entry_{i}.resources.txt").write_text(f"Resources(smem_scratch_bytes={smem})")
  script._report(tmp_path)  # pylint: disable=protected-access
  forward, backward = capsys.readouterr().out.splitlines()
  assert forward.split()[:2] == ["entry_0", "forward"]
  assert "spill stores    0 B" in forward and "injected waits  0" in forward
  assert "serialized  0" in forward and forward.endswith("KiB")
  assert "smem 163 KiB" in forward
  assert backward.split()[:2] == ["entry_1", "backward"]
  assert "registers  168" in backward and "spill stores  376 B" in backward
  assert "loads  480 B" in backward and "stack  176 B" in backward
  assert "injected waits  2" in backward and "smem 193 KiB" in backward
  assert "serialized  0" in backward and backward.endswith("KiB")


def test_resources_report_counts_serialized_wgmma(tmp_path, capsys):
  script = helpers.load_script("gpu_resources")
  (tmp_path / "entry_0.ptxas").write_text(_SERIALIZED + _FORWARD)
  (tmp_path / "entry_0.ptx").write_text("cp.async.bulk.tensor")
  script._report(tmp_path)  # pylint: disable=protected-access
  line, = capsys.readouterr().out.splitlines()
  assert "injected waits  0" in line and "serialized  1" in line
  assert line.endswith("smem ? KiB  (non wgmma instructions defining accumulator registers of a w)")


# The backward's H200 CSV has these columns among others; each "(Not Issued)" column counts
# a subset of the samples of its reason and must not be added to it.
_HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
           "Warp Stall Sampling (Not-issued Samples)", "# Samples", "Instructions Executed",
           "stall_barrier", "stall_drain", "stall_long_sb", "stall_short_sb", "stall_wait",
           "stall_barrier (Not Issued)", "stall_long_sb (Not Issued)", "stall_wait (Not Issued)"]


def _sass_csv(kernels):
  """Text in the format of `ncu --page source --csv --print-source sass`.

  kernels: lists of (SASS, samples, {reason: samples}), one list per kernel.
  """
  def line(cells):
    return ",".join(f'"{cell}"' for cell in cells) + "\n"
  text = ""
  for rows in kernels:
    text += '"Kernel Name","entry_mosaic_gpu_kernel",\n' + line(_HEADER)
    for i, (sass, samples, stalls) in enumerate(rows):
      values = {"Address": f"0x7f77b37a{0xea00 + 16 * i:04x}", "Source": f"      {sass}",
                "Warp Stall Sampling (All Samples)": samples, "# Samples": samples,
                "Warp Stall Sampling (Not-issued Samples)": "7",
                "Instructions Executed": "1,032,192"}
      values.update({f"stall_{reason}": n for reason, n in stalls.items()})
      values.update({f"stall_{reason} (Not Issued)": "9" for reason in stalls})
      text += line(values.get(name, "0") for name in _HEADER)
  return text


_COMPUTE = [
    ("LDC R1, c[0x0][0x28]", "0", {}),
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8", "0", {}),
    ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0", "1,000", {"wait": "1,000"}),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", "2,000", {"barrier": "2,000"}),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R10", "0", {}),
    ("LDL R20, [R1+0x10]", "250", {"long_sb": "200", "wait": "50"}),
    ("@!P1  BRA 0x7f77b37aeb00", "500", {"long_sb": "500"}),
    # Near the try-wait but not its branch: another predicate.
    ("@P3   BRA 0x7f77b37aea00", "250", {"short_sb": "250"}),
    ("@P0   EXIT", "0", {}),
]
_MEMORY = [
    ("USETMAXREG.DEALLOC.CTAPOOL 0x28", "0", {}),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR9], R4", "0", {}),
    ("@!P2  BRA 0x7f77b37aeb20", "3,000", {"long_sb": "3,000"}),
    ("BAR.SYNC.DEFER_BLOCKING R12, 0x80", "1,000", {"barrier": "1,000"}),
    ("EXIT", "0", {}),
]
_RETRY = [("MOV R16, UR9", "2,000", {"drain": "2,000"}),
          ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R16+URZ], R10", "0", {})]
# A kernel without a memory warpgroup: all compute up to its last EXIT.
_PLAIN = [("FFMA R2, R3, R4, R2", "1,032,192", {"wait": "1,032,192"}), ("EXIT", "0", {}),
          ("BRA 0x7f77b37aea10", "0", {})]


def test_stalls_split_roles_and_categories(tmp_path, capsys):
  script = helpers.load_script("gpu_stalls")
  path = tmp_path / "sass.csv"
  path.write_text(_sass_csv([_COMPUTE + _MEMORY + _RETRY, _PLAIN]))
  first, second = script.parse(path)
  assert [row["samples"] for row in first["rows"][2:4]] == [1000, 2000]
  a = script.analyse(first, top=3)
  assert a["samples"] == 10000
  compute, memory, retry = (a["roles"][role] for role in ("compute", "memory", "retry"))
  assert (compute["samples"], memory["samples"], retry["samples"]) == (4000, 4000, 2000)
  assert (compute["share"], memory["share"], retry["share"]) == (0.4, 0.4, 0.2)
  assert compute["stalls"] == [("barrier", 0.5), ("wait", 0.2625), ("long_sb", 0.175),
                               ("short_sb", 0.0625)]
  assert compute["categories"] == {"wgmma waits": 0.5, "mbarrier waits": 0.125, "spill": 0.0625,
                                   "fences": 0.0, "named barriers": 0.0}
  assert memory["stalls"] == [("long_sb", 0.75), ("barrier", 0.25)]
  assert memory["categories"] == {"wgmma waits": 0.0, "mbarrier waits": 0.75, "spill": 0.0,
                                  "fences": 0.0, "named barriers": 0.25}
  assert retry["stalls"] == [("drain", 1.0)] and not any(retry["categories"].values())
  assert [(t["share"], t["address"] & 0xfffff, t["sass"]) for t in a["top"]] == [
      (0.5, 0xaea30, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
      (0.25, 0xaea20, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0"),
      (0.125, 0xaea60, "@!P1 BRA 0x7f77b37aeb00")]
  assert a["top"][0]["stalls"] == [("barrier", 1.0)] and a["top"][0]["phasechk"] is None
  assert a["top"][2]["phasechk"] == "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R10"

  b = script.analyse(second)
  assert b["samples"] == 1032192 and b["roles"]["compute"]["share"] == 1.0
  assert b["roles"]["memory"]["samples"] == 0 and b["roles"]["retry"]["samples"] == 0

  script.report(path, top=3)
  out = capsys.readouterr().out
  assert "kernel 0: entry_mosaic_gpu_kernel, 16 instructions, 10000 samples" in out
  assert "kernel 1: entry_mosaic_gpu_kernel, 3 instructions, 1032192 samples" in out
  assert "wgmma waits 50.0%  mbarrier waits 12.5%  spill 6.2%" in out
  assert "after SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R10" in out


def test_gpu_tests_deals_the_collected_cases_and_reads_the_summaries():
  script = helpers.load_script("gpu_tests")
  collected = ("tests/contract/test_pallas_gpu.py::TestPallasGpu::test_lse_cotangent_flows\n"
               "tests/test_pallas_gpu.py::test_auto_picks_pallas_gpu\n"
               "tests/test_pallas_gpu.py::test_ring_one_gpu_matches_oracle[True-2]\n"
               "\n3 tests collected in 0.11s\n")
  ids = script.case_ids(collected)
  assert ids == ["contract/test_pallas_gpu.py::TestPallasGpu::test_lse_cotangent_flows",
                 "test_pallas_gpu.py::test_auto_picks_pallas_gpu",
                 "test_pallas_gpu.py::test_ring_one_gpu_matches_oracle[True-2]"]
  assert script.deal(ids, 2) == [[ids[0], ids[2]], [ids[1]]]
  assert script.deal(ids, 5) == [[ids[0]], [ids[1]], [ids[2]]]
  # --part i/n: every n-th case from the i-th; the shares together are the selection, once
  assert script.part_of(ids, "1/2") == [ids[0], ids[2]]
  assert script.part_of(ids, "2/2") == [ids[1]]
  many = [f"case{i}" for i in range(76)]
  shares = [script.part_of(many, f"{i}/3") for i in (1, 2, 3)]
  assert sorted(sum(shares, [])) == sorted(many) and [len(s) for s in shares] == [26, 25, 25]
  assert script.part_of(ids, "1/1") == ids and script.part_of(ids, "4/4") == []
  for bad in ("0/2", "3/2", "1", "1/0", "a/b", "-1/2", "1/2/3"):
    with pytest.raises(ValueError, match="--part must be i/n"):
      script.part_of(ids, bad)
  log = ("..F\n=== short test summary info ===\n"
         "FAILED test_pallas_gpu.py::test_auto_picks_pallas_gpu - AssertionError\n"
         "1 failed, 2 passed in 97.10s (0:01:37)\n\n")
  assert script.summary(log) == (
      "1 failed, 2 passed in 97.10s (0:01:37)",
      ["FAILED test_pallas_gpu.py::test_auto_picks_pallas_gpu - AssertionError"])
  assert script.summary("") == ("(no output)", [])
  assert script.summary("=========== 3 passed in 9.10s ===========\n")[0] == "3 passed in 9.10s"
  # a process past --timeout: the cases whose result line it printed, as ids of tests/; the
  # one it was running when killed (its id printed, no outcome yet) did not finish
  log = ("collected 3 items\n\n"
         f"{ids[0]} PASSED                    [ 33%]\n"
         f"tests/{ids[2]} FAILED              [ 66%]\n"
         f"{ids[1]} ")
  assert script.results(log, ids) == {ids[0]: "PASSED", ids[2]: "FAILED"}
  assert script.results("collected 3 items\n", ids) == {}
