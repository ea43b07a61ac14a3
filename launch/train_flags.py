"""`ringflash train`'s command line: its flags, the run they define (RunConfig) and the checked
job around it (Job), checked before any device is touched.

The order of the checks (ringflash.cli's contract: a mistake is one line naming the flag,
before any work): absl's bounds while parsing, then job_from_flags (relations between flags,
the environment of `ringflash launch`, the folders), then, once the job's devices are known,
check_devices; what needs ring attention's own rules is Trainer.check_shapes (launch/train.py).
`ringflash launch` runs the same checks on a FlagValues of its own before it starts a process.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from absl import flags

from ringflash.cli import MAX_CPU_DEVICES
from ringflash.cli import MAX_SEQ_LEN
from ringflash.cli import UsageError
from ringflash.cli import define_float
from ringflash.launch import distributed

FLAGS = flags.FLAGS

# What the state's counters hold: "step" and optax's update count are int32, and the learning
# rate schedule's step boundaries are int32 too (optax refuses 2**31).
MAX_STEPS = 2**31 - 1
# jax.random.PRNGKey keeps 32 bits of a seed with jax_enable_x64 off (2**32 gives the key of 0),
# and refuses seeds beyond int64; every seed below 2**32 is its own key.
MAX_SEED = 2**32 - 1
# Each sequence of a batch is built on the host in Python (launch/data.py, about 0.15 ms a
# sequence): a mistyped --batch_size=1000000000 spent days there before any message.
MAX_BATCH = 2**16


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """Defines this command's flags on `flag_values` (absl's FLAGS by default). The ringflash
  command calls it once before parsing; importing the module (as tests do) defines nothing.
  `ringflash launch` defines them on a FlagValues of its own to check a job's flags before it
  starts any process."""
  fv = {"flag_values": flag_values}

  def positive(name, default, help_, upper_bound=None):
    flags.DEFINE_integer(name, default, help_, lower_bound=1, upper_bound=upper_bound, **fv)

  positive("steps", 240, "Training steps to run in total, counted from step 0 (a resumed run "
           "stops at this step too; it may be raised on resume, and the learning rate's "
           "cosine decay then follows the new total).", upper_bound=MAX_STEPS)
  positive("seq_len", 4096, "Tokens per sequence: even, divisible by --ring.",
           upper_bound=MAX_SEQ_LEN)
  positive("batch_size", 2, "Global batch size (sequences per step), divisible by "
           "--data_parallel.", upper_bound=MAX_BATCH)
  positive("data_parallel", 2, "Mesh size of the data (batch) axis.")
  positive("ring", 4, "Mesh size of the ring (sequence) axis \"sp\"; data_parallel x ring "
           "devices are used.")
  positive("cpu_devices", 8, "Simulated CPU devices per process (platform cpu).",
           upper_bound=MAX_CPU_DEVICES)
  flags.DEFINE_enum("platform", "cpu", ["cpu", "default"], "cpu: the simulated CPU mesh; "
                    "default: whatever accelerator JAX finds.", **fv)
  positive("d_model", 64, "Model width, divisible by --num_heads.")
  positive("num_heads", 2, "Attention heads; d_model / num_heads must be even (RoPE).")
  positive("num_layers", 1, "Transformer blocks (one suffices for the task).")
  positive("d_ff", 128, "MLP hidden width.")
  define_float("rope_base", 1e6, "RoPE wavelength base, > 0 (large, as in long-context "
               "models: slow rotations let content match across thousands of tokens).", **fv)
  define_float("dropout", 0.0, "Residual dropout rate in [0, 1) (uses the checkpointed RNG "
               "key).", lower_bound=0.0, **fv)
  define_float("learning_rate", 5e-3, "Peak learning rate (AdamW), > 0.", **fv)
  flags.DEFINE_integer("warmup_steps", 10, "Linear warmup steps from learning rate 0; 0: "
                       "none, the first step takes the peak rate.", lower_bound=0,
                       upper_bound=MAX_STEPS, **fv)
  flags.DEFINE_integer("seed", 0, "Seed of the parameters, RNG key and data stream.",
                       lower_bound=0, upper_bound=MAX_SEED, **fv)
  positive("num_keys", 16, "Retrieval task: distinct keys.")
  positive("num_values", 8, "Retrieval task: distinct values (chance = 1/this).")
  positive("num_pairs", 16, "Retrieval task: (key, value) pairs stored per sequence in its "
           "first half; at most --num_keys.")
  positive("num_copies", 8, "Retrieval task: positions each stored pair occupies.")
  positive("num_queries", 64, "Retrieval task: queries per sequence in its second half.")
  positive("num_fillers", 16, "Retrieval task: distinct filler tokens.")
  flags.DEFINE_string("backend", "auto", "Ring attention backend: auto, xla, pallas_tpu or "
                      "pallas_gpu.", **fv)
  flags.DEFINE_string("checkpoint_dir", None, "Directory of checkpoints (none: no "
                      "checkpoints).", **fv)
  positive("save_every", 50, "Save a checkpoint every this many steps (needs "
           "--checkpoint_dir).")
  positive("keep", 3, "Checkpoints to keep (needs --checkpoint_dir).")
  flags.DEFINE_bool("async_save", True, "Write checkpoints in the background (needs "
                    "--checkpoint_dir).", **fv)
  flags.DEFINE_bool("resume", False, "Continue from the newest complete checkpoint in "
                    "--checkpoint_dir (which must be given); an error if checkpoints exist "
                    "but none restores.", **fv)
  flags.DEFINE_string("metrics_file", None, "Append one JSON line per step (step, loss, "
                      "accuracy) here; process 0 only. --resume first drops its lines of steps after the "
                      "step restored, which the run computes again.", **fv)
  flags.DEFINE_integer("crash_after_save_starts", -1, "Fault injection for tests: SIGKILL this "
                       "process right after the save of this step has started (write in "
                       "flight; needs --checkpoint_dir; a step that saves: a multiple of "
                       "--save_every, or --steps).", lower_bound=-1, upper_bound=MAX_STEPS,
                       **fv)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything that defines a run; the model and task parts must match on resume."""

  model: Any            # model.ModelConfig
  task: Any             # data.TaskConfig
  batch_size: int
  data_parallel: int
  ring: int
  learning_rate: float
  warmup_steps: int
  total_steps: int
  seed: int
  backend: str = "auto"


@dataclasses.dataclass(frozen=True)
class Job:
  """A checked `ringflash train` command line: the run and everything around it."""

  config: RunConfig
  checkpoint_dir: str | None
  save_every: int
  keep: int
  async_save: bool
  resume: bool
  metrics_file: str | None
  crash_after_save_starts: int
  platform: str
  cpu_devices: int


def job_from_flags(values: flags.FlagValues = FLAGS, *, folders: bool = True) -> Job:
  """Every flag of `ringflash train`, checked; no device is touched. The folders of
  --checkpoint_dir and --metrics_file, checked last, are created (the only way to know they
  can be); folders=False skips that check, for a job that runs on other machines (`launch
  tpu`), whose folders are theirs.

  absl's bounds have refused non-positive sizes while parsing; this checks what relates
  flags to each other, to the environment of `ringflash launch` and to the file system (a
  --checkpoint_dir that already holds complete steps needs --resume). What needs the device
  count is check_devices, what needs ring attention's own rules is Trainer.check_shapes.

  Raises:
    UsageError: naming the flag and what is allowed.
  """
  from ringflash import introspect                # pylint: disable=g-import-not-at-top
  from ringflash.launch import data, model        # pylint: disable=g-import-not-at-top
  v = values
  for name in ("checkpoint_dir", "metrics_file"):
    if v[name].value is not None and not v[name].value.strip():
      # an empty path was taken as no flag: the run saved nothing, and said nothing
      raise UsageError(f"--{name} is empty: give a path, or leave the flag out")
  if v.batch_size % v.data_parallel:
    raise UsageError(f"--batch_size={v.batch_size} must be divisible by "
                     f"--data_parallel={v.data_parallel} (each data-parallel group takes "
                     f"batch_size / data_parallel sequences)")
  if v.seq_len % v.ring:
    raise UsageError(f"--seq_len={v.seq_len} must be divisible by --ring={v.ring} (each "
                     f"device of a ring holds seq_len / ring tokens)")
  for name in ("learning_rate", "rope_base"):
    if not v[name].value > 0:
      raise UsageError(f"--{name} must be > 0, got {v[name].value}")
  if v.backend not in introspect.BACKENDS:
    # Here, not only in ring_attention: a launched job refuses it before any process starts.
    raise UsageError(f"--backend must be one of {', '.join(introspect.BACKENDS)}, got "
                     f"{v.backend!r}")
  if v.resume and not v.checkpoint_dir:
    raise UsageError("--resume needs --checkpoint_dir (the directory to resume from)")
  # They only shape the saves, and without --checkpoint_dir nothing is saved.
  for name in ("save_every", "keep", "async_save", "crash_after_save_starts"):
    if v[name].present and not v.checkpoint_dir:
      raise UsageError(f"--{name} needs --checkpoint_dir (without it no checkpoint is saved)")
  crash = v.crash_after_save_starts
  if crash != -1 and not (1 <= crash <= v.steps and (crash % v.save_every == 0
                                                     or crash == v.steps)):
    raise UsageError(f"--crash_after_save_starts={crash} is not a step at which a save starts "
                     f"(a multiple of --save_every={v.save_every} up to --steps={v.steps}, or "
                     f"--steps itself); -1: no fault")
  per_process = os.environ.get(distributed.ENV_DEVICES_PER_PROCESS, "").strip()
  if v["cpu_devices"].present and per_process and per_process != str(v.cpu_devices):
    raise UsageError(f"--cpu_devices={v.cpu_devices} disagrees with "
                     f"{distributed.ENV_DEVICES_PER_PROCESS}={per_process} (set by `ringflash "
                     f"launch local --devices-per-process`), which sets the devices of each "
                     f"process; give one of them")
  if v["cpu_devices"].present and v.platform != "cpu":
    raise UsageError(f"--cpu_devices applies to --platform=cpu (simulated devices), not "
                     f"--platform={v.platform}, which takes the devices JAX finds")
  try:
    task = data.TaskConfig(seq_len=v.seq_len, num_keys=v.num_keys, num_values=v.num_values,
                           num_pairs=v.num_pairs, num_copies=v.num_copies,
                           num_queries=v.num_queries, num_fillers=v.num_fillers)
    mcfg = model.ModelConfig(vocab_size=task.vocab_size, d_model=v.d_model,
                             num_heads=v.num_heads, num_layers=v.num_layers, d_ff=v.d_ff,
                             rope_base=v.rope_base, dropout=v.dropout)
  except ValueError as err:
    raise usage_error(err, values) from None
  # Last, as checking a folder creates it: no other flag's mistake leaves one behind.
  if v.checkpoint_dir and folders:
    problem = distributed.directory_problem(v.checkpoint_dir)
    if problem:
      raise UsageError(f"--checkpoint_dir={v.checkpoint_dir}: {problem}")
    from ringflash.launch import checkpointing    # pylint: disable=g-import-not-at-top
    held = checkpointing.finalized_steps(v.checkpoint_dir)
    if held and not v.resume:
      # Checked before the job joins: every process reads the folder before any saves.
      raise UsageError(f"--checkpoint_dir={v.checkpoint_dir} already holds complete "
                       f"checkpoint step(s) {', '.join(map(str, held))}: pass --resume to "
                       f"continue from them, or give another folder")
  if v.metrics_file and folders:
    # appended to, in a folder created if missing
    problem = ("it is a directory" if os.path.isdir(v.metrics_file) else
               distributed.directory_problem(os.path.dirname(os.path.abspath(v.metrics_file))))
    if problem:
      raise UsageError(f"--metrics_file={v.metrics_file}: {problem}")
  config = RunConfig(model=mcfg, task=task, batch_size=v.batch_size,
                     data_parallel=v.data_parallel, ring=v.ring,
                     learning_rate=v.learning_rate, warmup_steps=v.warmup_steps,
                     total_steps=v.steps, seed=v.seed, backend=v.backend)
  return Job(config=config, checkpoint_dir=v.checkpoint_dir, save_every=v.save_every,
             keep=v.keep, async_save=v.async_save, resume=v.resume,
             metrics_file=v.metrics_file, crash_after_save_starts=v.crash_after_save_starts,
             platform=v.platform, cpu_devices=v.cpu_devices)


def check_devices(config: RunConfig, device_count: int, processes: int = 1) -> None:
  """The mesh data_parallel x ring must fit the job's devices, and (it takes the first
  data_parallel x ring of them, process by process) reach every one of its `processes`: a
  process holding no device of the mesh cannot read the values train reads back.

  Raises:
    UsageError: naming --data_parallel and --ring.
  """
  needed = config.data_parallel * config.ring
  if needed > device_count:
    raise UsageError(f"--data_parallel={config.data_parallel} x --ring={config.ring} needs "
                     f"{needed} devices, the job has {device_count}")
  per = device_count // processes if processes > 1 and device_count % processes == 0 else 0
  if per and needed <= (processes - 1) * per:
    raise UsageError(f"--data_parallel={config.data_parallel} x --ring={config.ring} = "
                     f"{needed} devices leaves process {processes - 1} of the job's "
                     f"{processes} x {per} devices without one; every process must hold a "
                     f"device of the mesh, so it needs more than {(processes - 1) * per}")


def usage_error(err: Exception, values: flags.FlagValues, otherwise: str = "") -> UsageError:
  """A library's ValueError as a UsageError: a message that starts with a field named like a
  flag names that flag (`seq_len must be even` -> `--seq_len must be even`); any other
  message gets `otherwise` in front."""
  text = str(err)
  first = re.match(r"[a-z_]+", text)
  if first and first.group(0) in values:
    return UsageError(f"--{text}")
  return UsageError(f"{otherwise}{text}")
