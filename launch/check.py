"""`ringflash check`: ring attention over every device of the job, verified on every process.

What the launchers run by default. Every process builds the same global inputs from --seed,
checks with the other processes that all agree on the inputs' shapes and dtypes, keeps its
own slice of the sequence (process p holds the positions of its devices in the ring), runs
ring attention forward and backward over a 1-D mesh of all global devices. Each process
compares the output shards and gradient shards it holds with a dense float32 reference
computed locally from the full inputs, and prints one line: its errors and "ok" or "FAILED".

Example, 2 processes x 4 CPU devices, T = 256: the ring has 8 devices of 32 tokens each;
process 0 holds tokens 0..127 (its devices 0..3), process 1 tokens 128..255.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import numpy as np
from absl import flags
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ringflash
from ringflash import _reference
from ringflash.launch import distributed

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines this command's flags on absl's FLAGS. The ringflash command calls it once
  before parsing; importing the module (as tests do) defines nothing."""
  flags.DEFINE_integer("batch", 1, "B, global batch")
  flags.DEFINE_integer("seq_len", 256, "T = S, global sequence length; divisible by "
                       "the number of global devices")
  flags.DEFINE_integer("heads", 2, "N, query heads")
  flags.DEFINE_integer("kv_heads", 1, "K, key/value heads (N % K == 0)")
  flags.DEFINE_integer("head_dim", 32, "H")
  flags.DEFINE_boolean("causal", True, "causal mask")
  flags.DEFINE_integer("seed", 0, "seed of the inputs (the same on every process)")
  flags.DEFINE_integer("repeat", 1, "forward+backward passes; the last one is verified")
  flags.DEFINE_float("tolerance", 1e-4, "largest accepted error, relative to "
                     "max(1, max |reference|), per output")
  flags.DEFINE_string("out_dir", "", "if set, each process writes the values it "
                      "holds to OUT_DIR/process_<id>.npz (NaN where not held)")


AXIS = "sp"
NAMES = ("out", "dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Config:
  """Shapes and numerics of one check. q [B, T, N, H]; k, v [B, T, K, H]."""

  batch: int = 1
  seq_len: int = 256
  heads: int = 2
  kv_heads: int = 1
  head_dim: int = 32
  causal: bool = True
  seed: int = 0


def global_inputs(config: Config) -> dict[str, np.ndarray]:
  """The full inputs q, k, v and the output cotangent dout, float32, identical everywhere."""
  rng = np.random.default_rng(config.seed)
  q_shape = (config.batch, config.seq_len, config.heads, config.head_dim)
  kv_shape = (config.batch, config.seq_len, config.kv_heads, config.head_dim)
  return {name: rng.standard_normal(shape, dtype=np.float32)
          for name, shape in (("q", q_shape), ("k", kv_shape), ("v", kv_shape),
                              ("dout", q_shape))}


def reference(inputs: dict[str, np.ndarray], causal: bool) -> dict[str, np.ndarray]:
  """Dense attention and its gradients in float32 at HIGHEST precision, on one device."""
  device = jax.local_devices()[0]
  q, k, v, dout = (jax.device_put(inputs[n], device) for n in ("q", "k", "v", "dout"))
  out, vjp = jax.vjp(lambda q, k, v: _reference.dense_attention(q, k, v, causal,
                                                                chunk=q.shape[1]), q, k, v)
  dq, dk, dv = vjp(dout)
  return {name: np.asarray(x) for name, x in zip(NAMES, (out, dq, dk, dv))}


def run(config: Config, repeat: int = 1) -> tuple[dict[str, jax.Array], dict[str, np.ndarray]]:
  """Ring attention forward and backward over all global devices.

  Args:
    config: the shapes.
    repeat: forward+backward passes (the results of the last one are returned).

  Returns:
    ({"out", "dq", "dk", "dv": global jax.Array}, the global inputs as numpy).

  Raises:
    ValueError: the sequence does not divide over the devices, or the processes hold
      process-local inputs of different shapes (found before ring attention runs).
  """
  inputs = global_inputs(config)
  # First, before anything that could fail on some processes only: every process must mean
  # the same global inputs, or the slices below would not fit together.
  distributed.check_same_across_processes(inputs)
  devices = jax.devices()
  if config.seq_len % len(devices):
    raise ValueError(f"seq_len={config.seq_len} must be divisible by the number of global "
                     f"devices, {len(devices)}")
  mesh = Mesh(np.array(devices), (AXIS,))
  sharding = NamedSharding(mesh, P(None, AXIS))
  # Every process holds the whole inputs; each device takes its sequence slice of them.
  q, k, v, dout = (jax.make_array_from_callback(inputs[n].shape, sharding,
                                                lambda idx, x=inputs[n]: x[idx])
                   for n in ("q", "k", "v", "dout"))

  @jax.jit
  def forward_backward(q, k, v, dout):
    out, vjp = jax.vjp(
        lambda q, k, v: ringflash.ring_attention(q, k, v, mesh=mesh, axis_name=AXIS,
                                                 is_causal=config.causal), q, k, v)
    return (out, *vjp(dout))

  for step in range(repeat):
    results = dict(zip(NAMES, forward_backward(q, k, v, dout)))
    if repeat > 1:
      jax.block_until_ready(results)
      print(f"process {jax.process_index()}: pass {step + 1}/{repeat} done", flush=True)
  return results, inputs


def errors(results: dict[str, jax.Array], expected: dict[str, np.ndarray]) -> dict[str, float]:
  """Largest |result - expected| / max(1, max |expected|) over the shards this process holds."""
  worst = {}
  for name, array in results.items():
    scale = max(1.0, float(np.abs(expected[name]).max()))
    worst[name] = max(float(np.abs(np.asarray(s.data) - expected[name][s.index]).max())
                      for s in array.addressable_shards) / scale
  return worst


def held_values(array: jax.Array) -> np.ndarray:
  """The global-shaped values this process holds, NaN elsewhere."""
  full = np.full(array.shape, np.nan, np.float32)
  for shard in array.addressable_shards:
    full[shard.index] = np.asarray(shard.data)
  return full


def main(argv) -> None:
  if len(argv) > 1:
    raise ValueError(f"ringflash check takes flags only, got {argv[1:]}")
  joined = distributed.initialize()
  config = Config(batch=FLAGS.batch, seq_len=FLAGS.seq_len, heads=FLAGS.heads,
                  kv_heads=FLAGS.kv_heads, head_dim=FLAGS.head_dim, causal=FLAGS.causal,
                  seed=FLAGS.seed)
  me = f"process {joined.process_id} of {joined.num_processes}"
  print(f"ringflash check: {me}: {jax.local_device_count()} local of {jax.device_count()} "
        f"global {jax.devices()[0].platform} devices; {config}", flush=True)
  try:
    results, inputs = run(config, repeat=FLAGS.repeat)
  except distributed.InputsDifferError as err:
    # Every process found the same disagreement, before any collective of the attention.
    # Exit at once: the runtime's shutdown barrier would wait on peers that are leaving too
    # (seen to outlast two minutes on a loaded machine).
    print(f"ringflash check: {me}: ValueError: {err}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)
  worst = errors(results, reference(inputs, config.causal))
  if FLAGS.out_dir:
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    np.savez(os.path.join(FLAGS.out_dir, f"process_{joined.process_id}.npz"),
             **{name: held_values(x) for name, x in results.items()})
  ok = all(e <= FLAGS.tolerance for e in worst.values())
  summary = ", ".join(f"{name} {e:.1e}" for name, e in worst.items())
  print(f"ringflash check: {me}: max error {summary} (tolerance {FLAGS.tolerance:.0e}): "
        f"{'ok' if ok else 'FAILED'}", flush=True)
  if not ok:
    sys.exit(1)
