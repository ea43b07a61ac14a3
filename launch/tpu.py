"""The job on every worker of a Cloud TPU VM slice: `gcloud compute tpus tpu-vm` fan-out.

The commands, in order (`--dry-run` prints exactly these):

0. without --workers, count the workers (hosts) of the slice, for step 5:
                                     gcloud compute tpus tpu-vm describe NAME --format=json
   one networkEndpoints entry per worker (count_workers). If gcloud cannot tell, the launch
   stops here, saying how to give the count (--workers).
1. pack the source tree here:        tar -czf <log_dir>/ringflash-src.tar.gz -C <source> ...
2. copy it to every worker:          gcloud compute tpus tpu-vm scp ... --worker=all
3. unpack and install (tpu extra):   gcloud compute tpus tpu-vm ssh ... --worker=all
                                     --command '... python3 -m pip install ".[tpu]"'
4. run the job on every worker:      gcloud compute tpus tpu-vm ssh ... --worker=all
                                     --command '... python3 -u -m ringflash.cli <job> ...'
   each worker writes its output to ~/ringflash-logs/job.log; jax.distributed finds the
   slice by itself (distributed.initialize, case 2 of README.md ("Multi-host launch"))
5. collect one log per worker:       gcloud compute tpus tpu-vm scp NAME:ringflash-logs/job.log
                                     <log_dir>/worker_<w>.log --worker=<w>, w = 0 .. workers-1

Steps 2-4 reach every worker through gcloud's `--worker=all`, whatever their number; only
step 5 names workers one by one, so only it needs the count. Steps 0-3 stop the launch on
failure; step 5 runs whatever step 4 returned, and the launch exits with 1 if step 4 (or an
earlier step) failed, else 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from typing import TextIO

from ringflash.launch import distributed

# What an install needs: the folders pyproject.toml maps into ringflash.*, and the metadata.
SOURCE_ENTRIES = ("pyproject.toml", "README.md", "LICENSE", "ringflash", "kernels", "parallel",
                  "launch")
REMOTE_ARCHIVE = "ringflash-src.tar.gz"     # in the remote home directory
REMOTE_SOURCE = "ringflash"                 # unpacked into ~/ringflash
REMOTE_LOG = "ringflash-logs/job.log"       # relative to the remote home directory


WORKER = "<w>"      # in a dry run's printout of step 5 when the count is not known yet


@dataclasses.dataclass(frozen=True)
class Step:
  """One command of the launch. `always`: runs even after an earlier failure.
  `per_worker`: argv holds WORKER, to be read once per worker w (a dry run's printout)."""

  what: str
  argv: tuple[str, ...]
  always: bool = False
  per_worker: bool = False

  def shell(self) -> str:
    return shlex.join(self.argv)


@dataclasses.dataclass(frozen=True)
class Slice:
  """Where the job runs: a Cloud TPU VM named `name` in `zone` with `workers` hosts.

  workers: None when not given: count_workers asks gcloud (needed only to collect the logs).
  """

  name: str
  zone: str
  workers: int | None = None
  project: str | None = None

  def __post_init__(self):
    for field in ("name", "zone"):
      if not getattr(self, field):
        raise ValueError(f"{field} must be set")
    if self.workers is not None and self.workers < 1:
      raise ValueError(f"workers must be >= 1 (hosts of the slice, e.g. 4 for v5p-32), "
                       f"got {self.workers}")

  def gcloud(self, verb: str, *args: str, worker: str | None = "all") -> tuple[str, ...]:
    """`gcloud compute tpus tpu-vm <verb> <args> --zone --project [--worker]`; worker None
    leaves --worker out (verbs about the slice, not its workers: describe)."""
    where = (f"--zone={self.zone}",) + ((f"--project={self.project}",) if self.project else ())
    return ("gcloud", "compute", "tpus", "tpu-vm", verb, *args, *where,
            *((f"--worker={worker}",) if worker is not None else ()))


def describe_command(where: Slice) -> tuple[str, ...]:
  """gcloud's description of the slice as JSON; its networkEndpoints has one entry per worker."""
  return where.gcloud("describe", where.name, "--format=json", worker=None)


HOW_TO_GIVE_WORKERS = "give --workers=W, the hosts of the slice (e.g. 4 for v5p-32)"


def count_workers(where: Slice, run=subprocess.run, timeout_s: float = 120.0) -> int:
  """The workers (hosts) of the slice, as `gcloud compute tpus tpu-vm describe` lists them.

  Args:
    where: the slice.
    run: subprocess.run, or a stand-in (tests).
    timeout_s: bound on the gcloud call.

  Raises:
    ValueError: gcloud cannot tell (missing, failing, or no networkEndpoints); the message
      names the command and says how to give the count instead (--workers).
  """
  argv = describe_command(where)
  prefix = f"--workers is not given and `{shlex.join(argv)}`"
  try:
    done = run(argv, capture_output=True, text=True, check=False, timeout=timeout_s)
  except FileNotFoundError:
    raise ValueError(f"--workers is not given and gcloud, which could count the workers of "
                     f"the slice, is not installed; {HOW_TO_GIVE_WORKERS}") from None
  except subprocess.TimeoutExpired:
    raise ValueError(f"{prefix} did not answer within {timeout_s:g} s; "
                     f"{HOW_TO_GIVE_WORKERS}") from None
  if done.returncode:
    said = (done.stderr or "").strip().splitlines()      # gcloud's first line: its ERROR
    raise ValueError(f"{prefix} failed (status {done.returncode}"
                     f"{': ' + said[0].strip() if said else ''}); {HOW_TO_GIVE_WORKERS}")
  try:
    endpoints = json.loads(done.stdout)["networkEndpoints"]
  except (ValueError, KeyError, TypeError):
    endpoints = None
  if not isinstance(endpoints, list) or not endpoints:
    raise ValueError(f"{prefix} lists no networkEndpoints (one per worker); "
                     f"{HOW_TO_GIVE_WORKERS}")
  return len(endpoints)


def source_entries(source_dir: str) -> tuple[str, ...]:
  """The entries of SOURCE_ENTRIES that exist in source_dir (pyproject.toml must)."""
  if not os.path.isfile(os.path.join(source_dir, "pyproject.toml")):
    raise ValueError(f"source_dir={source_dir!r} has no pyproject.toml; pass the root of the "
                     f"ringflash source tree")
  return tuple(e for e in SOURCE_ENTRIES if os.path.exists(os.path.join(source_dir, e)))


def default_source_dir() -> str:
  """The source tree this ringflash was installed from (editable installs)."""
  import ringflash  # pylint: disable=g-import-not-at-top
  return os.path.dirname(os.path.dirname(os.path.abspath(ringflash.__file__)))


def steps(where: Slice, job: Sequence[str], *, source_dir: str, log_dir: str,
          init_timeout_s: int = distributed.DEFAULT_INIT_TIMEOUT_S,
          python: str = "python3") -> list[Step]:
  """The commands that run `ringflash <job>` on every worker of the slice.

  Args:
    where: the slice. Without its worker count (workers None), the plan is for a dry run's
      printout: it begins with the describe command (step 0) and step 5 is one per-worker
      template; count the workers first (count_workers) for a plan that can run.
    job: the ringflash subcommand and its flags, e.g. ["check"] or ["train", "--steps=10"].
    source_dir: root of the ringflash source tree to copy.
    log_dir: local folder for the archive and the collected logs worker_<w>.log.
    init_timeout_s: RINGFLASH_INIT_TIMEOUT_S on the workers.
    python: the workers' Python (>= 3.12).

  Returns:
    The steps, in order.
  """
  if not job:
    raise ValueError("job must name a ringflash subcommand, e.g. ['check']")
  archive = os.path.join(log_dir, REMOTE_ARCHIVE)
  install = (f"rm -rf ~/{REMOTE_SOURCE} && mkdir -p ~/{REMOTE_SOURCE} && "
             f"tar -xzf ~/{REMOTE_ARCHIVE} -C ~/{REMOTE_SOURCE} && "
             f"cd ~/{REMOTE_SOURCE} && {python} -m pip install --quiet \".[tpu]\"")
  # Run from the home directory: inside ~/ringflash, the source folder `ringflash/` would
  # shadow the installed package (which maps kernels/, parallel/, launch/ into it).
  # `python` is a word of the workers' shell, as in `install` above: the same spelling in
  # both, so that `~/venv/bin/python` installs and runs in the same Python.
  run = f"{python} {shlex.join(['-u', '-m', 'ringflash.cli', *job])}"
  log_parent = os.path.dirname(REMOTE_LOG)
  remote_job = (f"cd ~ && mkdir -p ~/{log_parent} && "
                f"{distributed.ENV_INIT_TIMEOUT_S}={init_timeout_s} {run} > ~/{REMOTE_LOG} 2>&1; "
                f"status=$?; tail -n 5 ~/{REMOTE_LOG}; exit $status")
  out = [] if where.workers else [
      Step("count the workers of the slice (--workers not given): one networkEndpoints "
           "entry each", describe_command(where))]
  out += [
      Step("pack the source tree",
           ("tar", "-czf", archive, "--exclude=__pycache__", "-C", source_dir,
            *source_entries(source_dir))),
      Step("copy it to every worker",
           where.gcloud("scp", archive, f"{where.name}:{REMOTE_ARCHIVE}")),
      Step("install ringflash[tpu] on every worker",
           where.gcloud("ssh", where.name, "--command", install)),
      Step("run the job on every worker",
           where.gcloud("ssh", where.name, "--command", remote_job)),
  ]

  def collect(w: str) -> tuple[str, ...]:
    return where.gcloud("scp", f"{where.name}:{REMOTE_LOG}",
                        os.path.join(log_dir, f"worker_{w}.log"), worker=w)

  if where.workers:
    out += [Step(f"collect the log of worker {w}", collect(str(w)), always=True)
            for w in range(where.workers)]
  else:
    out.append(Step(f"collect the log of worker {WORKER}, for each w = 0 .. W-1 (W: the "
                    f"count above)", collect(WORKER), always=True, per_worker=True))
  return out


def missing_programs(plan: Sequence[Step]) -> list[str]:
  """The programs the plan runs on this machine (gcloud, tar) that are not on PATH."""
  return sorted({step.argv[0] for step in plan if shutil.which(step.argv[0]) is None})


def launch(plan: Sequence[Step], *, dry_run: bool, terminal: TextIO) -> int:
  """Prints the steps (dry_run) or runs them; returns the job's exit status.

  A failing step before the job stops the launch (status 1); the log collection steps run
  even when the job failed.

  Raises:
    ValueError: not a dry run, and the plan holds per-worker templates (see steps).
  """
  if dry_run:
    for step in plan:
      terminal.write(f"# {step.what}\n{step.shell()}\n")
    terminal.flush()
    return 0
  if any(step.per_worker for step in plan):
    raise ValueError("the plan has per-worker templates (a slice without its worker count); "
                     "count the workers first (count_workers)")
  status = 0
  for step in plan:
    if status and not step.always:
      continue
    terminal.write(f"ringflash launch: {step.what}: {step.shell()}\n")
    terminal.flush()
    try:
      code = subprocess.run(step.argv, check=False).returncode
    except OSError as err:      # one that vanished, or cannot run, after missing_programs
      terminal.write(f"ringflash launch: {step.argv[0]}: {err.strerror or err}\n")
      code = 127
    if code and not step.always:
      terminal.write(f"ringflash launch: FAILED ({step.what}): status {code}\n")
      status = code
    elif code:
      terminal.write(f"ringflash launch: warning ({step.what}): status {code}\n")
  terminal.flush()
  return 1 if status else 0
