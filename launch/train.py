"""`ringflash train`: long-context language model training with ring attention.

A small decoder-only transformer (launch/model.py) learns long-range key -> value retrieval
(launch/data.py: a query must find the pair token with its key thousands of tokens back) on a
("data", "sp") mesh: batch over data, sequence over the ring. By default it runs one layer on
a simulated mesh of 8 CPU devices (2 x 4) at a context of 4096 tokens. Each step prints one
line (accuracy over the step's query positions; chance is 1 / num_values):

  step 240 loss 0.7316 acc 0.742 (chance 0.125) tokens/s 15689

With --checkpoint_dir, a checkpoint is saved asynchronously every --save_every steps and at
the last step (the newest --keep are kept), and --resume continues from the newest complete,
verified one: the parameters, optimizer state, RNG key and data stream position are restored,
so the resumed run computes exactly the steps the uninterrupted run would have (bit for bit on
CPU, same mesh). The mesh may differ from the one that saved (another ring size): arrays are
restored directly into the new shardings. The run's identity (model, task, batch size, seed,
learning rate and warmup) must match; --steps may differ (extending a run is legitimate: the
cosine decay of the learning rate then follows the new total, so the steps after the
restored one differ from those of the shorter run). A restored step past --steps is refused;
a restored step equal to it is a complete run, and nothing is trained.

Progress is never lost silently: --resume needs --checkpoint_dir; a run without --resume into
a --checkpoint_dir that holds complete steps is refused (orbax would not save over them: its
saves would silently not happen); when complete checkpoints exist but none restores (the model
or task flags changed, or the files are damaged) the run stops with an error naming each step
and why, rather than starting at step 0 and saving over them; complete steps newer than the one
restored (skipped as unusable) are moved aside to `<step>.unusable`, so that the resumed run's
saves start; and a save that is due but does not start is an error.

Before any work (ringflash.cli's contract) every flag is checked: by absl's bounds while
parsing, then job_from_flags (relations between flags, directories), then, once the job's
devices are known but before anything compiles, check_devices and Trainer.check_shapes. A
mistake is one line naming the flag, and exit status 2.

Stopping: on SIGTERM (a scheduler's preemption notice) every process saves the step it has
reached and the run exits with PREEMPTED_STATUS (distributed.PreemptionNotice). With several
processes, an error on one of them (a lost peer makes every collective fail) ends that process
at once with status 1 (distributed.exit_promptly_on_error), so that the launcher sees it.

Under `ringflash launch local --processes 2 --devices-per-process 4 -- train ...` every
process runs this same program: it joins the job (ringflash.launch.distributed.initialize)
before touching any device, the mesh spans the devices of all processes, each process fills
only its own shards of a batch, every process takes part in each orbax save and restore, and
only process 0 prints and writes the metrics file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sys
import time
from typing import Any

from absl import flags
from absl import logging

from ringflash.cli import UsageError
from ringflash.cli import define_float
from ringflash.launch import distributed

FLAGS = flags.FLAGS

# The exit status of a run that saved on a preemption notice and stopped before --steps: what
# a shell reports for a process ended by SIGTERM (128 + 15), so that a scheduler sees the job
# as unfinished and starts it again (with --resume).
PREEMPTED_STATUS = 143

# What the state's counters hold: "step" and optax's update count are int32, and the learning
# rate schedule's step boundaries are int32 too (optax refuses 2**31).
MAX_STEPS = 2**31 - 1
# jax.random.PRNGKey keeps 32 bits of a seed with jax_enable_x64 off (2**32 gives the key of 0),
# and refuses seeds beyond int64; every seed below 2**32 is its own key.
MAX_SEED = 2**32 - 1


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
  positive("seq_len", 4096, "Tokens per sequence: even, divisible by --ring.")
  positive("batch_size", 2, "Global batch size (sequences per step), divisible by "
           "--data_parallel.")
  positive("data_parallel", 2, "Mesh size of the data (batch) axis.")
  positive("ring", 4, "Mesh size of the ring (sequence) axis \"sp\"; data_parallel x ring "
           "devices are used.")
  positive("cpu_devices", 8, "Simulated CPU devices per process (platform cpu).")
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
  flags.DEFINE_string("backend", "auto", "Ring attention backend.", **fv)
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
                      "accuracy) here; process 0 only.", **fv)
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


def learning_rate_schedule(config: RunConfig):
  """The learning rate of each update (optax schedule of the update count 0, 1, ...).

  A linear warmup from 0 over config.warmup_steps updates to config.learning_rate, then a
  cosine decay to a tenth of it at config.total_steps. warmup_steps=0: no warmup, the first
  update takes the peak rate.
  """
  import optax                                    # pylint: disable=g-import-not-at-top
  peak = config.learning_rate
  if config.warmup_steps == 0:
    return optax.cosine_decay_schedule(peak, max(config.total_steps, 1), alpha=0.1)
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, config.warmup_steps, max(config.total_steps, config.warmup_steps + 1),
      end_value=peak * 0.1)


class Trainer:
  """The jitted training step and the state layout of one run on one mesh.

  State: {"params": pytree, "opt_state": optax state, "step": int32 [], "rng": uint32 [2]},
  every array replicated over the mesh.
  """

  def __init__(self, config: RunConfig, mesh=None):
    import jax                                    # pylint: disable=g-import-not-at-top
    import optax                                  # pylint: disable=g-import-not-at-top

    from ringflash.launch import model            # pylint: disable=g-import-not-at-top

    self.config = config
    self.mesh = mesh if mesh is not None else model.make_mesh(config.data_parallel, config.ring)
    if config.batch_size % self.mesh.shape[model.DATA_AXIS]:
      raise ValueError(f"batch_size={config.batch_size} must be divisible by the data axis "
                       f"({self.mesh.shape[model.DATA_AXIS]})")
    self.optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.adamw(learning_rate_schedule(config),
                                             weight_decay=0.01))
    self.replicated = model.replicated(self.mesh)
    self.tokens = model.token_sharding(self.mesh)
    self._model = model
    mcfg, mesh_ = config.model, self.mesh

    def loss_fn(params, batch, key):
      logits = model.forward(params, batch["tokens"], batch["positions"], mcfg, mesh_,
                             dropout_key=key if mcfg.dropout > 0 else None,
                             backend=config.backend)
      return model.answer_loss(logits, batch["targets"], batch["weights"])

    def train_step(state, batch):
      rng, key = jax.random.split(state["rng"])
      (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          state["params"], batch, key)
      updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
      params = optax.apply_updates(state["params"], updates)
      new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}
      return new, {"loss": loss, "accuracy": acc}

    def eval_step(state, batch):
      return loss_fn(state["params"], batch, None)

    self._train_step = jax.jit(train_step, donate_argnums=0)
    self._eval_step = jax.jit(eval_step)

  def _make_state(self):
    """The function building the initial state (traced under this mesh)."""
    import jax                                    # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp                       # pylint: disable=g-import-not-at-top
    pkey, rng = jax.random.split(jax.random.PRNGKey(self.config.seed))

    def make():
      params = self._model.init_params(self.config.model, pkey)
      return {"params": params, "opt_state": self.optimizer.init(params),
              "step": jnp.zeros((), jnp.int32), "rng": rng}

    return make

  def init_state(self):
    """The state at step 0, replicated over the mesh."""
    import jax                                    # pylint: disable=g-import-not-at-top
    make = self._make_state()
    with self._mesh_context():
      return jax.jit(make, out_shardings=self.replicated)()   # one sharding for every leaf

  def abstract_state(self):
    """ShapeDtypeStructs of the state with this mesh's shardings (the restore target)."""
    import jax                                    # pylint: disable=g-import-not-at-top
    with self._mesh_context():
      shapes = jax.eval_shape(self._make_state())
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated), shapes)

  def check_shapes(self) -> None:
    """Traces one training step on abstract inputs: nothing is compiled or run.

    Raises:
      ValueError, NotImplementedError: what ring_attention (or the model) refuses about the
        shapes and options of this configuration, before any collective exists.
    """
    import jax                                    # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp                       # pylint: disable=g-import-not-at-top
    shape = (self.config.batch_size, self.config.task.seq_len)
    batch = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=self.tokens)
             for name, dtype in (("tokens", jnp.int32), ("positions", jnp.int32),
                                 ("targets", jnp.int32), ("weights", jnp.float32))}
    with self._mesh_context():
      jax.eval_shape(self._train_step, self.abstract_state(), batch)

  def batch(self, step: int) -> dict:
    """The global batch of `step`, as arrays sharded P("data", "sp") over the mesh.

    Each process fills only the shards of its own devices.
    """
    import jax                                    # pylint: disable=g-import-not-at-top

    from ringflash.launch import data             # pylint: disable=g-import-not-at-top
    host = data.batch(self.config.task, self.config.seed, step, self.config.batch_size)
    out = {}
    for name in ("tokens", "positions", "targets", "weights"):
      array = getattr(host, name)
      out[name] = jax.make_array_from_callback(array.shape, self.tokens,
                                               lambda index, a=array: a[index])
    return out

  def step(self, state, batch):
    with self._mesh_context():
      return self._train_step(state, batch)

  def evaluate(self, state, batch):
    with self._mesh_context():
      return self._eval_step(state, batch)

  def _mesh_context(self):
    import jax                                    # pylint: disable=g-import-not-at-top
    return jax.set_mesh(self.mesh)


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
  --checkpoint_dir that already holds complete steps needs --resume). What needs the device count is check_devices,
  what needs ring attention's own rules is Trainer.check_shapes.

  Raises:
    UsageError: naming the flag and what is allowed.
  """
  from ringflash.launch import data, model        # pylint: disable=g-import-not-at-top
  v = values
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
  try:
    task = data.TaskConfig(seq_len=v.seq_len, num_keys=v.num_keys, num_values=v.num_values,
                           num_pairs=v.num_pairs, num_copies=v.num_copies,
                           num_queries=v.num_queries, num_fillers=v.num_fillers)
    mcfg = model.ModelConfig(vocab_size=task.vocab_size, d_model=v.d_model,
                             num_heads=v.num_heads, num_layers=v.num_layers, d_ff=v.d_ff,
                             rope_base=v.rope_base, dropout=v.dropout)
  except ValueError as err:
    raise _usage(err, values) from None
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


def check_devices(config: RunConfig, device_count: int) -> None:
  """The mesh data_parallel x ring must fit the job's devices.

  Raises:
    UsageError: naming --data_parallel and --ring.
  """
  needed = config.data_parallel * config.ring
  if needed > device_count:
    raise UsageError(f"--data_parallel={config.data_parallel} x --ring={config.ring} needs "
                     f"{needed} devices, the job has {device_count}")


def _usage(err: Exception, values: flags.FlagValues, otherwise: str = "") -> UsageError:
  """A library's ValueError as a UsageError: a message that starts with a field named like a
  flag names that flag (`seq_len must be even` -> `--seq_len must be even`); any other
  message gets `otherwise` in front."""
  text = str(err)
  first = re.match(r"[a-z_]+", text)
  if first and first.group(0) in values:
    return UsageError(f"--{text}")
  return UsageError(f"{otherwise}{text}")


def _identity(config: RunConfig) -> dict:
  """What a checkpoint must agree with to be resumed (the mesh may differ), as JSON reads it."""
  return json.loads(json.dumps({
      "model": dataclasses.asdict(config.model), "task": dataclasses.asdict(config.task),
      "batch_size": config.batch_size, "seed": config.seed,
      "learning_rate": config.learning_rate, "warmup_steps": config.warmup_steps}))


def _same_run(config: RunConfig):
  """The check_meta of Checkpoints.restore_latest: the step's run identity must be this one."""
  want = _identity(config)

  def flat(tree, prefix=""):       # {"model": {"d_model": 64}} -> {"model.d_model": 64}
    if not isinstance(tree, dict):
      return {prefix.rstrip("."): tree}
    return {k: x for key, sub in tree.items() for k, x in flat(sub, f"{prefix}{key}.").items()}

  def check(meta: dict) -> str | None:
    saved = meta.get("run")
    if not isinstance(saved, dict):
      return "its metadata does not say which run configuration saved it"
    have, now = flat(saved), flat(want)
    diffs = [f"{k} {have.get(k)!r} there, {now.get(k)!r} now"
             for k in sorted(set(have) | set(now)) if have.get(k) != now.get(k)]
    if diffs:
      return "saved by another run configuration (" + ", ".join(diffs) + ")"
    return None

  return check


def holds_step(step: int, state, meta: dict) -> str | None:
  """The check_restored of Checkpoints.restore_latest: the folder of `step` must hold the
  state after `step` steps, and its metadata the data stream at `step` (a folder copied
  under another step's name would otherwise resume at the wrong step)."""
  import jax                                      # pylint: disable=g-import-not-at-top
  have = int(jax.device_get(state["step"]))
  if have != step:
    return f"holds the state of step {have}"
  stream = meta.get("data")
  next_step = stream.get("next_step") if isinstance(stream, dict) else None
  if next_step != step:
    return f"its metadata puts the data stream at step {next_step!r}"
  return None


def _refused_save(ckpt, step: int) -> str:
  """Why orbax did not start the save of `step` (Checkpoints.save returned False)."""
  latest = ckpt.latest_step()
  if latest is not None and latest >= step:
    return (f"{ckpt.directory} already holds step {latest}, and orbax saves only steps after "
            f"its newest (is another run writing into this folder?)")
  return f"orbax refused it (its newest step in {ckpt.directory}: {latest})"


def _configure_jax(job: Job) -> "distributed.Processes":
  """Platform and device count, before any backend initializes; joins the job."""
  import jax                                      # pylint: disable=g-import-not-at-top
  if job.platform == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", job.cpu_devices)
  # SIGTERM is read by distributed.PreemptionNotice alone. JAX's preemption service would
  # take it too, and its protocol, which waits for every process, would then hold up each
  # step's question (PreemptionNotice.reached, orbax's save) when the SIGTERM follows a lost
  # process: the survivor would wait for the launcher's SIGKILL instead of ending at once.
  jax.config.update("jax_enable_preemption_service", False)
  # Joins the multi-process job under `ringflash launch` (RINGFLASH_* environment); there
  # RINGFLASH_DEVICES_PER_PROCESS overrides --cpu_devices. A no-op for a single process.
  return distributed.initialize()


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What a run did: the metrics of the steps run here, and where a preemption notice
  stopped it (None: it ran to config.total_steps)."""

  history: list[dict]
  preempted_at: int | None = None


def run(trainer: Trainer, *, checkpoint_dir: str | None, save_every: int, keep: int,
        async_save: bool, resume: bool, metrics_file: str | None = None,
        crash_after_save_starts: int = -1, log=print) -> Outcome:
  """Trains to trainer.config.total_steps, or until a preemption notice (SIGTERM).

  On the notice every process saves the step it has reached (with checkpoint_dir) and the
  run stops there: see distributed.PreemptionNotice.

  A checkpoint is saved every save_every steps and at the last step, which is waited for.
  With resume, complete steps newer than the one restored (all of them skipped: unusable) are
  moved aside (Checkpoints.move_aside), so that orbax saves the steps that follow.

  Raises:
    checkpointing.NoUsableCheckpointError: resume, and complete checkpoints exist but none
      restores (another run configuration, unreadable, corrupted); nothing was trained.
    UsageError: resume, and the step restored is past total_steps.
    RuntimeError: a save that was due did not start (orbax holds a newer step: something
      else writes into checkpoint_dir).
    ValueError: resume without checkpoint_dir.
  """
  import jax                                      # pylint: disable=g-import-not-at-top

  from ringflash.launch import checkpointing      # pylint: disable=g-import-not-at-top

  if resume and not checkpoint_dir:
    raise ValueError("resume needs a checkpoint_dir")
  config = trainer.config
  lead = jax.process_index() == 0
  say = log if lead else (lambda _: None)
  ckpt = None
  if checkpoint_dir:
    ckpt = checkpointing.Checkpoints(checkpoint_dir, save_every=save_every, keep=keep,
                                     async_save=async_save, log=say)
  state = None
  if resume:
    restored = ckpt.restore_latest(trainer.abstract_state(), check_meta=_same_run(config),
                                   check_restored=holds_step)
    if restored is None:
      say(f"resume: no checkpoint in {ckpt.directory} yet, starting from step 0")
    else:
      if restored.step > config.total_steps:
        ckpt.close()
        raise UsageError(f"--steps={config.total_steps} is below the step restored from "
                         f"{ckpt.directory}, {restored.step}: give --steps={restored.step} or "
                         f"more")
      state = restored.state
      say(f"resume: restored step {restored.step} from {ckpt.directory} "
          f"(data stream at step {restored.meta['data']['next_step']})")
      ckpt.move_aside(restored.skipped)
      if restored.step == config.total_steps:
        ckpt.close()
        say(f"train: the run is already complete: step {restored.step} of --steps="
            f"{config.total_steps} restored, nothing to train")
        return Outcome(history=[])
  if state is None:
    state = trainer.init_state()
  start = int(jax.device_get(state["step"]))
  tokens_per_step = config.batch_size * config.task.seq_len
  say(f"train: mesh {dict(trainer.mesh.shape)} over {jax.device_count()} devices "
      f"({jax.process_count()} processes), seq_len {config.task.seq_len}, "
      f"batch {config.batch_size}, steps {start}..{config.total_steps}, "
      f"chance accuracy {config.task.chance:.4f}")
  history = []
  preempted_at = None
  t_start = time.perf_counter()
  metrics_out = None
  if metrics_file and lead:
    os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
    metrics_out = open(metrics_file, "a")
  try:
    with distributed.PreemptionNotice() as notice:
      for step in range(start, config.total_steps):
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, trainer.batch(step))
        loss, acc = (float(x) for x in jax.device_get((metrics["loss"], metrics["accuracy"])))
        elapsed = time.perf_counter() - t0
        done = step + 1
        record = {"step": done, "loss": loss, "accuracy": acc}
        history.append(record)
        say(f"step {done} loss {loss:.4f} acc {acc:.3f} (chance {config.task.chance:.3f}) "
            f"tokens/s {tokens_per_step / elapsed:.0f}")
        if metrics_out is not None:
          metrics_out.write(json.dumps(record) + "\n")
          metrics_out.flush()
        saved = False
        meta = {"data": {"seed": config.seed, "next_step": done}, "run": _identity(config)}
        if ckpt is not None:
          final = done == config.total_steps
          saved = ckpt.save(done, state, meta, force=final)
          if not saved and (final or done % save_every == 0):
            raise RuntimeError(f"checkpoint: the save of step {done}, due, did not start: "
                               f"{_refused_save(ckpt, done)}")
          if saved and done == crash_after_save_starts:
            say(f"fault injection: SIGKILL while the save of step {done} is in flight")
            os.kill(os.getpid(), signal.SIGKILL)
        # Every process asks at every step; all of them get the same answer at the same step.
        if done < config.total_steps and notice.reached(done):
          preempted_at = done
          if ckpt is not None and not saved:
            saved = ckpt.save(done, state, meta, force=True)
          if ckpt is None:
            where = "no --checkpoint_dir, nothing saved"
          elif saved:
            where = f"saved step {done} in {ckpt.directory}"
          else:
            where = f"could not save step {done}: {_refused_save(ckpt, done)}"
          say(f"train: preemption notice (SIGTERM): {where}; stopping at step {done} of "
              f"{config.total_steps}")
          break
    if ckpt is not None:
      ckpt.close()                 # waits for the save in flight, the last step's included
    if history:
      last = history[-20:]
      say(f"train: steps {history[0]['step']}..{history[-1]['step']} in "
          f"{time.perf_counter() - t_start:.0f} s; last {len(last)} steps: mean loss "
          f"{sum(m['loss'] for m in last) / len(last):.4f}, mean accuracy "
          f"{sum(m['accuracy'] for m in last) / len(last):.3f} (chance "
          f"{config.task.chance:.3f})")
  finally:
    if metrics_out is not None:
      metrics_out.close()
  return Outcome(history=history, preempted_at=preempted_at)


def main(argv) -> None:
  del argv                           # ringflash.cli refuses positional arguments
  job = job_from_flags()             # every flag, before anything is touched
  logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
  _configure_jax(job)
  import jax                                      # pylint: disable=g-import-not-at-top

  from ringflash.launch import checkpointing      # pylint: disable=g-import-not-at-top
  with distributed.exit_promptly_on_error("train"):
    check_devices(job.config, jax.device_count())
    trainer = Trainer(job.config)
    try:
      trainer.check_shapes()
    except (ValueError, NotImplementedError) as err:
      raise _usage(err, FLAGS, "ring attention refuses what these flags give: ") from None
    try:
      outcome = run(trainer, checkpoint_dir=job.checkpoint_dir, save_every=job.save_every,
                    keep=job.keep, async_save=job.async_save, resume=job.resume,
                    metrics_file=job.metrics_file,
                    crash_after_save_starts=job.crash_after_save_starts,
                    log=lambda msg: print(msg, flush=True))
    except checkpointing.NoUsableCheckpointError as err:
      # Found alike by every process (the same directory).
      print(f"ringflash train: {err}; refusing to start again at step 0, which would save "
            f"over them; to start afresh, give another --checkpoint_dir",
            file=sys.stderr, flush=True)
      sys.exit(1)
  if outcome.preempted_at is not None:
    sys.exit(PREEMPTED_STATUS)
