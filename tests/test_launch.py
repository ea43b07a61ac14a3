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
import socket
import shutil
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
                  devices: int = 2, init_timeout_s: int = 60,
                  command: str = "check") -> subprocess.Popen:
  """One process of a job, started by hand with the environment contract (README)."""
  env = job_env(RINGFLASH_COORDINATOR=f"127.0.0.1:{port}",
                RINGFLASH_NUM_PROCESSES=str(num_processes),
                RINGFLASH_PROCESS_ID=str(process_id),
                RINGFLASH_DEVICES_PER_PROCESS=str(devices),
                RINGFLASH_INIT_TIMEOUT_S=str(init_timeout_s))
  return subprocess.Popen([PYTHON, "-m", "ringflash.cli", command, *args], env=env, cwd=REPO,
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


@pytest.mark.parametrize("token", [3, 40])
def test_check_errors_see_a_nan_in_any_shard(token):
  """A NaN in device 5's shard (token 40 of 64 on 8 devices) is the error, as in device 0's:
  it was dropped by Python's max over the shards, and check said ok."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()[:8]), ("sp",))
  want = np.zeros((1, 64, 2, 4), np.float32)
  got = want.copy()
  got[0, token, 0, 0] = np.nan
  worst = check.errors({"out": jax.device_put(got, NamedSharding(mesh, P(None, "sp")))},
                       {"out": want})
  assert np.isnan(worst["out"]), worst


def test_check_prints_the_tolerance_it_applies():
  """The tolerance printed as given, the errors to three digits: one digit printed 3e-07
  for a tolerance of both 2.95e-07 and 3.4e-07, beside the same error and opposite
  verdicts."""
  worst = {"out": 1.0e-7, "dv": 3.3e-7}
  assert check.verdict(worst, 3.4e-7) == (
      True, "max error out 1.00e-07, dv 3.30e-07 (tolerance 3.4e-07): ok")
  assert check.verdict(worst, 2.95e-7) == (
      False, "max error out 1.00e-07, dv 3.30e-07 (tolerance 2.95e-07): FAILED")
  assert not check.verdict({"out": float("nan")}, 1.0)[0]


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

_INPUTS_PROGRAM = """
import numpy as np
from ringflash.launch import distributed
joined = distributed.initialize()
t = 128 if joined.process_id == 0 else 64
try:
  distributed.check_same_across_processes({"q": np.zeros((1, t, 2, 32), np.float32),
                                           "k": np.zeros((1, 128, 1, 32), np.float32)})
except distributed.InputsDifferError as err:
  distributed.leave_together(2, f"process {joined.process_id}: ValueError: {err}")
print("inputs agree")
"""


def test_mismatched_shapes_detected_before_ring_attention():
  """A program of its own, run by hand in two processes whose inputs disagree (check and
  train compare their flags first, distributed.check_same_settings): both leave together."""
  port = local.free_port()
  procs = []
  for i in (0, 1):
    env = job_env(RINGFLASH_COORDINATOR=f"127.0.0.1:{port}", RINGFLASH_NUM_PROCESSES="2",
                  RINGFLASH_PROCESS_ID=str(i), RINGFLASH_DEVICES_PER_PROCESS="2",
                  RINGFLASH_INIT_TIMEOUT_S="60")
    procs.append(subprocess.Popen([PYTHON, "-c", _INPUTS_PROGRAM], env=env, cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  for code, out in finish(procs, timeout=120):
    assert code == 2, out[-2000:]      # both leave together (distributed.leave_together)
    assert "ValueError: inputs differ across processes" in out, out[-2000:]
    assert "q: process 0: (1, 128, 2, 32) float32, process 1: (1, 64, 2, 32) float32" in out
    assert "k:" not in out and "inputs agree" not in out


def kill_during_launch(tmp_path, job: list[str], ready: str, victim: int,
                       stop_timeout_s: float = 60) -> tuple[str, int, float]:
  """Launches `job` on 2 processes x 2 CPU devices, SIGKILLs process `victim` once a line
  starting with `ready` appears, and returns (launcher output, victim's pid, seconds from
  the kill to the launcher's exit)."""
  command = [PYTHON, "-m", "ringflash.cli", "launch", "local", "--processes=2",
             "--devices-per-process=2", f"--log_dir={tmp_path}",
             f"--stop_timeout_s={stop_timeout_s}", "--init_timeout_s=60", "--", *job]
  launcher = subprocess.Popen(command, env=job_env(), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
  reader.start()
  try:
    deadline = time.monotonic() + 150
    while not any(l.startswith(ready) for l in lines):
      assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
      time.sleep(0.1)
    pid = int(next(re.search(rf"process {victim}: pid (\d+)", l).group(1) for l in lines
                   if re.search(rf"process {victim}: pid \d+", l)))
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    launcher.wait(timeout=max(stop_timeout_s, 10) + 30)
    seconds = time.monotonic() - killed_at
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait()
  reader.join(10)
  return "".join(lines), pid, seconds


def assert_lost_and_stopped(text: str, lost: int, pid: int, stopped: int,
                            how: tuple[str, ...]) -> None:
  """The launcher names the killed process as the cause and the other as stopped by it,
  ended in one of the ways `how` (never the launcher's SIGKILL)."""
  assert f"lost process {lost} (pid {pid}): killed by signal SIGKILL" in text, text[-3000:]
  stopped_line = re.search(rf"process {stopped}: stopped after process {lost} was lost "
                           rf"\((.*)\)$", text, re.M)
  assert stopped_line and stopped_line.group(1) in how, text[-3000:]
  assert f"FAILED: process {lost} was lost" in text
  assert f"lost process {stopped}" not in text


def test_killed_process_stops_the_launch(tmp_path):
  """`check` across processes: the survivor's collective fails (status 1), or, blocked on a
  send to the dead peer, it ends at the launcher's SIGTERM (check has nothing to save)."""
  text, pid, seconds = kill_during_launch(
      tmp_path, ["check", "--seq_len=64", "--repeat=1000000"], "[1] process 1: pass 2/",
      victim=1)
  assert seconds < 10, text[-3000:]
  assert_lost_and_stopped(text, lost=1, pid=pid, stopped=0,
                          how=("exited with status 1", "killed by signal SIGTERM"))
  assert os.path.exists(tmp_path / "process_0.log")


def test_a_second_interrupt_does_not_cut_the_stop_short(tmp_path):
  """Ctrl-C twice while the launcher stops processes that outlive SIGTERM: the second one
  raised out of the stop, the launcher died with a traceback and left them running. Now it
  ends within --stop_timeout_s, SIGKILL for both, no traceback."""
  fake = tmp_path / "python"               # a job process that ignores SIGTERM
  fake.write_text("#!/bin/sh\ntrap '' TERM\necho ready\nexec sleep 120\n")
  fake.chmod(0o755)
  # Python's own Ctrl-C handler, as in a terminal: a test runner's worker may ignore SIGINT,
  # and its children inherit that.
  program = ("import signal, sys; from ringflash.launch import local; "
             "signal.signal(signal.SIGINT, signal.default_int_handler); "
             f"sys.exit(local.launch(['check'], processes=2, devices_per_process=1, "
             f"log_dir={str(tmp_path / 'logs')!r}, stop_timeout_s=4, python={str(fake)!r}))")
  launcher = subprocess.Popen([PYTHON, "-c", program], env=job_env(), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines = []
  reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
  reader.start()
  deadline = time.monotonic() + 60
  # Both ignore SIGTERM from here on (under load a SIGTERM before the trap ended one).
  while sum(line.endswith("] ready\n") for line in lines) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
  pids = [int(m.group(1)) for m in re.finditer(r"process \d: pid (\d+)", "".join(lines))]
  try:
    assert len(pids) == 2, "".join(lines)
    launcher.send_signal(signal.SIGINT)
    time.sleep(1)
    launcher.send_signal(signal.SIGINT)
    # It needs stop_timeout_s (4 s) and a moment; a starved 2-core host once took over 30 s.
    assert launcher.wait(90) == 1
    reader.join(5)
    text = "".join(lines)
    assert "Traceback" not in text, text
    assert text.count("killed by SIGKILL") == 2, text
    for pid in pids:
      assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[
          2] == "Z", text
  finally:
    launcher.kill()
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass


TRAIN_TINY = ["train", "--steps=100000", "--seq_len=64", "--batch_size=2", "--data_parallel=2",
              "--ring=2", "--d_model=16", "--num_heads=2", "--d_ff=32", "--num_keys=4",
              "--num_pairs=2", "--num_copies=2", "--num_queries=4", "--num_values=4",
              "--num_fillers=4"]


def test_lost_training_process_ends_the_launch_within_seconds(tmp_path):
  """The issue's case, small: a training job of 2 processes, process 1 SIGKILLed mid-run.
  Process 0's all-reduce fails ("Connection closed by peer"); it prints the error and ends at
  once instead of waiting in the runtime's shutdown barrier; the launcher, whose SIGKILL
  would come only after --stop_timeout_s=60, exits within 10 s and blames process 1."""
  text, pid, seconds = kill_during_launch(tmp_path, TRAIN_TINY, "[0] step 3 ", victim=1)
  assert seconds < 10, text[-3000:]
  assert_lost_and_stopped(text, lost=1, pid=pid, stopped=0, how=("exited with status 1",))
  assert "[0] process 0 of 2: ending at once (status 1)" in text, text[-3000:]
  assert re.search(r"^\[0\] jax\.errors\.JaxRuntimeError: .*Gloo", text, re.M), text[-3000:]


def test_supervisor_names_lost_and_stopped_processes(tmp_path, monkeypatch):
  """The launcher alone, on stand-in processes (`python` is a shell script): process 1 dies of
  SIGKILL; process 0 exits 1 on SIGTERM (as a job whose collective fails) or ignores it."""
  script = tmp_path / "job.sh"
  script.write_text(
      "#!/bin/bash\n"
      "if [ \"$RINGFLASH_PROCESS_ID\" = 1 ]; then sleep 0.5; kill -9 $$; fi\n"
      "if [ \"$MODE\" = ignore ]; then trap '' TERM; else trap 'exit 1' TERM; fi\n"
      "for i in $(seq 300); do sleep 0.1; done\n")
  script.chmod(0o755)
  for mode, stop_timeout_s, how in (
      ("exit", 30.0, "exited with status 1"),
      ("ignore", 1.0, "still alive 1 s after SIGTERM, killed by SIGKILL")):
    monkeypatch.setenv("MODE", mode)
    terminal = io.StringIO()
    started = time.monotonic()
    status = local.launch(["check"], processes=2, devices_per_process=1,
                          log_dir=str(tmp_path / mode), stop_timeout_s=stop_timeout_s,
                          python=str(script), terminal=terminal)
    seconds = time.monotonic() - started
    text = terminal.getvalue()
    assert status == 1, text
    assert re.search(r"lost process 1 \(pid \d+\): killed by signal SIGKILL", text), text
    assert f"process 0: stopped after process 1 was lost ({how})" in text, text
    assert seconds < 10, text          # no wait for --stop_timeout_s=30 when 0 exits itself


def _stand_in(tmp_path, body: str):
  """A stand-in job process (the launcher's `python`): a bash script running `body`."""
  script = tmp_path / "job.sh"
  script.write_text("#!/bin/bash\n" + body)
  script.chmod(0o755)
  return str(script)


class _ClosedAfterOneWrite(io.StringIO):
  """A terminal whose reader exits after the first line, as `| head -1` does."""

  def write(self, text):
    if self.getvalue():
      raise BrokenPipeError(32, "Broken pipe")
    return super().write(text)


def test_a_terminal_that_goes_away_does_not_hang_the_job(tmp_path):
  """Each stand-in process writes 4000 lines (past a pipe's 64 KiB) and exits 0. A terminal
  write that raised BrokenPipeError ended the pump thread, nobody drained the process's
  pipe, and the process blocked on it forever (`launch local ... | head -3` hung). Now the
  job ends, every line in its log."""
  script = _stand_in(tmp_path, "for i in $(seq 4000); do echo \"line $i of a long output\"; "
                               "done\n")
  started = time.monotonic()
  status = local.launch(["check"], processes=2, devices_per_process=1,
                        log_dir=str(tmp_path / "logs"), python=script, timeout_s=60,
                        terminal=_ClosedAfterOneWrite())
  assert status == 0 and time.monotonic() - started < 30
  for i in (0, 1):
    lines = (tmp_path / "logs" / f"process_{i}.log").read_text().splitlines()
    assert len(lines) == 4000 and lines[-1] == "line 4000 of a long output", lines[-3:]


class _AsciiTerminal(io.StringIO):
  """A terminal whose encoding is ASCII (PYTHONIOENCODING=ascii, a C locale)."""
  encoding = "ascii"

  def write(self, text):
    text.encode("ascii")                  # UnicodeEncodeError, as a TextIOWrapper raises
    return super().write(text)


def test_a_terminal_of_another_encoding_still_gets_every_line(tmp_path):
  """A job line the terminal cannot encode (a UnicodeEncodeError, a ValueError) was taken as
  the terminal gone: the launcher's verdict never reached it. Now the line is written with
  replacements, and the verdict follows."""
  script = _stand_in(tmp_path, "if [ \"$RINGFLASH_PROCESS_ID\" = 0 ]; then echo 'a → b'; "
                               "exit 1; fi\nsleep 5\n")
  terminal = _AsciiTerminal()
  status = local.launch(["check"], processes=2, devices_per_process=1,
                        log_dir=str(tmp_path / "logs"), python=script, terminal=terminal)
  text = terminal.getvalue()
  assert status == 1 and "[0] a ? b" in text and "FAILED: process 0 was lost" in text, text


def test_processes_stopping_on_a_preemption_notice_are_not_lost(tmp_path):
  """Every process saves on a preemption notice and exits with status 143, process 1 a
  second after process 0: process 0 is not lost, process 1 is not stopped (its SIGTERM
  would end it with status 1 here), and the launcher exits with 143 so that a scheduler
  starts the job again. Before, the launcher blamed process 0 as lost and exited with 1."""
  script = _stand_in(tmp_path,
                     "trap 'exit 1' TERM\n"
                     "if [ \"$RINGFLASH_PROCESS_ID\" = 1 ]; then sleep 1.5; else sleep 0.3; fi\n"
                     "exit 143\n")
  terminal = io.StringIO()
  status = local.launch(["train"], processes=2, devices_per_process=1,
                        log_dir=str(tmp_path / "logs"), stop_timeout_s=30, python=script,
                        terminal=terminal)
  text = terminal.getvalue()
  assert status == distributed.PREEMPTED_STATUS == 143, text
  for i in (0, 1):
    assert f"process {i} stopped on a preemption notice (status 143)" in text, text
  assert ("PREEMPTED: all 2 processes saved and stopped on a preemption notice (status 143); "
          "run the job again with --resume to continue") in text, text
  assert "lost" not in text and "FAILED" not in text, text


def test_a_process_that_does_not_stop_on_the_notice_fails_the_launch(tmp_path):
  """Process 0 stops on a preemption notice; process 1 goes on (exits 1 on SIGTERM): it
  gets --stop_timeout_s (1 s) to stop at the same step, then is stopped, and the job fails."""
  script = _stand_in(tmp_path,
                     "trap 'exit 1' TERM\n"
                     "if [ \"$RINGFLASH_PROCESS_ID\" = 0 ]; then sleep 0.3; exit 143; fi\n"
                     "for i in $(seq 300); do sleep 0.1; done\n")
  terminal = io.StringIO()
  started = time.monotonic()
  status = local.launch(["train"], processes=2, devices_per_process=1,
                        log_dir=str(tmp_path / "logs"), stop_timeout_s=1, python=script,
                        terminal=terminal)
  text = terminal.getvalue()
  assert status == 1, text
  assert time.monotonic() - started < 20, text
  assert ("processes [1] still running 1 s after process 0 stopped on a preemption notice; "
          "stopping them") in text, text
  assert "process 1: exited with status 1" in text, text
  assert "FAILED: processes [1] did not stop on the preemption notice (status 143)" in text
  assert "PREEMPTED" not in text, text


@pytest.mark.parametrize("job, codes, want", [
    ("train", (143, 143), 143), ("train", (143, 1), 1), ("train", (143, None), 143),
    ("train", (None, 1), 1), ("check", (None, None), 1)])
def test_sigterm_to_the_launcher_reports_a_preemption(tmp_path, job, codes, want):
  """SIGTERM to the launcher (a scheduler's notice): it passes SIGTERM on; when every process
  saves and exits with 143 the launcher exits with 143 (it said 1), else with 1. A train
  process that the SIGTERM ends (None: no handler, as before its training loop) stopped on
  the notice too: the launcher exited with 1 for it, where a shell reports 143. A check (it
  neither saves nor resumes) that the SIGTERM ends failed."""
  script = _stand_in(tmp_path,
                     f"if [ \"$RINGFLASH_PROCESS_ID\" = 1 ]; then code={codes[1]}; "
                     f"else code={codes[0]}; fi\n"
                     "if [ \"$code\" != None ]; then trap 'exit $code' TERM; fi\necho ready\n"
                     "for i in $(seq 600); do sleep 0.1; done\n")
  program = ("import sys; from ringflash.launch import local; "
             f"sys.exit(local.launch([{job!r}], processes=2, devices_per_process=1, "
             f"log_dir={str(tmp_path / 'logs')!r}, stop_timeout_s=30, python={script!r}))")
  launcher = subprocess.Popen([PYTHON, "-c", program], env=job_env(), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
  reader.start()
  try:
    deadline = time.monotonic() + 60
    while sum(line.endswith("] ready\n") for line in lines) < 2:
      assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)
      time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == want, "".join(lines)
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait()
  reader.join(5)
  text = "".join(lines)
  assert "Traceback" not in text, text
  if job == "check":
    assert "process 1: killed by signal SIGTERM" in text and "PREEMPTED" not in text, text
  elif None in codes and want == 143:
    assert "process 1: killed by signal SIGTERM" in text, text
    assert ("PREEMPTED: all 2 processes stopped on a preemption notice; processes [1] were "
            "ended by its SIGTERM outside their training loop") in text, text
  elif want == 143:
    assert "PREEMPTED: all 2 processes saved and stopped" in text, text
  else:
    assert "process 1: exited with status 1" in text and "PREEMPTED" not in text, text


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
     "processes=2 x devices_per_process=1 GPUs needed, CUDA_VISIBLE_DEVICES='3' has 1"),
    # set and empty hides every GPU from CUDA: the processes would get GPU 0, 1 regardless
    ({"platform": "gpu", "base": {"CUDA_VISIBLE_DEVICES": ""}},
     "processes=2 x devices_per_process=1 GPUs needed, CUDA_VISIBLE_DEVICES='' has 0")])
def test_launch_refuses_bad_platform_arguments_before_starting(tmp_path, kwargs, message,
                                                              monkeypatch):
  for name, value in kwargs.pop("base", {}).items():
    monkeypatch.setenv(name, value)
  terminal = io.StringIO()
  with pytest.raises(ValueError, match=re.escape(message)):
    local.launch(["check"], processes=2, devices_per_process=1, log_dir=str(tmp_path / "l"),
                 terminal=terminal, **kwargs)
  assert terminal.getvalue() == "" and not (tmp_path / "l").exists()


@pytest.mark.parametrize("plugin,files,visible,needed,message", [
    (False, ["nvidia0"], None, 1, "'s JAX has no CUDA plugin (install jax[cuda12] or "
                                  "jax[cuda13]), so its processes would find no GPU"),
    (False, ["nvidia0"], "0", 1, "'s JAX has no CUDA plugin"),
    (True, [], None, 1, "platform=gpu: 1 GPUs needed, this machine has 0"),
    (True, ["nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-caps"], None, 2,
     "platform=gpu: 2 GPUs needed, this machine has 1"),
    (True, ["nvidia0", "nvidia1", "nvidiactl"], None, 2, None),
    (True, [], "GPU-1234", 1, None),        # CUDA_VISIBLE_DEVICES: the GPUs it lists count
    (True, ["nvidia0", "nvidia1"], "1", 2, "platform=gpu: 2 GPUs needed, "
                                           "CUDA_VISIBLE_DEVICES='1' has 1"),
    # set and empty hides every GPU (the command line checks this before its log folder)
    (True, ["nvidia0"], "", 1, "platform=gpu: 1 GPUs needed, CUDA_VISIBLE_DEVICES='' has 0"),
])
def test_gpu_problem_reads_the_plugin_and_the_device_files(tmp_path, plugin, files, visible,
                                                           needed, message):
  python = tmp_path / "python"               # prints what the real probe would
  python.write_text(f"#!/bin/sh\necho {plugin}\n")
  python.chmod(0o755)
  dev = tmp_path / "dev"
  dev.mkdir()
  for name in files:
    (dev / name).write_text("")
  base = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
  problem = local.gpu_problem(base, needed, python=str(python), dev=str(dev))
  if message is None:
    assert problem is None
  else:
    assert problem is not None and message in problem, problem


def test_gpu_problem_probe_agrees_with_jax():
  """The real probe, run by this Python: a CUDA plugin found iff JAX lists a cuda backend
  factory here."""
  from jax._src import xla_bridge                 # pylint: disable=g-import-not-at-top
  xla_bridge.discover_pjrt_plugins()
  has_cuda = any("cuda" in name for name in xla_bridge._backend_factories)  # pylint: disable=protected-access
  problem = local.gpu_problem({"CUDA_VISIBLE_DEVICES": "0"}, 1)
  assert (problem is None) == has_cuda, problem


# ---------------------------------------------------------------------------------------------
# A user's mistake: one line naming the flag, status 2, before any work.

def assert_usage_error(run: subprocess.CompletedProcess, command: str, message: str) -> None:
  assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
  lines = run.stderr.splitlines()
  assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
  assert lines[0].startswith(f"ringflash {command}: ") and message in lines[0], lines[0]


@pytest.mark.parametrize("args,devices,message", [
    (["--seq_len=100"], 8, "--seq_len=100 must be divisible by the number of global devices, 8"),
    (["--heads=3", "--kv_heads=2"], 1, "--heads=3 must be a multiple of --kv_heads=2"),
    (["--batch=0"], 1, "flag --batch=0: 0 is not a positive integer"),
    (["extra"], 1, "takes flags only, got the argument(s) extra"),
    (["--out_dir={file}/out"], 1, "{file} is a file, not a directory"),
])
def test_check_refuses_bad_flags_in_one_line(tmp_path, args, devices, message):
  afile = tmp_path / "afile"
  afile.write_text("")
  run = ringflash("check", *(a.format(file=afile) for a in args), timeout=120,
                  env=job_env(RINGFLASH_DEVICES_PER_PROCESS=str(devices)))
  assert_usage_error(run, "check", message.format(file=afile))
  assert run.stdout == ""                  # refused before the check started


def test_flag_refuted_by_the_job_devices_ends_every_process_at_once():
  """Two processes started by hand with --seq_len=102 over 2 x 2 devices: each joins the job,
  learns the device count, and leaves with the one line and status 2 (no collective ran)."""
  port = local.free_port()
  started = time.monotonic()
  procs = [start_process(i, 2, port, "--seq_len=102") for i in (0, 1)]
  for code, out in finish(procs, timeout=120):
    assert code == 2, out[-2000:]
    assert ("ringflash check: --seq_len=102 must be divisible by the number of global "
            "devices, 4") in out, out[-2000:]
    assert "Traceback" not in out and "max error" not in out
  assert time.monotonic() - started < 60


@pytest.mark.parametrize("command,first,second,message", [
    # process 1 ran a second pass alone and waited in its collective (300 s)
    ("check", ["--repeat=1"], ["--repeat=2"], "--repeat: process 0: 1, process 1: 2"),
    # other inputs: each process checked its shards against inputs the other did not use
    ("check", ["--seed=0", "--out_dir={tmp}/a"], ["--seed=1", "--out_dir={tmp}/b"],
     "--seed: process 0: 0, process 1: 1"),
    # process 0's --seq_len=102 was refuted by the job's devices, process 1's default not:
    # process 0 waited 30 s at the barrier, process 1's first collective had no peer
    ("check", ["--seq_len=102"], [], "--seq_len: process 0: 102, process 1: 256"),
    ("train", ["--steps=4", "--seed=3", "--metrics_file={tmp}/m.jsonl"], ["--steps=4"],
     "--seed: process 0: 3, process 1: 0"),
    ("bench", ["--iters=3", "--out={tmp}/a"], ["--iters=4", "--out={tmp}/b"],
     "--iters: process 0: 3, process 1: 4"),
])
def test_processes_given_different_flags_leave_together(tmp_path, command, first, second,
                                                        message):
  """Processes started by hand, each with its own command line: every one prints the one
  line naming the flags that differ and leaves with status 2, before the job's first
  collective."""
  port = local.free_port()
  started = time.monotonic()
  procs = [start_process(i, 2, port, *(a.format(tmp=tmp_path) for a in args),
                         command=command) for i, args in enumerate((first, second))]
  for i, (code, out) in enumerate(finish(procs, timeout=150)):
    assert code == 2, out[-2000:]
    assert (f"ringflash {command}: process {i}: the processes were given different settings "
            f"(every process of a job must run the same command); {message}") in out, (
                out[-2000:])
    assert "Traceback" not in out and "max error" not in out and "step" not in out
  assert time.monotonic() - started < 60


def test_bench_modes_of_one_process_are_refused_by_the_processes_of_a_job(tmp_path):
  """Started by hand, without the launcher's check: every process names the mode in one
  line and the job ends with status 2 (process 1 of --mode=kernels had died with a
  traceback, its program's device being process 0's)."""
  port = local.free_port()
  procs = [start_process(i, 2, port, "--mode=kernels", "--seq_lens=64", "--heads=2",
                         "--kv_heads=2", "--head_dim=16", "--iters=1", "--warmup=0",
                         "--impls=ringflash", f"--out={tmp_path}/{i}", devices=1,
                         command="bench") for i in range(2)]
  for code, out in finish(procs, timeout=150):
    assert code == 2, out[-2000:]
    assert "ringflash bench: --mode=kernels runs in one process" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]


def test_every_subcommand_is_a_joining_or_a_single_process_job():
  from ringflash import cli as ringflash_cli      # pylint: disable=g-import-not-at-top
  from ringflash.launch import cli as launch_cli  # pylint: disable=g-import-not-at-top
  both = launch_cli.JOINING_JOBS + launch_cli.SINGLE_PROCESS_JOBS
  assert sorted(both) == sorted(set(ringflash_cli.SUBCOMMANDS) - {"launch"})


@pytest.mark.parametrize("args,message", [
    (["local", "extra", "--", "check"], "must start with a ringflash subcommand, one of "),
    (["local", "--processes=2", "--devices-per-process=4", "--", "check", "--seq_len=100"],
     "job check: --seq_len=100 must be divisible by the number of global devices, 8"),
    (["local", "--", "train", "--ring=16"],
     "job train: --data_parallel=2 x --ring=16 needs 32 devices, the job has 8"),
    (["local", "--", "train", "--seq_len=0"],
     "job train: flag --seq_len=0: 0 is not an integer in the range [1, 1073741824]"),
    (["local", "--", "check", "extra"], "job check: takes flags only, got the argument(s) extra"),
    (["local", "--name=slice", "--", "check"],
     "--name is a flag of `launch tpu`, not `launch local`"),
    (["local", "--log_dir={file}/logs", "--", "check"], "{file} is a file, not a directory"),
    (["tpu", "--zone=z", "--dry-run", "--", "check"], "--name must be set"),
    (["tpu", "--name=n", "--zone=z", "--processes=3", "--dry-run"],
     "--processes is a flag of `launch local`, not `launch tpu`"),
    (["elsewhere"], "the target must be one of local, tpu, got 'elsewhere'"),
    (["local", "--timeout_s=nan", "--", "check"], "flag --timeout_s=nan: must be a finite"),
    (["local", "--stop_timeout_s=nan", "--", "check"],
     "flag --stop_timeout_s=nan: must be a finite number"),
    (["local", "--log_dir=/proc/nosuch/x", "--", "check"],
     "--log_dir=/proc/nosuch/x: /proc/nosuch/x cannot be created or written: "),
    (["local", "--", "check", "--out_dir=/proc/nosuch/x"], "job check: --out_dir=/proc/nosuch/x: "),
    # each process refused it after joining, and the launcher saw a lost process (status 1)
    (["local", "--", "train", "--backend=nope"],
     "job train: --backend must be one of auto, xla, pallas_tpu, pallas_gpu, got 'nope'"),
    (["local", "--", "train", "--save_every=5"],
     "job train: --save_every needs --checkpoint_dir"),
    # the processes would print the launcher's help (absl's, parsed here) and exit 1
    (["local", "--", "train", "--help"], "job train: --help is not for a launched job (its "
                                         "processes would print help and exit); run "
                                         "`ringflash train --help` for the flags of train"),
    (["local", "--", "check", "--helpfull"], "job check: --helpfull is not for a launched job"),
    (["local", "--", "bench", "-h"], "job bench: -h is not for a launched job"),
    # both processes were started, and each refused it: the launcher saw a lost process
    (["local", "--processes=2", "--devices-per-process=1", "--", "bench", "--seq_lens=0"],
     "job bench: --seq_lens takes integers >= 1, got '0'"),
    (["local", "--", "bench", "--mode=decode", "--layout=zigzag"],
     "job bench: --layout applies to --mode=scaling | longest, not --mode=decode"),
    # process 1 died reading back a program of process 0's device (a traceback, then a lost
    # process), or, with a baseline on process 0's device, printed efficiencies of 0.00
    (["local", "--processes=2", "--devices-per-process=1", "--", "bench", "--mode=kernels"],
     "job bench: --mode=kernels runs in one process (on its first device, or with a baseline "
     "there); a job of 2 processes runs --mode=scaling or --mode=longest: run kernels "
     "without the launcher"),
    (["local", "--processes=2", "--devices-per-process=2", "--", "bench", "--mode=strategies"],
     "job bench: --mode=strategies runs in one process"),
    # each process ran its own copy, alone
    (["local", "--", "generate"], "job generate: `ringflash generate` runs in one process and "
                                  "joins no launched job; run it directly (the jobs that join: "
                                  "bench, check, train)"),
    (["local", "--processes=1", "--", "demo"], "job demo: `ringflash demo` runs in one process"),
    (["tpu", "--name=n", "--zone=z", "--dry-run", "--", "plan"],
     "job plan: `ringflash plan` runs in one process"),
    # each process gets RINGFLASH_DEVICES_PER_PROCESS=4, which --cpu_devices would contradict
    (["local", "--devices-per-process=4", "--", "train", "--cpu_devices=8"],
     "job train: --cpu_devices=8 disagrees with RINGFLASH_DEVICES_PER_PROCESS=4"),
    # the mesh takes the first 2 devices, all of process 0's: process 1 crashed reading back
    (["local", "--processes=2", "--devices-per-process=4", "--", "train", "--data_parallel=1",
      "--ring=2"], "job train: --data_parallel=1 x --ring=2 = 2 devices leaves process 1 of "
                   "the job's 2 x 4 devices without one"),
    (["local", "--processes=3", "--devices-per-process=2", "--", "train", "--data_parallel=2",
      "--ring=2"], "leaves process 2 of the job's 3 x 2 devices without one"),
    # train's own --platform=cpu set jax_platforms: it trained on CPU devices and exited 0
    (["local", "--platform=gpu", "--processes=1", "--devices-per-process=1", "--", "train"],
     "job train: --platform=cpu (its default) runs on simulated CPU devices, not on the GPUs "
     "this launch gives each process; pass --platform=default"),
    (["tpu", "--name=n", "--zone=z", "--dry-run", "--", "train", "--platform=cpu"],
     "job train: --platform=cpu runs on simulated CPU devices, not on the TPUs"),
    # each process failed in JAX's backend initialization (AssertionError): no CUDA plugin
    # here, or fewer than 16 GPUs
    (["local", "--platform=gpu", "--processes=16", "--devices-per-process=1", "--", "check"],
     "platform=gpu: "),
    # past int32: every process died in jax.distributed.initialize
    (["local", "--init_timeout_s=3000000000", "--", "check"],
     "flag --init_timeout_s=3000000000: 3000000000 is not an integer in the range "
     "[1, 2147483647]"),
])
def test_launch_refuses_bad_arguments_before_starting(tmp_path, args, message):
  afile = tmp_path / "afile"
  afile.write_text("")
  logs = tmp_path / "logs"
  args = [a.format(file=afile) for a in args]
  if not any(a.startswith("--log_dir") for a in args) and args[0] != "elsewhere":
    args.insert(1, f"--log_dir={logs}")
  run = ringflash("launch", *args, timeout=120)
  assert_usage_error(run, "launch", message.format(file=afile))
  assert run.stdout == "" and not logs.exists()       # nothing started, nothing written


def test_launch_refuses_a_port_in_use_before_starting(tmp_path):
  """--port held by another program: process 0 failed to listen with a traceback while the
  others could wait on whoever held it. Now one line naming the port, nothing started."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    run = ringflash("launch", "local", f"--log_dir={tmp_path / 'logs'}", f"--port={port}",
                    "--", "check", timeout=120)
  assert_usage_error(run, "launch", f"port={port}: 127.0.0.1:{port} is in use")
  assert run.stdout == "" and not (tmp_path / "logs").exists()


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
    ({"RINGFLASH_INIT_TIMEOUT_S": "0"}, "RINGFLASH_INIT_TIMEOUT_S must be in 1..2147483647"),
    ({"RINGFLASH_INIT_TIMEOUT_S": "3000000000"},
     "RINGFLASH_INIT_TIMEOUT_S must be in 1..2147483647, got 3000000000"),
    ({"RINGFLASH_NUM_PROCESSES": "2", "RINGFLASH_PROCESS_ID": "0",
      "RINGFLASH_COORDINATOR": "127.0.0.1:99999"},
     "RINGFLASH_COORDINATOR=127.0.0.1:99999: the port must be in 1..65535, got 99999"),
    ({"RINGFLASH_NUM_PROCESSES": "2", "RINGFLASH_PROCESS_ID": "1",
      "RINGFLASH_COORDINATOR": "127.0.0.1:0"}, "the port must be in 1..65535, got 0"),
    # else ignored: the process would run alone
    ({"RINGFLASH_PROCESS_ID": "1"}, "RINGFLASH_PROCESS_ID is set ('1') but "
                                    "RINGFLASH_NUM_PROCESSES is not"),
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


def test_default_log_folders_of_launches_in_the_same_second_differ(monkeypatch):
  """./ringflash-logs/<target>-<time>-<pid>: two launchers started in the same second (other
  pids) write to folders of their own; --log_dir is taken as given."""
  from ringflash.launch import cli as launch_cli
  monkeypatch.setattr(time, "strftime", lambda fmt: "20250101-120000")
  folders = set()
  for pid in (4242, 4243):
    monkeypatch.setattr(os, "getpid", lambda pid=pid: pid)
    folders.add(launch_cli.log_dir("local", None))
  assert folders == {os.path.abspath(f"ringflash-logs/local-20250101-120000-{pid}")
                     for pid in (4242, 4243)}
  assert launch_cli.log_dir("local", "logs") == os.path.abspath("logs")


@pytest.mark.parametrize("command", [["check"], ["train"], ["bench", "--mode=scaling"]])
def test_bad_environment_is_one_line_from_the_commands(command):
  """The commands that join a job said a wrong RINGFLASH_* variable in a 27-line traceback
  ending in the ValueError; now in one line naming it, status 2."""
  run = ringflash(*command, timeout=120, env=job_env(
      RINGFLASH_NUM_PROCESSES="2", RINGFLASH_PROCESS_ID="0",
      RINGFLASH_COORDINATOR="127.0.0.1:notaport"))
  assert_usage_error(run, command[0],
                     "RINGFLASH_COORDINATOR must be host:port, got '127.0.0.1:notaport'")


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


def test_an_error_ends_the_process_when_its_output_pipe_is_gone(monkeypatch):
  """A launcher killed by SIGKILL leaves its processes' output pipe closed: printing the
  error's traceback raised BrokenPipeError, os._exit never ran, and the process waited in
  JAX's shutdown barrier (300 s) before aborting. It now ends at once, status 1."""
  class Gone(io.TextIOBase):
    def write(self, text):
      raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
      raise BrokenPipeError(32, "Broken pipe")

    def close(self):        # at garbage collection: nothing to flush, no warning
      pass

  class Ended(BaseException):
    pass

  statuses = []

  def end(status):
    statuses.append(status)
    raise Ended

  monkeypatch.setattr(distributed, "_joined", distributed.Processes(0, 2, None, "env"))
  monkeypatch.setattr(sys, "stdout", Gone())
  monkeypatch.setattr(sys, "stderr", Gone())
  monkeypatch.setattr(os, "_exit", end)
  previous = signal.getsignal(signal.SIGTERM)
  try:
    with pytest.raises(Ended):
      with distributed.exit_promptly_on_error("check"):
        raise RuntimeError("peer lost")
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert statuses == [1]


def test_preemption_notice_agrees_through_its_own_flags(monkeypatch):
  """Several processes: SIGTERM sets PreemptionNotice's own flag and `reached` OR-s the
  processes' flags with an all-gather, whatever jax_enable_preemption_service says. JAX's
  preemption sync point is never asked: on SIGTERM its protocol waits at a barrier for every
  process, and after a lost process a survivor asking it waits there for the launcher's
  SIGKILL instead of failing in its next collective."""
  import jax                                      # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils    # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  gathered = []

  def allgather(flags):
    gathered.append(bool(flags[0]))
    return np.stack([flags, np.array([False])])     # the other process saw no SIGTERM

  def sync_point(step):
    raise AssertionError(f"JAX's preemption sync point asked at step {step}")

  monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", sync_point)
  previous = signal.getsignal(signal.SIGTERM)
  with distributed.PreemptionNotice() as notice:
    assert not notice.reached(1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)                                   # the handler runs between bytecodes
    assert notice.reached(2)
  assert gathered == [False, True]
  assert signal.getsignal(signal.SIGTERM) is previous

  # An error leaving the block ends the process (exit_promptly_on_error), which the
  # launcher's SIGTERM must not end first: the handler stays.
  try:
    with pytest.raises(RuntimeError, match="peer lost"):
      with distributed.PreemptionNotice():
        raise RuntimeError("peer lost")
    assert signal.getsignal(signal.SIGTERM) is not previous
  finally:
    signal.signal(signal.SIGTERM, previous)


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


def test_tpu_job_folders_belong_to_the_workers(tmp_path):
  """`launch tpu -- train --checkpoint_dir=...`: the folder is the workers'; checking it on
  the launching machine would create it there (checking a folder creates it), so the
  launcher leaves it to the job."""
  ckpt, metrics = tmp_path / "ckpt" / "run", tmp_path / "metrics" / "m.jsonl"
  run = ringflash("launch", "tpu", "--name=rf", "--zone=z", "--workers=2", "--dry-run",
                  f"--log_dir={tmp_path / 'logs'}", "--", "train", "--platform=default",
                  f"--checkpoint_dir={ckpt}", f"--metrics_file={metrics}", "--save_every=5",
                  timeout=60)
  assert run.returncode == 0, run.stderr[-2000:]
  assert os.listdir(tmp_path) == []


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


def test_tpu_launch_without_gcloud_is_refused_before_any_step(tmp_path):
  """With --workers nothing asks gcloud first: the launch packed the archive, then the copy
  was a FileNotFoundError traceback. Every program the plan runs here is looked up first."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for tool in ("tar", "gzip"):
    (bin_dir / tool).symlink_to(shutil.which(tool))
  run = ringflash("launch", "tpu", "--name=rf", "--zone=z", "--workers=2",
                  f"--log_dir={tmp_path / 'logs'}", "--", "check", timeout=60,
                  env=job_env(PATH=str(bin_dir)))
  assert_usage_error(run, "launch", "gcloud, which the launch runs on this machine, is not "
                     "installed (not found on PATH)")
  assert not (tmp_path / "logs").exists() and run.stdout == ""


def test_tpu_launch_reports_a_program_that_cannot_start_as_its_step_failing(tmp_path):
  plan = [tpu.Step("job", (str(tmp_path / "gone"),)),
          tpu.Step("collect", ("touch", str(tmp_path / "collected")), always=True)]
  terminal = io.StringIO()
  assert tpu.launch(plan, dry_run=False, terminal=terminal) == 1
  assert "No such file or directory" in terminal.getvalue()
  assert "FAILED (job): status 127" in terminal.getvalue()
  assert (tmp_path / "collected").exists()


def test_tpu_python_is_spelled_alike_in_the_install_and_the_job(tmp_path):
  """`--python=~/venv/bin/python`: the install's shell expanded the ~, the job's quoted it,
  so every worker installed into the venv, then failed with status 127 to start it."""
  home = tmp_path / "home"
  (home / "venv" / "bin").mkdir(parents=True)
  (home / "venv" / "bin" / "python").symlink_to(sys.executable)
  plan = tpu.steps(tpu.Slice(name="rf", zone="z", workers=1), ["check", "--heads=2"],
                   source_dir=REPO, log_dir=str(tmp_path), python="~/venv/bin/python")
  commands = {step.what: step.argv[step.argv.index("--command") + 1] for step in plan
              if "--command" in step.argv}
  install = commands["install ringflash[tpu] on every worker"]
  job = commands["run the job on every worker"]
  assert "&& ~/venv/bin/python -m pip install" in install
  assert ("RINGFLASH_INIT_TIMEOUT_S=300 ~/venv/bin/python -u -m ringflash.cli check "
          "--heads=2 >") in job
  # Each as the worker's shell runs it: the job's python starts.
  probe = job.split(" -u -m ")[0].split("&& ")[-1] + " -c 'print(1)'"
  done = subprocess.run(["bash", "-c", probe], env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 0 and done.stdout == "1\n", done.stderr


def test_tpu_slice_validated():
  with pytest.raises(ValueError, match="workers must be >= 1"):
    tpu.Slice(name="n", zone="z", workers=0)
  with pytest.raises(ValueError, match="zone must be set"):
    tpu.Slice(name="n", zone="", workers=1)
  assert tpu.Slice(name="n", zone="z").workers is None        # counted when needed


def test_tpu_dry_run_leaves_no_log_folder(tmp_path):
  """The log folder is checked by creating it; a dry run, which writes nothing, removes it."""
  logs = tmp_path / "new" / "logs"
  run = ringflash("launch", "tpu", "--name=rf", "--zone=z", "--workers=2", "--dry-run",
                  f"--log_dir={logs}", "--", "check", timeout=60)
  assert run.returncode == 0, run.stderr[-2000:]
  assert os.listdir(tmp_path) == []


def test_directory_problem_tries_to_create_the_directory(tmp_path, monkeypatch):
  """os.access is no proof: as root it allows /proc/nosuch/x, which cannot be created."""
  made = tmp_path / "a" / "b"
  assert distributed.directory_problem(str(made)) is None and made.is_dir()
  (tmp_path / "afile").write_text("")
  assert distributed.directory_problem(str(tmp_path / "afile" / "x")) == (
      f"{tmp_path / 'afile'} is a file, not a directory")
  monkeypatch.setattr(os, "access", lambda *_: True)     # what root is told
  problem = distributed.directory_problem("/proc/nosuch/x")
  assert problem.startswith("/proc/nosuch/x cannot be created or written: [Errno "), problem
  problem = distributed.directory_problem("/proc")        # exists, takes no file
  assert problem.startswith("/proc cannot be created or written: [Errno "), problem


def test_tpu_dry_run_without_workers_counts_them_first(tmp_path):
  """Without --workers: the fan-out is --worker=all as before; the plan starts with the
  describe command that counts the workers, and the log collection is one template."""
  run = ringflash("launch", "tpu", "--name=rf", "--zone=us-east5-a", "--dry-run",
                  f"--log_dir={tmp_path}", "--", "check", timeout=60)
  assert run.returncode == 0, run.stderr[-2000:]
  lines = run.stdout.splitlines()
  gcloud = "gcloud compute tpus tpu-vm"
  assert lines[0].startswith("# count the workers of the slice (--workers not given)")
  assert lines[1] == f"{gcloud} describe rf --format=json --zone=us-east5-a"
  assert [l for l in lines if l.startswith("#")][1:5] == [
      "# pack the source tree", "# copy it to every worker",
      "# install ringflash[tpu] on every worker", "# run the job on every worker"]
  assert sum("--worker=all" in l for l in lines) == 3
  assert lines[-2] == ("# collect the log of worker <w>, for each w = 0 .. W-1 (W: the count "
                       "above)")
  assert shlex.split(lines[-1]) == [*gcloud.split(), "scp", "rf:ringflash-logs/job.log",
                                    f"{tmp_path}/worker_<w>.log", "--zone=us-east5-a",
                                    "--worker=<w>"]
  assert os.listdir(tmp_path) == []


def _described(stdout: str, returncode: int = 0, stderr: str = ""):
  calls = []

  def run(argv, **kwargs):
    calls.append((argv, kwargs))
    return subprocess.CompletedProcess(argv, returncode, stdout=stdout, stderr=stderr)

  return run, calls


def test_tpu_workers_counted_from_the_network_endpoints():
  where = tpu.Slice(name="rf", zone="z", project="p")
  endpoints = [{"ipAddress": f"10.0.0.{i}", "port": 8470} for i in range(4)]
  run, calls = _described(json.dumps({"name": "rf", "networkEndpoints": endpoints}))
  assert tpu.count_workers(where, run=run) == 4
  ((argv, kwargs),) = calls
  assert argv == ("gcloud", "compute", "tpus", "tpu-vm", "describe", "rf", "--format=json",
                  "--zone=z", "--project=p")
  assert kwargs["timeout"] > 0


@pytest.mark.parametrize("stdout,returncode,stderr,message", [
    ("", 1, "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: rf\nmore",
     "failed (status 1: ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: rf)"),
    ('{"name": "rf"}', 0, "", "lists no networkEndpoints (one per worker)"),
    ("not json", 0, "", "lists no networkEndpoints (one per worker)"),
])
def test_tpu_workers_that_cannot_be_counted_say_how_to_give_them(stdout, returncode, stderr,
                                                                 message):
  run, _ = _described(stdout, returncode, stderr)
  with pytest.raises(ValueError) as err:
    tpu.count_workers(tpu.Slice(name="rf", zone="z"), run=run)
  assert message in str(err.value)
  assert str(err.value).endswith("give --workers=W, the hosts of the slice (e.g. 4 for v5p-32)")

  def missing(argv, **kwargs):
    raise FileNotFoundError(argv[0])

  with pytest.raises(ValueError, match="gcloud, which could count the workers of the slice, "
                                       "is not installed; give --workers=W"):
    tpu.count_workers(tpu.Slice(name="rf", zone="z"), run=missing)


FAKE_GCLOUD = """#!/bin/bash
echo "$*" >> "$GCLOUD_CALLS"
if [ "$4" = describe ]; then
  echo '{"networkEndpoints": [{"ipAddress": "10.0.0.1"}, {"ipAddress": "10.0.0.2"}]}'
fi
"""


def test_tpu_launch_without_workers_asks_gcloud_then_collects_each_log(tmp_path):
  """A stand-in gcloud that records its calls: the slice says 2 workers, so 2 logs."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
  (bin_dir / "gcloud").chmod(0o755)
  calls = tmp_path / "calls.txt"
  env = job_env(PATH=f"{bin_dir}:{os.environ['PATH']}", GCLOUD_CALLS=str(calls))
  run = ringflash("launch", "tpu", "--name=rf", "--zone=z", f"--log_dir={tmp_path / 'logs'}",
                  "--", "check", timeout=120, env=env)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  verbs = [line.split()[3:5] for line in calls.read_text().splitlines()]
  assert verbs == [["describe", "rf"], ["scp", str(tmp_path / "logs" / "ringflash-src.tar.gz")],
                   ["ssh", "rf"], ["ssh", "rf"], ["scp", "rf:ringflash-logs/job.log"],
                   ["scp", "rf:ringflash-logs/job.log"]]
  collected = calls.read_text().splitlines()[-2:]
  for w, line in enumerate(collected):
    assert line.endswith(f"{tmp_path / 'logs'}/worker_{w}.log --zone=z --worker={w}"), line


def test_tpu_launch_without_workers_or_gcloud_says_how_to_give_them(tmp_path):
  empty = tmp_path / "bin"
  empty.mkdir()
  run = ringflash("launch", "tpu", "--name=rf", "--zone=z", f"--log_dir={tmp_path / 'logs'}",
                  "--", "check", timeout=60, env=job_env(PATH=str(empty)))
  assert_usage_error(run, "launch", "--workers is not given and gcloud, which could count "
                     "the workers of the slice, is not installed; give --workers=W")
  assert not (tmp_path / "logs").exists()
