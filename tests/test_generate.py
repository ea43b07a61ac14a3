"""`ringflash generate` and the model's decode step: a checkpoint of the training example,
prefilled by ring attention and decoded by decode attention, gives what one teacher-forced
pass gives."""

from __future__ import annotations

import json
import os
import re
import shutil
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
  saved as step 0 with the run's identity; tests/test_train.py covers the training itself)."""
  directory = str(tmp_path_factory.mktemp("ckpt"))
  config = _config()
  ckpt = checkpointing.Checkpoints(directory, save_every=1, keep=1, async_save=False,
                                   log=lambda _: None)
  ckpt.save(0, train.Trainer(config).init_state(),
            {"data": {"seed": config.seed, "next_step": 0}, "run": train._identity(config)})
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
  # the sequence is 128 tokens: the 4 generated are the predictions at positions 127 .. 130,
  # each the next one's input (a slice one position early passed the shape check alone)
  assert result.decoded.shape == (2, 128 + 4 - 1)
  np.testing.assert_array_equal(result.generated, result.decoded[:, 127:131])
  # 128 + 3 positions get an input token: caches of 512 slots, 128 per device of the ring of
  # 4 (pallas_tpu tiles a device's slots by 128 on a TPU); the free ones change nothing above
  assert result.slots == 512


def test_predictions_from_nonfinite_logits_are_counted_not_equal(checkpoint, monkeypatch):
  """Logits of NaN on both sides: argmax read them as id 0 on both, so a model that gave
  NaN everywhere passed as equal to its teacher. Each is now marked and counted (and so is
  a mismatch), and the command fails on them."""
  forward, decode_step = model.forward, model.decode_step

  def nan_forward(*args, **kwargs):
    out = forward(*args, **kwargs)
    return (out[0] * jnp.nan, out[1]) if kwargs.get("return_kv") else out * jnp.nan

  def nan_decode_step(*args, **kwargs):
    logits, caches = decode_step(*args, **kwargs)
    return logits * jnp.nan, caches

  monkeypatch.setattr(model, "forward", nan_forward)
  monkeypatch.setattr(model, "decode_step", nan_decode_step)
  result = generate.run(_job(checkpoint, "--new_tokens=2"), log=lambda _: None)
  assert (result.decoded[:, 63:] == -2).all() and (result.teacher[:, 63:] == -3).all()
  assert result.nonfinite == 2 * 2 * (128 + 1 - 63) and result.mismatches == 2 * (128 + 1 - 63)
  assert result.answers_equal == 0


def test_a_decoder_that_disagrees_with_its_teacher_is_counted(checkpoint, monkeypatch):
  """Finite decoded logits that disagree with the teacher-forced ones (here negated): every
  prediction whose top two are apart counts as a mismatch, not a near tie (no test gave
  finite disagreement, and a margin of the wrong sign counted each as a near tie)."""
  decode_step = model.decode_step

  def negated_decode_step(*args, **kwargs):
    logits, caches = decode_step(*args, **kwargs)
    return -logits, caches

  monkeypatch.setattr(model, "decode_step", negated_decode_step)
  job = _job(checkpoint, "--new_tokens=2")
  result = generate.run(job, log=lambda _: None)
  assert result.nonfinite == 0 and (result.margin[:, 63:] > 0).all()
  # position 63's prediction comes from the prompt's forward pass, the 65 after it from the
  # negated steps: their argmin, never the argmax
  np.testing.assert_array_equal(result.decoded[:, 63], result.teacher[:, 63])
  assert (result.decoded[:, 64:] != result.teacher[:, 64:]).all()
  tie = int(np.sum(result.margin[:, 64:] < job.tie_tolerance))
  assert result.mismatches == 2 * 65 - tie and result.near_ties == tie


def test_a_teacher_logit_of_minus_infinity_is_marked_and_never_a_near_tie(checkpoint,
                                                                          monkeypatch):
  """-inf in one id of the teacher-forced logits only (below the top two, whose margin stays
  finite): each such position is marked, counted and a mismatch, never a near tie, even with
  a tie tolerance that takes every margin."""
  forward = model.forward

  def forward_with_minus_inf(*args, **kwargs):
    out = forward(*args, **kwargs)
    return out if kwargs.get("return_kv") else out.at[..., -1].set(-jnp.inf)

  monkeypatch.setattr(model, "forward", forward_with_minus_inf)
  result = generate.run(_job(checkpoint, "--new_tokens=2", "--tie_tolerance=1e30"),
                        log=lambda _: None)
  positions = 2 * (128 + 1 - 63)
  assert (result.decoded[:, 63:] >= 0).all() and (result.teacher[:, 63:] == -3).all()
  assert result.nonfinite == positions and result.mismatches == positions
  assert result.near_ties == 0


def test_a_decoded_logit_of_minus_infinity_is_marked(checkpoint, monkeypatch):
  """-inf in one id of the decoded logits only (the decoder's side of the test above):
  each prediction of the decoding steps is marked and counted, and a mismatch, not the
  argmax of its finite ids; the prompt's own prediction (position 63) is untouched."""
  decode_step = model.decode_step

  def decode_step_with_minus_inf(*args, **kwargs):
    logits, caches = decode_step(*args, **kwargs)
    return logits.at[..., -1].set(-jnp.inf), caches

  monkeypatch.setattr(model, "decode_step", decode_step_with_minus_inf)
  result = generate.run(_job(checkpoint, "--new_tokens=2"), log=lambda _: None)
  assert (result.decoded[:, 64:] == -2).all() and (result.teacher[:, 63:] >= 0).all()
  np.testing.assert_array_equal(result.decoded[:, 63], result.teacher[:, 63])
  assert result.nonfinite == 2 * 65 and result.mismatches == 2 * 65
  assert result.near_ties == 0


def test_the_newest_step_with_a_runs_metadata_is_read(tmp_path):
  """generate reads the run's settings from the newest step whose metadata is a run of
  `ringflash train`: step 7's here, past step 9's (not JSON), step 8's (no run) and an
  interrupted save's temporary folder, and not step 3's."""
  for step, text in ((3, json.dumps({"run": {"seed": 3}})), (7, json.dumps({"run": {"seed": 7}})),
                     (8, json.dumps({"data": {"next_step": 8}})), (9, "{not json")):
    (tmp_path / str(step) / "meta").mkdir(parents=True)
    (tmp_path / str(step) / "meta" / "metadata").write_text(text)
  (tmp_path / "12.orbax-checkpoint-tmp-1").mkdir()
  assert generate.newest_meta(str(tmp_path)) == (7, {"run": {"seed": 7}})


def test_cache_slots_are_whole_tiles_of_128_per_device():
  assert generate.cache_slots(4103, 4) == 4608          # the default run: 1152 per device
  assert generate.cache_slots(512, 4) == 512
  assert generate.cache_slots(1, 2) == 256


def _edited_copy(checkpoint, tmp_path, edit):
  """A copy of the checkpoint whose metadata `edit` changed in place."""
  directory = tmp_path / "ckpt"
  shutil.copytree(checkpoint, directory)
  meta_file = directory / "0" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  edit(meta)
  meta_file.write_text(json.dumps(meta))
  return str(directory)


def test_generate_takes_its_own_batch_and_mesh(checkpoint, tmp_path):
  """Trained with batch 2 (and here without run.batch_size in the metadata at all); decoded
  with 4 sequences over a data axis of 4 (before: the training batch 2 was checked against
  the data axis, and failed)."""
  directory = _edited_copy(checkpoint, tmp_path, lambda meta: meta["run"].pop("batch_size"))
  result = generate.run(_job(directory, "--ring=2", "--data_parallel=4", "--batch_size=4",
                             "--new_tokens=1"), log=lambda _: None)
  assert result.decoded.shape == (4, 128) and result.generated.shape == (4, 1)
  assert result.mismatches == 0 and result.answers_equal == 4 * 8


@pytest.mark.parametrize("edit,message", [
    (lambda meta: meta.update(data="x"), "data must be an object, got 'x'"),
    (lambda meta: meta["data"].pop("seed"), "(KeyError: 'seed')"),
    (lambda meta: meta["data"].update(next_step="1"), "data.next_step must be an integer >= 0"),
    (lambda meta: meta["run"].update(task=3), "argument after ** must be a mapping"),
    # rope_base was unchecked: "abc" was a traceback, 0 made every logit NaN
    (lambda meta: meta["run"]["model"].update(rope_base="abc"),
     "rope_base must be a finite number, got 'abc'"),
    (lambda meta: meta["run"]["model"].update(rope_base=0), "rope_base must be > 0, got 0"),
    # a task of more token ids than the model's embedding rows: ids past it embedded as 0
    (lambda meta: meta["run"]["task"].update(num_fillers=20),
     "run.model.vocab_size=60 is not the task's 64 token ids"),
])
def test_metadata_generate_cannot_read_is_one_line(checkpoint, tmp_path, edit, message):
  from ringflash.cli import UsageError
  directory = _edited_copy(checkpoint, tmp_path, edit)
  with pytest.raises(UsageError, match=re.escape(
      f"--checkpoint_dir={directory}: step 0's metadata does not describe a model, task and "
      f"data stream this version reads (")) as err:
    _job(directory)
  assert message in str(err.value)


def test_no_usable_checkpoint_is_said_for_generate(checkpoint, tmp_path):
  """The arrays of the only step differ from their fingerprints: status 1, one line that
  names the step and does not speak of training (before: "refusing to start again at step
  0, which would save over them")."""
  def corrupt(meta):
    key = sorted(meta["fingerprint"])[0]
    meta["fingerprint"][key] += 1
  directory = _edited_copy(checkpoint, tmp_path, corrupt)
  done = _cli(f"--checkpoint_dir={directory}", "--new_tokens=0")
  assert done.returncode == 1, (done.stdout[-1000:], done.stderr[-2000:])
  lines = done.stderr.splitlines()
  assert lines[-1].startswith(f"ringflash generate: none of the 1 complete checkpoint(s) in "
                              f"{directory} restores (step 0: arrays differ from the "
                              f"fingerprints saved with them (corrupted): "), lines[-1]
  assert lines[-1].endswith("nothing to decode with: give a --checkpoint_dir that holds a "
                            "usable one") and "step 0, which" not in lines[-1]


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
    (["--batch_size=1000000000"], "--batch_size=1000000000: 1000000000 is not an integer in "
                                  "the range [1, 65536]"),
    (["--ring=16"], "needs 16 devices"),
    (["--backend=cuda"], "--backend"),
    # the conftest's and _cli's devices are CPUs: found by tracing, before the restore
    (["--backend=pallas_gpu"], "--backend=pallas_gpu cannot run this decoding: backend "
                               "'pallas_gpu' runs on GPUs"),
    (["--tie_tolerance=nan"], "flag --tie_tolerance=nan: must be a finite number"),
    (["--tie_tolerance=inf"], "flag --tie_tolerance=inf: must be a finite number"),
    # it did nothing there, and the error that followed named --ring
    (["--platform=default", "--cpu_devices=8"], "--cpu_devices applies to --platform=cpu "
                                                "(simulated devices), not --platform=default"),
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
