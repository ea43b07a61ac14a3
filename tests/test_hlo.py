"""ringflash.cli.hlo reads compiled HLO text: which ring-loop K/V permutes are in flight around
a kernel. Checked on small modules written in the compiled format of each platform."""

from __future__ import annotations

import pytest

import helpers
from ringflash.cli import hlo

KV = "bf16[1,4096,8,128]{3,2,1,0}"
START = (f"  %collective-permute-start.1 = ({KV}, {KV}, u32[], u32[]) "
         "collective-permute-start(%kv), channel_id=1, source_target_pairs={{0,1},{1,0}}")
# the GPU compiler's format of the same start: its operands as a nested tuple
START_GPU = (f"  %collective-permute-start.1 = (({KV}), {KV}) collective-permute-start(%kv), "
             "channel_id=1, source_target_pairs={{0,1},{1,0}}")
DONE = f"  %collective-permute-done.1 = {KV} collective-permute-done(%collective-permute-start.1)"
SYNC = (f"  %ppermute.3 = {KV} collective-permute(%kv), channel_id=1, "
        "source_target_pairs={{0,1},{1,0}}")
TARGETS = {
    "mosaic_gpu": f'  %o = f32[1,4096,8,128] custom-call({KV} %q, {KV} %kv), '
                  'custom_call_target="mosaic_gpu_v2"',
    "tpu": '  %o = f32[1,4096,8,128] custom-call(%q, %kv), custom_call_target="tpu_custom_call"',
    "triton": '  %o = f32[1,4096,8,128] fusion(%q, %kv), kind=kCustom, calls=%triton_comp, '
              'backend_config={"fusion_backend_config":{"kind":"__triton"}}',
    "nested": "  %o = f32[1,4096,8,128] fusion(%q, %kv), kind=kCustom, calls=%wrapped",
}
WRAPPED = ("%wrapped (a: bf16[1,4096,8,128]) -> f32[1,4096,8,128] {\n"
           '  ROOT %k = f32[1,4096,8,128] custom-call(%a), custom_call_target="mosaic_gpu"\n'
           "}\n")


def _module(body_lines):
  body = "\n".join([f"  %kv = {KV} parameter(0)", "  %q = bf16[1,4096,8,128] parameter(1)",
                    *body_lines, "  ROOT %t = (f32[1,4096,8,128]) tuple(%o)"])
  return (f"HloModule jit_f\n\n{WRAPPED}\n"
          f"%ring_body.2 (p: ({KV})) -> (f32[1,4096,8,128]) {{\n{body}\n}}\n\n"
          "ENTRY %main.9 (x: bf16[1,4096,8,128]) -> f32[1,4096,8,128] {\n"
          "  %while.1 = (f32[1,4096,8,128]) while(%init), condition=%cond.3, "
          "body=%ring_body.2\n}\n")


@pytest.mark.parametrize("start", [START, START_GPU], ids=["tpu_format", "gpu_format"])
@pytest.mark.parametrize("kernel", sorted(TARGETS))
def test_a_kernel_between_start_and_done_is_overlap(kernel, start):
  found = hlo.permute_overlap(_module([start, TARGETS[kernel], DONE]))
  assert found == [hlo.PermuteOverlap("ring_body.2", "collective-permute-start.1",
                                      "bf16[1,4096,8,128]", True)]
  assert hlo.overlap_summary(found) == (
      "permutes spanning a kernel: bf16[1,4096,8,128] 1 of 1")


@pytest.mark.parametrize("order", ["kernel_first", "kernel_after_done", "synchronous"])
def test_a_transfer_that_spans_no_kernel_is_reported(order):
  kernel = TARGETS["mosaic_gpu"]
  lines = {"kernel_first": [kernel, START, DONE], "kernel_after_done": [START, DONE, kernel],
           "synchronous": [SYNC, kernel]}[order]
  found = hlo.permute_overlap(_module(lines))
  assert len(found) == 1 and not found[0].encloses_kernel, found
  assert found[0].shape == "bf16[1,4096,8,128]"


def test_computations_without_a_kernel_are_not_ring_steps():
  plain = "  %o = f32[1,4096,8,128] fusion(%q, %kv), kind=kLoop, calls=%fused"
  assert hlo.permute_overlap(_module([START, plain, DONE])) == []
  assert hlo.overlap_summary([]) == "permutes spanning a kernel: none found"


def test_an_unrolled_ring_is_read_in_its_own_computation():
  """XLA unrolls a short ring loop (2 devices) into the calling computation."""
  positions = ("  %collective-permute-start.2 = (s32[4096]{0}, s32[4096]{0}) "
               "collective-permute-start(%pos), channel_id=2")
  text = _module([]).replace(
      "  %while.1 = (f32[1,4096,8,128]) while(%init), condition=%cond.3, body=%ring_body.2\n",
      "\n".join([START, positions, TARGETS["mosaic_gpu"], DONE,
                 "  %collective-permute-done.2 = s32[4096]{0} collective-permute-done("
                 "%collective-permute-start.2)", TARGETS["mosaic_gpu"], ""]))
  found = hlo.permute_overlap(text)
  assert [(p.body, p.shape, p.encloses_kernel) for p in found] == [
      ("main.9", "bf16[1,4096,8,128]", True), ("main.9", "s32[4096]", True)]
  assert hlo.overlap_summary(found) == (
      "permutes spanning a kernel: bf16[1,4096,8,128] 1 of 1, s32[4096] 1 of 1")


def test_computations_lists_each_body_in_order_and_the_entry():
  comps, entry = hlo.computations(_module([START, TARGETS["tpu"], DONE]))
  assert entry == "main.9"
  assert set(comps) == {"wrapped", "ring_body.2", "main.9"}
  assert [line.split(" = ")[0].strip() for line in comps["ring_body.2"]] == [
      "%kv", "%q", "%collective-permute-start.1", "%o", "%collective-permute-done.1",
      "ROOT %t"]


def test_schedule_script_lists_events_in_order(tmp_path, capsys):
  script = helpers.load_script("hlo_schedule")
  module = tmp_path / "m.txt"
  module.write_text(_module([SYNC, START_GPU, TARGETS["mosaic_gpu"], DONE]))
  assert script.main([str(module)]) == 0
  text = capsys.readouterr().out
  assert ("ring_body.2 (7 instructions): ppermute.3:collective-permute | "
          "collective-permute-start.1:collective-permute-start | o:custom-call[mosaic_gpu_v2] | "
          "collective-permute-done.1:collective-permute-done") in text, text
  assert "main.9 (1 instructions): while.1:while" in text
  assert "ring_body.2: ppermute.3 bf16[1,4096,8,128] spans no kernel" in text
  assert "ring_body.2: collective-permute-start.1 bf16[1,4096,8,128] spans a kernel" in text
  assert script.main([]) == 2
