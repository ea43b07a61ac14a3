"""The training job: model against dense attention, and checkpoints that lose nothing.

In-process tests use conftest's 8 simulated CPU devices; the kill tests run `ringflash train`
in subprocesses (JAX_PLATFORMS=cpu) and SIGKILL or SIGTERM them; the last ones run it in two
processes under `ringflash launch local`.
"""

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringflash.launch import checkpointing, data, model, train

SMALL = ["--seq_len", "256", "--batch_size", "2", "--d_model", "32", "--num_heads", "2",
         "--num_layers", "2", "--d_ff", "64", "--num_keys", "4", "--num_pairs", "4",
         "--num_values", "8", "--num_copies", "2", "--num_queries", "16", "--dropout", "0.1",
         "--learning_rate", "1e-2"]


def _config(ring=4, data_parallel=2, steps=4):
  task = data.TaskConfig(seq_len=256, num_keys=4, num_pairs=4, num_values=8, num_copies=2,
                         num_queries=16)
  mcfg = model.ModelConfig(vocab_size=task.vocab_size, d_model=32, num_heads=2, num_layers=2,
                           d_ff=64, dropout=0.1)
  return train.RunConfig(model=mcfg, task=task, batch_size=2, data_parallel=data_parallel,
                         ring=ring, learning_rate=1e-2, warmup_steps=2, total_steps=steps,
                         seed=0)


def _train_cmd(tmp_path, *extra):
  code = "from ringflash.cli import run; run()"
  return [sys.executable, "-c", code, "train", *SMALL, "--checkpoint_dir",
          str(tmp_path / "ckpt"), *extra]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return env


def _metrics(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------- model


def test_model_with_ring_attention_matches_dense_attention(monkeypatch):
  """Loss and every gradient of the ring model (2 x 4 mesh) equal the dense model's."""
  cfg = _config()
  b = data.batch(cfg.task, 0, 0, 2)
  params = model.init_params(cfg.model, jax.random.PRNGKey(1))

  def loss(p, mesh, tok, pos, tgt, w):
    return model.answer_loss(model.forward(p, tok, pos, cfg.model, mesh), tgt, w)[0]

  mesh = model.make_mesh(2, 4)
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, model.token_sharding(mesh))
            for a in (b.tokens, b.positions, b.targets, b.weights)]
    ring_loss, ring_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(
        jax.device_put(params, model.replicated(mesh)), mesh, *args)
    ring_loss, ring_grads = jax.device_get((ring_loss, ring_grads))

  def dense(q, k, v, **kwargs):
    assert kwargs["is_causal"]
    with jax.default_matmul_precision("highest"):
      return jax.nn.dot_product_attention(q, k, v, is_causal=True)

  monkeypatch.setattr(model.ringflash, "ring_attention", dense)
  one = model.make_mesh(1, 1)
  with jax.set_mesh(one):
    dense_loss, dense_grads = jax.device_get(jax.jit(jax.value_and_grad(loss), static_argnums=1)(
        params, one, b.tokens, b.positions, b.targets, b.weights))
  np.testing.assert_allclose(ring_loss, dense_loss, rtol=1e-5)
  for (path, g), d in zip(jax.tree_util.tree_leaves_with_path(ring_grads),
                          jax.tree_util.tree_leaves(dense_grads)):
    np.testing.assert_allclose(g, d, rtol=1e-4, atol=1e-5 * np.abs(d).max(),
                               err_msg=jax.tree_util.keystr(path))


def test_training_lowers_the_loss_of_the_batch_it_trains_on():
  """Twenty steps on one batch (no dropout): the loss falls to under a fifth. Every other
  training test compares a run with another run of the same code, or asks only for a
  finite loss, so an update of the wrong sign (gradient ascent) passed them all."""
  config = dataclasses.replace(_config(ring=4, data_parallel=1, steps=20),
                               model=dataclasses.replace(_config().model, dropout=0.0))
  trainer = train.Trainer(config)
  state, batch = trainer.init_state(), trainer.batch(0)
  first = float(trainer.evaluate(state, batch)[0])
  for _ in range(20):
    state, _ = trainer.step(state, batch)
  last = float(trainer.evaluate(state, batch)[0])
  assert np.isfinite(first) and last < first / 5, (first, last)


def test_rope_is_a_rotation_by_position_of_each_pair():
  """model.rope against the complex form (x_i + i x_{i+H/2}) e^{i p f_i}, f_i =
  base^(-2i/H): the tests of the model compare two paths that both call rope, so a sign
  error in it passed them. Hence also: norms kept, and q.k a function of p_q - p_k."""
  h, base = 8, 100.0
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (2, 5, 3, h)), np.float64)
  positions = np.array([[0, 1, 7, 30, 100], [5, 4, 3, 2, 1]], np.int32)
  got = np.asarray(model.rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions), base))
  freq = base ** (-np.arange(h // 2) / (h // 2))
  z = (x[..., :h // 2] + 1j * x[..., h // 2:]) * np.exp(
      1j * positions[:, :, None, None] * freq)
  # float32 angles: p * f rounded by up to 100 * 2^-24 radians, times |x| < 5
  np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], axis=-1), atol=5e-5)
  np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1),
                             rtol=1e-5)
  q, k = jnp.asarray(x[:, :1], jnp.float32), jnp.asarray(x[:, 1:2], jnp.float32)

  def score(pq, pk):
    rot = lambda y, p: model.rope(y, jnp.full((2, 1), p, jnp.int32), base)
    return np.asarray(jnp.sum(rot(q, pq) * rot(k, pk), axis=-1))

  np.testing.assert_allclose(score(3, 1), score(103, 101), rtol=1e-4, atol=1e-5)


def test_dropout_scales_what_it_keeps_so_that_the_mean_is_kept():
  """Residual dropout at rate r zeroes about r of the elements and divides the rest by
  1 - r (inverted dropout: evaluation, which drops nothing, sees the same scale); without a
  key or at rate 0 it is the identity. Only the training runs' losses read it before, and
  they passed without the division."""
  x = jax.random.normal(jax.random.PRNGKey(5), (4, 64, 32))
  out = np.asarray(model._dropout(x, 0.25, jax.random.PRNGKey(6)))
  kept = out != 0
  assert 0.2 < 1 - kept.mean() < 0.3, kept.mean()
  np.testing.assert_allclose(out[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)
  np.testing.assert_array_equal(model._dropout(x, 0.25, None), x)
  np.testing.assert_array_equal(model._dropout(x, 0.0, jax.random.PRNGKey(6)), x)


def test_the_parameter_bound_counts_what_init_params_makes():
  config = _config().model
  params = model.init_params(config, jax.random.PRNGKey(0))
  assert config.num_params == sum(x.size for x in jax.tree.leaves(params))
  with pytest.raises(ValueError, match="make 1073754144 parameters; at most 2"):
    dataclasses.replace(config, d_ff=2**30 // (2 * 2 * 32) + 1)


def test_data_is_a_function_of_seed_and_step():
  task = data.TaskConfig(seq_len=512, num_keys=12, num_pairs=6, num_copies=3, num_values=5,
                         num_queries=20)
  a, b = data.batch(task, 3, 7, 4), data.batch(task, 3, 7, 4)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, data.batch(task, 3, 8, 4).tokens)
  # each row is a sequence of its own (its own stream): a batch of copies of one sequence
  # passed every other check here
  assert len({row.tobytes() for row in a.tokens}) == 4
  np.testing.assert_array_equal(data.batch(task, 3, 7, 4, rows=slice(2, 4)).tokens,
                                a.tokens[2:4])
  np.testing.assert_array_equal(a.positions, np.tile(np.arange(512), (4, 1)))


def test_every_query_is_answered_by_its_pair_in_the_first_half():
  task = data.TaskConfig(seq_len=512, num_keys=12, num_pairs=6, num_copies=3, num_values=5,
                         num_queries=20)
  b = data.batch(task, 1, 2, 4)
  half = task.seq_len // 2
  pairs = np.arange(task.pair_base, task.query_base)
  for toks, tgts, w in zip(b.tokens, b.targets, b.weights):
    assert toks.max() < task.value_base                  # values are never inputs
    stored = toks[:half][np.isin(toks[:half], pairs)]
    ids, counts = np.unique(stored, return_counts=True)
    keys, values = divmod(ids - task.pair_base, task.num_values)
    assert len(ids) == task.num_pairs and (counts == task.num_copies).all()
    assert len(set(keys)) == task.num_pairs              # distinct keys
    assert not np.isin(toks[half:], pairs).any()
    queries = np.flatnonzero(w)
    assert len(queries) == task.num_queries and (queries >= half).all()
    assert (np.flatnonzero(toks >= task.query_base) == queries).all()
    answer = dict(zip(keys, values))
    for pos in queries:
      assert tgts[pos] == task.value_base + answer[toks[pos] - task.query_base]
    assert (tgts[w == 0] == 0).all()


# ------------------------------------------------------------------------------ flags


@pytest.mark.parametrize("args,message", [
    (["--seq_len=0"], "flag --seq_len=0: 0 is not an integer in the range [1, 1073741824]"),
    (["--batch_size=3"], "--batch_size=3 must be divisible by --data_parallel=2"),
    # each sequence is built in Python: days before any message
    (["--batch_size=1000000000"], "flag --batch_size=1000000000: 1000000000 is not an integer "
                                  "in the range [1, 65536]"),
    # an empty path was taken as no flag: nothing saved or written, and nothing said
    (["--checkpoint_dir="], "--checkpoint_dir is empty: give a path, or leave the flag out"),
    (["--metrics_file= "], "--metrics_file is empty: give a path, or leave the flag out"),
    (["--ring=16"], "--data_parallel=2 x --ring=16 needs 32 devices, the job has 8"),
    (["extra"], "takes flags only, got the argument(s) extra"),
    (["--checkpoint_dir={file}/ckpt"], "--checkpoint_dir={file}/ckpt: {file} is a file, not a "
                                       "directory"),
    (["--resume"], "--resume needs --checkpoint_dir (the directory to resume from)"),
    (["--seq_len=100"], "--num_pairs=16 x num_copies=8 = 128 must be <= seq_len / 2 = 50"),
    (["--d_model=30"], "--d_model=30 / num_heads=2 = 15 (head_dim) must be even for RoPE"),
    # a mistyped size: the job waited for hundreds of GiB that never came
    (["--d_ff=1000000000"], "the model is too large: d_model=64, d_ff=1000000000, num_layers=1 "
                            "and the vocabulary of 168 token ids make 128000038080 parameters; "
                            "at most 2**30 = 1073741824"),
    (["--d_model=1048576"], "the model is too large: d_model=1048576, d_ff=128, num_layers=1"),
    (["--backend=nope"], "--backend must be one of auto, xla, pallas_tpu, pallas_gpu, got "
                         "'nope'"),
    (["--learning_rate=inf"], "flag --learning_rate=inf: must be a finite number"),
    (["--keep=2"], "--keep needs --checkpoint_dir (without it no checkpoint is saved)"),
    (["--metrics_file=/proc/nosuch/m.jsonl"], "--metrics_file=/proc/nosuch/m.jsonl: "
                                              "/proc/nosuch cannot be created or written"),
    # beyond what PRNGKey (int64, 32 bits kept) and optax's int32 step counts take
    (["--seed=9223372036854775808"], "flag --seed=9223372036854775808: 9223372036854775808 is "
                                     "not an integer in the range [0, 4294967295]"),
    (["--warmup_steps=3000000000"], "flag --warmup_steps=3000000000: 3000000000 is not an "
                                    "integer in the range [0, 2147483647]"),
    # complete steps in the folder, no --resume: orbax would not save over them
    (["--checkpoint_dir={held}"], "--checkpoint_dir={held} already holds complete checkpoint "
                                  "step(s) 8, 4: pass --resume to continue from them, or give "
                                  "another folder"),
])
def test_bad_flags_are_one_line_before_any_work(tmp_path, args, message):
  afile = tmp_path / "afile"
  afile.write_text("")
  held = tmp_path / "held"
  for name in ("4", "8", "10.unusable", "12.orbax-checkpoint-tmp-1"):
    os.makedirs(held / name)
  names = {"file": afile, "held": held}
  run = subprocess.run([sys.executable, "-m", "ringflash.cli", "train",
                        *(a.format(**names) for a in args)],
                       env=_env(), capture_output=True, text=True, timeout=120)
  assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
  lines = run.stderr.splitlines()
  assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
  assert lines[0].startswith("ringflash train: ") and message.format(**names) in lines[0], (
      lines[0])
  assert run.stdout == ""                  # not a step, not even the mesh line


def _job_from(*args):
  from absl import flags
  values = flags.FlagValues()
  train.define_flags(values)
  values(["train", *args])
  return train.job_from_flags(values)


@pytest.fixture
def no_launch_env(monkeypatch):
  for name in list(os.environ):
    if name.startswith("RINGFLASH_"):
      monkeypatch.delenv(name)
  return monkeypatch


@pytest.mark.parametrize("args,message", [
    (["--learning_rate=inf"], "flag --learning_rate=inf: must be a finite number"),
    (["--learning_rate=nan"], "flag --learning_rate=nan: must be a finite number"),
    (["--rope_base=inf"], "flag --rope_base=inf: must be a finite number"),
    (["--dropout=nan"], "flag --dropout=nan: must be a finite number"),
    (["--save_every=5"], "--save_every needs --checkpoint_dir"),
    (["--keep=2"], "--keep needs --checkpoint_dir"),
    (["--noasync_save"], "--async_save needs --checkpoint_dir"),
    (["--async_save"], "--async_save needs --checkpoint_dir"),
    (["--crash_after_save_starts=4"], "--crash_after_save_starts needs --checkpoint_dir"),
    (["--checkpoint_dir=/proc/nosuch/x"], "--checkpoint_dir=/proc/nosuch/x: /proc/nosuch/x "
                                          "cannot be created or written"),
    (["--seed=4294967296"], "flag --seed=4294967296: 4294967296 is not an integer in the "
                            "range [0, 4294967295]"),
    (["--steps=2147483648"], "flag --steps=2147483648: 2147483648 is not an integer in the "
                             "range [1, 2147483647]"),
    (["--warmup_steps=2147483648"], "flag --warmup_steps=2147483648: 2147483648 is not an "
                                    "integer in the range [0, 2147483647]"),
])
def test_flags_that_would_be_lost_are_refused(args, message):
  """NaN and infinities (absl's bounds let NaN through), flags of the saves without a
  --checkpoint_dir (nothing would be saved), a folder that cannot be created."""
  from absl import flags
  from ringflash.cli import UsageError
  with pytest.raises((flags.Error, UsageError), match=re.escape(message)):
    _job_from(*args)


@pytest.mark.parametrize("args,message", [
    (["--crash_after_save_starts=3"], "--crash_after_save_starts=3 is not a step at which a "
                                      "save starts (a multiple of --save_every=2 up to "
                                      "--steps=7, or --steps itself)"),
    (["--crash_after_save_starts=0"], "--crash_after_save_starts=0 is not a step at which"),
    (["--crash_after_save_starts=8"], "--crash_after_save_starts=8 is not a step at which"),
])
def test_a_fault_that_would_never_fire_is_refused(tmp_path, no_launch_env, args, message):
  from ringflash.cli import UsageError
  common = [f"--checkpoint_dir={tmp_path / 'ckpt'}", "--save_every=2", "--steps=7"]
  with pytest.raises(UsageError, match=re.escape(message)):
    _job_from(*common, *args)
  for step in (2, 6, 7):                    # saves start there (7: the last step)
    assert _job_from(*common, f"--crash_after_save_starts={step}").crash_after_save_starts == (
        step)


def test_cpu_devices_must_agree_with_the_launchers_devices_per_process(no_launch_env):
  from ringflash.cli import UsageError
  # --platform=default takes the devices JAX finds: --cpu_devices did nothing there
  with pytest.raises(UsageError, match=re.escape(
      "--cpu_devices applies to --platform=cpu (simulated devices), not --platform=default")):
    _job_from("--platform=default", "--cpu_devices=8")
  assert _job_from("--platform=default").platform == "default"
  no_launch_env.setenv("RINGFLASH_DEVICES_PER_PROCESS", "2")
  with pytest.raises(UsageError, match=re.escape(
      "--cpu_devices=4 disagrees with RINGFLASH_DEVICES_PER_PROCESS=2")):
    _job_from("--cpu_devices=4")
  assert _job_from("--cpu_devices=2").cpu_devices == 2       # the same: fine
  assert _job_from().cpu_devices == 8                          # not given: the variable wins


def test_a_fresh_run_into_a_folder_holding_checkpoints_is_refused(tmp_path, no_launch_env):
  """Orbax saves only steps after its newest: a run without --resume would save nothing
  there. Folders moved aside and partial saves are no complete steps."""
  from ringflash.cli import UsageError
  ckpt = tmp_path / "ckpt"
  for name in ("10.unusable", "12.orbax-checkpoint-tmp-1"):
    os.makedirs(ckpt / name)
  assert _job_from(f"--checkpoint_dir={ckpt}").checkpoint_dir == str(ckpt)
  os.makedirs(ckpt / "6")
  with pytest.raises(UsageError, match=re.escape(
      f"--checkpoint_dir={ckpt} already holds complete checkpoint step(s) 6: pass --resume")):
    _job_from(f"--checkpoint_dir={ckpt}")
  assert _job_from(f"--checkpoint_dir={ckpt}", "--resume").resume


def test_learning_rate_schedule_warms_up_over_warmup_steps_only():
  """warmup_steps=0: the first update takes the peak rate (before: as 1, the first update at
  rate 0); 2: 0, half, peak; the largest counts the flags allow still evaluate in int32."""
  def rates(config, steps):
    schedule = jax.jit(train.learning_rate_schedule(config))
    return [float(schedule(jnp.int32(i))) for i in steps]

  cfg = _config(steps=10)
  none = dataclasses.replace(cfg, warmup_steps=0)
  np.testing.assert_allclose(rates(none, (0, 10)), [1e-2, 1e-3], rtol=1e-6)
  assert rates(none, (1,))[0] < 1e-2
  np.testing.assert_allclose(rates(cfg, (0, 1, 2, 10)), [0.0, 5e-3, 1e-2, 1e-3], rtol=1e-6)
  most = dataclasses.replace(cfg, warmup_steps=train.MAX_STEPS, total_steps=train.MAX_STEPS)
  np.testing.assert_allclose(rates(most, (0, train.MAX_STEPS)), [0.0, 1e-2], rtol=1e-5)


def test_checkpoint_flags_with_a_checkpoint_dir_are_taken(tmp_path):
  job = _job_from(f"--checkpoint_dir={tmp_path / 'ckpt'}", "--save_every=5", "--keep=2",
                  "--noasync_save", f"--metrics_file={tmp_path / 'm' / 'm.jsonl'}")
  assert (job.save_every, job.keep, job.async_save) == (5, 2, False)
  assert (tmp_path / "ckpt").is_dir() and (tmp_path / "m").is_dir()    # checked by making


# ---------------------------------------------------------------------- (0) fingerprints


def _word_sum_oracle(array: np.ndarray) -> int:
  """Sum of the elements' bit patterns as unsigned ints of their width, mod 2**32 (numpy)."""
  width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[array.dtype.itemsize]
  return int(array.view(width).astype(np.uint64).sum() % 2**32)


def test_fingerprint_compares_bits_also_of_two_byte_floats():
  # bfloat16 0.5 and 0.25 are the words 0x3F00 and 0x3E80; as values cast to uint32 both are
  # 0, so a value fingerprint could not tell [0.5, 0.25] from [0.25, 0.25].
  a = np.array([0.5, 0.25, -3.0], jnp.bfloat16)
  b = np.array([0.25, 0.25, -3.0], jnp.bfloat16)
  tree = {"a": a, "h": np.array([1.5, -2.0], np.float16), "i8": np.array([-1, 7], np.int8),
          "f": np.linspace(-1, 1, 7, dtype=np.float32), "u": np.array([2**32 - 1], np.uint32),
          "flag": np.array([True, False, True])}
  got = checkpointing.fingerprint(jax.tree.map(jnp.asarray, tree))
  want = {f"['{k}']": (int(v.sum()) if v.dtype == bool else _word_sum_oracle(v))
          for k, v in tree.items()}
  assert got == want
  assert checkpointing.fingerprint({"a": jnp.asarray(b)})["['a']"] != got["['a']"]
  # Sharded over 8 devices: the same words, the same sum.
  mesh = model.make_mesh(1, 8)
  sharded = jax.device_put(jnp.asarray(np.arange(64, dtype=np.float32).astype(jnp.bfloat16)),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("sp")))
  assert checkpointing.fingerprint({"s": sharded})["['s']"] == _word_sum_oracle(
      np.arange(64, dtype=np.float32).astype(jnp.bfloat16))


# ------------------------------------------------------------------------ (a) kill + resume


@pytest.mark.slow
def test_sigkill_between_saves_then_resume_matches_straight_run_bitwise(tmp_path):
  """8 steps straight vs killed after step 6 (saves every 4) and resumed from step 4.

  Saves are synchronous here so that the save of step 4 is surely complete at the kill
  (the kill during an asynchronous save is the next test).
  """
  straight = tmp_path / "straight"
  subprocess.run(_train_cmd(straight, "--steps", "8", "--save_every", "4", "--metrics_file",
                            str(straight / "m.jsonl")), env=_env(), check=True,
                 capture_output=True, timeout=300)

  killed = tmp_path / "killed"
  proc = subprocess.Popen(_train_cmd(killed, "--steps", "8", "--save_every", "4",
                                     "--noasync_save",
                                     "--metrics_file", str(killed / "m.jsonl")),
                          env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True)
  try:
    for line in proc.stdout:
      if line.startswith("step 6 "):
        proc.send_signal(signal.SIGKILL)
        break
  finally:
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  # The kill landed between the saves of steps 4 and 8.
  assert sorted(os.listdir(killed / "ckpt")) == ["4"], os.listdir(killed / "ckpt")

  resumed = subprocess.run(_train_cmd(killed, "--steps", "8", "--save_every", "4", "--resume",
                                      "--metrics_file", str(killed / "resumed.jsonl")),
                           env=_env(), check=True, capture_output=True, text=True, timeout=300)
  assert "resume: restored step 4" in resumed.stdout
  want = [m["loss"] for m in _metrics(straight / "m.jsonl")]
  got = [m["loss"] for m in _metrics(killed / "resumed.jsonl")]
  before = [m["loss"] for m in _metrics(killed / "m.jsonl")]
  assert len(want) == 8 and len(got) == 4
  assert before == want[:len(before)]
  assert got == want[4:], list(zip(want[4:], got))        # bit for bit


# ------------------------------------------------------------------- (b) kill during a save


@pytest.mark.slow
def test_sigkill_during_async_save_leaves_previous_checkpoint(tmp_path):
  proc = subprocess.run(_train_cmd(tmp_path, "--steps", "8", "--save_every", "2",
                                   "--crash_after_save_starts", "4"),
                        env=_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  ckpt = tmp_path / "ckpt"
  assert "4" not in os.listdir(ckpt)        # the save of step 4 never completed
  partial = glob.glob(str(ckpt / "4.orbax-checkpoint-tmp*"))

  messages = []
  cfg = _config()
  trainer = train.Trainer(cfg)
  restored = checkpointing.Checkpoints(str(ckpt), save_every=2, keep=3,
                                       log=messages.append).restore_latest(
                                           trainer.abstract_state())
  assert restored is not None and restored.step == 2
  assert int(restored.state["step"]) == 2 and restored.meta["data"]["next_step"] == 2
  if partial:
    assert any("step 4" in m and "partial" in m for m in messages), messages

  resumed = subprocess.run(_train_cmd(tmp_path, "--steps", "4", "--save_every", "2",
                                      "--resume"),
                           env=_env(), capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "resume: restored step 2" in resumed.stdout
  assert "step 4 loss" in resumed.stdout


# -------------------------------------------------------------- (c) another ring size


@pytest.mark.slow
def test_checkpoint_from_ring_4_restores_on_rings_2_and_8(tmp_path):
  base = train.Trainer(_config(ring=4, data_parallel=2))
  state = base.init_state()
  ckpt = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=2, async_save=False)
  for step in range(2):
    state, _ = base.step(state, base.batch(step))
  assert ckpt.save(2, state, {"data": {"seed": 0, "next_step": 2}})
  ckpt.wait()
  want = float(base.evaluate(state, base.batch(2))[0])

  for ring, data_parallel in ((2, 2), (8, 1)):
    trainer = train.Trainer(_config(ring=ring, data_parallel=data_parallel))
    restored = ckpt.restore_latest(trainer.abstract_state())
    assert restored is not None and restored.step == 2
    leaf = restored.state["params"]["embed"]
    assert leaf.sharding.mesh.shape == trainer.mesh.shape       # restored into the new mesh
    got = float(trainer.evaluate(restored.state, trainer.batch(2))[0])
    np.testing.assert_allclose(got, want, rtol=2e-5, err_msg=f"ring {ring}")
    _, metrics = trainer.step(restored.state, trainer.batch(2))   # and it trains on
    assert np.isfinite(float(metrics["loss"]))
  ckpt.close()


# ------------------------------------------------------ (d) partial or corrupted: skipped


def _corrupt_arrays(step_dir):
  """Flips bytes in the middle of every array data file of the step's state."""
  files = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"),
                                recursive=True) if os.path.isfile(f)]
  assert files, f"no array data under {step_dir}"
  for name in files:
    with open(name, "r+b") as f:
      blob = bytearray(f.read())
      mid = len(blob) // 2
      blob[mid:mid + 8] = bytes(255 - x for x in blob[mid:mid + 8])
      f.seek(0)
      f.write(blob)


@pytest.mark.parametrize("damage", [
    "corrupt_arrays", "delete_arrays", pytest.param("drop_metadata", marks=pytest.mark.slow),
    pytest.param("truncate_arrays", marks=pytest.mark.slow),
    # metadata that lost one array's fingerprint: skipped, not loaded with that array unchecked
    pytest.param("drop_a_fingerprint", marks=pytest.mark.slow)])
def test_partial_or_corrupted_checkpoint_is_skipped_and_named(tmp_path, damage):
  trainer = train.Trainer(_config())
  state = trainer.init_state()
  ckpt = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=5, async_save=False)
  for step in range(4):
    state, _ = trainer.step(state, trainer.batch(step))
    ckpt.save(step + 1, state, {"data": {"seed": 0, "next_step": step + 1}})
  ckpt.close()
  assert sorted(os.listdir(tmp_path)) == ["2", "4"]

  step4 = str(tmp_path / "4")
  if damage == "corrupt_arrays":
    _corrupt_arrays(step4)
  elif damage == "delete_arrays":
    for name in glob.glob(os.path.join(step4, "state", "**", "d", "*"), recursive=True):
      os.remove(name)
  elif damage == "truncate_arrays":
    # TensorStore's read error reaches us wrapped in a plain Exception by orbax. Every data
    # file is emptied: which of them a load reads differs from save to save (orbax merges the
    # per-process OCDBT files into the root's, leaving copies a load may not read).
    for name in glob.glob(os.path.join(step4, "state", "**", "d", "*"), recursive=True):
      with open(name, "w"):
        pass
  elif damage == "drop_a_fingerprint":
    meta_file = tmp_path / "4" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["fingerprint"]["['step']"]
    meta_file.write_text(json.dumps(meta))
  else:
    os.remove(os.path.join(step4, "meta", "metadata"))
  # A leftover of an interrupted save of step 6.
  os.makedirs(tmp_path / "6.orbax-checkpoint-tmp-1234567" / "state")

  messages = []
  restored = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=5,
                                       log=messages.append).restore_latest(
                                           trainer.abstract_state())
  assert restored is not None and restored.step == 2, messages
  assert int(restored.state["step"]) == 2
  assert any("skipping step 6" in m and "partial" in m for m in messages), messages
  assert any("skipping step 4" in m for m in messages), messages
  if damage == "truncate_arrays":
    # TensorStore's error, as orbax raises it: a plain Exception or a ValueError, by file.
    assert any("skipping step 4: cannot be loaded (" in m for m in messages), messages
  if damage == "drop_a_fingerprint":
    assert any("skipping step 4: arrays differ from the fingerprints saved with them "
               "(corrupted): ['step']" in m for m in messages), messages


@pytest.mark.parametrize("error,skipped", [(Exception, True), (OSError, True),
                                           (AttributeError, False)])
def test_what_a_load_raises_skips_the_step_unless_it_is_a_bug(tmp_path, monkeypatch, error,
                                                             skipped):
  """orbax wraps TensorStore's read errors in a plain Exception: the step is skipped and
  named (it was a traceback); an error of ours (AttributeError) is raised, not hidden."""
  trainer = train.Trainer(_config())
  ckpt = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=5, async_save=False)
  for step in (2, 4):
    ckpt.save(step, trainer.init_state(), {"data": {"seed": 0, "next_step": step}})
  ckpt.close()
  messages = []
  reader = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=5,
                                     log=messages.append)
  restore = reader._manager.restore

  def failing(step, *args, **kwargs):
    if step == 4:
      raise error("Error reading Byte range [0, 208438) of local file")
    return restore(step, *args, **kwargs)

  monkeypatch.setattr(reader._manager, "restore", failing)
  if skipped:
    assert reader.restore_latest(trainer.abstract_state()).step == 2
    assert messages == [f"checkpoint: skipping step 4: cannot be loaded ({error.__name__}: "
                        f"Error reading Byte range [0, 208438) of local file)"], messages
  else:
    with pytest.raises(AttributeError):
      reader.restore_latest(trainer.abstract_state())


def test_no_checkpoint_restores_is_an_error_naming_every_step(tmp_path):
  trainer = train.Trainer(_config())
  state = trainer.init_state()
  ckpt = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=5, async_save=False)
  for step in (2, 4):
    ckpt.save(step, state, {"data": {"seed": 0, "next_step": step}})
  ckpt.close()
  _corrupt_arrays(str(tmp_path / "4"))
  os.remove(tmp_path / "2" / "meta" / "metadata")
  messages = []
  with pytest.raises(checkpointing.NoUsableCheckpointError) as err:
    checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=5,
                              log=messages.append).restore_latest(trainer.abstract_state())
  (step4, why4), (step2, why2) = err.value.tried
  assert (step4, step2) == (4, 2)
  assert "cannot be loaded" in why4 or "corrupted" in why4, why4
  assert "unreadable metadata" in why2, why2
  assert f"step 4: {why4}; step 2: {why2}" in str(err.value)
  # What it means is the caller's to say (train: it will not start again at step 0 over them).
  assert "step 0" not in str(err.value)
  assert len(messages) == 2          # each skipped step was also reported as it was tried


def test_resume_of_another_model_stops_instead_of_saving_over(tmp_path):
  """A checkpoint of step 2 of the model d_model=32; `--resume` with d_model=64 finds it
  complete but not restorable: one line naming step 2 and the difference, status 1, nothing
  trained and nothing saved (before: "no usable checkpoint, starting from step 0")."""
  ckpt = tmp_path / "ckpt"
  config = _config()
  saver = checkpointing.Checkpoints(str(ckpt), save_every=2, keep=3, async_save=False)
  saver.save(2, train.Trainer(config).init_state(),       # as train.run saves it
             {"data": {"seed": 0, "next_step": 2}, "run": train._identity(config)})
  saver.close()
  assert sorted(os.listdir(ckpt)) == ["2"]
  before = {p: os.path.getmtime(p) for p in glob.glob(str(ckpt / "**"), recursive=True)}
  args = _train_cmd(tmp_path, "--steps", "4", "--save_every", "2", "--resume",
                    "--metrics_file", str(tmp_path / "m.jsonl"))
  args[args.index("--d_model") + 1] = "64"
  run = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=300)
  assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
  lines = run.stderr.splitlines()
  assert lines[-1].startswith("ringflash train: none of the 1 complete checkpoint(s) in "
                              f"{ckpt} restores (step 2: saved by another run configuration ("), (
                                  run.stderr[-3000:])
  assert "model.d_model 32 there, 64 now" in lines[-1]
  assert lines[-1].endswith("; refusing to start again at step 0, which would save over them; "
                            "to start afresh, give another --checkpoint_dir")
  assert "step 1 " not in run.stdout and not (tmp_path / "m.jsonl").exists()
  assert {p: os.path.getmtime(p) for p in glob.glob(str(ckpt / "**"), recursive=True)} == before


# ------------------------------------------- which steps resume, and saves that must happen


def _state_at(trainer, step):
  """The initial state as if `step` steps had run (its "step" counter says so)."""
  state = trainer.init_state()
  return dict(state, step=jax.device_put(jnp.int32(step), trainer.replicated))


def _save_as_run(ckpt, step, state, config):
  """Saves as train.run does: the data stream position and the run's identity."""
  assert ckpt.save(step, state, {"data": {"seed": config.seed, "next_step": step},
                                 "run": train._identity(config)}, force=True)
  ckpt.wait()


def test_a_step_folder_holding_another_step_is_skipped(tmp_path):
  """A copy of 2/ named 6/ (all its fingerprints right) holds the state of step 2: skipped,
  2 restores; metadata that puts the data stream at another step is refused too."""
  config = _config()
  trainer = train.Trainer(config)
  ckpt = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=5, async_save=False)
  _save_as_run(ckpt, 2, _state_at(trainer, 2), config)
  ckpt.close()
  shutil.copytree(tmp_path / "2", tmp_path / "6")
  messages = []
  restored = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=5,
                                       log=messages.append).restore_latest(
                                           trainer.abstract_state(),
                                           check_meta=train._same_run(config),
                                           check_restored=train.holds_step)
  assert restored is not None and restored.step == 2 and restored.skipped == (6,)
  assert messages == ["checkpoint: skipping step 6: holds the state of step 2"], messages
  assert train.holds_step(2, restored.state, restored.meta) is None
  assert train.holds_step(2, restored.state, {"data": {"next_step": 3}}) == (
      "its metadata puts the data stream at step 3")


def test_resume_moves_unusable_newer_steps_aside_and_saves_the_last_step(tmp_path):
  """Steps 2 (good) and 4 (corrupted): resume restores 2 and moves 4 aside (to
  4.unusable-2, as 4.unusable exists), so that orbax saves 4 again and the last step, 5 (not
  a multiple of --save_every). Before: the saves of 4 and 5 silently did not happen."""
  config = _config(steps=5)
  trainer = train.Trainer(config)
  ckpt = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=3, async_save=False)
  _save_as_run(ckpt, 2, _state_at(trainer, 2), config)
  _save_as_run(ckpt, 4, _state_at(trainer, 4), config)
  ckpt.close()
  _corrupt_arrays(str(tmp_path / "4"))
  os.makedirs(tmp_path / "4.unusable")
  messages = []
  outcome = train.run(trainer, checkpoint_dir=str(tmp_path), save_every=2, keep=3,
                      async_save=True, resume=True, log=messages.append)
  assert [m["step"] for m in outcome.history] == [3, 4, 5]
  assert any(m.startswith("checkpoint: skipping step 4: ") for m in messages), messages
  assert (f"checkpoint: moved unusable step 4 aside, to {tmp_path / '4.unusable-2'} (newer "
          "than the step restored, it would stop every later save)") in messages, messages
  assert sorted(os.listdir(tmp_path)) == ["2", "4", "4.unusable", "4.unusable-2", "5"]
  reader = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=3)
  assert reader.complete_steps() == [5, 4, 2] and reader.partial_steps() == []
  restored = reader.restore_latest(trainer.abstract_state(), check_restored=train.holds_step)
  assert restored.step == 5 and int(restored.state["step"]) == 5
  reader.close()


def test_resume_drops_the_metrics_of_the_steps_it_computes_again(tmp_path):
  """Killed after step 3 (in the middle of writing step 4's line) with step 2 saved: the
  resumed run drops the lines of steps 3 and 4 before it appends its own, so every step has
  one line. Before: steps 3 and 4 had two lines each, one glued to a cut-off line."""
  config = _config(steps=4)
  trainer = train.Trainer(config)
  ckpt = checkpointing.Checkpoints(str(tmp_path / "ckpt"), save_every=2, keep=3,
                                   async_save=False)
  _save_as_run(ckpt, 2, _state_at(trainer, 2), config)
  ckpt.close()
  path = tmp_path / "m.jsonl"
  path.write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\nnot a record\n'
                  '{"step": 3, "loss": 7.0}\n{"step": 4, "lo')
  messages = []
  outcome = train.run(trainer, checkpoint_dir=str(tmp_path / "ckpt"), save_every=2, keep=3,
                      async_save=False, resume=True, metrics_file=str(path),
                      log=messages.append)
  assert [m["step"] for m in outcome.history] == [3, 4]
  assert (f"resume: dropped 2 line(s) of steps after 2 from {path} (this run computes those "
          "steps again)") in messages, messages
  lines = path.read_text().splitlines()
  assert lines[:3] == ['{"step": 1, "loss": 9.0}', '{"step": 2, "loss": 8.0}', "not a record"]
  assert [json.loads(line) for line in lines[3:]] == outcome.history
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "m.jsonl"]      # no temporary file left


def test_a_save_that_is_due_and_does_not_start_is_reported(tmp_path, monkeypatch):
  """Step 8 is in the folder (as if another run wrote there meanwhile): orbax refuses to save
  steps 1 and 2. On a preemption notice at step 1 the message says it could not save; a due
  save (step 2, not the last) that does not start is an error. Before: "saved step 1", and
  nothing."""
  config = _config(steps=3)
  trainer = train.Trainer(config)
  ckpt = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=3, async_save=False)
  _save_as_run(ckpt, 8, _state_at(trainer, 8), config)
  ckpt.close()
  monkeypatch.setattr(train.distributed.PreemptionNotice, "reached",
                      lambda self, step: step == 1)
  messages = []
  outcome = train.run(trainer, checkpoint_dir=str(tmp_path), save_every=2, keep=3,
                      async_save=False, resume=False, log=messages.append)
  assert outcome.preempted_at == 1
  assert (f"train: preemption notice (SIGTERM): could not save step 1: {tmp_path} already "
          "holds step 8, and orbax saves only steps after its newest (is another run writing "
          "into this folder?); stopping at step 1 of 3") in messages, messages
  monkeypatch.setattr(train.distributed.PreemptionNotice, "reached", lambda self, step: False)
  with pytest.raises(RuntimeError, match=re.escape(
      f"checkpoint: the save of step 2, due, did not start: {tmp_path} already holds step 8")):
    train.run(trainer, checkpoint_dir=str(tmp_path), save_every=2, keep=3, async_save=False,
              resume=False, log=messages.append)
  assert sorted(os.listdir(tmp_path)) == ["8"]


@pytest.mark.slow
def test_a_notice_after_the_last_step_leaves_a_complete_run(tmp_path, monkeypatch):
  """A notice that arrives during the last step: the run is complete (its last step saved as
  every run's is), not preempted, so that the launch reports success rather than a
  preemption to resume. Asking after the last step too passed every test."""
  trainer = train.Trainer(_config(steps=2))
  monkeypatch.setattr(train.distributed.PreemptionNotice, "reached",
                      lambda self, step: step >= 2)
  messages = []
  outcome = train.run(trainer, checkpoint_dir=str(tmp_path), save_every=5, keep=3,
                      async_save=False, resume=False, log=messages.append)
  assert outcome.preempted_at is None and [m["step"] for m in outcome.history] == [1, 2]
  assert not any("preemption" in m for m in messages), messages
  assert sorted(os.listdir(tmp_path)) == ["2"]


@pytest.mark.parametrize("flag,there,now", [("learning_rate", 0.01, 0.05),
                                            ("warmup_steps", 2, 0)])
def test_resume_with_another_learning_rate_or_warmup_is_refused(tmp_path, flag, there, now):
  """Part of the run's identity (before: silently resumed with the new value); --steps is
  not (extending a run is legitimate)."""
  config = _config(steps=2)
  ckpt = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=3, async_save=False)
  _save_as_run(ckpt, 2, _state_at(train.Trainer(config), 2), config)
  ckpt.close()
  other = train.Trainer(dataclasses.replace(config, **{flag: now}))
  with pytest.raises(checkpointing.NoUsableCheckpointError, match=re.escape(
      f"step 2: saved by another run configuration ({flag} {there!r} there, {now!r} now)")):
    train.run(other, checkpoint_dir=str(tmp_path), save_every=2, keep=3, async_save=False,
              resume=True, log=lambda _: None)
  assert train._same_run(dataclasses.replace(config, total_steps=9))(
      {"run": train._identity(config)}) is None


def test_a_setting_only_the_saved_run_has_is_another_run():
  """A checkpoint whose run identity holds a setting this run's lacks (a model field of
  another version of the model) is another run's, named with its value there; comparing
  only this run's settings passed every test."""
  config = _config()
  saved = train._identity(config)
  saved["model"]["num_experts"] = 8
  assert train._same_run(config)({"run": saved}) == (
      "saved by another run configuration (model.num_experts 8 there, None now)")
  del saved["model"]["num_experts"], saved["seed"]
  assert train._same_run(config)({"run": saved}) == (
      "saved by another run configuration (seed None there, 0 now)")


def test_resume_past_steps_is_refused_and_at_steps_is_complete(tmp_path):
  """A restored step past --steps would train nothing and say nothing: refused (status 2 in
  the command); equal to --steps: the run is complete, said so, nothing trained or saved."""
  from ringflash.cli import UsageError
  config = _config(steps=4)
  ckpt = checkpointing.Checkpoints(str(tmp_path), save_every=2, keep=3, async_save=False)
  _save_as_run(ckpt, 4, _state_at(train.Trainer(config), 4), config)
  ckpt.close()
  shorter = train.Trainer(dataclasses.replace(config, total_steps=2))
  with pytest.raises(UsageError, match=re.escape(
      f"--steps=2 is below the step restored from {tmp_path}, 4: give --steps=4 or more")):
    train.run(shorter, checkpoint_dir=str(tmp_path), save_every=2, keep=3, async_save=False,
              resume=True, log=lambda _: None)
  # a fault at a step the resumed run does not reach again: it ran to its end, status 0
  longer = train.Trainer(dataclasses.replace(config, total_steps=6))
  for crash in (2, 4):
    with pytest.raises(UsageError, match=re.escape(
        f"--crash_after_save_starts={crash} is not after the step restored from {tmp_path}, "
        f"4: no save starts there in this run")):
      train.run(longer, checkpoint_dir=str(tmp_path), save_every=2, keep=3, async_save=False,
                resume=True, crash_after_save_starts=crash, log=lambda _: None)
  messages = []
  outcome = train.run(train.Trainer(config), checkpoint_dir=str(tmp_path), save_every=2,
                      keep=3, async_save=False, resume=True, log=messages.append)
  assert outcome.history == [] and outcome.preempted_at is None
  assert messages[-1] == ("train: the run is already complete: step 4 of --steps=4 restored, "
                          "nothing to train"), messages
  assert sorted(os.listdir(tmp_path)) == ["4"]


# ------------------------------------------------------------- preemption notice (SIGTERM)


def _sigterm_at(command, env, prefix: str, *, timeout: float):
  """Runs `command`, sends it SIGTERM at the output line starting with `prefix`, waits for it
  to end; (the finished process, its whole output)."""
  proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  lines = []
  try:
    for line in proc.stdout:
      lines.append(line)
      if line.startswith(prefix):
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return proc, "".join(lines)


@pytest.mark.slow
def test_sigterm_saves_the_step_reached_and_exits_then_resume_continues(tmp_path):
  """SIGTERM mid-run (saves every 100 steps, so none is due): the run saves the step it has
  reached, exits with status 143, and --resume continues from that step."""
  smaller = ["--num_layers", "1", "--cpu_devices", "4", "--ring", "2"]   # compiles faster
  proc, text = _sigterm_at(_train_cmd(tmp_path, "--steps", "1000", "--save_every", "100",
                                      *smaller), _env(), "step 3 ", timeout=60)
  assert proc.returncode == train.PREEMPTED_STATUS, text[-3000:]
  saved = re.search(r"^train: preemption notice \(SIGTERM\): saved step (\d+) in "
                    rf"{re.escape(str(tmp_path / 'ckpt'))}; stopping at step \1 of 1000$",
                    text, re.M)
  assert saved, text[-3000:]
  step = int(saved.group(1))
  assert step >= 3 and f"step {step} loss" in text and f"step {step + 1} loss" not in text
  assert os.listdir(tmp_path / "ckpt") == [str(step)]

  resumed = subprocess.run(_train_cmd(tmp_path, "--steps", str(step + 1), "--resume", *smaller),
                           env=_env(), capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f"resume: restored step {step} " in resumed.stdout
  assert f"step {step + 1} loss" in resumed.stdout


# ------------------------------------------ (e) two processes under `ringflash launch local`


def _launch_env():
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("PYTEST_", "RINGFLASH_")) and k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  return env


def _launch_train(tmp_path, name, ckpt, *extra):
  """`ringflash launch local --processes 2 --devices-per-process 4 -- train ...`: mesh 2 x 4,
  the data axis across the two processes, each ring inside one."""
  command = [sys.executable, "-m", "ringflash.cli", "launch", "local", "--processes", "2",
             "--devices-per-process", "4", "--log_dir", str(tmp_path / f"{name}-logs"),
             "--init_timeout_s", "120", "--stop_timeout_s", "10", "--timeout_s", "280", "--",
             "train", *SMALL, "--steps", "4", "--save_every", "2", "--checkpoint_dir",
             str(ckpt), "--metrics_file", str(tmp_path / f"{name}.jsonl"), *extra]
  run = subprocess.run(command, env=_launch_env(), capture_output=True, text=True,
                       timeout=300)
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
  assert "all 2 processes finished" in run.stdout, run.stdout[-4000:]
  assert "(2 processes)" in run.stdout, run.stdout[-4000:]
  return run


@pytest.mark.slow
def test_two_processes_save_and_resume_match_straight_run(tmp_path):
  """Both processes save steps 2 and 4; a new 2-process job resumes from step 2 alone and
  computes steps 3 and 4 bit for bit as the straight job did."""
  straight_ckpt = tmp_path / "straight-ckpt"
  _launch_train(tmp_path, "straight", straight_ckpt, "--keep", "5")
  assert sorted(os.listdir(straight_ckpt)) == ["2", "4"], os.listdir(straight_ckpt)

  # Another job's directory holding only the checkpoint of step 2, as if preempted there.
  resumed_ckpt = tmp_path / "resumed-ckpt"
  shutil.copytree(straight_ckpt / "2", resumed_ckpt / "2")
  run = _launch_train(tmp_path, "resumed", resumed_ckpt, "--resume")
  assert re.search(r"^\[0\] resume: restored step 2 ", run.stdout, re.M), run.stdout[-4000:]
  assert sorted(os.listdir(resumed_ckpt)) == ["2", "4"], os.listdir(resumed_ckpt)

  want = [m["loss"] for m in _metrics(tmp_path / "straight.jsonl")]
  got = [m["loss"] for m in _metrics(tmp_path / "resumed.jsonl")]
  assert len(want) == 4 and len(got) == 2
  assert got == want[2:], list(zip(want[2:], got))          # bit for bit


@pytest.mark.slow
def test_two_processes_save_on_sigterm_at_the_same_step(tmp_path):
  """SIGTERM to the launcher: it passes SIGTERM on; PreemptionNotice's all-gather of the
  processes' SIGTERM flags gives both the same step, both take part in its save, both
  exit with status 143, and so does the launcher."""
  command = [sys.executable, "-m", "ringflash.cli", "launch", "local", "--processes", "2",
             "--devices-per-process", "4", "--log_dir", str(tmp_path / "logs"),
             "--init_timeout_s", "120", "--stop_timeout_s", "60", "--", "train", *SMALL,
             "--steps", "1000", "--save_every", "100", "--checkpoint_dir",
             str(tmp_path / "ckpt")]
  proc, text = _sigterm_at(command, _launch_env(), "[0] step 3 ", timeout=120)
  saved = re.search(r"^\[0\] train: preemption notice \(SIGTERM\): saved step (\d+) ", text,
                    re.M)
  assert saved, text[-4000:]
  assert os.listdir(tmp_path / "ckpt") == [saved.group(1)]
  for i in (0, 1):
    assert f"ringflash launch: process {i}: exited with status 143" in text, text[-4000:]
  assert proc.returncode == train.PREEMPTED_STATUS, text[-4000:]
  assert "ringflash launch: PREEMPTED: all 2 processes saved and stopped" in text, text[-4000:]
