"""`ringflash generate` and the model's decode step: a checkpoint of the training example,
prefilled by ring attention and decoded by decode attention, gives what one teacher-forced
pass gives."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

import ringflash
from ringflash.launch import checkpointing, data, generate, model, train


def _config(steps=2):
  task = data.TaskConfig(seq_len=128, num_keys=4, num_pairs=4, num_values=8, num_copies=2,
                         num_queries=8)
  mcfg = model.ModelConfig(vocab_size=task.vocab_size, d_model=32, num_heads=2, num_layers=2,
                           d_ff=64)
  return train.RunConfig(model=mcfg, task=task, batch_size=2, data_parallel=2, ring=4,
                         learning_rate=1e-2, warmup_steps=1, total_steps=steps, seed=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A directory holding a checkpoint as `ringflash train` writes it (the state at step 0,
  saved as step 1 with the run's identity; tests/test_train.py covers the training itself)."""
  directory = str(tmp_path_factory.mktemp("ckpt"))
  config = _config()
  ckpt = checkpointing.Checkpoints(directory, save_every=1, keep=1, async_save=False,
                                   log=lambda _: None)
  ckpt.save(1, train.Trainer(config).init_state(),
            {"data": {"seed": config.seed, "next_step": 1}, "run": train._identity(config)})
  ckpt.close()
  return directory


def _job(directory, *args):
  values = flags.FlagValues()
  generate.define_flags(values)
  values(["generate", f"--checkpoint_dir={directory}", *args])
  return generate.job_from_flags(values)


def test_decode_step_logits_equal_the_teacher_forced_logits():
  """On a 2 x 2 mesh (batch over "data", the caches over "sp"), prefill 64 tokens with the
  ring, decode 1 + 2 more through KV caches: every logit equals the full forward's at the
  same position (float32)."""
  cfg = _config()
  params = model.init_params(cfg.model, jax.random.PRNGKey(0))
  tokens = data.batch(cfg.task, 0, 0, 2).tokens[:, :67]
  mesh = model.make_mesh(2, 2)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(model.DATA_AXIS, None))
  with jax.set_mesh(mesh):
    def put(x):
      return jax.device_put(x, model.token_sharding(mesh))

    positions = np.broadcast_to(np.arange(68, dtype=np.int32), (2, 68))
    ref = jax.jit(lambda p, t, s: model.forward(p, t, s, cfg.model, mesh))(   # one pad token
        params, put(np.pad(tokens, ((0, 0), (0, 1)))), put(positions))
    logits, kvs = jax.jit(lambda p, t, s: model.forward(p, t, s, cfg.model, mesh,
                                                        return_kv=True))(
        params, put(tokens[:, :64]), put(positions[:, :64]))
    caches = [ringflash.KVCache.create(2, 72, 2, 16, mesh=mesh, dtype=jnp.float32,
                                       batch_axis=model.DATA_AXIS).prefill(k, v)
              for k, v in kvs]
    step = jax.jit(lambda p, c, t: model.decode_step(p, t, c, cfg.model), donate_argnums=1)
    got, start = [np.asarray(logits)], 64
    for t in (1, 2):
      out, caches = step(params, caches, jax.device_put(tokens[:, start:start + t], rows))
      got.append(np.asarray(out))
      start += t
  got = np.concatenate(got, axis=1)
  np.testing.assert_allclose(got, np.asarray(ref)[:, :67], atol=2e-5, rtol=1e-5)


def test_generate_answers_equal_the_teacher_forced_argmax(checkpoint):
  result = generate.run(_job(checkpoint, "--new_tokens=4", "--data_step=7"), log=lambda _: None)
  rows, positions = result.answer_positions
  assert len(positions) == 2 * 8                       # every query of the second half
  np.testing.assert_array_equal(result.decoded[rows, positions],
                                result.teacher[rows, positions])
  decoded = result.decoded[:, 63:]                     # prompt 64: predictions from 63 on
  assert (decoded >= 0).all()
  tie = result.margin[:, 63:] < 1e-3
  np.testing.assert_array_equal(np.where(tie, -1, decoded),
                                np.where(tie, -1, result.teacher[:, 63:]))
  assert result.mismatches == 0 and result.answers_equal == 16
  assert result.generated.shape == (2, 4)


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "ringflash.cli", "generate", *args], env=env,
                        capture_output=True, text=True, timeout=300)


def test_generate_command_end_to_end(checkpoint):
  done = _cli(f"--checkpoint_dir={checkpoint}", "--ring=2", "--data_parallel=2",
              "--new_tokens=2")
  assert done.returncode == 0, done.stderr[-2000:]
  assert "equal to the teacher-forced argmax at 16 of 16" in done.stdout
  assert "0 differ from the teacher-forced argmax" in done.stdout


@pytest.mark.parametrize("args,names", [
    ([], "--checkpoint_dir is required"),
    (["--checkpoint_dir=/nonexistent/ckpt"], "--checkpoint_dir=/nonexistent/ckpt"),
    (["--prompt_len=66"], "--prompt_len=66 must be divisible by --ring=4"),
    (["--prompt_len=128"], "--prompt_len=128"),
    (["--batch_size=3", "--data_parallel=2"], "--batch_size=3"),
    (["--ring=16"], "needs 16 devices"),
    (["--backend=cuda"], "--backend"),
    (["--tie_tolerance=nan"], "flag --tie_tolerance=nan: must be a finite number"),
    (["--tie_tolerance=inf"], "flag --tie_tolerance=inf: must be a finite number"),
])
def test_a_flag_mistake_is_one_line_and_status_2(checkpoint, args, names):
  if args and args[0].startswith("--checkpoint_dir") or not args:
    done = _cli(*args)
  else:
    done = _cli(f"--checkpoint_dir={checkpoint}", *args)
  assert done.returncode == 2, (done.stdout[-1000:], done.stderr[-2000:])
  lines = done.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("ringflash generate: "), done.stderr[-2000:]
  assert names in lines[0]
  assert not done.stdout
