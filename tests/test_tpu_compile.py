"""Deviceless compilation for real TPU generations (8 chips): the real TPU compiler, Mosaic
kernels included, on topology devices from libtpu; no TPU needed.

Compiles value_and_grad of a loss over ringflash.ring_attention (bf16, GQA 8:2, causal and
not) and reads the compiled HLO: the Mosaic kernels are there, K/V move only by
collective-permute, and each ring step's permute is in flight around the kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

# Several test processes may load libtpu at once (pytest-xdist); each only compiles.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ringflash  # noqa: E402
from ringflash.cli import hlo as hlo_text  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="needs libtpu (the `tpu` extra) for deviceless compile")

TOPOLOGIES = ["v4:2x2x2", "v5e:2x4", "v5p:2x2x2", "v6e:2x4"]
B, T, N, K, H = 1, 8 * 1024, 8, 2, 128      # 1024 tokens per chip


@functools.lru_cache(maxsize=None)
def _compiled(topology: str, causal: bool, head_dim: int = H, heads: int = N, kv_heads: int = K):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  mesh = Mesh(np.array(devices), ("sp",))
  sharding = NamedSharding(mesh, P(None, "sp", None, None))

  def loss(q, k, v):
    out = ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
          for shape in ((B, T, heads, head_dim), (B, T, kv_heads, head_dim),
                        (B, T, kv_heads, head_dim))]
  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  return compiled.as_text()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_compiles_with_mosaic_kernels_and_moves_kv_only_by_permute(topology, causal):
  hlo = _compiled(topology, causal)
  kernels = re.findall(r"%(ringflash_\w+?)(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\"",
                       hlo)
  assert {"ringflash_fwd", "ringflash_bwd_dkv", "ringflash_bwd_dq"} <= set(kernels), kernels
  assert "collective-permute-start" in hlo and "collective-permute-done" in hlo
  for op in ("all-gather", "all-to-all"):
    assert not re.search(rf"\s{op}(-start)?\(", hlo), f"{op} in the compiled program"


@pytest.mark.parametrize("topology,heads,kv_heads,head_dim", [
    ("v5p:2x2x2", 8, 2, 64), ("v5p:2x2x2", 8, 2, 256),
    ("v4:2x2x2", 32, 2, 128)])    # GQA group 16 on v4's 16 MiB of VMEM: shorter query tiles
def test_other_shapes_compile_with_mosaic_kernels(topology, heads, kv_heads, head_dim):
  hlo = _compiled(topology, True, head_dim, heads, kv_heads)
  kernels = re.findall(r"%(ringflash_\w+?)(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\"",
                       hlo)
  assert {"ringflash_fwd", "ringflash_bwd_dkv", "ringflash_bwd_dq"} <= set(kernels), kernels


@functools.lru_cache(maxsize=None)
def _schedule(topology: str, per_chip: int, kv_heads: int) -> str:
  """value_and_grad compiled at a realistic per-chip length (the scheduler overlaps a
  transfer only when its cost model says the transfer is worth hiding)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  mesh = Mesh(np.array(devices), ("sp",))
  sharding = NamedSharding(mesh, P(None, "sp", None, None))
  t = per_chip * len(devices)

  def loss(q, k, v):
    out = ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=True)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
          for shape in ((1, t, 8, H), (1, t, kv_heads, H), (1, t, kv_heads, H))]
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()


@pytest.mark.parametrize("topology", ["v5p:2x2x2"])
def test_each_ring_step_permute_is_in_flight_around_the_kernel(topology):
  """In every ring loop body (forward and backward) each K/V block's collective-permute-start
  is issued before a kernel and its done comes after it: the transfer overlaps the kernel."""
  per_chip, kv_heads = 4096, 8
  found = hlo_text.permute_overlap(_schedule(topology, per_chip, kv_heads))
  kv = [p for p in found if p.shape == f"bf16[2,1,{per_chip},{kv_heads},{H}]"]   # k, v as one
  bodies = len({p.body for p in kv})
  for p in kv:
    assert p.encloses_kernel, f"{p.body}: {p.start} .. its done encloses no kernel"
  assert bodies >= 2, "expected a forward and a backward ring loop body"


def test_each_transfer_is_one_array_and_dkdv_go_home_in_the_input_dtype():
  """K and V travel as one array (XLA's GPU scheduler overlaps one collective at a time by
  default: as two permutes, one ran outside the kernel on two H200s), and their positions
  not at all; the dk/dv accumulators travel in fp32 between steps and, complete, in bf16 on
  their last hop home."""
  per_chip, kv_heads = 4096, 8
  comps, _ = hlo_text.computations(_schedule("v5p:2x2x2", per_chip, kv_heads))
  bodies = hlo_text.loop_bodies(comps)
  moved = {"loop": [], "after": []}
  for name, lines in comps.items():
    for line in filter(hlo_text.is_permute, lines):
      moved["loop" if name in bodies else "after"].append(hlo_text.transferred_shape(line))
  pair = f"[2,1,{per_chip},{kv_heads},{H}]"      # [k or dk, v or dv] of one block
  # forward loop: k+v; backward loop: dk+dv, k+v (positions are computed, not sent)
  assert sorted(moved["loop"]) == sorted([f"bf16{pair}", f"f32{pair}", f"bf16{pair}"]), moved
  assert moved["after"] == [f"bf16{pair}"], moved
