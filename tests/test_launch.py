"""Multi-process launch: local processes with CPU devices and gloo, TPU command construction.

The jobs run as subprocesses (`python -m ringflash.cli ...`) with JAX_PLATFORMS=cpu and an
environment stripped of pytest's own variables; every wait on them is bounded.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ringflash.launch import check
from ringflash.launch import distributed
from ringflash.launch import local
from ringflash.launch import tpu

PYTHON = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job_env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("PYTEST_", "RINGFLASH_")) and k not in ("JAX_NUM_CPU_DEVICES",)}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
  return env


def ringflash(*args: str, timeout: float, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([PYTHON, "-m", "ringflash.cli", *args], env=env or job_env(),
                        capture_output=True, text=True, timeout=timeout, cwd=REPO)


def start_process(process_id: int, num_processes: int, port: int, *args: str,
                  devices: int = 2, init_timeout_s: int = 60) -> subprocess.Popen:
  """One process of a job, started by hand with the environment contract (README)."""
  env = job_env(RINGFLASH_COORDINATOR=f"127.0.0.1:{port}",
                RINGFLASH_NUM_PROCESSES=str(num_processes),
                RINGFLASH_PROCESS_ID=str(process_id),
                RINGFLASH_DEVICES_PER_PROCESS=str(devices),
                RINGFLASH_INIT_TIMEOUT_S=str(init_timeout_s))
  return subprocess.Popen([PYTHON, "-m", "ringflash.cli", "check", *args], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout: float) -> list[tuple[int, str]]:
  """(returncode, output) of each process; kills them all if any runs past `timeout`."""
  results = []
  deadline = time.monotonic() + timeout
  try:
    for proc in procs:
      out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
      results.append((proc.returncode, out))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  return results


# ---------------------------------------------------------------------------------------------
# The result across processes equals the single-process 8-device result.

SHAPES = dict(batch=1, seq_len=128, heads=2, kv_heads=1, head_dim=32, causal=True, seed=3)


@pytest.fixture(scope="module")
def single_process_result():
  """check.run in this process: one process, the 8 simulated devices of conftest."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.device_count() != 8:
    pytest.skip(f"needs 8 devices in the test process, has {jax.device_count()}")
  results, inputs = check.run(check.Config(**SHAPES))
  worst = check.errors(results, check.reference(inputs, SHAPES["causal"]))
  assert max(worst.values()) < 1e-4, worst
  return {name: np.asarray(x) for name, x in results.items()}


@pytest.mark.parametrize("processes,devices", [(2, 4), (4, 2)])
def test_processes_match_single_process(processes, devices, single_process_result, tmp_path):
  flags_ = [f"--{k}={v}" if not isinstance(v, bool) else f"--{'' if v else 'no'}{k}"
            for k, v in SHAPES.items()]
  run = ringflash("launch", "local", f"--processes={processes}",
                  f"--devices-per-process={devices}", f"--log_dir={tmp_path / 'logs'}",
                  "--init_timeout_s=60", "--stop_timeout_s=10", "--",
                  "check", *flags_, f"--out_dir={tmp_path / 'out'}", timeout=240)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  for i in range(processes):
    assert re.search(rf"^\[{i}\] ringflash check: process {i} of {processes}: .*: ok$",
                     run.stdout, re.M), run.stdout[-3000:]
    assert os.path.getsize(tmp_path / "logs" / f"process_{i}.log") > 0
  held = [np.load(tmp_path / "out" / f"process_{i}.npz") for i in range(processes)]
  for name, expected in single_process_result.items():
    parts = [h[name] for h in held]
    # Every value is held by exactly one process, and equals the 8-device single-process one.
    np.testing.assert_array_equal(sum((~np.isnan(p)).astype(int) for p in parts),
                                  np.ones(expected.shape, int), err_msg=name)
    merged = np.where(np.isnan(parts[0]), 0.0, parts[0])
    for p in parts[1:]:
      merged = merged + np.where(np.isnan(p), 0.0, p)
    np.testing.assert_allclose(merged, expected, rtol=0, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Failures.

def test_mismatched_shapes_detected_before_ring_attention():
  port = local.free_port()
  procs = [start_process(0, 2, port, "--seq_len=128"),
           start_process(1, 2, port, "--seq_len=64")]
  (code0, out0), (code1, out1) = finish(procs, timeout=120)
  for code, out in ((code0, out0), (code1, out1)):
    assert code != 0, out[-2000:]
    assert "ValueError: inputs differ across processes" in out, out[-2000:]
    assert "q: process 0: (1, 128, 2, 32) float32, process 1: (1, 64, 2, 32) float32" in out
    assert "max error" not in out       # ring attention never ran


def test_killed_process_stops_the_launch(tmp_path):
  command = [PYTHON, "-m", "ringflash.cli", "launch", "local", "--processes=2",
             "--devices-per-process=2", f"--log_dir={tmp_path}", "--stop_timeout_s=3",
             "--init_timeout_s=60", "--", "check", "--seq_len=64", "--repeat=1000000"]
  launcher = subprocess.Popen(command, env=job_env(), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
  reader.start()
  try:
    deadline = time.monotonic() + 120
    while not any(l.startswith("[1] process 1: pass 2/") for l in lines):
      assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
      time.sleep(0.2)
    pid = int(next(re.search(r"process 1: pid (\d+)", l).group(1) for l in lines
                   if re.search(r"process 1: pid \d+", l)))
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    code = launcher.wait(timeout=60)
    assert time.monotonic() - killed_at < 60
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait()
  reader.join(10)
  text = "".join(lines)
  assert code != 0, text[-3000:]
  assert f"lost process 1 (pid {pid}): killed by signal SIGKILL" in text, text[-3000:]
  assert "FAILED: process 1 was lost" in text
  assert os.path.exists(tmp_path / "process_0.log")


def test_process_that_never_starts_fails_the_others():
  port = local.free_port()
  # Processes 0 and 1 of 3 start; process 2 never does.
  started = time.monotonic()
  procs = [start_process(i, 3, port, "--seq_len=64", init_timeout_s=10) for i in (0, 1)]
  results = finish(procs, timeout=90)
  assert time.monotonic() - started < 90
  where = f"the coordinator (process 0) at 127.0.0.1:{port}"
  for code, out in results:
    assert code != 0, out[-2000:]
    assert f"process(es) 2 of 3 did not join {where} within 10 s" in out, out[-2000:]


def test_missing_coordinator_is_named():
  port = local.free_port()
  ((code, out),) = finish([start_process(1, 2, port, init_timeout_s=3)], timeout=60)
  assert code != 0
  assert (f"process 1 of 2 could not reach the coordinator (process 0) at 127.0.0.1:{port} "
          f"within 3 s") in out, out[-2000:]


def test_failing_job_fails_the_launch(tmp_path):
  """A job that exits at once with status 2 (unknown subcommand): named, non-zero, logged."""
  terminal = io.StringIO()
  status = local.launch(["no-such-job"], processes=2, devices_per_process=1,
                        log_dir=str(tmp_path), stop_timeout_s=10, timeout_s=60,
                        terminal=terminal)
  text = terminal.getvalue()
  assert status == 1
  lost = re.search(r"lost process ([01]) \(pid \d+\): exited with status 2", text)
  assert lost, text
  # The lost process logged its error; the other may have been stopped before it printed.
  with open(tmp_path / f"process_{lost.group(1)}.log") as f:
    assert "unknown subcommand 'no-such-job'" in f.read()
  assert f"[{lost.group(1)}] ringflash: unknown subcommand 'no-such-job'" in text


def test_scaling_bench_over_processes(tmp_path):
  """`bench --mode=scaling` in a 2-process job: P=1 on each process's own device, then the
  ring over both processes; process 0 writes the rows (CPU and gloo here, NCCL on GPUs)."""
  status = local.launch(["bench", "--mode=scaling", "--seq_lens=128", "--kv_heads=1",
                         "--heads=2", "--head_dim=32", "--causal=true", "--warmup=0",
                         "--iters=1", f"--out={tmp_path}"],
                        processes=2, devices_per_process=1, log_dir=str(tmp_path / "logs"),
                        stop_timeout_s=10, timeout_s=240, terminal=io.StringIO())
  assert status == 0, open(tmp_path / "logs" / "process_0.log").read()[-2000:]
  run = json.load(open(tmp_path / "bench_scaling.json"))
  assert run["meta"]["processes"] == 2 and run["meta"]["devices"] == 2
  assert [r["P"] for r in run["rows"]] == [1, 2]
  assert run["rows"][0]["fwd_eff"] == 1.0 and run["rows"][1]["fwdbwd_eff"] > 0
  assert run["rows"][1]["layout"] == "zigzag"


@pytest.mark.parametrize("base,process_id,want", [
    ({}, 0, "0,1"), ({}, 1, "2,3"),
    ({"CUDA_VISIBLE_DEVICES": "4,5,6,7,0"}, 1, "6,7")])
def test_gpu_processes_get_their_own_gpus(base, process_id, want):
  base = dict(base, NCCL_NVLS_ENABLE="0", RINGFLASH_DEVICES_PER_PROCESS="8")
  env = local.process_env(base, process_id=process_id, processes=2, devices_per_process=2,
                          port=1234, init_timeout_s=30, platform="gpu")
  assert env["CUDA_VISIBLE_DEVICES"] == want and env["JAX_PLATFORMS"] == "cuda"
  assert env["NCCL_NVLS_ENABLE"] == "0"                  # the caller's NCCL settings pass on
  assert env["XLA_FLAGS"] == "--xla_gpu_experimental_parallel_collective_overlap_limit=2"
  assert "RINGFLASH_DEVICES_PER_PROCESS" not in env      # CPU-only; would be misread
  assert env["RINGFLASH_PROCESS_ID"] == str(process_id)
  assert env["RINGFLASH_COORDINATOR"] == "127.0.0.1:1234"


def test_gpu_processes_keep_the_callers_xla_flags():
  base = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
  env = local.process_env(base, process_id=0, processes=1, devices_per_process=1, port=1,
                          init_timeout_s=30, platform="gpu")
  assert env["XLA_FLAGS"] == ("--xla_dump_to=/tmp/d "
                              "--xla_gpu_experimental_parallel_collective_overlap_limit=2")
  base = {"XLA_FLAGS": "--xla_gpu_experimental_parallel_collective_overlap_limit=3"}
  env = local.process_env(base, process_id=0, processes=1, devices_per_process=1, port=1,
                          init_timeout_s=30, platform="gpu")
  assert env["XLA_FLAGS"] == base["XLA_FLAGS"]


@pytest.mark.parametrize("kwargs,message", [
    ({"platform": "tpu"}, "platform must be one of ('cpu', 'gpu'), got 'tpu'"),
    ({"platform": "gpu", "base": {"CUDA_VISIBLE_DEVICES": "3"}},
     "processes=2 x devices_per_process=1 GPUs needed, CUDA_VISIBLE_DEVICES='3' has 1")])
def test_launch_refuses_bad_platform_arguments_before_starting(tmp_path, kwargs, message,
                                                              monkeypatch):
  for name, value in kwargs.pop("base", {}).items():
    monkeypatch.setenv(name, value)
  terminal = io.StringIO()
  with pytest.raises(ValueError, match=re.escape(message)):
    local.launch(["check"], processes=2, devices_per_process=1, log_dir=str(tmp_path / "l"),
                 terminal=terminal, **kwargs)
  assert terminal.getvalue() == "" and not (tmp_path / "l").exists()


# ---------------------------------------------------------------------------------------------
# The environment contract and the rendezvous, in this process.

@pytest.mark.parametrize("env,message", [
    ({"RINGFLASH_NUM_PROCESSES": "2", "RINGFLASH_PROCESS_ID": "0"},
     "RINGFLASH_COORDINATOR (host:port of process 0) must be set"),
    ({"RINGFLASH_NUM_PROCESSES": "2", "RINGFLASH_PROCESS_ID": "2",
      "RINGFLASH_COORDINATOR": "127.0.0.1:1"}, "RINGFLASH_PROCESS_ID=2 must be < "),
    ({"RINGFLASH_NUM_PROCESSES": "two"}, "RINGFLASH_NUM_PROCESSES must be an integer"),
    ({"RINGFLASH_NUM_PROCESSES": "2"}, "RINGFLASH_PROCESS_ID must be set"),
    ({"RINGFLASH_NUM_PROCESSES": "2", "RINGFLASH_PROCESS_ID": "1",
      "RINGFLASH_COORDINATOR": "localhost"}, "RINGFLASH_COORDINATOR must be host:port"),
    ({"RINGFLASH_INIT_TIMEOUT_S": "0"}, "RINGFLASH_INIT_TIMEOUT_S must be >= 1"),
])
def test_bad_environment_named(env, message, monkeypatch):
  for name in list(os.environ):
    if name.startswith("RINGFLASH_"):
      monkeypatch.delenv(name)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  monkeypatch.setattr(distributed, "_joined", None)
  with pytest.raises(ValueError, match=re.escape(message)):
    distributed.initialize()


def test_rendezvous_refuses_disagreeing_processes():
  """Process 1 believes in 2 processes, process 0 in 3; a second 'process 1' is refused."""
  port = local.free_port()
  errors: dict[str, Exception] = {}

  def attempt(key, process_id, num_processes):
    try:
      distributed._rendezvous("127.0.0.1", port, process_id, num_processes, 5)
    except RuntimeError as err:
      errors[key] = err

  server = threading.Thread(target=attempt, args=("server", 0, 3))
  server.start()
  clients = [threading.Thread(target=attempt, args=(key, 1, n))
             for key, n in (("wrong count", 2), ("first", 3))]
  for c in clients:
    c.start()
    c.join(15)
  server.join(15)
  assert "process 1 says RINGFLASH_NUM_PROCESSES=2, process 0 says 3" in str(
      errors["wrong count"])
  assert "process(es) 2 of 3 did not join" in str(errors["server"])
  assert "process(es) 2 of 3 did not join" in str(errors["first"])


# ---------------------------------------------------------------------------------------------
# TPU: the constructed commands.

def test_tpu_dry_run_prints_the_commands(tmp_path):
  run = ringflash("launch", "tpu", "--name=rf-v5p-32", "--zone=us-east5-a", "--project=proj",
                  "--workers=4", "--dry-run", f"--log_dir={tmp_path}", "--init_timeout_s=600",
                  "--", "check", "--seq_len=65536", "--heads=8", timeout=60)
  assert run.returncode == 0, run.stderr[-2000:]
  gcloud = "gcloud compute tpus tpu-vm"
  where = "--zone=us-east5-a --project=proj"
  entries = " ".join(e for e in tpu.SOURCE_ENTRIES if os.path.exists(os.path.join(REPO, e)))
  expected = [
      "# pack the source tree",
      f"tar -czf {tmp_path}/ringflash-src.tar.gz --exclude=__pycache__ -C {REPO} {entries}",
      "# copy it to every worker",
      f"{gcloud} scp {tmp_path}/ringflash-src.tar.gz rf-v5p-32:ringflash-src.tar.gz {where} "
      "--worker=all",
      "# install ringflash[tpu] on every worker",
      f"{gcloud} ssh rf-v5p-32 --command 'rm -rf ~/ringflash && mkdir -p ~/ringflash && "
      "tar -xzf ~/ringflash-src.tar.gz -C ~/ringflash && cd ~/ringflash && "
      f"python3 -m pip install --quiet \".[tpu]\"' {where} --worker=all",
      "# run the job on every worker",
      f"{gcloud} ssh rf-v5p-32 --command 'cd ~ && mkdir -p ~/ringflash-logs && "
      "RINGFLASH_INIT_TIMEOUT_S=600 python3 -u -m ringflash.cli check --seq_len=65536 "
      "--heads=8 > ~/ringflash-logs/job.log 2>&1; status=$?; tail -n 5 "
      f"~/ringflash-logs/job.log; exit $status' {where} --worker=all",
  ]
  for w in range(4):
    expected += [f"# collect the log of worker {w}",
                 f"{gcloud} scp rf-v5p-32:ringflash-logs/job.log {tmp_path}/worker_{w}.log "
                 f"{where} --worker={w}"]
  assert run.stdout.splitlines() == expected
  assert os.listdir(tmp_path) == []       # a dry run creates nothing
  # The remote command survives the shell: split back, it is one argument.
  argv = shlex.split(expected[7])
  assert argv[argv.index("--command") + 1].startswith("cd ~ && ")


def test_tpu_launch_runs_steps_and_collects_logs_after_a_failure(tmp_path):
  """The executor on stand-in commands: the job fails, the logs are still collected."""
  marker = tmp_path / "collected"
  plan = [tpu.Step("prepare", ("true",)),
          tpu.Step("job", ("false",)),
          tpu.Step("skipped after failure", ("touch", str(tmp_path / "skipped"))),
          tpu.Step("collect", ("touch", str(marker)), always=True)]
  terminal = io.StringIO()
  assert tpu.launch(plan, dry_run=False, terminal=terminal) == 1
  assert marker.exists() and not (tmp_path / "skipped").exists()
  assert "FAILED (job): status 1" in terminal.getvalue()


def test_tpu_slice_validated():
  with pytest.raises(ValueError, match="workers must be >= 1"):
    tpu.Slice(name="n", zone="z", workers=0)
  with pytest.raises(ValueError, match="zone must be set"):
    tpu.Slice(name="n", zone="", workers=1)
