"""`ringflash launch`: start a ringflash job on local processes or on a Cloud TPU slice.

  ringflash launch local --processes N --devices-per-process M [--log_dir D] -- <job>
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

# Both targets. --log_dir is absl's own flag (defined by absl.logging), used here as the
# folder of the per-process (local) or per-worker (tpu) logs.
_INIT_TIMEOUT_S = flags.DEFINE_integer(
    "init_timeout_s", distributed.DEFAULT_INIT_TIMEOUT_S,
    "start-up timeout of every process (RINGFLASH_INIT_TIMEOUT_S)", lower_bound=1)
# local
_PROCESSES = flags.DEFINE_integer("processes", 2, "local: N, processes to start",
                                  lower_bound=1)
_DEVICES_PER_PROCESS = flags.DEFINE_integer("devices_per_process", 4,
                                            "local: M, CPU devices per process", lower_bound=1)
_STOP_TIMEOUT_S = flags.DEFINE_float(
    "stop_timeout_s", 60.0, "local: once a process is lost, the others get SIGTERM, and "
    "SIGKILL if still alive this many seconds later", lower_bound=0.0)
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 0.0, "local: stop the whole job after this many "
                                "seconds (a failure); 0: no limit", lower_bound=0.0)
_PORT = flags.DEFINE_integer("port", 0, "local: coordinator port on 127.0.0.1; 0 picks a "
                             "free one", lower_bound=0)
# tpu
_NAME = flags.DEFINE_string("name", "", "tpu: name of the TPU VM (the slice)")
_ZONE = flags.DEFINE_string("zone", "", "tpu: its zone, e.g. us-east5-a")
_PROJECT = flags.DEFINE_string("project", "", "tpu: its Google Cloud project; empty: gcloud's "
                               "default")
_WORKERS = flags.DEFINE_integer("workers", 0, "tpu: hosts of the slice (e.g. 4 for v5p-32), "
                                "one log is collected from each")
_DRY_RUN = flags.DEFINE_boolean("dry_run", False, "tpu: print the commands, run nothing")
_SOURCE_DIR = flags.DEFINE_string("source_dir", "", "tpu: root of the ringflash source tree "
                                  "to copy; empty: the one this ringflash is installed from")
_PYTHON = flags.DEFINE_string("python", "python3", "tpu: the workers' Python (>= 3.12)")

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
    status = local.launch(job, processes=_PROCESSES.value,
                          devices_per_process=_DEVICES_PER_PROCESS.value,
                          log_dir=log_dir(target), stop_timeout_s=_STOP_TIMEOUT_S.value,
                          init_timeout_s=_INIT_TIMEOUT_S.value,
                          timeout_s=_TIMEOUT_S.value or None, port=_PORT.value or None)
  else:
    try:
      where = tpu.Slice(name=_NAME.value, zone=_ZONE.value, workers=_WORKERS.value,
                        project=_PROJECT.value or None)
    except ValueError as err:
      raise app.UsageError(f"launch tpu: --{err}") from err
    folder = log_dir(target)
    plan = tpu.steps(where, job, source_dir=_SOURCE_DIR.value or tpu.default_source_dir(),
                     log_dir=folder, init_timeout_s=_INIT_TIMEOUT_S.value,
                     python=_PYTHON.value)
    if not _DRY_RUN.value:
      os.makedirs(folder, exist_ok=True)
    status = tpu.launch(plan, dry_run=_DRY_RUN.value, terminal=sys.stdout)
  sys.exit(status)
