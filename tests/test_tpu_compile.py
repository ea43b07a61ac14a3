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

import hlo as hlo_text  # noqa: E402
import ringflash  # noqa: E402

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


def _computations(hlo: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines, in the compiled (scheduled) order."""
  return hlo_text.computations(hlo)[0]


def _has_kernel(comps, name, seen=None) -> bool:
  """Whether computation `name` runs a Mosaic kernel, directly or through what it calls."""
  seen = set() if seen is None else seen
  if name in seen or name not in comps:
    return False
  seen.add(name)
  for line in comps[name]:
    if 'custom_call_target="tpu_custom_call"' in line:
      return True
    for callee in _callees([line]):
      if _has_kernel(comps, callee, seen):
        return True
  return False


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
  comps = _computations(_schedule(topology, per_chip, kv_heads))
  kv_shape = f"bf16[1,{per_chip},{kv_heads},{H}]"
  loop_bodies = {m for lines in comps.values() for l in lines
                 for m in re.findall(r"\bbody=%?([\w.\-]+)", l)}
  bodies = 0
  for name in loop_bodies:
    lines = comps[name]
    kernel_at = [i for i, l in enumerate(lines) if _line_runs_kernel(comps, l)]
    kv_starts = [i for i, l in enumerate(lines)
                 if " collective-permute-start(" in l and f"({kv_shape}" in l]
    if not kernel_at or not kv_starts:
      continue
    bodies += 1
    for i in kv_starts:
      start = re.match(r"\s*%([\w.\-]+) =", lines[i]).group(1)
      done = next(j for j, l in enumerate(lines)
                  if re.search(rf"collective-permute-done\(%{re.escape(start)}\)", l))
      assert any(i < k < done for k in kernel_at), (
          f"{name}: {start} (line {i}) .. done (line {done}) encloses no kernel; kernels at "
          f"{kernel_at}")
  assert bodies >= 2, "expected a forward and a backward ring loop body"


def _callees(lines):
  """Names of the computations that these instruction lines call."""
  out = []
  for line in lines:
    for callee in re.findall(r"(?:calls|to_apply|body|condition|branch_computations)="
                             r"(\{[^}]*\}|%?[\w.\-]+)", line):
      out += [c.strip().lstrip("%") for c in callee.strip("{}").split(",")]
  return out


def _line_runs_kernel(comps, line) -> bool:
  return 'custom_call_target="tpu_custom_call"' in line or any(
      _has_kernel(comps, c) for c in _callees([line]))
