"""The contract cases on the pallas_gpu backend (tests/contract/base.py).

Its Mosaic GPU kernels need a GPU of compute capability >= 9.0 (they do not run in JAX's
CPU interpreter), so every case runs on Hopper GPUs only (JAX_PLATFORMS=cuda) and is skipped elsewhere
with that reason. bf16 inputs (the kernels take bf16 and fp16), head dim 64, 256 tokens per
device per unit (tiles of 64-128 rows; a CUDA block covers 128 query rows). A case whose
ring is larger than the GPUs present runs on a ring of all of them (P = 8 on two H200s runs
at P = 2), with its global length scaled to match. The backend claims every feature of the
base (soft-cap, value head dims, any head dim a multiple of 8 up to 256 by padding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import helpers
from contract import base


class TestPallasGpu(base.ContractTests):
  BACKEND = "pallas_gpu"
  DTYPE = jnp.bfloat16
  LOW_DTYPE = jnp.float16
  HEAD_DIM = 64
  UNIT = 256
  SKIP = None if helpers.hopper_devices() else (
      "needs a GPU of compute capability >= 9.0 (run with JAX_PLATFORMS=cuda on an H200)")

  def adapt(self, case):
    # The global length kept: a window-wide-P8 ring of 2048 tokens shrunk to 512 had a
    # window wider than the sequence, which masked nothing.
    p = min(case.ring_size, len(helpers.hopper_devices()))
    grow = case.ring_size // p if p and case.ring_size % p == 0 else 1
    return dataclasses.replace(case, ring_size=p, t=case.t * grow, s=case.s * grow)

  def mesh(self, ring_size):
    return jax.sharding.Mesh(np.array(helpers.hopper_devices()[:ring_size]), ("sp",))
