"""`ringflash plan`: per-device memory of ring attention on a TPU slice, compiled without a TPU.

Example:
  ringflash plan --topology v5p:4x4x4 --batch 1 --seq_len 1048576 --heads 32 --kv_heads 8 \
      --head_dim 128 --dtype bfloat16 --causal --mode train

Compiles deviceless for the topology (libtpu's TPU compiler, Mosaic kernels included), with the
sequence sharded over a ring of all its chips, and prints per-device memory from the compiled
program (arguments, temporaries, outputs), whether it fits the chip's HBM, the number of
collective-permutes per ring step and the kernel block sizes.
"""

from __future__ import annotations

import os
import re

from absl import flags

from ringflash import hlo

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines this command's flags on absl's FLAGS. The ringflash command calls it once
  before parsing; importing the module (as tests do) defines nothing."""
  flags.DEFINE_string("topology", "v5p:2x2x2", "TPU topology name, e.g. v5p:4x4x4")
  flags.DEFINE_integer("batch", 1, "batch size B")
  flags.DEFINE_integer("seq_len", 131072, "global sequence length T (= S)")
  flags.DEFINE_integer("heads", 32, "query heads N")
  flags.DEFINE_integer("kv_heads", 8, "key/value heads K (N % K == 0)")
  flags.DEFINE_integer("head_dim", 128, "head dimension H")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32", "float16"],
                    "input dtype")
  flags.DEFINE_boolean("causal", False, "causal masking")
  flags.DEFINE_enum("mode", "train", ["forward", "train"],
                    "forward only, or forward + backward (value_and_grad)")
  flags.DEFINE_string("backend", "auto", "ringflash backend")


# HBM per chip, by the topology name's prefix.
HBM_BYTES = {"v4": 32 * 2**30, "v5e": 16 * 10**9, "v5litepod": 16 * 10**9,
             "v5p": 95 * 2**30, "v6e": 32 * 10**9}


def plan(topology: str, *, batch: int, seq_len: int, heads: int, kv_heads: int,
         head_dim: int, dtype: str, causal: bool, mode: str, backend: str = "auto") -> dict:
  """Compiles the attention step for `topology` without a TPU; returns the figures."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import ringflash  # pylint: disable=g-import-not-at-top
  from ringflash import _validate  # pylint: disable=g-import-not-at-top
  from ringflash.kernels import get_backend  # pylint: disable=g-import-not-at-top

  devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  ring = len(devices)
  mesh = Mesh(np.array(devices), ("sp",))
  sharding = NamedSharding(mesh, P(None, "sp", None, None))
  dt = jnp.dtype(dtype)
  args = [jax.ShapeDtypeStruct((batch, seq_len, h, head_dim), dt, sharding=sharding)
          for h in (heads, kv_heads, kv_heads)]

  def attn(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal, backend=backend)

  if mode == "train":
    fn = jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2),
                            argnums=(0, 1, 2))
  else:
    fn = attn
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  text = compiled.as_text()

  kernel = get_backend(_validate.resolve_backend(backend, "tpu", devices[0]))
  bq, bk = kernel.resolve_block_sizes(
      ringflash.BlockSizes(), seq_len // ring, seq_len // ring, head_dim=head_dim,
      kv_heads=kv_heads, group=heads // kv_heads, dtype=dt,
      device_kind=devices[0].device_kind)
  per_body = _permutes_per_loop_body(text)
  total = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
  hbm = HBM_BYTES.get(topology.split(":")[0])
  return {
      "topology": topology, "chips": ring, "device_kind": devices[0].device_kind,
      "backend": kernel.NAME, "tokens_per_chip": seq_len // ring, "block_q": bq, "block_k": bk,
      "arguments": mem.argument_size_in_bytes, "temporaries": mem.temp_size_in_bytes,
      "outputs": mem.output_size_in_bytes, "total": total, "hbm": hbm,
      "fits": None if hbm is None else total <= hbm,
      "permutes_per_step": per_body,
      "all_gathers": len(re.findall(r" all-gather(?:-start)?\(", text)),
  }


def _permutes_per_loop_body(text: str) -> list[int]:
  """Collective-permutes in each while-loop body of a compiled module, in order.

  A ring loop body runs one step; it sends one permute per array that travels (k and v as
  one array; in the backward also the dk/dv accumulators, one array; segment ids if given).
  Asynchronous permutes are counted by their start, synchronous ones as they are.
  """
  comps, _ = hlo.computations(text)
  bodies = hlo.loop_bodies(comps)
  counts = [sum(map(hlo.is_permute, lines)) for name, lines in comps.items() if name in bodies]
  return [c for c in counts if c]


def _gib(x):
  return f"{x / 2**30:8.2f} GiB"


def main(argv):
  del argv
  r = plan(FLAGS.topology, batch=FLAGS.batch, seq_len=FLAGS.seq_len, heads=FLAGS.heads,
           kv_heads=FLAGS.kv_heads, head_dim=FLAGS.head_dim, dtype=FLAGS.dtype,
           causal=FLAGS.causal, mode=FLAGS.mode, backend=FLAGS.backend)
  print(f"{r['topology']} ({r['chips']} x {r['device_kind']}), backend {r['backend']}, "
        f"{r['tokens_per_chip']} tokens per chip, blocks bq={r['block_q']} bk={r['block_k']}")
  print(f"  per device  arguments {_gib(r['arguments'])}  temporaries {_gib(r['temporaries'])}"
        f"  outputs {_gib(r['outputs'])}  total {_gib(r['total'])}")
  if r["hbm"] is not None:
    room = r["hbm"] - r["total"]
    print(f"  HBM {_gib(r['hbm'])}: {'fits' if r['fits'] else 'DOES NOT FIT'} "
          f"({_gib(room).strip()} {'left' if room >= 0 else 'short'})")
  print(f"  collective-permutes per ring step (per loop body): {r['permutes_per_step']}; "
        f"all-gathers: {r['all_gathers']}")
