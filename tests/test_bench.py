"""`ringflash bench` runs end to end on CPU at tiny sizes (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("mode", ["virtual", "layouts"])
def test_bench_mode_writes_rows(tmp_path, mode):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "ringflash.cli", "bench", f"--mode={mode}", "--seq_lens=256",
         "--ring_sizes=2", "--kv_heads=1", "--heads=2", "--head_dim=32", "--warmup=0",
         "--iters=1", f"--out={tmp_path}"]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  rows = json.load(open(tmp_path / f"bench_{mode}.json"))["rows"]
  if mode == "layouts":
    assert [r["layout"] for r in rows] == ["contiguous", "zigzag", "striped"]
    assert all(len(r["per_device_ms"]) == 2 and r["max_over_mean"] >= 1.0 for r in rows)
  else:
    assert len(rows) == 1 and rows[0]["P"] == 2 and rows[0]["one_ms"] > 0
