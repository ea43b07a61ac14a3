"""Deviceless compilation for real TPU generations (8 chips): the real TPU compiler, Mosaic
kernels included, on topology devices from libtpu; no TPU needed.

Compiles value_and_grad of a loss over ringflash.ring_attention (bf16, GQA 8:2, causal and
not) and reads the compiled HLO: the Mosaic kernels are there, K/V move only by
collective-permute, and each ring step's permute is in flight around the kernel. The
vocabulary of real models compiles too (soft-cap, MLA's 192 / 128 head dims, H = 96), a
length per chip past the SMEM limit of the kernels' earlier per-tile flags fits, and a local
length the kernels cannot tile is refused before Mosaic sees it.
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


def _mesh(topology: str):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  return Mesh(np.array(devices), ("sp",))


@functools.lru_cache(maxsize=None)
def _compiled(topology: str, causal: bool, head_dim: int = H, heads: int = N, kv_heads: int = K,
              head_dim_v: int | None = None, softcap: float | None = None,
              per_chip: int | None = None):
  """(HLO text, memory analysis) of value_and_grad of a loss over ring_attention."""
  mesh = _mesh(topology)
  sharding = NamedSharding(mesh, P(None, "sp", None, None))
  t = T if per_chip is None else per_chip * mesh.size

  def loss(q, k, v):
    out = ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal, strategy="ring",
                                   logits_soft_cap=softcap)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
          for shape in ((B, t, heads, head_dim), (B, t, kv_heads, head_dim),
                        (B, t, kv_heads, head_dim_v or head_dim))]
  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  return compiled.as_text(), compiled.memory_analysis()


def _kernels(hlo: str) -> set[str]:
  return set(re.findall(
      r"%(ringflash_\w+?)(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\"", hlo))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("topology", [
    t if t == "v5p:2x2x2" else pytest.param(t, marks=pytest.mark.slow) for t in TOPOLOGIES])
def test_compiles_with_mosaic_kernels_and_moves_kv_only_by_permute(topology, causal):
  hlo, _ = _compiled(topology, causal)
  kernels = _kernels(hlo)
  assert {"ringflash_fwd", "ringflash_bwd_dkv", "ringflash_bwd_dq"} <= kernels, kernels
  assert "collective-permute-start" in hlo and "collective-permute-done" in hlo
  for op in ("all-gather", "all-to-all"):
    assert not re.search(rf"\s{op}(-start)?\(", hlo), f"{op} in the compiled program"


@pytest.mark.parametrize("topology,heads,kv_heads,head_dim", [
    pytest.param("v5p:2x2x2", 8, 2, 64, marks=pytest.mark.slow),
    pytest.param("v5p:2x2x2", 8, 2, 256, marks=pytest.mark.slow),
    ("v4:2x2x2", 32, 2, 128),     # GQA group 16 on v4's 16 MiB of VMEM: shorter query tiles
    # GPT-2 XL (25 heads of 64): no multiple of 8 divides K, so a block holds all 25 kv heads
    # and the dK/dV kernel ran out of v4's VMEM at 16 x 128 tiles; key tiles go below 128
    ("v4:2x2x2", 25, 25, 64)])
def test_other_shapes_compile_with_mosaic_kernels(topology, heads, kv_heads, head_dim):
  hlo, _ = _compiled(topology, True, head_dim, heads, kv_heads)
  kernels = _kernels(hlo)
  assert {"ringflash_fwd", "ringflash_bwd_dkv", "ringflash_bwd_dq"} <= kernels, kernels


@pytest.mark.parametrize("topology,head_dim,head_dim_v,softcap", [
    pytest.param(t, *shape, id=f"{t}-{name}",
                 marks=() if (t, name) == ("v5p:2x2x2", "head-dim-96") else pytest.mark.slow)
    for t in ("v5p:2x2x2", "v5e:2x4", "v6e:2x4")
    for name, shape in (("mla-192-128-softcap", (192, 128, 30.0)),
                        ("head-dim-96", (96, None, None)))])
def test_vocabulary_of_real_models_compiles_with_mosaic_kernels(topology, head_dim, head_dim_v,
                                                                softcap):
  """Soft-capped logits with MLA's head dims (q, k 192; v, out 128), and a head dim that is
  not a multiple of 128, in the kernels: blocks keep the head dim whole. v5p's head dim 96
  by default (MLA's compile takes 80 s on two cores); MLA, v5e and v6e (other VMEM, v6e's
  1024-key tiles) among the slow cases."""
  hlo, _ = _compiled(topology, True, head_dim, head_dim_v=head_dim_v, softcap=softcap)
  kernels = _kernels(hlo)
  assert {"ringflash_fwd", "ringflash_bwd_dkv", "ringflash_bwd_dq"} <= kernels, kernels
  if head_dim_v is not None:     # each device's output [B, T / 8, N, Hv], in the input dtype
    assert f"bf16[{B},{T // 8},{N},{head_dim_v}]" in hlo


@pytest.mark.slow
def test_a_length_past_the_smem_limit_of_per_tile_flags_fits():
  """262,144 tokens per chip, training step on v5p:2x2x2 (GQA 8:2, causal): the per-tile
  flags of earlier kernels ((T / 512)^2 int32, twice) needed 2 MiB of the 1 MiB of SMEM and
  the compile failed; per-tile ranges need a few KiB. The step fits the chip's HBM."""
  hlo, mem = _compiled("v5p:2x2x2", True, per_chip=262144)
  assert {"ringflash_fwd", "ringflash_bwd_dkv", "ringflash_bwd_dq"} <= _kernels(hlo)
  total = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
  assert total < 95 * 2**30, total


def test_a_local_length_the_kernels_cannot_tile_is_padded_or_refused_before_mosaic():
  """1000 tokens striped over 8 chips: 125 per chip reached Mosaic once and died there
  ("Invalid vector register cast"). ring_attention now pads each chip's share to 128 (the
  backend's LENGTH_MULTIPLE), which the kernels tile; ring_attention_sharded, which takes
  shards as they are, refuses 125 with the reason before Mosaic sees it."""
  mesh = _mesh("v5p:2x2x2")
  sharding = NamedSharding(mesh, P(None, "sp", None, None))
  args = [jax.ShapeDtypeStruct((1, 1000, h, H), jnp.bfloat16, sharding=sharding)
          for h in (N, K, K)]
  options = dict(is_causal=True, layout="striped", backend="pallas_tpu", strategy="ring")

  def attn(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, **options)

  compiled = jax.jit(attn).lower(*args).compile()
  assert "ringflash_fwd" in _kernels(compiled.as_text())
  assert compiled.out_info.shape == (1, 1000, N, H)

  sharded = jax.shard_map(
      lambda q, k, v: ringflash.ring_attention_sharded(q, k, v, axis_name="sp", **options),
      mesh=mesh, in_specs=(P(None, "sp", None, None),) * 3,
      out_specs=P(None, "sp", None, None))
  with pytest.raises(NotImplementedError, match="multiples of 8"):
    jax.jit(sharded).lower(*args)


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
    out = ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=True, strategy="ring")
    return jnp.sum(out.astype(jnp.float32) ** 2)

  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
          for shape in ((1, t, 8, H), (1, t, kv_heads, H), (1, t, kv_heads, H))]
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_float16_is_refused_by_the_tpu_kernels_and_auto_takes_xla():
  """Mosaic loads no float16 vectors on any TPU generation: the kernels died in the compiler
  ("Invalid vector type for load", a traceback from `ringflash plan --dtype=float16`). A
  named pallas_tpu refuses float16 before Mosaic sees it; "auto" runs the xla backend."""
  mesh = _mesh("v5p:2x2x2")
  sharding = NamedSharding(mesh, P(None, "sp", None, None))
  args = [jax.ShapeDtypeStruct((1, 1024, h, 64), jnp.float16, sharding=sharding)
          for h in (4, 4, 4)]

  def attn(backend):
    return lambda q, k, v: ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=True,
                                                    backend=backend, strategy="ring")

  with pytest.raises(NotImplementedError, match="not float16"):
    jax.jit(attn("pallas_tpu")).lower(*args)
  assert ringflash.explain(*args, mesh=mesh, is_causal=True, strategy="ring").backend == "xla"
  compiled = jax.jit(attn("auto")).lower(*args).compile()
  assert not _kernels(compiled.as_text())
  assert compiled.out_info.dtype == jnp.float16

