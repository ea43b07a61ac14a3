"""The contract cases on the pallas_tpu backend, its Mosaic kernels run in Pallas interpret
mode on the CPU devices (tests/contract/base.py), with every feature of the contract. The
default tiles of 16 tokens per device are whole local lengths (TPU tiling allows a block equal
to the array)."""

from __future__ import annotations

import ringflash
from contract import base


class TestPallasTpu(base.ContractTests):
  BACKEND = "pallas_tpu"
  SHARD_MAP_CHECK_VMA = False        # interpret mode (tests/test_ring.py checks the error)
  # Run with the slow cases: among the default run's longest in a --durations run of the whole
  # suite (48-103 s each there, 9-13 s each run alone). Each combines features that other
  # default cases run on this backend one or two at a time, and the xla backend runs them all
  # by default.
  SLOW_CASES = frozenset({
      "test_error_does_not_grow_with_ring_size",
      "test_ring_matches_oracle[gqa-causal-seg-P8]",
      "test_vocabulary_matches_oracle[value-64-128-P4]",
      "test_vocabulary_matches_oracle[cross-uneven-zigzag-wide-right-window-P4]",
      "test_vocabulary_matches_oracle[zigzag-uneven-sinks-seg-P4]",
      "test_vocabulary_matches_oracle[causal-uneven-zigzag-sinks-P4]",
  })

  def block_sizes(self, q_len, kv_len):
    # Several tiles per block pair where the lengths allow (kernel cases: 256 tokens), the
    # whole local length otherwise (ring cases: 16 tokens per device).
    return ringflash.TpuBlockSizes(block_q=64 if q_len % 64 == 0 else None,
                                   block_k=128 if kv_len % 128 == 0 else None)
