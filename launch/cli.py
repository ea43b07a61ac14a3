"""`ringflash launch`: start a ringflash job on local processes or on a Cloud TPU slice.

  ringflash launch local --processes N --devices-per-process M [--platform cpu|gpu]
                         [--log_dir D] -- <job>
  ringflash launch tpu --name NAME --zone ZONE --workers W [--project P] [--dry-run] -- <job>

<job> is a ringflash subcommand and its flags (`check`, `train --steps=10`); default `check`.
Everything after `--` belongs to the job. Multi-word flags may be spelled with `-` or `_`.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app
from absl import flags

from ringflash.launch import distributed
from ringflash.launch import local
from ringflash.launch import tpu

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines this command's flags on absl's FLAGS. The ringflash command calls it once
  before parsing; importing the module (as tests do) defines nothing.

  --log_dir is absl's own flag (defined by absl.logging), used here as the folder of the
  per-process (local) or per-worker (tpu) logs.
  """
  # both targets
  flags.DEFINE_integer(
      "init_timeout_s", distributed.DEFAULT_INIT_TIMEOUT_S,
      "start-up timeout of every process (RINGFLASH_INIT_TIMEOUT_S)", lower_bound=1)
  # local
  flags.DEFINE_integer("processes", 2, "local: N, processes to start",
                       lower_bound=1)
  flags.DEFINE_integer("devices_per_process", 4,
                       "local: M, devices per process (CPU devices, or GPUs)", lower_bound=1)
  flags.DEFINE_enum("platform", "cpu", list(local.PLATFORMS),
                    "local: cpu (simulated devices, gloo) or gpu (M of this machine's GPUs "
                    "per process, NCCL)")
  flags.DEFINE_float(
      "stop_timeout_s", 60.0, "local: once a process is lost, the others get SIGTERM, and "
      "SIGKILL if still alive this many seconds later", lower_bound=0.0)
  flags.DEFINE_float("timeout_s", 0.0, "local: stop the whole job after this many "
                     "seconds (a failure); 0: no limit", lower_bound=0.0)
  flags.DEFINE_integer("port", 0, "local: coordinator port on 127.0.0.1; 0 picks a "
                       "free one", lower_bound=0)
  # tpu
  flags.DEFINE_string("name", "", "tpu: name of the TPU VM (the slice)")
  flags.DEFINE_string("zone", "", "tpu: its zone, e.g. us-east5-a")
  flags.DEFINE_string("project", "", "tpu: its Google Cloud project; empty: gcloud's "
                      "default")
  flags.DEFINE_integer("workers", 0, "tpu: hosts of the slice (e.g. 4 for v5p-32), "
                       "one log is collected from each")
  flags.DEFINE_boolean("dry_run", False, "tpu: print the commands, run nothing")
  flags.DEFINE_string("source_dir", "", "tpu: root of the ringflash source tree "
                      "to copy; empty: the one this ringflash is installed from")
  flags.DEFINE_string("python", "python3", "tpu: the workers' Python (>= 3.12)")

  for _flag in ("init_timeout_s", "devices_per_process", "stop_timeout_s", "timeout_s",
                "dry_run", "source_dir", "log_dir"):
    flags.DEFINE_alias(_flag.replace("_", "-"), _flag)


TARGETS = ("local", "tpu")
DEFAULT_JOB = ("check",)


def log_dir(target: str) -> str:
  """--log_dir, or ./ringflash-logs/<target>-<time> when it is not given."""
  if flags.FLAGS.log_dir:
    return os.path.abspath(flags.FLAGS.log_dir)
  return os.path.abspath(os.path.join("ringflash-logs",
                                      f"{target}-{time.strftime('%Y%m%d-%H%M%S')}"))


def main(argv) -> None:
  if len(argv) < 2 or argv[1] not in TARGETS:
    got = argv[1] if len(argv) > 1 else "nothing"
    raise app.UsageError(f"the target must be one of {TARGETS}, got {got}")
  target, job = argv[1], list(argv[2:]) or list(DEFAULT_JOB)
  if target == "local":
    status = local.launch(job, processes=FLAGS.processes,
                          devices_per_process=FLAGS.devices_per_process,
                          log_dir=log_dir(target), stop_timeout_s=FLAGS.stop_timeout_s,
                          init_timeout_s=FLAGS.init_timeout_s,
                          timeout_s=FLAGS.timeout_s or None, port=FLAGS.port or None,
                          platform=FLAGS.platform)
  else:
    try:
      where = tpu.Slice(name=FLAGS.name, zone=FLAGS.zone, workers=FLAGS.workers,
                        project=FLAGS.project or None)
    except ValueError as err:
      raise app.UsageError(f"launch tpu: --{err}") from err
    folder = log_dir(target)
    plan = tpu.steps(where, job, source_dir=FLAGS.source_dir or tpu.default_source_dir(),
                     log_dir=folder, init_timeout_s=FLAGS.init_timeout_s,
                     python=FLAGS.python)
    if not FLAGS.dry_run:
      os.makedirs(folder, exist_ok=True)
    status = tpu.launch(plan, dry_run=FLAGS.dry_run, terminal=sys.stdout)
  sys.exit(status)
