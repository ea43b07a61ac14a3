"""The training job: model against dense attention, and checkpoints that lose nothing.

In-process tests use conftest's 8 simulated CPU devices; the kill tests run `ringflash train`
in subprocesses (JAX_PLATFORMS=cpu) and SIGKILL them; the last runs it in two processes under
`ringflash launch local`.
"""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
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


def test_data_is_a_function_of_seed_and_step():
  task = data.TaskConfig(seq_len=512, num_keys=12, num_pairs=6, num_copies=3, num_values=5,
                         num_queries=20)
  a, b = data.batch(task, 3, 7, 4), data.batch(task, 3, 7, 4)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, data.batch(task, 3, 8, 4).tokens)
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


# ------------------------------------------------------------------------ (a) kill + resume


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


@pytest.mark.parametrize("damage", ["corrupt_arrays", "delete_arrays", "drop_metadata"])
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
