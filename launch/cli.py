"""`ringflash launch`: start a ringflash job on local processes or on a Cloud TPU slice.

  ringflash launch local --processes N --devices-per-process M [--platform cpu|gpu]
                         [--log_dir D] -- <job>
  ringflash launch tpu --name NAME --zone ZONE [--workers W] [--project P] [--dry-run] -- <job>

<job> is a ringflash subcommand and its flags (`check`, `train --steps=10`); default `check`.
Everything after `--` belongs to the job. Multi-word flags may be spelled with `-` or `_`.

Everything is checked before anything starts (a mistake: one line, exit status 2): the
target; its own flags (a flag of the other target is refused, directories must be usable);
the job: its first word must be a ringflash subcommand, and the flags of `check` and `train`
are parsed and checked here exactly as the job will check them, with the job's device count
where the launch knows it (local: N x M), so that `-- train --ring=16` on 2 x 4 devices fails
here rather than in every process. A help flag in the job (`-- train --help`) is refused:
`ringflash train --help` prints the job's flags.

Logs go to --log_dir, by default ./ringflash-logs/<target>-<date>-<time>-<launcher's pid>, a
folder of its own for every launch (two launches in the same second included).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import sys
import time

from absl import flags

from ringflash import cli as ringflash_cli
from ringflash.cli import UsageError
from ringflash.launch import distributed
from ringflash.launch import local
from ringflash.launch import tpu

FLAGS = flags.FLAGS


# absl's own flags this command reads (listed by --help with the ones it defines).
ABSL_FLAGS = ("log_dir",)
# `launch local` starts its processes on this machine: a mistyped count is refused, not forked.
MAX_PROCESSES = 256


def define_flags() -> None:
  """Defines this command's flags on absl's FLAGS. The ringflash command calls it once
  before parsing; importing the module (as tests do) defines nothing.

  --log_dir is absl's own flag (defined by absl.logging), used here as the folder of the
  per-process (local) or per-worker (tpu) logs.
  """
  # both targets
  flags.DEFINE_integer(
      "init_timeout_s", distributed.DEFAULT_INIT_TIMEOUT_S,
      "start-up timeout of every process (RINGFLASH_INIT_TIMEOUT_S)", lower_bound=1,
      upper_bound=2**31 - 1)
  # local
  flags.DEFINE_integer("processes", 2, "local: N, processes to start on this machine",
                       lower_bound=1, upper_bound=MAX_PROCESSES)
  flags.DEFINE_integer("devices_per_process", 4,
                       "local: M, devices per process (CPU devices, or GPUs)", lower_bound=1,
                       upper_bound=ringflash_cli.MAX_CPU_DEVICES)
  flags.DEFINE_enum("platform", "cpu", list(local.PLATFORMS),
                    "local: cpu (simulated devices, gloo) or gpu (M of this machine's GPUs "
                    "per process, NCCL)")
  ringflash_cli.define_float(
      "stop_timeout_s", 10.0, "local: once a process is lost, the others get SIGTERM, and "
      "SIGKILL if still alive this many seconds later", lower_bound=0.0)
  ringflash_cli.define_float("timeout_s", 0.0, "local: stop the whole job after this many "
                             "seconds (a failure); 0: no limit", lower_bound=0.0)
  flags.DEFINE_integer("port", 0, "local: coordinator port on 127.0.0.1; 0 picks a "
                       "free one", lower_bound=0, upper_bound=65535)
  # tpu
  flags.DEFINE_string("name", "", "tpu: name of the TPU VM (the slice)")
  flags.DEFINE_string("zone", "", "tpu: its zone, e.g. us-east5-a")
  flags.DEFINE_string("project", "", "tpu: its Google Cloud project; empty: gcloud's "
                      "default")
  flags.DEFINE_integer("workers", None, "tpu: hosts of the slice (e.g. 4 for v5p-32), one "
                       "log is collected from each; not given: counted by `gcloud compute "
                       "tpus tpu-vm describe` (the job itself reaches every worker through "
                       "--worker=all)", lower_bound=1)
  flags.DEFINE_boolean("dry_run", False, "tpu: print the commands, run nothing")
  flags.DEFINE_string("source_dir", "", "tpu: root of the ringflash source tree "
                      "to copy; empty: the one this ringflash is installed from")
  flags.DEFINE_string("python", "python3", "tpu: the workers' Python (>= 3.12), a word of "
                      "their shell (~/venv/bin/python expands there)")

  for _flag in ("init_timeout_s", "devices_per_process", "stop_timeout_s", "timeout_s",
                "dry_run", "source_dir", "log_dir"):
    flags.DEFINE_alias(_flag.replace("_", "-"), _flag)


TARGETS = ("local", "tpu")
TAKES_ARGUMENTS = True     # the target, then the job after `--` (ringflash.cli)
DEFAULT_JOB = ("check",)
# The flags that belong to one target only (the other refuses them).
TARGET_FLAGS = {
    "local": ("processes", "devices_per_process", "platform", "stop_timeout_s", "timeout_s",
              "port"),
    "tpu": ("name", "zone", "project", "workers", "dry_run", "source_dir", "python"),
}
# Jobs whose flags the launcher checks before it starts them: module with define_flags(fv),
# job_from_flags(fv) and check_devices(config, device_count).
# The subcommands that join a multi-process job (distributed.initialize), and those that
# run in one process whatever the environment.
JOINING_JOBS = ("bench", "check", "train")
SINGLE_PROCESS_JOBS = ("demo", "plan", "generate")

CHECKED_JOBS = {"bench": "ringflash.cli.bench", "check": "ringflash.launch.check",
                "train": "ringflash.launch.train"}


# absl's help flags (absl.app): parsed in the launcher they would print the launcher's help.
HELP_FLAGS = ("help", "helpfull", "helpshort", "helpxml", "h", "?")


def log_dir(target: str, given: str | None) -> str:
  """`given` (--log_dir), or ./ringflash-logs/<target>-<date>-<time>-<pid> when it is not:
  the launcher's pid keeps apart the folders of launches started in the same second."""
  if given:
    return os.path.abspath(given)
  return os.path.abspath(os.path.join(
      "ringflash-logs", f"{target}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"))


@contextlib.contextmanager
def _job_environment(values: dict[str, str]):
  """os.environ with `values` set (the variables the launcher gives every process), so that
  the job's flags are checked here as the job will check them; restored on leaving."""
  saved = {name: os.environ.get(name) for name in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value


def check_job(job: list[str], *, devices: int | None, processes: int = 1,
              platform: str = "cpu") -> None:
  """Checks a job before it starts anywhere.

  Args:
    job: the subcommand and its arguments, e.g. ["train", "--steps", "10"].
    devices: the job's global device count if known (local: processes x devices per
      process), for the checks that need it; None skips them, and the checks of the job's
      folders, which belong to the machines that run it (tpu).
    processes: the job's processes, each holding devices / processes of them.
    platform: the devices the launch gives each process: "cpu" (simulated), "gpu", "tpu".

  Raises:
    UsageError: the job is not a ringflash subcommand, or (bench, check, train) one of its flags
      is wrong, exactly as the job would say it.
  """
  name = job[0]
  if name in SINGLE_PROCESS_JOBS:
    # Each process would run its own copy, alone, on its own devices.
    raise UsageError(f"job {name}: `ringflash {name}` runs in one process and joins no "
                     f"launched job; run it directly (the jobs that join: "
                     f"{', '.join(JOINING_JOBS)})")
  if name not in JOINING_JOBS:
    raise UsageError(f"the job (after the target, or after `--`) must start with a ringflash "
                     f"subcommand, one of {', '.join(JOINING_JOBS)}; got {' '.join(job)!r}")
  for arg in job[1:]:
    if arg == "--":
      break
    if arg.startswith("-") and arg.lstrip("-").split("=")[0] in HELP_FLAGS:
      raise UsageError(f"job {name}: {arg.split('=')[0]} is not for a launched job (its "
                       f"processes would print help and exit); run `ringflash {name} --help` "
                       f"for the flags of {name}")
  if name not in CHECKED_JOBS:
    return
  module = importlib.import_module(CHECKED_JOBS[name])
  values = flags.FlagValues()
  module.define_flags(values)
  # absl's own flags (logging, help) are accepted by every job.
  for module_name, module_flags in FLAGS.flags_by_module_dict().items():
    for flag in module_flags if module_name.startswith("absl.") else ():
      if flag.name not in values:
        values[flag.name] = copy.deepcopy(flag)
  try:
    try:
      rest = values([name, *job[1:]])
    except ValueError as err:     # absl's `--noflag=value`: a ValueError, not a flags.Error
      raise UsageError(str(err)) from None
    if len(rest) > 1:
      raise UsageError(f"takes flags only, got the argument(s) {' '.join(rest[1:])}")
    if platform != "cpu" and "platform" in values and values.platform == "cpu":
      # train's --platform=cpu sets jax_platforms itself: it trained on simulated CPU devices
      # under `launch local --platform=gpu`, and exited 0.
      default = "" if values["platform"].present else " (its default)"
      raise UsageError(f"--platform=cpu{default} runs on simulated CPU devices, not on the "
                       f"{platform.upper()}s this launch gives each process; pass "
                       f"--platform=default")
    parsed = module.job_from_flags(values, folders=devices is not None)
    if hasattr(module, "check_processes"):        # bench: most modes run in one process
      module.check_processes(values, processes)
    if devices is not None and parsed is not None:     # bench's need the devices themselves
      module.check_devices(parsed.config, devices, processes)
  except (flags.Error, UsageError) as err:
    raise UsageError(f"job {name}: {err}") from None


def _check_targets_flags(target: str) -> None:
  for other, names in TARGET_FLAGS.items():
    given = [n for n in names if other != target and FLAGS[n].present]
    if given:
      raise UsageError(f"--{given[0]} is a flag of `launch {other}`, not `launch {target}`")


def _check_dir(name: str, path: str, *, keep: bool = True) -> None:
  """The last check before anything starts, as checking a directory creates it; with
  keep=False (a dry run, which writes nothing) the folders it created are removed again."""
  missing = []                  # the folders the check creates, innermost first
  folder = os.path.abspath(path)
  while not os.path.exists(folder):
    missing.append(folder)
    folder = os.path.dirname(folder)
  problem = distributed.directory_problem(path)
  if problem:
    raise UsageError(f"--{name}={path}: {problem}")
  if not keep:
    for folder in missing:
      os.rmdir(folder)


def main(argv) -> None:
  if len(argv) < 2 or argv[1] not in TARGETS:
    got = repr(argv[1]) if len(argv) > 1 else "nothing"
    raise UsageError(f"the target must be one of {', '.join(TARGETS)}, got {got}")
  target, job = argv[1], list(argv[2:]) or list(DEFAULT_JOB)
  _check_targets_flags(target)
  folder = log_dir(target, FLAGS.log_dir)
  if target == "local":
    # As each process will see it (local.process_env).
    env = ({distributed.ENV_DEVICES_PER_PROCESS: str(FLAGS.devices_per_process)}
           if FLAGS.platform == "cpu" else {})
    with _job_environment(env):
      check_job(job, devices=FLAGS.processes * FLAGS.devices_per_process,
                processes=FLAGS.processes, platform=FLAGS.platform)
    if FLAGS.port:
      try:
        local.check_port(FLAGS.port)
      except ValueError as err:
        raise UsageError(f"--{err}") from None
    if FLAGS.platform == "gpu":
      problem = local.gpu_problem(dict(os.environ),
                                  FLAGS.processes * FLAGS.devices_per_process)
      if problem:
        raise UsageError(f"--{problem}")
    _check_dir("log_dir", folder)
    try:
      status = local.launch(job, processes=FLAGS.processes,
                            devices_per_process=FLAGS.devices_per_process,
                            log_dir=folder, stop_timeout_s=FLAGS.stop_timeout_s,
                            init_timeout_s=FLAGS.init_timeout_s,
                            timeout_s=FLAGS.timeout_s or None, port=FLAGS.port or None,
                            platform=FLAGS.platform)
    except ValueError as err:     # raised before any process starts (local.launch)
      raise UsageError(str(err)) from None
    sys.exit(status)

  check_job(job, devices=None, platform="tpu")
  if not FLAGS.python.strip():
    raise UsageError("--python must name the workers' Python, e.g. python3")
  try:
    where = tpu.Slice(name=FLAGS.name, zone=FLAGS.zone, workers=FLAGS.workers,
                      project=FLAGS.project or None)
    source_dir = FLAGS.source_dir or tpu.default_source_dir()
    tpu.source_entries(source_dir)
  except ValueError as err:
    raise UsageError(f"--{err}") from None
  if where.workers is None and not FLAGS.dry_run:
    # Only the collection of the logs, one per worker, needs the count.
    try:
      where = tpu.Slice(name=where.name, zone=where.zone, project=where.project,
                        workers=tpu.count_workers(where))
    except ValueError as err:
      raise UsageError(str(err)) from None
  plan = tpu.steps(where, job, source_dir=source_dir, log_dir=folder,
                   init_timeout_s=FLAGS.init_timeout_s, python=FLAGS.python)
  missing = [] if FLAGS.dry_run else tpu.missing_programs(plan)
  if missing:
    # Before the first step: without gcloud the archive would be packed, then the copy fail.
    raise UsageError(f"{' and '.join(missing)}, which the launch runs on this machine, "
                     f"{'is' if len(missing) == 1 else 'are'} not installed (not found on "
                     f"PATH)")
  _check_dir("log_dir", folder, keep=not FLAGS.dry_run)
  sys.exit(tpu.launch(plan, dry_run=FLAGS.dry_run, terminal=sys.stdout))
