"""The H200-only tests, in several pytest processes on the GPUs of this host.

A case of tests/contract/test_pallas_gpu.py or tests/test_pallas_gpu.py spends most of its
30-90 s compiling (Mosaic GPU, ptxas: CPU work); N processes share the cores and the GPU
memory (no preallocation). The compiling binds them to the cores: on a host of 16 cores the
contract file's 76 cases (`-m "slow or not slow"`) finish at about 0.09 a second whether 7 or
15 processes share them (docs/GPU_NOTES.md, runs 192-195), some 14 minutes, so a session
whose calls stop at 10 minutes runs it as `--part 1/2` and `--part 2/2`, one call each. Run
from the repository root after `python3 -m pip install .` (from the root, the folder
ringflash/ would shadow the installed package; the tests run in tests/):

  python3 scripts/gpu_tests.py [--processes N] [--timeout S] [--part i/n] [pytest selection]

(--platform=cpu runs the same on CPU devices, for the CPU-only cases; with no selection, the
whole default suite, which is how it runs on another jax than the test environment's. Install
with `python3 -m pip install -e .` for that: tests/test_launch.py starts `python -m
ringflash.cli` in the repository root, where only the editable install finds
ringflash.parallel and the other subpackages.)

e.g. `python3 scripts/gpu_tests.py contract/test_pallas_gpu.py -m "slow or not slow"`
(paths relative to tests/). It collects the selected case ids once, deals them round-robin
to N processes (default: a third of the cores, at least 1), waits, prints each process's
summary line and the failures' lines (for a process past --timeout, what its result lines
say; --logs DIR keeps each process's whole log), then the ids of the cases that processes
past --timeout did not finish (to pass as the selection of the next call), and exits 1 if any
process failed or ran past --timeout. docs/GPU_NOTES.md (run 37) has what the same dealing
printed for the contract file.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"


def case_ids(collect_output: str) -> list[str]:
  """The case ids in `pytest --collect-only -q` output, relative to tests/ (pytest names
  them from the repository root, where pyproject.toml is)."""
  return [line.strip().removeprefix("tests/") for line in collect_output.splitlines()
          if "::" in line]


def deal(ids: list[str], processes: int) -> list[list[str]]:
  """ids dealt round-robin to at most `processes` non-empty parts (neighbouring cases are
  often alike in cost)."""
  return [part for part in (ids[i::processes] for i in range(processes)) if part]


def part_of(ids: list[str], part: str) -> list[str]:
  """The i-th of n near-equal shares of ids for `--part i/n` (every n-th case from the i-th:
  the shares of 1/n .. n/n together are ids, each case once, whatever the selection's
  order). A ValueError says what is wrong with `part`."""
  i, sep, n = part.partition("/")
  if not (sep and i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
    raise ValueError(f"--part must be i/n with 1 <= i <= n, got {part!r}")
  return ids[int(i) - 1::int(n)]


def summary(log: str) -> tuple[str, list[str]]:
  """(the last non-empty line of a pytest log, its FAILED / ERROR lines)."""
  lines = [line for line in log.splitlines() if line.strip()]
  bad = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
  return (lines[-1].strip("= ") if lines else "(no output)"), bad


OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


def results(log: str, part: list[str]) -> dict[str, str]:
  """The outcome of each case of `part` whose result line (pytest -v: "<id> PASSED ...", the
  id relative to tests/ or to the repository root) is in log, in the order of `part`. A
  case that started and did not finish (its id printed, no outcome after it) is absent."""
  done = {}
  for line in log.splitlines():
    words = line.split()
    if len(words) >= 2 and words[1] in OUTCOMES:
      done[words[0].removeprefix("tests/")] = words[1]
  return {i: done[i] for i in part if i in done}


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=max(1, (os.cpu_count() or 3) // 3))
  parser.add_argument("--timeout", type=int, default=900, help="seconds per process")
  parser.add_argument("--platform", default="cuda", help="JAX_PLATFORMS of the processes")
  parser.add_argument("--logs", default=None,
                      help="a folder to write each process's whole pytest log to")
  parser.add_argument("--part", default="1/1",
                      help="i/n: run the i-th of n shares of the selected cases")
  args, selection = parser.parse_known_args(argv)
  if args.processes < 1 or args.timeout < 1:
    parser.error("--processes and --timeout must be >= 1")
  try:
    part_of([], args.part)
  except ValueError as e:
    parser.error(str(e))
  env = dict(os.environ, JAX_PLATFORMS=args.platform, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             PYTHONUNBUFFERED="1")   # a process past --timeout keeps what it printed
  collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                              *selection], cwd=TESTS, env=env, capture_output=True, text=True)
  ids = case_ids(collected.stdout)
  if not ids:
    print(f"no cases selected by {selection}:")
    print(collected.stdout[-2000:] + collected.stderr[-2000:])
    return 1
  share = part_of(ids, args.part)
  if not share:
    print(f"--part {args.part} of {len(ids)} cases has none")
    return 1
  parts = deal(share, args.processes)
  print(f"{len(share)} cases" + (f" (part {args.part} of {len(ids)})" if share != ids else "")
        + f" in {len(parts)} processes", flush=True)
  start = time.time()
  marks = [arg for i, arg in enumerate(selection) if arg == "-m" or
           (i > 0 and selection[i - 1] == "-m")]
  procs = [subprocess.Popen(["timeout", str(args.timeout), sys.executable, "-m", "pytest",
                             "-v", "-rfE", "-p", "no:cacheprovider", *marks, *part],
                            cwd=TESTS, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for part in parts]
  logs = [p.communicate()[0] for p in procs]
  if args.logs:
    folder = pathlib.Path(args.logs)
    folder.mkdir(parents=True, exist_ok=True)
    for i, log in enumerate(logs):
      (folder / f"process{i}.log").write_text(log)
  failed = False
  left = []
  for i, (proc, log, part) in enumerate(zip(procs, logs, parts)):
    last, bad = summary(log)
    failed |= proc.returncode != 0
    if proc.returncode in (124, 137):
      # killed before pytest's summary: its -v result lines say what ran
      done = results(log, part)
      left += [c for c in part if c not in done]
      counts = ", ".join(f"{sum(o == name for o in done.values())} {name.lower()}"
                         for name in OUTCOMES if name in done.values())
      last = (f"ran past --timeout after {len(done)} of its {len(part)} cases"
              + (f" ({counts})" if counts else ""))
      bad = [f"{o} {c}" for c, o in done.items() if o in ("FAILED", "ERROR")]
    print(f"process {i}: {last}")
    for line in bad:
      print(f"  {line}")
  if left:
    print(f"{len(left)} cases not finished (pass them as the selection to run them):")
    for case in left:
      print(f"  {case}")
  print(f"{time.time() - start:.0f} s", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
