"""`ringflash train`: long-context language model training with ring attention.

A small decoder-only transformer (launch/model.py) learns long-range key -> value retrieval
(launch/data.py: a query must find the pair token with its key thousands of tokens back) on a
("data", "sp") mesh: batch over data, sequence over the ring. By default it runs one layer on
a simulated mesh of 8 CPU devices (2 x 4) at a context of 4096 tokens. Each step prints one
line (accuracy over the step's query positions; chance is 1 / num_values):

  step 240 loss 0.7316 acc 0.742 (chance 0.125) tokens/s 15689

With --checkpoint_dir, a checkpoint is saved asynchronously every --save_every steps (the
newest --keep are kept), and --resume continues from the newest complete, verified one: the
parameters, optimizer state, RNG key and data stream position are restored, so the resumed
run computes exactly the steps the uninterrupted run would have (bit for bit on CPU, same
mesh). The mesh may differ from the one that saved (another ring size): arrays are restored
directly into the new shardings.

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
import signal
import time
from typing import Any

from absl import flags
from absl import logging

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines this command's flags on absl's FLAGS. The ringflash command calls it once
  before parsing; importing the module (as tests do) defines nothing."""
  flags.DEFINE_integer("steps", 240, "Training steps to run in total (a resumed run stops at the "
                       "same step).")
  flags.DEFINE_integer("seq_len", 4096, "Tokens per sequence.")
  flags.DEFINE_integer("batch_size", 2, "Global batch size (sequences per step).")
  flags.DEFINE_integer("data_parallel", 2, "Mesh size of the data (batch) axis.")
  flags.DEFINE_integer("ring", 4, "Mesh size of the ring (sequence) axis \"sp\".")
  flags.DEFINE_integer("cpu_devices", 8, "Simulated CPU devices per process (platform cpu).")
  flags.DEFINE_enum("platform", "cpu", ["cpu", "default"], "cpu: the simulated CPU mesh; "
                    "default: whatever accelerator JAX finds.")
  flags.DEFINE_integer("d_model", 64, "Model width.")
  flags.DEFINE_integer("num_heads", 2, "Attention heads.")
  flags.DEFINE_integer("num_layers", 1, "Transformer blocks (one suffices for the task).")
  flags.DEFINE_integer("d_ff", 128, "MLP hidden width.")
  flags.DEFINE_float("rope_base", 1e6, "RoPE wavelength base (large, as in long-context "
                     "models: slow rotations let content match across thousands of tokens).")
  flags.DEFINE_float("dropout", 0.0, "Residual dropout rate (uses the checkpointed RNG key).")
  flags.DEFINE_float("learning_rate", 5e-3, "Peak learning rate (AdamW).")
  flags.DEFINE_integer("warmup_steps", 10, "Linear warmup steps.")
  flags.DEFINE_integer("seed", 0, "Seed of the parameters, RNG key and data stream.")
  flags.DEFINE_integer("num_keys", 16, "Retrieval task: distinct keys.")
  flags.DEFINE_integer("num_values", 8, "Retrieval task: distinct values (chance = 1/this).")
  flags.DEFINE_integer("num_pairs", 16, "Retrieval task: (key, value) pairs stored per "
                       "sequence in its first half.")
  flags.DEFINE_integer("num_copies", 8, "Retrieval task: positions each stored pair occupies.")
  flags.DEFINE_integer("num_queries", 64, "Retrieval task: queries per sequence in its second "
                       "half.")
  flags.DEFINE_integer("num_fillers", 16, "Retrieval task: distinct filler tokens.")
  flags.DEFINE_string("backend", "auto", "Ring attention backend.")
  flags.DEFINE_string("checkpoint_dir", None, "Directory of checkpoints (none: no checkpoints).")
  flags.DEFINE_integer("save_every", 50, "Save a checkpoint every this many steps.")
  flags.DEFINE_integer("keep", 3, "Checkpoints to keep.")
  flags.DEFINE_bool("async_save", True, "Write checkpoints in the background.")
  flags.DEFINE_bool("resume", False, "Continue from the newest complete checkpoint.")
  flags.DEFINE_string("metrics_file", None, "Append one JSON line per step (step, loss, "
                      "accuracy) here; process 0 only.")
  flags.DEFINE_integer("crash_after_save_starts", -1, "Fault injection for tests: SIGKILL this "
                       "process right after the save of this step has started (write in flight).")


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
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, max(1, config.warmup_steps),
        max(config.total_steps, config.warmup_steps + 1),
        end_value=config.learning_rate * 0.1)
    self.optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.adamw(schedule, weight_decay=0.01))
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


def config_from_flags() -> RunConfig:
  from ringflash.launch import data, model        # pylint: disable=g-import-not-at-top
  task = data.TaskConfig(seq_len=FLAGS.seq_len, num_keys=FLAGS.num_keys,
                         num_values=FLAGS.num_values, num_pairs=FLAGS.num_pairs,
                         num_copies=FLAGS.num_copies,
                         num_queries=FLAGS.num_queries, num_fillers=FLAGS.num_fillers)
  mcfg = model.ModelConfig(vocab_size=task.vocab_size, d_model=FLAGS.d_model,
                           num_heads=FLAGS.num_heads, num_layers=FLAGS.num_layers,
                           d_ff=FLAGS.d_ff, rope_base=FLAGS.rope_base,
                           dropout=FLAGS.dropout)
  return RunConfig(model=mcfg, task=task, batch_size=FLAGS.batch_size,
                   data_parallel=FLAGS.data_parallel, ring=FLAGS.ring,
                   learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
                   total_steps=FLAGS.steps, seed=FLAGS.seed, backend=FLAGS.backend)


def _identity(config: RunConfig) -> dict:
  """What a checkpoint must agree with to be resumed (the mesh may differ)."""
  return {"model": dataclasses.asdict(config.model), "task": dataclasses.asdict(config.task),
          "batch_size": config.batch_size, "seed": config.seed}


def _configure_jax() -> None:
  """Platform and device count, before any backend initializes."""
  import jax                                      # pylint: disable=g-import-not-at-top
  if FLAGS.platform == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
  # Joins the multi-process job under `ringflash launch` (RINGFLASH_* environment); there
  # RINGFLASH_DEVICES_PER_PROCESS overrides --cpu_devices. A no-op for a single process.
  from ringflash.launch import distributed        # pylint: disable=g-import-not-at-top
  distributed.initialize()


def run(config: RunConfig, *, checkpoint_dir: str | None, save_every: int, keep: int,
        async_save: bool, resume: bool, metrics_file: str | None = None,
        crash_after_save_starts: int = -1, log=print) -> list[dict]:
  """Trains to config.total_steps; returns the metrics of the steps run here."""
  import jax                                      # pylint: disable=g-import-not-at-top

  from ringflash.launch import checkpointing      # pylint: disable=g-import-not-at-top

  trainer = Trainer(config)
  lead = jax.process_index() == 0
  say = log if lead else (lambda _: None)
  ckpt = None
  if checkpoint_dir:
    ckpt = checkpointing.Checkpoints(checkpoint_dir, save_every=save_every, keep=keep,
                                     async_save=async_save, log=say)
  state = None
  if resume and ckpt is not None:
    restored = ckpt.restore_latest(trainer.abstract_state())
    if restored is None:
      say("resume: no usable checkpoint, starting from step 0")
    else:
      if restored.meta.get("run") != _identity(config):
        raise ValueError(f"checkpoint step {restored.step} in {checkpoint_dir} was saved by "
                         f"another run configuration: {restored.meta.get('run')} vs "
                         f"{_identity(config)}")
      state = restored.state
      say(f"resume: restored step {restored.step} from {ckpt.directory} "
          f"(data stream at step {restored.meta['data']['next_step']})")
  if state is None:
    state = trainer.init_state()
  start = int(jax.device_get(state["step"]))
  tokens_per_step = config.batch_size * config.task.seq_len
  say(f"train: mesh {dict(trainer.mesh.shape)} over {jax.device_count()} devices "
      f"({jax.process_count()} processes), seq_len {config.task.seq_len}, "
      f"batch {config.batch_size}, steps {start}..{config.total_steps}, "
      f"chance accuracy {config.task.chance:.4f}")
  history = []
  t_start = time.perf_counter()
  metrics_out = open(metrics_file, "a") if (metrics_file and lead) else None
  try:
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
      if ckpt is not None:
        meta = {"data": {"seed": config.seed, "next_step": done}, "run": _identity(config)}
        started = ckpt.save(done, state, meta)
        if started and done == crash_after_save_starts:
          say(f"fault injection: SIGKILL while the save of step {done} is in flight")
          os.kill(os.getpid(), signal.SIGKILL)
    if ckpt is not None:
      ckpt.close()
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
  return history


def main(argv) -> None:
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)   # orbax logs every save at INFO
  _configure_jax()
  run(config_from_flags(), checkpoint_dir=FLAGS.checkpoint_dir, save_every=FLAGS.save_every,
      keep=FLAGS.keep, async_save=FLAGS.async_save, resume=FLAGS.resume,
      metrics_file=FLAGS.metrics_file, crash_after_save_starts=FLAGS.crash_after_save_starts,
      log=lambda msg: print(msg, flush=True))
