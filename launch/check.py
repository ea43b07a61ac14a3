"""`ringflash check`: ring attention over every device of the job, verified on every process.

What the launchers run by default. Every process builds the same global inputs from --seed,
checks with the other processes that all agree on the inputs' shapes and dtypes, keeps its
own slice of the sequence (process p holds the positions of its devices in the ring), runs
ring attention forward and backward over a 1-D mesh of all global devices. Each process
compares the output shards and gradient shards it holds with a dense float32 reference
computed locally from the full inputs, and prints one line: its errors and "ok" or "FAILED".

Example, 2 processes x 4 CPU devices, T = 256: the ring has 8 devices of 32 tokens each;
process 0 holds tokens 0..127 (its devices 0..3), process 1 tokens 128..255.

Every flag is checked before any work (ringflash.cli's contract): absl's bounds while parsing,
job_from_flags, then, once the job's devices are known but before anything compiles,
check_devices (e.g. --seq_len=100 on 8 devices) and check_shapes (ring attention's own rules,
traced on abstract inputs). A mistake is one line naming the flag, and exit status 2.
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
from ringflash import reference as dense
from ringflash.cli import MAX_SEQ_LEN
from ringflash.cli import UsageError
from ringflash.cli import define_float
from ringflash.cli import command_flags
from ringflash.launch import distributed

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """Defines this command's flags on `flag_values` (absl's FLAGS by default). The ringflash
  command calls it once before parsing; importing the module (as tests do) defines nothing.
  `ringflash launch` defines them on a FlagValues of its own to check a job's flags before it
  starts any process."""
  fv = {"flag_values": flag_values}
  flags.DEFINE_integer("batch", 1, "B, global batch", lower_bound=1, **fv)
  flags.DEFINE_integer("seq_len", 256, "T = S, global sequence length; divisible by "
                       "the number of global devices", lower_bound=1,
                       upper_bound=MAX_SEQ_LEN, **fv)
  flags.DEFINE_integer("heads", 2, "N, query heads", lower_bound=1, **fv)
  flags.DEFINE_integer("kv_heads", 1, "K, key/value heads (N % K == 0)", lower_bound=1, **fv)
  flags.DEFINE_integer("head_dim", 32, "H", lower_bound=1, **fv)
  flags.DEFINE_boolean("causal", True, "causal mask", **fv)
  flags.DEFINE_integer("seed", 0, "seed of the inputs (the same on every process)",
                       lower_bound=0, **fv)
  flags.DEFINE_integer("repeat", 1, "forward+backward passes; the last one is verified",
                       lower_bound=1, **fv)
  define_float("tolerance", 1e-4, "largest accepted error, relative to "
               "max(1, max |reference|), per output; > 0", **fv)
  flags.DEFINE_string("out_dir", "", "if set, each process writes the values it "
                      "holds to OUT_DIR/process_<id>.npz (NaN where not held)", **fv)


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


@dataclasses.dataclass(frozen=True)
class Job:
  """A checked `ringflash check` command line."""

  config: Config
  repeat: int
  tolerance: float
  out_dir: str


def job_from_flags(values: flags.FlagValues = FLAGS, *, folders: bool = True) -> Job:
  """Every flag of `ringflash check`, checked; no device is touched. --out_dir, checked last,
  is created (the only way to know it can be); folders=False skips that check, for a job
  that runs on other machines (`launch tpu`), whose folders are theirs.

  absl's bounds have refused non-positive sizes while parsing. What needs the device count
  is check_devices, what needs ring attention's own rules is check_shapes.

  Raises:
    UsageError: naming the flag and what is allowed.
  """
  v = values
  if v.heads % v.kv_heads:
    raise UsageError(f"--heads={v.heads} must be a multiple of --kv_heads={v.kv_heads}")
  if not v.tolerance > 0:
    raise UsageError(f"--tolerance must be > 0, got {v.tolerance}")
  if v.out_dir and folders:
    problem = distributed.directory_problem(v.out_dir)
    if problem:
      raise UsageError(f"--out_dir={v.out_dir}: {problem}")
  config = Config(batch=v.batch, seq_len=v.seq_len, heads=v.heads, kv_heads=v.kv_heads,
                  head_dim=v.head_dim, causal=v.causal, seed=v.seed)
  return Job(config=config, repeat=v.repeat, tolerance=v.tolerance, out_dir=v.out_dir)


def check_devices(config: Config, device_count: int, processes: int = 1) -> None:
  """The sequence must divide over the job's devices (the ring takes all of them, so every
  one of `processes` holds some).

  Raises:
    UsageError: naming --seq_len.
  """
  del processes
  if config.seq_len % device_count:
    raise UsageError(f"--seq_len={config.seq_len} must be divisible by the number of "
                     f"global devices, {device_count}")


def check_shapes(config: Config) -> None:
  """Traces the forward and backward pass on abstract inputs: nothing compiles or runs.

  Raises:
    UsageError: what ring_attention refuses about these shapes.
  """
  mesh, sharding = _mesh()
  q_shape = (config.batch, config.seq_len, config.heads, config.head_dim)
  kv_shape = (config.batch, config.seq_len, config.kv_heads, config.head_dim)
  q, k, v, dout = (jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
                   for shape in (q_shape, kv_shape, kv_shape, q_shape))
  try:
    jax.eval_shape(_forward_backward(mesh, config.causal), q, k, v, dout)
  except (ValueError, NotImplementedError) as err:
    raise UsageError(f"ring attention refuses what these flags give: {err}") from None


def _mesh() -> tuple[Mesh, NamedSharding]:
  """The 1-D ring over every global device, and the inputs' sharding (sequence over it)."""
  mesh = Mesh(np.array(jax.devices()), (AXIS,))
  return mesh, NamedSharding(mesh, P(None, AXIS))


def _forward_backward(mesh: Mesh, causal: bool):
  def forward_backward(q, k, v, dout):
    out, vjp = jax.vjp(
        lambda q, k, v: ringflash.ring_attention(q, k, v, mesh=mesh, axis_name=AXIS,
                                                 is_causal=causal), q, k, v)
    return (out, *vjp(dout))
  return jax.jit(forward_backward)


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
  out, vjp = jax.vjp(lambda q, k, v: dense.dense_attention(q, k, v, causal,
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
  if config.seq_len % jax.device_count():
    raise ValueError(f"seq_len={config.seq_len} must be divisible by the number of global "
                     f"devices, {jax.device_count()}")
  mesh, sharding = _mesh()
  # Every process holds the whole inputs; each device takes its sequence slice of them.
  q, k, v, dout = (jax.make_array_from_callback(inputs[n].shape, sharding,
                                                lambda idx, x=inputs[n]: x[idx])
                   for n in ("q", "k", "v", "dout"))
  forward_backward = _forward_backward(mesh, config.causal)

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
    # np.max over every shard's error: a NaN in any shard is the result (Python's max
    # keeps its first argument beside a NaN, so a NaN past the first shard was dropped).
    worst[name] = float(np.max([np.abs(np.asarray(s.data) - expected[name][s.index]).max()
                                for s in array.addressable_shards])) / scale
  return worst


def held_values(array: jax.Array) -> np.ndarray:
  """The global-shaped values this process holds, NaN elsewhere."""
  full = np.full(array.shape, np.nan, np.float32)
  for shard in array.addressable_shards:
    full[shard.index] = np.asarray(shard.data)
  return full


def verdict(worst: dict, tolerance: float) -> tuple[bool, str]:
  """(every error within tolerance, the line saying so): the tolerance as given and the
  errors to three digits, so that the figures printed agree with the verdict (with one
  digit, 3.3e-07 against a tolerance of 2.95e-07 printed as 3e-07 said FAILED, and against
  3.4e-07, printed alike, ok)."""
  ok = all(e <= tolerance for e in worst.values())
  summary = ", ".join(f"{name} {e:.2e}" for name, e in worst.items())
  return ok, f"max error {summary} (tolerance {tolerance:g}): {'ok' if ok else 'FAILED'}"


def main(argv) -> None:
  del argv                           # ringflash.cli refuses positional arguments
  job = job_from_flags()             # every flag, before anything is touched
  # SIGTERM ends a check at once (it has nothing to save). JAX's preemption service would
  # turn SIGTERM into a notice that nothing here reads: a process blocked in a collective
  # whose peer is gone (gloo's collective-permute waits on a send to it) would then outlive
  # the launcher's SIGTERM and wait for its SIGKILL.
  jax.config.update("jax_enable_preemption_service", False)
  joined = distributed.initialize()
  with distributed.exit_promptly_on_error("check"):
    # Processes started by hand may differ: another --repeat left a peer waiting in a
    # collective, another --seed made other inputs. --out_dir is each process's own.
    distributed.agree_on_settings("check", command_flags(exclude=("out_dir",)))
    check_devices(job.config, jax.device_count())
    check_shapes(job.config)
    _check(job, joined)


def _check(job: Job, joined: distributed.Processes) -> None:
  config = job.config
  me = f"process {joined.process_id} of {joined.num_processes}"
  print(f"ringflash check: {me}: {jax.local_device_count()} local of {jax.device_count()} "
        f"global {jax.devices()[0].platform} devices; {config}", flush=True)
  try:
    results, inputs = run(config, repeat=job.repeat)
  except distributed.InputsDifferError as err:
    # Every process found the same disagreement, before any collective of the attention.
    distributed.leave_together(2, f"ringflash check: {me}: ValueError: {err}")
  worst = errors(results, reference(inputs, config.causal))
  if job.out_dir:
    os.makedirs(job.out_dir, exist_ok=True)
    np.savez(os.path.join(job.out_dir, f"process_{joined.process_id}.npz"),
             **{name: held_values(x) for name, x in results.items()})
  ok, line = verdict(worst, job.tolerance)
  print(f"ringflash check: {me}: {line}", flush=True)
  if not ok:
    sys.exit(1)
