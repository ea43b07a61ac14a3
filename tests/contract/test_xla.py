"""The contract cases on the xla backend (tests/contract/base.py), with small tiles so that
every block pair spans several tiles."""

from __future__ import annotations

import math

import ringflash
from contract import base


class TestXla(base.ContractTests):
  BACKEND = "xla"

  def block_sizes(self, q_len, kv_len):
    # 8 x 8 tiles where they divide the unit the ring tiles (zigzag chunks and bidirectional
    # halves of 16 tokens: 8).
    return ringflash.XlaBlockSizes(block_q=math.gcd(8, q_len), block_k=math.gcd(8, kv_len),
                                   block_q_bwd=math.gcd(4, q_len),
                                   block_k_bwd=math.gcd(8, kv_len))
