"""`ringflash generate`: greedy decoding from a checkpoint of `ringflash train`, checked.

Loads the newest complete, verified checkpoint in --checkpoint_dir (the model and task shapes
come from the checkpoint's own metadata), builds --batch_size sequences of the retrieval task
(launch/data.py) that training never drew (--data_step), and then:

  1. prefill: the first --prompt_len tokens (default: the first half, where the key-value
     pairs are stored) go through the model with ring attention over the "sp" axis, and
     every layer's keys and values go into a ringflash.KVCache, each device keeping the slots
     it computed;
  2. decode: the rest of the sequence arrives one token at a time (fillers and query tokens,
     as a user would send them) and then the model continues alone for --new_tokens tokens,
     each fed its own greedy choice. Every step appends the token's keys and values to the
     caches and attends with decode attention: each device attends the slots it holds, one
     reduction combines them. The model's greedy prediction after each query token is its
     answer (the value stored with that key, thousands of tokens back);
  3. check: one teacher-forced pass (ring attention over the whole sequence, the generated
     tokens included) must give the same argmax at every decoded position: the answers, the
     predictions after every other token, and the generated tokens. A position where the
     teacher-forced top two logits lie within --tie_tolerance of each other may go either way
     and is counted, not failed.

Prints, e.g.:
  generate: answers to 128 queries: accuracy 0.641 (chance 0.125); equal to the
    teacher-forced argmax at 128 of 128
and ends with status 1 if any decoded prediction differs from the teacher-forced argmax by
more than a near tie, or any prediction comes from logits that are not all finite. Every
flag is checked before any device is touched (ringflash.cli's contract: a mistake is one
line naming the flag, and status 2), and so is every field of the
checkpoint's metadata that is read here; what only the backend can refute (--backend=pallas_gpu
on CPU devices) is found by tracing the prefill and one decode step on abstract inputs, before
the checkpoint is restored, and is one line with status 2 too. One process (no launcher).

The mesh is --data_parallel x --ring, whatever the mesh and batch size of the training run:
the restored state is replicated, and --batch_size sequences are decoded. The caches hold a
multiple of 128 x --ring slots (every backend's kernel tiles such a share, README "Decoding"):
the positions that get an input token, rounded up; the extra slots stay free and are masked.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

from absl import flags
from absl import logging

from ringflash.cli import MAX_CPU_DEVICES
from ringflash.cli import UsageError
from ringflash.cli import define_float
from ringflash.launch.train_flags import MAX_BATCH

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """Defines this command's flags on `flag_values` (absl's FLAGS by default)."""
  fv = {"flag_values": flag_values}
  flags.DEFINE_string("checkpoint_dir", None, "Directory of `ringflash train "
                      "--checkpoint_dir=...` checkpoints; the newest complete one is loaded.",
                      **fv)
  flags.DEFINE_integer("ring", 4, "Devices of the ring (sequence) axis \"sp\": the KV cache "
                       "is sharded over them.", lower_bound=1, **fv)
  flags.DEFINE_integer("data_parallel", 1, "Devices of the data (batch) axis.", lower_bound=1,
                       **fv)
  flags.DEFINE_integer("cpu_devices", 8, "Simulated CPU devices (platform cpu).",
                       lower_bound=1, upper_bound=MAX_CPU_DEVICES, **fv)
  flags.DEFINE_enum("platform", "cpu", ["cpu", "default"], "cpu: the simulated CPU mesh; "
                    "default: whatever accelerator JAX finds.", **fv)
  flags.DEFINE_integer("batch_size", 2, "Sequences decoded together, divisible by "
                       "--data_parallel.", lower_bound=1, upper_bound=MAX_BATCH, **fv)
  flags.DEFINE_integer("prompt_len", 0, "Tokens prefilled by ring attention, divisible by "
                       "--ring and below the task's seq_len; 0: seq_len / 2.", lower_bound=0,
                       **fv)
  flags.DEFINE_integer("new_tokens", 8, "Tokens the model generates alone after the "
                       "sequence, each fed its own greedy choice.", lower_bound=0, **fv)
  flags.DEFINE_integer("data_seed", -1, "Seed of the task's sequences; -1: the checkpoint's "
                       "data seed.", lower_bound=-1, **fv)
  flags.DEFINE_integer("data_step", 1_000_000, "Which batch of the task's stream to decode "
                       "(training draws steps 0, 1, ...).", lower_bound=0, **fv)
  flags.DEFINE_string("backend", "auto", "Attention backend (ring prefill and decode).", **fv)
  define_float("tie_tolerance", 1e-3, "A teacher-forced top-two logit margin below this "
               "is a near tie: a different argmax there is counted, not failed.",
               lower_bound=0.0, **fv)


@dataclasses.dataclass(frozen=True)
class Job:
  """A checked `ringflash generate` command line."""

  checkpoint_dir: str
  meta: dict               # the newest complete checkpoint's metadata
  step: int
  ring: int
  data_parallel: int
  cpu_devices: int
  platform: str
  batch_size: int
  prompt_len: int
  new_tokens: int
  data_seed: int
  data_step: int
  backend: str
  tie_tolerance: float


def cache_slots(input_positions: int, ring: int) -> int:
  """Slots of a cache that holds `input_positions` tokens over a ring of `ring` devices: the
  next multiple of kvcache.SLOT_MULTIPLE (128) x ring (e.g. 4103 positions on a ring of 4:
  4608 slots, 1152 per device, nine tiles of 128)."""
  from ringflash import kvcache                   # pylint: disable=g-import-not-at-top
  unit = kvcache.SLOT_MULTIPLE * ring
  return -(-input_positions // unit) * unit


def newest_meta(directory: str) -> tuple[int, dict] | None:
  """(step, metadata) of the newest step directory whose metadata reads as a run of
  `ringflash train` (the arrays are verified later, when restored), or None."""
  steps = sorted((int(name) for name in os.listdir(directory) if name.isdigit()),
                 reverse=True)
  for step in steps:
    try:
      with open(os.path.join(directory, str(step), "meta", "metadata")) as f:
        meta = json.load(f)
    except (OSError, json.JSONDecodeError):
      continue
    if isinstance(meta, dict) and isinstance(meta.get("run"), dict):
      return step, meta
  return None


def job_from_flags(values: flags.FlagValues = FLAGS) -> Job:
  """Every flag, checked against each other and the checkpoint's metadata; no device is
  touched.

  Raises:
    UsageError: naming the flag.
  """
  from ringflash import kvcache                   # pylint: disable=g-import-not-at-top
  from ringflash.launch import data, model        # pylint: disable=g-import-not-at-top
  v = values
  if not v.checkpoint_dir:
    raise UsageError("--checkpoint_dir is required (a directory `ringflash train "
                     "--checkpoint_dir=...` wrote)")
  if not os.path.isdir(v.checkpoint_dir):
    raise UsageError(f"--checkpoint_dir={v.checkpoint_dir} is not a directory")
  found = newest_meta(v.checkpoint_dir)
  if found is None:
    raise UsageError(f"--checkpoint_dir={v.checkpoint_dir} holds no complete checkpoint of "
                     f"`ringflash train`")
  step, meta = found
  # Every field of the metadata that run() reads: run.task, run.model, data.seed (the
  # default of --data_seed) and data.next_step (checked against the restored step).
  try:
    task = data.TaskConfig(**meta["run"]["task"])
    mcfg = model.ModelConfig(**meta["run"]["model"])
    if mcfg.vocab_size != task.vocab_size:        # train builds the model on the task's ids
      raise ValueError(f"run.model.vocab_size={mcfg.vocab_size} is not the task's "
                       f"{task.vocab_size} token ids")
    stream = meta["data"]
    if not isinstance(stream, dict):
      raise ValueError(f"data must be an object, got {stream!r}")
    for key in ("seed", "next_step"):
      value = stream[key]
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"data.{key} must be an integer >= 0, got {value!r}")
  except (TypeError, ValueError, KeyError) as err:
    what = f"{type(err).__name__}: {err}" if isinstance(err, KeyError) else str(err)
    raise UsageError(f"--checkpoint_dir={v.checkpoint_dir}: step {step}'s metadata does not "
                     f"describe a model, task and data stream this version reads ({what})"
                     ) from None
  if v.batch_size % v.data_parallel:
    raise UsageError(f"--batch_size={v.batch_size} must be divisible by "
                     f"--data_parallel={v.data_parallel}")
  prompt = v.prompt_len or task.seq_len // 2
  if prompt % v.ring or not 0 < prompt < task.seq_len:
    raise UsageError(f"--prompt_len={prompt} must be divisible by --ring={v.ring} and "
                     f"between 1 and the checkpoint's seq_len - 1 = {task.seq_len - 1}")
  if v["cpu_devices"].present and v.platform != "cpu":
    raise UsageError(f"--cpu_devices applies to --platform=cpu (simulated devices), not "
                     f"--platform={v.platform}, which takes the devices JAX finds")
  if v.backend not in ("auto", "xla", "pallas_tpu", "pallas_gpu"):
    raise UsageError(f"--backend must be auto, xla, pallas_tpu or pallas_gpu, got "
                     f"{v.backend!r}")
  slots = cache_slots(task.seq_len + max(v.new_tokens - 1, 0), v.ring)
  if slots >= kvcache.EMPTY:
    raise UsageError(f"--new_tokens={v.new_tokens}: the caches would need {slots} slots, a "
                     f"KVCache holds fewer than {kvcache.EMPTY}")
  seed = v.data_seed if v.data_seed >= 0 else meta["data"]["seed"]
  return Job(checkpoint_dir=v.checkpoint_dir, meta=meta, step=step, ring=v.ring,
             data_parallel=v.data_parallel, cpu_devices=v.cpu_devices, platform=v.platform,
             batch_size=v.batch_size, prompt_len=prompt, new_tokens=v.new_tokens,
             data_seed=seed, data_step=v.data_step, backend=v.backend,
             tie_tolerance=v.tie_tolerance)


@dataclasses.dataclass(frozen=True)
class Result:
  """What a generate run found.

  Attributes:
    decoded: [B, L] int32 greedy prediction after each position p (the token p + 1), for
      p = prompt_len - 1 .. L_in - 1 (columns before prompt_len - 1 are -1).
    teacher: [B, L] int32 teacher-forced argmax at the same positions (-1 elsewhere).
    margin: [B, L] float32 teacher-forced top-two logit margin (inf elsewhere).
    answer_positions: (rows, positions) of the query tokens decoded.
    accuracy: of the answers against the task's targets.
    generated: [B, new_tokens] the tokens generated after the sequence.
    mismatches: decoded positions that differ from the teacher by more than a near tie.
    near_ties: decoded positions that differ within a near tie.
    slots: the capacity of each cache (cache_slots), over the ring.
    nonfinite: predictions (decoded or teacher-forced) whose logits were not all finite
      (marked -2 in decoded, -3 in teacher: never equal, so also counted as mismatches).
  """

  decoded: object
  teacher: object
  margin: object
  answer_positions: tuple
  accuracy: float
  generated: object
  mismatches: int
  near_ties: int
  answers_equal: int
  steps_per_second: float
  slots: int
  nonfinite: int


# A prediction from logits with a NaN or an infinity: argmax would read a NaN as any id (0
# on both sides), and a model that gives NaN would pass as equal to its teacher.
_NONFINITE, _NONFINITE_TEACHER = -2, -3


def _choose(logits):
  """Greedy ids from [..., V] logits; _NONFINITE where a row is not all finite."""
  import jax.numpy as jnp                         # pylint: disable=g-import-not-at-top
  return jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), jnp.argmax(logits, axis=-1),
                   _NONFINITE)


def run(job: Job, log=print) -> Result:
  """Restores the model, prefills, decodes and checks (see the module docstring).

  Raises:
    UsageError: --backend (or the attention it runs) refuses this decoding, found before the
      checkpoint is restored; or the directory holds no complete checkpoint.
    checkpointing.NoUsableCheckpointError: complete checkpoints exist but none restores.
  """
  import jax                                      # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp                         # pylint: disable=g-import-not-at-top
  import numpy as np                              # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding          # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P     # pylint: disable=g-import-not-at-top

  import ringflash                                # pylint: disable=g-import-not-at-top
  from ringflash.launch import checkpointing, data  # pylint: disable=g-import-not-at-top
  from ringflash.launch import model, train       # pylint: disable=g-import-not-at-top

  run_meta = job.meta["run"]
  mcfg = model.ModelConfig(**run_meta["model"])
  task = data.TaskConfig(**run_meta["task"])
  # The state's layout on generate's own mesh, to restore into; the training run's batch
  # size, mesh and optimizer settings play no part (the state is replicated).
  config = train.RunConfig(model=mcfg, task=task, batch_size=job.batch_size,
                           data_parallel=job.data_parallel, ring=job.ring, learning_rate=1e-3,
                           warmup_steps=1, total_steps=2, seed=0)
  mesh = model.make_mesh(job.data_parallel, job.ring)
  trainer = train.Trainer(config, mesh=mesh)

  b, t_seq, t0 = job.batch_size, task.seq_len, job.prompt_len
  l_in = t_seq + max(job.new_tokens - 1, 0)       # positions that get an input token
  slots = cache_slots(l_in, job.ring)
  tokens_spec = model.token_sharding(mesh)
  step_spec = NamedSharding(mesh, P(model.DATA_AXIS, None))

  def new_caches(kvs):
    return [ringflash.KVCache.create(b, slots, mcfg.num_heads, mcfg.head_dim, mesh=mesh,
                                     axis_name=model.RING_AXIS, dtype=k.dtype,
                                     batch_axis=model.DATA_AXIS).prefill(k, v)
            for k, v in kvs]

  with jax.set_mesh(mesh):
    @jax.jit
    def prefill(p, tok, pos):
      logits, kvs = model.forward(p, tok, pos, mcfg, mesh, backend=job.backend,
                                  return_kv=True)
      chosen = jax.reshard(_choose(logits), P(model.DATA_AXIS, None))
      return chosen[:, -1], kvs                   # [B, T0] sequence-sharded: gathered first

    @functools.partial(jax.jit, donate_argnums=1)
    def step(p, c, tok):
      logits, c = model.decode_step(p, tok, c, mcfg, backend=job.backend)
      return _choose(logits[:, 0]), c

    # What the backend refuses (a kernel for another platform, a shape it cannot tile) is
    # found by tracing, as train.main does with Trainer.check_shapes: nothing is compiled.
    def prefill_then_step(p, tok, pos, next_tok):
      _, kvs = prefill(p, tok, pos)
      return step(p, new_caches(kvs), next_tok)

    def spec(shape, sharding):
      return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

    try:
      jax.eval_shape(prefill_then_step, trainer.abstract_state()["params"],
                     spec((b, t0), tokens_spec), spec((b, t0), tokens_spec),
                     spec((b, 1), step_spec))
    except (ValueError, NotImplementedError) as err:
      first = (str(err).strip().splitlines() or [type(err).__name__])[0]
      raise UsageError(f"--backend={job.backend} cannot run this decoding: {first}") from None

  ckpt = checkpointing.Checkpoints(job.checkpoint_dir, save_every=1, keep=1 << 30,
                                   async_save=False, log=log)
  restored = ckpt.restore_latest(
      trainer.abstract_state(),
      check_meta=lambda meta: None if meta.get("run") == run_meta else
      "saved by another run configuration than the newest checkpoint",
      check_restored=train.holds_step)
  ckpt.close()
  if restored is None:
    raise UsageError(f"--checkpoint_dir={job.checkpoint_dir} holds no complete checkpoint "
                     f"(orbax finds no finalized step)")
  params = restored.state["params"]

  host = data.batch(task, job.data_seed, job.data_step, b)
  log(f"generate: step {restored.step} of {job.checkpoint_dir} (d_model {mcfg.d_model}, "
      f"{mcfg.num_layers} layer(s), {mcfg.num_heads} head(s)); mesh {dict(mesh.shape)}; "
      f"batch {b} of task step {job.data_step}; prompt {t0} tokens by ring attention, "
      f"{l_in - t0} tokens by decode attention; caches of {slots} slots, "
      f"{slots // job.ring} per device")

  decoded = np.full((b, l_in), -1, np.int64)
  with jax.set_mesh(mesh):
    first, kvs = prefill(params, jax.device_put(host.tokens[:, :t0], tokens_spec),
                         jax.device_put(host.positions[:, :t0], tokens_spec))
    caches = new_caches(kvs)
    decoded[:, t0 - 1] = np.asarray(jax.device_get(first))
    t_start = time.perf_counter()
    for pos in range(t0, l_in):
      # a marked prediction (_NONFINITE) goes on as id 0: the run fails on it anyway
      token = host.tokens[:, pos] if pos < t_seq else np.maximum(decoded[:, pos - 1], 0)
      chosen, caches = step(params, caches,
                            jax.device_put(np.asarray(token, np.int32)[:, None], step_spec))
      decoded[:, pos] = np.asarray(jax.device_get(chosen))
    rate = (l_in - t0) / max(time.perf_counter() - t_start, 1e-9)

    # The teacher-forced pass: the sequence and the generated tokens, padded at the end to a
    # length the ring divides (causal: padding changes no earlier logit).
    full = np.concatenate([host.tokens, np.maximum(decoded[:, t_seq - 1:l_in - 1], 0)],
                          axis=1)
    padded = -(-l_in // job.ring) * job.ring
    full = np.pad(full, ((0, 0), (0, padded - l_in))).astype(np.int32)
    positions = np.broadcast_to(np.arange(padded, dtype=np.int32), full.shape).copy()
    forced = jax.jit(lambda p, tok, pos: model.forward(p, tok, pos, mcfg, mesh,
                                                       backend=job.backend))
    logits = np.asarray(jax.device_get(forced(
        params, jax.device_put(full, tokens_spec), jax.device_put(positions, tokens_spec))))
  logits = logits[:, :l_in]
  top2 = np.sort(logits, axis=-1)[..., -2:]
  margin = np.full((b, l_in), np.inf, np.float32)
  teacher = np.full((b, l_in), -1, np.int64)
  margin[:, t0 - 1:] = (top2[..., 1] - top2[..., 0])[:, t0 - 1:]
  teacher[:, t0 - 1:] = np.where(np.all(np.isfinite(logits), axis=-1),
                                 np.argmax(logits, axis=-1), _NONFINITE_TEACHER)[:, t0 - 1:]
  nonfinite = int(np.sum(decoded == _NONFINITE) + np.sum(teacher == _NONFINITE_TEACHER))
  differ = decoded != teacher
  # a marked prediction is never a near tie (a margin of finite top two can be small)
  tie = ((margin < job.tie_tolerance) & (decoded != _NONFINITE)
         & (teacher != _NONFINITE_TEACHER))
  answers = np.nonzero(host.weights[:, :t_seq] * (np.arange(t_seq) >= t0 - 1) > 0)
  got = decoded[answers]
  accuracy = float(np.mean(got == host.targets[answers])) if got.size else float("nan")
  result = Result(decoded=decoded, teacher=teacher, margin=margin, answer_positions=answers,
                  accuracy=accuracy, generated=decoded[:, t_seq - 1:t_seq - 1 + job.new_tokens],
                  mismatches=int(np.sum(differ & ~tie)), near_ties=int(np.sum(differ & tie)),
                  answers_equal=int(np.sum(~differ[answers])), steps_per_second=rate,
                  slots=slots, nonfinite=nonfinite)
  log(f"generate: answers to {got.size} queries: accuracy {accuracy:.3f} (chance "
      f"{task.chance:.3f}); equal to the teacher-forced argmax at {result.answers_equal} of "
      f"{got.size}")
  log(f"generate: {b * (l_in - t0 + 1)} decoded predictions ({rate:.1f} decode steps/s): "
      f"{result.mismatches} differ from the teacher-forced argmax, {result.near_ties} near "
      f"tie(s) within {job.tie_tolerance:g} differ; {nonfinite} from non-finite logits")
  for row in range(b):
    log(f"generate: row {row} continues with {result.generated[row].tolist()}")
  return result


def main(argv) -> None:
  del argv
  job = job_from_flags()
  logging.set_verbosity(logging.WARNING)   # orbax logs at INFO
  import jax                                      # pylint: disable=g-import-not-at-top
  if job.platform == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", job.cpu_devices)
  if job.ring * job.data_parallel > jax.device_count():
    raise UsageError(f"--data_parallel={job.data_parallel} x --ring={job.ring} needs "
                     f"{job.ring * job.data_parallel} devices, the job has "
                     f"{jax.device_count()}")
  from ringflash.launch import checkpointing      # pylint: disable=g-import-not-at-top
  try:
    result = run(job, log=lambda msg: print(msg, flush=True))
  except checkpointing.NoUsableCheckpointError as err:
    print(f"ringflash generate: {err}; nothing to decode with: give a --checkpoint_dir "
          f"that holds a usable one", file=sys.stderr, flush=True)
    sys.exit(1)
  if result.nonfinite:
    print(f"ringflash generate: FAILED: {result.nonfinite} prediction(s) from logits that are "
          f"not all finite (NaN or infinity)", file=sys.stderr, flush=True)
    sys.exit(1)
  if result.mismatches:
    print(f"ringflash generate: FAILED: {result.mismatches} decoded prediction(s) differ from "
          f"the teacher-forced argmax", file=sys.stderr, flush=True)
    sys.exit(1)
