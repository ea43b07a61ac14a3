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

Before any work (ringflash.cli's contract) every flag is checked (launch/train_flags.py holds
the flags and their checks): by absl's bounds while parsing, then job_from_flags (relations
between flags, directories), then, once the job's devices are known but before anything
compiles, check_devices and Trainer.check_shapes. A mistake is one line naming the flag, and
exit status 2.

Stopping: on SIGTERM (a scheduler's preemption notice) every process saves the step it has
reached and the run exits with PREEMPTED_STATUS (distributed.PreemptionNotice). With several
processes, an error on one of them (a lost peer makes every collective fail) ends that process
at once with status 1 (distributed.exit_promptly_on_error), so that the launcher sees it.

Under `ringflash launch local --processes 2 --devices-per-process 4 -- train ...` every
process runs this same program: it joins the job (ringflash.launch.distributed.initialize)
before touching any device, the mesh spans the devices of all processes, each process fills
only its own shards of a batch, every process takes part in each orbax save and restore, and
only process 0 prints and writes the metrics file. A resume drops the metrics file's records of
steps after the one restored, which it computes again (_drop_records_past).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

from absl import logging

from ringflash.cli import UsageError
from ringflash.cli import command_flags
from ringflash.launch import distributed
from ringflash.launch.train_flags import FLAGS
from ringflash.launch.train_flags import MAX_SEED as MAX_SEED
from ringflash.launch.train_flags import MAX_STEPS as MAX_STEPS
from ringflash.launch.train_flags import Job
from ringflash.launch.train_flags import RunConfig
from ringflash.launch.train_flags import check_devices
from ringflash.launch.train_flags import define_flags as define_flags
from ringflash.launch.train_flags import job_from_flags
from ringflash.launch.train_flags import usage_error

# The exit status of a run that saved on a preemption notice and stopped before --steps.
PREEMPTED_STATUS = distributed.PREEMPTED_STATUS


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


def _drop_records_past(path: str, step: int, say) -> None:
  """On a resume from `step`: drops the metrics file's records of later steps.

  They are the steps the lost run computed after its last checkpoint, which this run
  computes again and appends; kept, each of those steps would have two records. A last line
  without its newline (a write cut short by the loss) goes too. Lines that are not step
  records are kept. The file is replaced as a whole (a temporary file, then os.replace).
  """
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  kept = []
  for line in lines:
    if not line.endswith("\n"):
      continue                    # only the last line can lack it: a write cut short
    try:
      later = int(json.loads(line)["step"]) > step
    except (ValueError, TypeError, KeyError):
      later = False
    if not later:
      kept.append(line)
  if len(kept) == len(lines):
    return
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)
  say(f"resume: dropped {len(lines) - len(kept)} line(s) of steps after {step} from {path} "
      f"(this run computes those steps again)")


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
      if 0 < crash_after_save_starts <= restored.step:
        ckpt.close()      # the fault would never be injected, and the run end as if it had not
        raise UsageError(f"--crash_after_save_starts={crash_after_save_starts} is not after "
                         f"the step restored from {ckpt.directory}, {restored.step}: no save "
                         f"starts there in this run")
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
    if resume:
      _drop_records_past(metrics_file, start, say)
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
    # Processes started by hand may differ; --metrics_file is process 0's alone, and the
    # fault injection may be given to one process.
    distributed.agree_on_settings("train", command_flags(
        exclude=("metrics_file", "crash_after_save_starts")))
    check_devices(job.config, jax.device_count(), jax.process_count())
    trainer = Trainer(job.config)
    try:
      trainer.check_shapes()
    except (ValueError, NotImplementedError) as err:
      raise usage_error(err, FLAGS, "ring attention refuses what these flags give: ") from None
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
