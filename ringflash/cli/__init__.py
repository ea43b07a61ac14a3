"""The `ringflash` command: `ringflash <subcommand> [--flags]`.

Each subcommand is a module with `define_flags()` (its absl flags) and `main(argv)`. Only
the chosen module's flags are defined, so subcommands may reuse flag names, and importing
a module for its functions (as the tests do) defines no flag.

A user's mistake is one line on stderr and exit status 2, before any work: a flag that does
not parse, a positional argument where none is taken, or a `UsageError` that a subcommand's
`main` raises while checking its flags (it checks them all before it touches a device).
A subcommand that takes positional arguments (`launch`) sets `TAKES_ARGUMENTS = True`.
Float flags are defined with `define_float`, which refuses NaN, infinities and values
float32 cannot hold while parsing. Sizes are bounded (MAX_SEQ_LEN, MAX_CPU_DEVICES), so that
a mistyped one is refused instead of building host arrays or devices for minutes.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import textwrap

# The longest sequence a command takes: ring_attention's own bound (_validate.MAX_TOKENS),
# given here so that a flag's parser refuses it before anything is built for it.
MAX_SEQ_LEN = 2**30
# Simulated CPU devices per process: XLA builds them one by one, in time that grows faster
# than their number (100000 did not finish in minutes).
MAX_CPU_DEVICES = 4096

# name -> (module, one-line help). Modules are imported only when chosen.
SUBCOMMANDS = {
    "demo": ("ringflash.cli.demo", "ring attention on a simulated 8-device mesh, checked"),
    "plan": ("ringflash.cli.plan", "per-device memory of a TPU slice, compiled without a TPU"),
    "bench": ("ringflash.cli.bench", "per-device kernel throughput against cuDNN"),
    "check": ("ringflash.launch.check", "ring attention over all global devices, verified"),
    "launch": ("ringflash.launch.cli", "start a job on local processes or a TPU slice"),
    "train": ("ringflash.launch.train", "long-context language model training"),
    "generate": ("ringflash.launch.generate", "greedy decoding from a train checkpoint, checked"),
}


class UsageError(Exception):
  """A mistake in a command's flags or arguments: `ringflash` prints
  `ringflash <subcommand>: <message>` as one line and exits with status 2."""


_command_flags: tuple[str, ...] = ()      # the running subcommand's own flags (run)


def command_flags(*, exclude=()) -> dict:
  """{"--name": value} of the running subcommand's own flags (those its define_flags added
  to absl's FLAGS in run), as parsed, less `exclude`: what the processes of a launched job
  must agree on (launch.distributed.check_same_settings)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  return {f"--{name}": flags.FLAGS[name].value for name in _command_flags
          if name not in exclude}


def define_float(name: str, default: float, help_: str, **kwargs) -> None:
  """absl's DEFINE_float (same arguments) for a flag that takes finite numbers only.

  absl's bounds let NaN through (every comparison with it is false), and NaN or an infinity
  would silently turn off what the flag sets (a time limit, a tolerance) or ruin a run (a
  learning rate): both are refused while parsing, `flag --timeout_s=nan: must be a finite
  number`. So is a number that float32, in which the programs compute, would turn into an
  infinity or 0 (`--learning_rate=1e300`, `--rope_base=1e-300` trained on NaN and exited
  0): 0, or a magnitude from float32's smallest normal 1.2e-38 to its largest 3.4e38.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_float(name, default, help_, **kwargs)
  flags.register_validator(name, lambda value: value is None or _float32_number(value),
                           message="must be a finite number that float32 holds: 0, or "
                                   "1.2e-38 <= |x| <= 3.4e38",
                           flag_values=kwargs.get("flag_values", flags.FLAGS))


def _float32_number(value: float) -> bool:
  tiny, big = 1.1754943508222875e-38, 3.4028234663852886e38     # float32's normal range
  return math.isfinite(value) and (value == 0 or tiny <= abs(value) <= big)


def _flag_help(flag) -> str:
  """One flag as --help lists it: name, help (absl's, an enum's choices first), default."""
  lines = textwrap.wrap(f"--{flag.name}: {flag.help}", 96, initial_indent="  ",
                        subsequent_indent="    ")
  return "\n".join(lines + [f"    (default: {flag.default_as_str})"])


def _usage() -> str:
  lines = ["usage: ringflash <subcommand> [--flags]   (ringflash <subcommand> --help)", ""]
  lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
  return "\n".join(lines)


def _starting_jax(err: BaseException) -> bool:
  """Whether err was raised where JAX starts its backends (JAX_PLATFORMS naming a platform
  that is unknown, or whose plugin or device is missing, ends there with a RuntimeError or
  an AssertionError)."""
  import traceback  # pylint: disable=g-import-not-at-top
  frames = traceback.extract_tb(err.__traceback__)
  return bool(frames) and os.path.basename(frames[-1].filename) == "xla_bridge.py"


def _fail(name: str, message: str) -> None:
  first = " ".join(str(message).split())        # one line, whatever the message held
  print(f"ringflash {name}: {first}", file=sys.stderr, flush=True)
  sys.exit(2)


def run(argv: list[str] | None = None) -> None:
  """Entry point of the console script."""
  try:
    _run(list(sys.argv if argv is None else argv))
  except BrokenPipeError:
    # The reader of stdout went away (`ringflash train --help | head`): nothing more can be
    # said, and Python's own flush at exit would fail again, so stdout goes to /dev/null.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)


def _run(argv: list[str]) -> None:
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    print(_usage())
    sys.exit(0 if len(argv) >= 2 else 2)
  name = argv[1]
  if name not in SUBCOMMANDS:
    print(f"ringflash: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
    sys.exit(2)
  import logging  # pylint: disable=g-import-not-at-top

  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top

  # absl shows INFO records; JAX's backend probing ("Unable to initialize backend ...") is
  # not news to a user of these commands.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  module = importlib.import_module(SUBCOMMANDS[name][0])
  before = set(flags.FLAGS)
  module.define_flags()
  global _command_flags
  _command_flags = tuple(sorted(set(flags.FLAGS) - before))
  own = argv[2:argv.index("--")] if "--" in argv else argv[2:]   # after "--": a job's
  if any(a in ("-h", "--help") for a in own):
    # Every flag the subcommand defined (in whichever module: train's are in
    # launch/train_flags.py, finite floats in this one), and absl's that it reads.
    names = list(_command_flags) + list(getattr(module, "ABSL_FLAGS", ()))
    print(f"usage: ringflash {name} [--flags]   ({SUBCOMMANDS[name][1]})\n")
    if module.__doc__:
      print(module.__doc__.strip() + "\n")
    print("flags:\n" + "\n".join(_flag_help(flags.FLAGS[n]) for n in names))
    sys.exit(0)

  def parse(args):
    try:
      rest = flags.FLAGS(args)
    except (flags.Error, ValueError) as err:  # `--noflag=value` is absl's plain ValueError
      _fail(name, err)
    if len(rest) > 1 and not getattr(module, "TAKES_ARGUMENTS", False):
      _fail(name, f"takes flags only, got the argument(s) {' '.join(rest[1:])}")
    return rest

  def main(args):
    try:
      return module.main(args)
    except UsageError as err:
      _fail(name, err)
    except MemoryError as err:
      # Valid sizes whose host arrays this machine cannot hold (numpy's allocation error).
      print(f"ringflash {name}: out of host memory: {' '.join(str(err).split())}",
            file=sys.stderr, flush=True)
      sys.exit(1)
    except Exception as err:  # pylint: disable=broad-except
      if _starting_jax(err) and os.environ.get("JAX_PLATFORMS"):
        _fail(name, f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']}: no JAX backend of it "
                    f"starts here: {str(err) or type(err).__name__} (unset it, or name a "
                    f"platform this machine has)")
      # Flags that are valid but ask for more memory than the devices have: the runtime's
      # message in one line, without the traceback through JAX.
      jax = sys.modules.get("jax")             # only JAX's runtime raises it
      # (an allocation at dispatch comes as INTERNAL: "... Out of memory allocating N bytes")
      if (jax is not None and isinstance(err, jax.errors.JaxRuntimeError)
          and ("RESOURCE_EXHAUSTED" in str(err) or "Out of memory allocating" in str(err))):
        first = " ".join(str(err).split())
        print(f"ringflash {name}: out of memory: {first}", file=sys.stderr, flush=True)
        sys.exit(1)
      raise

  app.run(main, argv=[f"ringflash {name}"] + argv[2:], flags_parser=parse)
