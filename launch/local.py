"""N processes of one job on this machine: CPU devices, gloo collectives over 127.0.0.1.

Each process is `python -m ringflash.cli <job>` with the RINGFLASH_* contract of
README.md ("Multi-host launch") in its environment. Its stdout and stderr go, line by line, to
LOG_DIR/process_<id>.log and to the terminal prefixed `[<id>] `.

Failure handling, every wait bounded:
- the first process to exit with a non-zero status (or a signal) is the lost process; the
  launcher names it as the cause, sends SIGTERM to the others at once and SIGKILL to any still
  alive `stop_timeout_s` later, and reports each of them as stopped after the lost process
  (with how it ended). The jobs of ringflash (check, train) end by themselves within a second
  or two of a lost peer (their collective fails and they exit at once, see
  distributed.exit_promptly_on_error), so the launcher returns without waiting for SIGKILL;
- a process that never joins: the others fail by themselves after RINGFLASH_INIT_TIMEOUT_S
  (distributed.initialize's rendezvous), which the launcher then reports like any failure;
- `timeout_s` (optional) bounds the whole job;
- SIGINT/SIGTERM to the launcher stop every process the same way. (If the launcher itself is
  SIGKILLed, its processes fail at their next write to the closed output pipe.)
- a preemption: a process that exits with distributed.PREEMPTED_STATUS (143) saved on a
  preemption notice (SIGTERM), which the processes of `train` read at the same step. It is not
  lost: the others get `stop_timeout_s` to stop there by themselves, and when every process
  exits with 143, whether the SIGTERM came to the processes or to the launcher (which passes
  it on), the launcher exits with 143 too, so that a scheduler starts the job again.
"""

from __future__ import annotations

import functools
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from ringflash import options
from ringflash.launch import distributed

_KILL_WAIT_S = 10.0      # after SIGKILL, how long to wait for the kernel to reap a process
_READER_JOIN_S = 5.0     # after a process ends, how long its output may still drain


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nobody listens on right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def check_port(port: int) -> None:
  """Raises ValueError unless 127.0.0.1:port is free to listen on: else process 0 fails to
  listen, and the others may wait on whoever holds it."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    try:
      s.bind(("127.0.0.1", port))
    except OSError as err:
      raise ValueError(f"port={port}: 127.0.0.1:{port} is in use ({err.strerror}); give a "
                       f"free port, or none (--port=0) to have one picked") from None


PLATFORMS = ("cpu", "gpu")


@functools.lru_cache(maxsize=8)
def _has_cuda_plugin(python: str) -> bool | str:
  """Whether `python`'s JAX has a CUDA plugin (or why it could not be asked), asked once per
  interpreter: the command line asks before it creates the log folder, launch() again."""
  probe = ("import importlib.util, pkgutil\n"
           "names = [m.name for m in pkgutil.iter_modules()]\n"
           "spec = importlib.util.find_spec('jax_plugins')\n"
           "names += [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]"
           " if spec else []\n"
           "print(any('cuda' in n and ('plugin' in n or n.startswith('xla_')) for n in names))")
  try:
    return subprocess.run([python, "-c", probe], capture_output=True, text=True,
                          timeout=60).stdout.strip() == "True"
  except (OSError, subprocess.TimeoutExpired) as err:
    return str(err)


def _visible_gpus(base: dict[str, str]) -> list[str] | None:
  """The GPUs `base`'s CUDA_VISIBLE_DEVICES lists, or None where it is not set (set and
  empty: none, as CUDA reads it)."""
  visible = base.get("CUDA_VISIBLE_DEVICES")
  return None if visible is None else [g.strip() for g in visible.split(",") if g.strip()]


def gpu_problem(base: dict[str, str], needed: int, *, python: str = sys.executable,
                dev: str = "/dev") -> str | None:
  """Why this machine cannot give `needed` GPUs to processes run by `python`, or None.

  Each process would otherwise fail inside JAX's backend initialization (an AssertionError
  without a CUDA plugin or without a GPU). Two things are read: whether `python`'s JAX has a
  CUDA plugin (jax_plugins' xla_cuda*, or a jax_cuda*_plugin package), and, unless `base`
  sets CUDA_VISIBLE_DEVICES (then the GPUs it lists count), how many NVIDIA device files
  /dev/nvidia<N> the machine has.
  """
  found = _has_cuda_plugin(python)
  if isinstance(found, str):
    return f"platform=gpu: cannot run {python} to look for JAX's CUDA plugin ({found})"
  if not found:
    return (f"platform=gpu: {python}'s JAX has no CUDA plugin (install jax[cuda12] or "
            f"jax[cuda13]), so its processes would find no GPU")
  visible = _visible_gpus(base)
  if visible is not None:
    if len(visible) < needed:
      return (f"platform=gpu: {needed} GPUs needed, "
              f"CUDA_VISIBLE_DEVICES={base['CUDA_VISIBLE_DEVICES']!r} has {len(visible)}")
    return None
  try:
    count = sum(1 for name in os.listdir(dev) if name[6:].isdigit() and
                name.startswith("nvidia"))
  except OSError:
    count = 0
  if count < needed:
    return (f"platform=gpu: {needed} GPUs needed, this machine has {count} ({dev}/nvidia<N>); "
            f"use --platform=cpu for simulated devices")
  return None


def process_env(base: dict[str, str], *, process_id: int, processes: int,
                devices_per_process: int, port: int, init_timeout_s: int,
                platform: str = "cpu") -> dict[str, str]:
  """The environment of one process: `base` plus the contract of README.md ("Multi-host launch").

  cpu: `devices_per_process` simulated CPU devices (RINGFLASH_DEVICES_PER_PROCESS).
  gpu: GPUs `process_id * M .. (process_id + 1) * M - 1` of the machine, counted within
  `base`'s CUDA_VISIBLE_DEVICES when it is set (set and empty: no GPU, as CUDA reads it), become
  the process's CUDA_VISIBLE_DEVICES;
  collectives go through NCCL. XLA_FLAGS gains ringflash.options.GPU_XLA_OPTIONS, each unless it
  sets that option already. Everything else in `base` (NCCL_* included) is passed on.

  Raises:
    ValueError: an unknown platform, or fewer GPUs in CUDA_VISIBLE_DEVICES than the job needs.
  """
  if platform not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
  env = dict(base)
  env.update({
      distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
      distributed.ENV_NUM_PROCESSES: str(processes),
      distributed.ENV_PROCESS_ID: str(process_id),
      distributed.ENV_INIT_TIMEOUT_S: str(init_timeout_s),
      "PYTHONUNBUFFERED": "1",
  })
  if platform == "cpu":
    env.update({distributed.ENV_DEVICES_PER_PROCESS: str(devices_per_process),
                "JAX_PLATFORMS": "cpu"})
    return env
  gpus = _visible_gpus(base)
  gpus = [str(i) for i in range(processes * devices_per_process)] if gpus is None else gpus
  if len(gpus) < processes * devices_per_process:
    raise ValueError(f"processes={processes} x devices_per_process={devices_per_process} "
                     f"GPUs needed, CUDA_VISIBLE_DEVICES={base['CUDA_VISIBLE_DEVICES']!r} "
                     f"has {len(gpus)}")
  env.pop(distributed.ENV_DEVICES_PER_PROCESS, None)
  # the caller's own setting of an option wins
  env["XLA_FLAGS"] = options.xla_flags(options.GPU_XLA_OPTIONS, env.get("XLA_FLAGS", ""))
  env.update({"CUDA_VISIBLE_DEVICES": ",".join(
      gpus[process_id * devices_per_process:(process_id + 1) * devices_per_process]),
              "JAX_PLATFORMS": "cuda"})
  return env


def describe_exit(returncode: int | None) -> str:
  if returncode is None:
    return "still running"
  if returncode < 0:
    try:
      return f"killed by signal {signal.Signals(-returncode).name}"
    except ValueError:
      return f"killed by signal {-returncode}"
  return f"exited with status {returncode}"


def launch(job: Sequence[str], *, processes: int, devices_per_process: int, log_dir: str,
           stop_timeout_s: float = 10.0, init_timeout_s: int = 300,
           timeout_s: float | None = None, port: int | None = None,
           python: str = sys.executable, terminal: TextIO = sys.stdout,
           platform: str = "cpu") -> int:
  """Runs `ringflash <job>` in `processes` processes; returns 0 iff all of them succeed.

  Args:
    job: the ringflash subcommand and its flags, e.g. ["check", "--seq_len=512"].
    processes: N, processes to start.
    devices_per_process: M, devices of each process (the ring has N * M devices): simulated
      CPU devices, or GPUs of this machine (see process_env).
    log_dir: one log file per process is written here (created if missing).
    stop_timeout_s: once a process is lost, the others get SIGTERM; those still alive after
      this many seconds get SIGKILL.
    init_timeout_s: RINGFLASH_INIT_TIMEOUT_S of the processes.
    timeout_s: if set, the whole job is stopped after this many seconds (a failure).
    port: the coordinator's port on 127.0.0.1; None picks a free one.
    python: the interpreter that runs the processes.
    terminal: where the combined, prefixed output and the launcher's messages go.
    platform: "cpu" or "gpu" (process_env).

  Returns:
    0 if every process exited with status 0; distributed.PREEMPTED_STATUS (143) if every
    process saved on a preemption notice and stopped (the job's own SIGTERM, or the
    launcher's passed on); else 1.
  """
  if processes < 1 or devices_per_process < 1:
    raise ValueError(f"processes={processes} and devices_per_process={devices_per_process} "
                     f"must be >= 1")
  if not job:
    raise ValueError("job must name a ringflash subcommand, e.g. ['check']")
  if port is not None:
    check_port(port)
  port = free_port() if port is None else port
  envs = [process_env(os.environ, process_id=i, processes=processes,
                      devices_per_process=devices_per_process, port=port,
                      init_timeout_s=init_timeout_s, platform=platform)
          for i in range(processes)]      # bad arguments raise here, before any process starts
  if platform == "gpu":
    problem = gpu_problem(dict(os.environ), processes * devices_per_process, python=python)
    if problem:
      raise ValueError(problem)
  os.makedirs(log_dir, exist_ok=True)
  command = [python, "-m", "ringflash.cli", *job]
  lock = threading.Lock()
  terminal = _Terminal(terminal)

  def say(text: str) -> None:
    with lock:
      terminal.write(f"ringflash launch: {text}\n")

  say(f"{processes} processes x {devices_per_process} {platform.upper()} devices, coordinator "
      f"127.0.0.1:{port}, logs in {log_dir}")
  say(f"job: {' '.join(command[3:])}")
  procs: list[subprocess.Popen] = []
  logs = [os.path.join(log_dir, f"process_{i}.log") for i in range(processes)]
  exits: queue.Queue[tuple[int, int]] = queue.Queue()
  threads: list[threading.Thread] = []
  previous = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
  try:
    for env in envs:
      procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for i, proc in enumerate(procs):
      say(f"process {i}: pid {proc.pid}, log {logs[i]}")
      threads.append(threading.Thread(target=_pump, args=(proc, i, logs[i], terminal, lock),
                                      daemon=True))
      threads.append(threading.Thread(target=_wait, args=(proc, i, exits), daemon=True))
    for thread in threads:
      thread.start()
    status = _supervise(procs, exits, logs, say, stop_timeout_s=stop_timeout_s,
                        deadline=None if timeout_s is None else time.monotonic() + timeout_s)
  except KeyboardInterrupt:
    say(f"interrupted; stopping all processes (SIGTERM now, SIGKILL to any still alive after "
        f"{stop_timeout_s:g} s)")
    if _main_thread():
      # A second Ctrl-C or SIGTERM must not cut the stop short and leave processes running:
      # it ends within stop_timeout_s regardless.
      previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
    killed = _stop(procs, stop_timeout_s, say)
    if _main_thread():
      signal.signal(signal.SIGINT, previous_int)
    for i, proc in enumerate(procs):
      say(f"process {i}: " + ("killed by SIGKILL" if i in killed else
                              describe_exit(proc.returncode)))
    # A job that reads SIGTERM as a preemption notice (train) saves and exits with
    # PREEMPTED_STATUS; the launcher's status says so when every process did. One that the
    # SIGTERM passed on ended outside its training loop (before it, while joining, restoring
    # or compiling; after it, waiting for the last save) was stopped by the same notice, with
    # nothing since its newest complete checkpoint to save: as a shell reports it, 143.
    # Only train saves and resumes: a check or bench that the SIGTERM ends failed.
    notice = ((distributed.PREEMPTED_STATUS, -signal.SIGTERM) if job[0] == "train"
              else (distributed.PREEMPTED_STATUS,))
    preempted = bool(procs) and all(proc.returncode in notice for proc in procs)
    status = _preempted_status(procs, say, notice) if preempted else 1
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
  for thread in threads:
    if thread.ident is not None:       # started: a SIGTERM may come before all of them are
      thread.join(_READER_JOIN_S)
  return status


def _supervise(procs, exits, logs, say, *, stop_timeout_s, deadline) -> int:
  """Waits for the processes; on the first failure names it and stops the rest.

  A process that exits with PREEMPTED_STATUS saved on a preemption notice, which every
  process of a ringflash job reads at the same step: the others get `stop_timeout_s` to stop
  there by themselves before they are stopped, and the job's status is PREEMPTED_STATUS when
  every process did.
  """
  done: dict[int, int] = {}
  preempted: tuple[int, float] | None = None   # the first process to stop on the notice, when
  while len(done) < len(procs):
    now = time.monotonic()
    alive = [i for i in range(len(procs)) if i not in done]
    if deadline is not None and deadline <= now:
      say(f"the job ran past its timeout; stopping processes {alive}")
      _stop(procs, stop_timeout_s, say)
      return 1
    if preempted is not None and now >= preempted[1] + stop_timeout_s:
      say(f"processes {alive} still running {stop_timeout_s:g} s after process {preempted[0]} "
          f"stopped on a preemption notice; stopping them (SIGTERM now, SIGKILL to any still "
          f"alive after {stop_timeout_s:g} s)")
      killed = _stop(procs, stop_timeout_s, say)
      for j in alive:
        say(f"process {j}: " + (f"still alive {stop_timeout_s:g} s after SIGTERM, killed by "
                                f"SIGKILL" if j in killed else describe_exit(procs[j].returncode)))
      break
    waits = [1.0]       # bounded, so that SIGINT/SIGTERM and the deadlines are seen promptly
    if deadline is not None:
      waits.append(deadline - now)
    if preempted is not None:
      waits.append(preempted[1] + stop_timeout_s - now)
    try:
      i, code = exits.get(timeout=min(waits))
    except queue.Empty:
      continue
    done[i] = code
    if code == 0:
      say(f"process {i} finished (status 0)")
      continue
    if code == distributed.PREEMPTED_STATUS:
      say(f"process {i} stopped on a preemption notice (status {code})")
      if preempted is None:
        preempted = (i, time.monotonic())
      continue
    # The first failure is the cause; whatever the others do from here on follows from it.
    say(f"lost process {i} (pid {procs[i].pid}): {describe_exit(code)}; see {logs[i]}")
    others = [j for j in range(len(procs)) if j not in done]
    killed: set[int] = set()
    if others:
      say(f"stopping processes {others} (SIGTERM now, SIGKILL to any still alive after "
          f"{stop_timeout_s:g} s)")
      killed = _stop(procs, stop_timeout_s, say)
    for j in others:
      code_j = procs[j].returncode
      if code_j == 0:
        say(f"process {j} finished (status 0)")
        continue
      how = (f"still alive {stop_timeout_s:g} s after SIGTERM, killed by SIGKILL"
             if j in killed else describe_exit(code_j))
      say(f"process {j}: stopped after process {i} was lost ({how})")
    say(f"FAILED: process {i} was lost")
    return 1
  if preempted is None:
    say(f"all {len(procs)} processes finished")
    return 0
  return _preempted_status(procs, say)


def _preempted_status(procs, say, notice=(distributed.PREEMPTED_STATUS,)) -> int:
  """PREEMPTED_STATUS if every process stopped on a preemption notice (its return code in
  `notice`: saved and exited with PREEMPTED_STATUS, or, where the launcher passed the notice
  on, ended by that SIGTERM), else 1."""
  status = distributed.PREEMPTED_STATUS
  others = [i for i, proc in enumerate(procs) if proc.returncode not in notice]
  if others:
    say(f"FAILED: processes {others} did not stop on the preemption notice (status {status})")
    return 1
  ended = [i for i, proc in enumerate(procs) if proc.returncode != status]
  if ended:
    say(f"PREEMPTED: all {len(procs)} processes stopped on a preemption notice; processes "
        f"{ended} were ended by its SIGTERM outside their training loop, with nothing to "
        f"save since their newest complete checkpoint; run the job again with --resume to "
        f"continue")
  else:
    say(f"PREEMPTED: all {len(procs)} processes saved and stopped on a preemption notice "
        f"(status {status}); run the job again with --resume to continue")
  return status


def _stop(procs, stop_timeout_s, say) -> set[int]:
  """SIGTERM to every live process, SIGKILL to those alive after stop_timeout_s.

  Returns as soon as every process has exited.

  Returns:
    The indices of the processes that needed SIGKILL.
  """
  for proc in procs:
    if proc.poll() is None:
      proc.terminate()
  deadline = time.monotonic() + stop_timeout_s
  killed = set()
  for i, proc in enumerate(procs):
    try:
      proc.wait(max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
      proc.kill()
      killed.add(i)
  for i, proc in enumerate(procs):
    try:
      proc.wait(_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
      say(f"process {i} (pid {proc.pid}) did not exit even after SIGKILL")
  return killed


class _Terminal:
  """The terminal's writes, which stop once it is gone: a reader that exits (`| head`) closes
  the pipe, and writing raises BrokenPipeError. The job goes on, its output still in the
  logs. (A pump thread that died of it left its process's pipe undrained: the process
  blocked on a full pipe, the others on it in a collective, and the launch hung.)"""

  def __init__(self, stream: TextIO):
    self._stream = stream
    self._gone = False

  def write(self, text: str) -> None:
    if self._gone:
      return
    try:
      self._stream.write(text)
      self._stream.flush()
    except UnicodeEncodeError:             # a terminal of another encoding: said as it can
      encoding = getattr(self._stream, "encoding", None) or "ascii"
      self.write(text.encode(encoding, "replace").decode(encoding))
    except OSError:                        # BrokenPipeError
      self._gone = True
    except ValueError:
      if not getattr(self._stream, "closed", False):
        raise
      self._gone = True                    # a closed stream


def _pump(proc, index: int, log_path: str, terminal: _Terminal, lock) -> None:
  """Copies one process's output to its log file and, prefixed, to the terminal."""
  prefix = f"[{index}] "
  with open(log_path, "w", encoding="utf-8") as log:
    for raw in proc.stdout:
      line = raw.decode("utf-8", errors="replace")
      log.write(line)
      log.flush()
      with lock:
        terminal.write(prefix + line if line.endswith("\n") else prefix + line + "\n")


def _wait(proc, index: int, exits) -> None:
  exits.put((index, proc.wait()))


def _raise_interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt


def _main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()

