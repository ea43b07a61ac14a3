"""Joining a multi-process JAX job, and leaving it: `initialize()`, the cross-process input
check, prompt exit on failure, the preemption notice.

How a process learns its place in the job (the contract: README.md, "Multi-host launch"):

1. `RINGFLASH_NUM_PROCESSES` set: the explicit contract. Process `RINGFLASH_PROCESS_ID` of
   `RINGFLASH_NUM_PROCESSES` joins the coordinator at `RINGFLASH_COORDINATOR` (host:port,
   served by process 0). This is what `ringflash launch local` sets.
2. Otherwise, on a Cloud TPU VM (libtpu installed and TPU device files present):
   `jax.distributed.initialize()` with no arguments; JAX reads the slice from the TPU
   metadata. This is what `ringflash launch tpu` relies on.
3. Otherwise: a single process; nothing to join.

`RINGFLASH_DEVICES_PER_PROCESS` (CPU only) sets `jax_num_cpu_devices` in every case, and with
several processes on CPU the collectives go through gloo. Both must be set before JAX
initializes its backends, so `initialize()` must run before the first `jax.devices()`.

Why a rendezvous of our own before `jax.distributed.initialize`: when a process is missing,
JAX's coordination client aborts the whole process (a C++ fatal error, DEADLINE_EXCEEDED)
without saying which process was missing. So, under the explicit contract, every process first
checks in with process 0 over a plain TCP connection on the coordinator's port, within
`RINGFLASH_INIT_TIMEOUT_S`; process 0 answers "go" once all have checked in, or names the
missing ones. Only then does anyone call `jax.distributed.initialize` (same port: process 0
closes its listener before JAX's coordination service binds it).

Why a job process ends at once on an error (`exit_promptly_on_error`): at exit, JAX's runtime
waits in a shutdown barrier for every other process of the job (up to 300 s). A process whose
peer is gone (its collective failed: "Gloo all-reduce failed ... Connection closed by peer")
would wait there until the launcher kills it, and a process that fails alone keeps its live
peers blocked in their next collective. So, in a job of several processes, an error that
escapes the job prints its traceback and ends the process with os._exit(1): the launcher sees
the failure within a second, and the peers' collectives fail at once.

Why an error that every process finds at the same point ends the job together
(`leave_together`: a flag that only the job's devices refute, inputs that differ across
processes): a process that leaves without a word drops its connection to the coordination
service, which reports that as a failed task to every process still connected, and JAX's
client aborts them (a C++ fatal error, status -6; seen when process 0 was still creating its
backend while process 1 had already left). So each process first waits at a barrier of the
coordination service (up to `_LEAVE_TOGETHER_S`), then all leave through JAX's own shutdown,
which they now reach together, and end with the error's status. A process that does not
reach the barrier in time (its flags differ) is left behind as on any error: the others end
at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback

import jax
import numpy as np

from ringflash.cli import MAX_CPU_DEVICES
from ringflash.cli import UsageError

ENV_COORDINATOR = "RINGFLASH_COORDINATOR"
ENV_NUM_PROCESSES = "RINGFLASH_NUM_PROCESSES"
ENV_PROCESS_ID = "RINGFLASH_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "RINGFLASH_DEVICES_PER_PROCESS"
ENV_INIT_TIMEOUT_S = "RINGFLASH_INIT_TIMEOUT_S"

DEFAULT_INIT_TIMEOUT_S = 300

# The exit status of a job process that saved on a preemption notice and stopped before its
# end: what a shell reports for a process ended by SIGTERM (128 + 15), so that a scheduler
# sees the job as unfinished and starts it again (with --resume). `launch local` exits with
# it too when every process did.
PREEMPTED_STATUS = 143

# The rendezvous protocol: one line each way, ASCII.
#   process k -> process 0:  "ringflash <k> <num_processes>\n"
#   process 0 -> process k:  "go\n"  |  "error <text>\n"
_HELLO = "ringflash"
_RETRY_S = 0.2
_ANSWER_GRACE_S = 5.0
# How long leave_together waits for every process at its barrier.
_LEAVE_TOGETHER_S = 30.0


class BadEnvironment(UsageError, ValueError):
  """A RINGFLASH_* variable that is wrong: a ValueError to initialize()'s callers, and to
  the commands that join a job (train, check, bench) a mistake of the command line, said in
  one line with status 2 (it was a traceback)."""


@dataclasses.dataclass(frozen=True)
class Processes:
  """This process's place in the job.

  Attributes:
    process_id: 0 .. num_processes - 1.
    num_processes: processes in the job.
    coordinator: "host:port" of process 0's coordination service; None when JAX found it by
      itself (TPU) or with a single process.
    source: "env" (RINGFLASH_* contract), "tpu" (JAX auto-detection) or "single".
  """

  process_id: int
  num_processes: int
  coordinator: str | None
  source: str


_joined: Processes | None = None


def initialize() -> Processes:
  """Joins the job this process belongs to; safe to call more than once.

  Reads the environment contract (README.md, "Multi-host launch"). The second and later
  calls return the first call's answer without touching JAX again.

  Returns:
    This process's Processes.

  Raises:
    ValueError: malformed RINGFLASH_* variables, naming the variable.
    RuntimeError: the job could not start within RINGFLASH_INIT_TIMEOUT_S; the message names
      the coordinator and the process(es) that failed to join.
  """
  global _joined
  if _joined is not None:
    return _joined
  if jax.distributed.is_initialized():
    # Someone else (the caller's own code) already joined; report what JAX knows.
    _joined = Processes(jax.process_index(), jax.process_count(), None, "external")
    return _joined

  timeout_s = _env_int(ENV_INIT_TIMEOUT_S, DEFAULT_INIT_TIMEOUT_S, minimum=1)
  devices_per_process = _env_int(ENV_DEVICES_PER_PROCESS, None, minimum=1,
                                 maximum=MAX_CPU_DEVICES)
  if os.environ.get(ENV_PROCESS_ID) and not os.environ.get(ENV_NUM_PROCESSES):
    # Else it would be ignored: a process meant to join a job would run alone.
    raise BadEnvironment(f"{ENV_PROCESS_ID} is set ({os.environ[ENV_PROCESS_ID]!r}) but "
                         f"{ENV_NUM_PROCESSES} is not: set both (the explicit contract) or "
                         f"neither")
  if os.environ.get(ENV_NUM_PROCESSES):
    num_processes = _env_int(ENV_NUM_PROCESSES, None, minimum=1)
    process_id = _env_int(ENV_PROCESS_ID, None, minimum=0)
    if process_id is None:
      raise BadEnvironment(f"{ENV_PROCESS_ID} must be set when {ENV_NUM_PROCESSES} is")
    if process_id >= num_processes:
      raise BadEnvironment(f"{ENV_PROCESS_ID}={process_id} must be < "
                           f"{ENV_NUM_PROCESSES}={num_processes}")
    coordinator = os.environ.get(ENV_COORDINATOR, "")
    if num_processes > 1 and not coordinator:
      raise BadEnvironment(f"{ENV_COORDINATOR} (host:port of process 0) must be set when "
                           f"{ENV_NUM_PROCESSES}={num_processes}")
    _configure_cpu(devices_per_process, multi_process=num_processes > 1)
    if num_processes == 1:
      _joined = Processes(0, 1, None, "single")
      return _joined
    host, port = _split_address(coordinator)
    _rendezvous(host, port, process_id, num_processes, timeout_s)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s)
    _joined = Processes(process_id, num_processes, coordinator, "env")
  elif _on_cloud_tpu_vm():
    jax.distributed.initialize(initialization_timeout=timeout_s)
    _joined = Processes(jax.process_index(), jax.process_count(), None, "tpu")
  else:
    _configure_cpu(devices_per_process, multi_process=False)
    _joined = Processes(0, 1, None, "single")
  return _joined


class InputsDifferError(ValueError):
  """Processes passed inputs of different shapes or dtypes (every process raises it)."""


def check_same_across_processes(arrays) -> None:
  """Raises unless every process passes arrays of the same names, shapes and dtypes.

  Call it before building global arrays from process-local data: a process whose inputs
  disagree would otherwise make the first collective hang or compute garbage. The exchange
  is one small all-gather of a fixed-size byte buffer, so it cannot itself mismatch.

  Args:
    arrays: {name: array-like with .shape and .dtype}, this process's inputs.

  Raises:
    InputsDifferError (a ValueError): the processes disagree; every process raises it, and
      the message lists each process's shapes.
  """
  mine = {name: [list(np.shape(x)), str(np.dtype(x.dtype))] for name, x in arrays.items()}
  if jax.process_count() == 1:
    return
  described = _gather_json(mine, "arrays")
  if all(d == described[0] for d in described):
    return
  lines = _differences(described, lambda p: "missing" if p is None else f"{tuple(p[0])} {p[1]}")
  raise InputsDifferError("inputs differ across processes (every process must pass the "
                          "same shapes and dtypes before ring attention runs); "
                          + "; ".join(lines))


def _differences(described: list[dict], show) -> list[str]:
  """"name: process 0: show(value), process 1: ..." for each name whose value differs
  across the processes' `described` (None where a process has no such name)."""
  lines = []
  for name in sorted(set().union(*described)):
    per = [d.get(name) for d in described]
    if any(p != per[0] for p in per):
      lines.append(f"{name}: " + ", ".join(f"process {i}: {show(p)}" for i, p in enumerate(per)))
  return lines


class SettingsDifferError(ValueError):
  """Processes of one job were given different settings (every process raises it)."""


def check_same_settings(settings: dict) -> None:
  """Raises unless every process passes equal `settings` (JSON values: a job's flags).

  For processes started by hand, each with its own command line: one whose flags differ
  would run another job (more passes, other inputs) and leave the others waiting in a
  collective. Call it right after initialize(), before the first collective of the job.

  Raises:
    SettingsDifferError (a ValueError): on every process; the message names each setting
      that differs and its value on each process.
  """
  if jax.process_count() == 1:
    return
  described = _gather_json(settings, "settings")
  if all(d == described[0] for d in described):
    return
  lines = _differences(described, str)
  raise SettingsDifferError("the processes were given different settings (every process "
                            "of a job must run the same command); " + "; ".join(lines))


def agree_on_settings(command: str, settings: dict) -> None:
  """check_same_settings for `ringflash <command>`: when the processes disagree, every one
  of them prints the one line naming the settings and leaves with status 2."""
  try:
    check_same_settings(settings)
  except SettingsDifferError as err:
    leave_together(2, f"ringflash {command}: process {jax.process_index()}: {err}")


def _gather_json(value, what: str, size: int = 16384) -> list:
  """`value` of every process, by one all-gather of a fixed-size byte buffer (which cannot
  itself mismatch)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  encoded = json.dumps(value, sort_keys=True).encode()
  if len(encoded) > size:
    raise ValueError(f"too many {what} to compare across processes ({len(encoded)} bytes of "
                     f"description, at most {size})")
  buf = np.zeros(size, np.uint8)
  buf[:len(encoded)] = np.frombuffer(encoded, np.uint8)
  gathered = np.asarray(multihost_utils.process_allgather(buf))       # [P, size]
  return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in gathered]


def several_processes() -> bool:
  """Whether this process joined a job of more than one process (initialize)."""
  return _joined is not None and _joined.num_processes > 1


@contextlib.contextmanager
def exit_promptly_on_error(command: str):
  """Around a job's work: in a job of several processes, an error ends this process at once.

  An exception that escapes the body (a failed collective, JaxRuntimeError; anything else
  that may have happened on this process alone) is printed with its traceback, and the
  process ends with os._exit(1), skipping the runtime's shutdown barrier (module docstring).
  A UsageError (a flag that only the job's devices could refute, so every process finds it)
  is printed as ringflash.cli prints it, `ringflash <command>: <message>`, and ends the job
  with status 2 through leave_together. With a single process everything passes through.

  Args:
    command: the ringflash subcommand, for the message of a UsageError.
  """
  try:
    yield
  except UsageError as err:
    if not several_processes():
      raise
    leave_together(2, f"ringflash {command}: {' '.join(str(err).split())}")
  except Exception:  # pylint: disable=broad-except  # the process boundary: report, then end
    if not several_processes():
      raise
    if threading.current_thread() is threading.main_thread():
      # Ending at once anyway: the launcher's SIGTERM (it stops the others as soon as one
      # process is lost) must not cut the report short.
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
      traceback.print_exc()
    except OSError:
      pass                      # the output pipe is gone (the launcher was killed): end anyway
    _end_now(1, f"process {_joined.process_id} of {_joined.num_processes}: ending at once "
                f"(status 1), without the runtime's shutdown barrier")


def _say(message: str):
  """message on stderr, both streams flushed; a closed pipe (a launcher that was killed) is
  no reason not to go on: the callers end the process next."""
  try:
    print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
  except OSError:
    pass


def _end_now(status: int, message: str):
  try:
    _say(message)
  finally:
    os._exit(status)  # pylint: disable=protected-access


def leave_together(status: int, message: str):
  """Ends this process with `status` after printing `message`, for an error that every
  process of the job finds at the same point: all wait for each other, then leave through
  JAX's shutdown (module docstring). With a single process, or when some process does not
  arrive within _LEAVE_TOGETHER_S, it ends at once."""
  _say(message)
  if several_processes():
    # The coordination service's client, as orbax reaches it: JAX has no public barrier
    # that is not itself a device collective.
    from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
    client = jax_distributed.global_state.client
    try:
      if client is not None:
        client.wait_at_barrier(f"ringflash_leave_{status}", int(_LEAVE_TOGETHER_S * 1000))
        jax.distributed.shutdown()
    except Exception:  # pylint: disable=broad-except  # a peer did not come: end at once
      pass
  os._exit(status)  # pylint: disable=protected-access


class PreemptionNotice:
  """SIGTERM (a scheduler's preemption notice, or the launcher stopping the job) as a step at
  which every process agrees to save and stop.

  A SIGTERM handler of our own sets a flag (the previous handler is restored on leaving the
  `with` block, except when an error leaves it in a job of several processes: that error ends
  the process, which a SIGTERM must not end first, see __exit__). With several processes the
  flags are OR-ed across processes at every step (a small all-gather), so that all of them
  stop at the same step; all processes must call `reached(step)` at every step. A process
  whose peer is gone fails in that all-gather at once, as in any other collective
  (exit_promptly_on_error).

  Why not JAX's preemption service (jax_enable_preemption_service,
  multihost_utils.reached_preemption_sync_point): on SIGTERM its protocol waits at a barrier
  of the coordination service for every process (up to 3 minutes), holding the lock that
  reached_preemption_sync_point takes. When the SIGTERM follows a lost process (the launcher
  stops the others at once), that barrier never completes, and a process that asks after a
  step whose collectives had all succeeded (a SIGKILL just after them) waits there instead of
  failing in the next collective, until the launcher's SIGKILL --stop_timeout_s later. So
  the jobs turn the service off before they join (train._configure_jax, check.main); JAX's
  own SIGTERM handler is then never installed, and orbax's question
  (CheckpointManager.reached_preemption) answers False.

  Use: `with PreemptionNotice() as notice: ... if notice.reached(step): save; stop`.
  """

  def __init__(self):
    self._signalled = False
    self._previous = None

  def __enter__(self) -> "PreemptionNotice":
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if self._previous is None:
      return
    if exc_type is not None and jax.process_count() > 1:
      # The error ends this process (exit_promptly_on_error), and the launcher sends SIGTERM
      # as soon as a peer is lost: the default action would end it before it has reported
      # the error. This handler only sets a flag that nobody reads any more.
      return
    signal.signal(signal.SIGTERM, self._previous)
    self._previous = None

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    self._signalled = True

  def reached(self, step: int) -> bool:
    """True when the job must save after `step` and stop (the same on every process)."""
    del step          # every process asks at every step, so the all-gathers pair up
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    if jax.process_count() == 1:
      return self._signalled
    flags = multihost_utils.process_allgather(np.array([self._signalled]))
    return bool(np.any(flags))


def directory_problem(path: str) -> str | None:
  """Why `path` cannot be (or become) a directory this process writes into, or None.

  Checked before any work, for directory flags (--checkpoint_dir, --out_dir, --log_dir): the
  path itself or its nearest existing ancestor must be a writable directory, and then the
  directory is created (if missing) and a file is written into it and removed. os.access
  alone is not proof: as root it allows writing where the file system refuses
  (/proc/nosuch/x), and a read-only mount refuses everyone.
  """
  path = os.path.abspath(path)
  if os.path.exists(path):
    if not os.path.isdir(path):
      return f"{path} exists and is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
      return f"{path} is not writable"
  else:
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
      parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
      return f"{parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
      return f"{parent} is not writable (it would hold {path})"
  # Left in place: several processes of a job may check the same directory at once.
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as err:
    return f"{path} cannot be created or written: {err}"
  return None


def _env_int(name: str, default: int | None, *, minimum: int,
             maximum: int = 2**31 - 1) -> int | None:
  raw = os.environ.get(name, "")
  if not raw:
    return default
  try:
    value = int(raw)
  except ValueError:
    raise BadEnvironment(f"{name} must be an integer, got {raw!r}") from None
  if not minimum <= value <= maximum:
    raise BadEnvironment(f"{name} must be in {minimum}..{maximum}, got {value}")
  return value


def _split_address(address: str) -> tuple[str, int]:
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit():
    raise BadEnvironment(f"{ENV_COORDINATOR} must be host:port, got {address!r}")
  if not 1 <= int(port) <= 65535:
    raise BadEnvironment(f"{ENV_COORDINATOR}={address}: the port must be in 1..65535, got "
                         f"{port}")
  return host.strip("[]"), int(port)


def _configure_cpu(devices_per_process: int | None, *, multi_process: bool) -> None:
  """CPU device count and collectives; must precede backend initialization."""
  if devices_per_process is None:
    return
  jax.config.update("jax_num_cpu_devices", devices_per_process)
  if multi_process:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _on_cloud_tpu_vm() -> bool:
  """libtpu installed and TPU chips attached (v4/v5e: /dev/accel*, v5p/v6e: /dev/vfio/N)."""
  if importlib.util.find_spec("libtpu") is None:
    return False
  return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def _rendezvous(host: str, port: int, process_id: int, num_processes: int,
                timeout_s: int) -> None:
  """Every process checks in with process 0 before JAX's coordination service starts."""
  deadline = time.monotonic() + timeout_s
  where = f"the coordinator (process 0) at {host}:{port}"
  if process_id == 0:
    _serve_rendezvous(port, num_processes, deadline, timeout_s, where)
  else:
    _join_rendezvous(host, port, process_id, num_processes, deadline, timeout_s, where)


def _serve_rendezvous(port, num_processes, deadline, timeout_s, where) -> None:
  try:
    listener = socket.create_server(("", port), reuse_port=False)
  except OSError as err:
    raise RuntimeError(f"process 0 of {num_processes} could not listen on port {port} for "
                       f"{where}: {err}") from err
  joined: dict[int, socket.socket] = {}
  try:
    while len(joined) < num_processes - 1:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        missing = sorted(set(range(1, num_processes)) - set(joined))
        names = ", ".join(str(p) for p in missing)
        message = (f"process(es) {names} of {num_processes} did not join {where} within "
                   f"{timeout_s} s ({ENV_INIT_TIMEOUT_S})")
        for conn in joined.values():
          _send_line(conn, f"error {message}")
        raise RuntimeError(f"process 0: {message}")
      listener.settimeout(min(remaining, 1.0))
      try:
        conn, _ = listener.accept()
      except TimeoutError:
        continue
      conn.settimeout(max(deadline - time.monotonic(), 0.1))
      try:
        words = _recv_line(conn).split()
      except (OSError, ValueError):
        conn.close()      # Not one of ours, or it went away: keep waiting for the others.
        continue
      problem = _check_hello(words, num_processes, joined)
      if problem:
        _send_line(conn, f"error {problem}")
        conn.close()
        continue
      joined[int(words[1])] = conn
    for conn in joined.values():
      _send_line(conn, "go")
    # Let the others hang up first, so that the port has no connection in TIME_WAIT on this
    # side when JAX's coordination service binds it.
    for conn in joined.values():
      conn.settimeout(max(min(deadline - time.monotonic(), 5.0), 0.1))
      try:
        while conn.recv(64):
          pass
      except OSError:
        pass
  finally:
    for conn in joined.values():
      conn.close()
    listener.close()


def _check_hello(words, num_processes, joined) -> str | None:
  if len(words) != 3 or words[0] != _HELLO or not words[1].isdigit() or not words[2].isdigit():
    return f"unexpected greeting {' '.join(words)!r}"
  pid, count = int(words[1]), int(words[2])
  if count != num_processes:
    return (f"process {pid} says {ENV_NUM_PROCESSES}={count}, process 0 says "
            f"{num_processes}")
  if not 1 <= pid < num_processes:
    return f"{ENV_PROCESS_ID}={pid} is outside 1..{num_processes - 1}"
  if pid in joined:
    return f"two processes claim {ENV_PROCESS_ID}={pid}"
  return None


def _join_rendezvous(host, port, process_id, num_processes, deadline, timeout_s, where):
  prefix = f"process {process_id} of {num_processes}"
  conn = None
  last_error = None
  while conn is None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      raise RuntimeError(f"{prefix} could not reach {where} within {timeout_s} s "
                         f"({ENV_INIT_TIMEOUT_S}); process 0 did not start or is unreachable "
                         f"(last error: {last_error})")
    try:
      conn = socket.create_connection((host, port), timeout=min(remaining, 1.0))
    except OSError as err:
      last_error = err
      time.sleep(min(_RETRY_S, max(deadline - time.monotonic(), 0)))
  with conn:
    try:
      _send_line(conn, f"{_HELLO} {process_id} {num_processes}")
      # A little past the deadline, so that process 0's answer naming the missing processes
      # arrives before this side gives up.
      conn.settimeout(max(deadline - time.monotonic(), 0.0) + _ANSWER_GRACE_S)
      answer = _recv_line(conn)
    except TimeoutError:
      raise RuntimeError(f"{prefix} reached {where}, but not all processes joined within "
                         f"{timeout_s} s ({ENV_INIT_TIMEOUT_S})") from None
    except (OSError, ValueError) as err:
      raise RuntimeError(f"{prefix}: {where} closed the connection before the job "
                         f"started: {err}") from err
  if answer != "go":
    raise RuntimeError(f"{prefix}: {where} refused to start: {answer.removeprefix('error ')}")


def _send_line(conn: socket.socket, text: str) -> None:
  try:
    conn.sendall(text.encode() + b"\n")
  except OSError:
    pass      # The peer is gone; it reports its own failure.


def _recv_line(conn: socket.socket, limit: int = 4096) -> str:
  data = b""
  while not data.endswith(b"\n"):
    chunk = conn.recv(limit)
    if not chunk:
      raise ValueError("connection closed")
    data += chunk
    if len(data) > limit:
      raise ValueError("line too long")
  return data.decode(errors="replace").strip()
