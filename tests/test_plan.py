"""`ringflash plan`: deviceless TPU compile reporting per-device memory and the ring's shape."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402

from ringflash import plan as planner  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="needs libtpu (the `tpu` extra) for deviceless compile")


def test_plan_reports_memory_fit_and_ring_permutes():
  small = planner.plan("v5e:2x4", batch=1, seq_len=65536, heads=8, kv_heads=2, head_dim=128,
                       dtype="bfloat16", causal=True, mode="train", backend="auto")
  assert small["backend"] == "pallas_tpu" and small["chips"] == 8
  assert small["tokens_per_chip"] == 8192
  # One loop body per ring: forward sends k and v (one array); backward also the dk/dv
  # accumulators (one array). Positions are computed, not sent.
  assert small["permutes_per_step"] == [1, 2]
  assert small["all_gathers"] == 0
  assert small["fits"] and 0 < small["total"] < small["hbm"]
  big = planner.plan("v5e:2x4", batch=1, seq_len=131072, heads=8, kv_heads=2, head_dim=128,
                     dtype="bfloat16", causal=True, mode="train", backend="auto")
  # Twice the tokens per chip: every buffer is linear in the length (measured 2.4x, as the
  # compiler keeps a shrinking share of small buffers on chip); scores would make it 4x.
  assert 1.5 < big["temporaries"] / small["temporaries"] < 3.0
