"""The `ringflash` command: `ringflash <subcommand> [--flags]`.

Each subcommand is a module with `define_flags()` (its absl flags) and `main(argv)`. Only
the chosen module's flags are defined, so subcommands may reuse flag names, and importing
a module for its functions (as the tests do) defines no flag.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help). Modules are imported only when chosen.
SUBCOMMANDS = {
    "demo": ("ringflash.demo", "ring attention on a simulated 8-device mesh, checked"),
    "plan": ("ringflash.plan", "per-device memory of a TPU slice, compiled without a TPU"),
    "bench": ("ringflash.bench", "per-device kernel throughput against cuDNN"),
    "check": ("ringflash.launch.check", "ring attention over all global devices, verified"),
    "launch": ("ringflash.launch.cli", "start a job on local processes or a TPU slice"),
    "train": ("ringflash.launch.train", "long-context language model training"),
}


def _usage() -> str:
  lines = ["usage: ringflash <subcommand> [--flags]   (ringflash <subcommand> --help)", ""]
  lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
  return "\n".join(lines)


def run(argv: list[str] | None = None) -> None:
  """Entry point of the console script."""
  argv = list(sys.argv if argv is None else argv)
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
  module.define_flags()
  own = argv[2:argv.index("--")] if "--" in argv else argv[2:]   # after "--": a job's
  if any(a in ("-h", "--help") for a in own):
    print(f"usage: ringflash {name} [--flags]   ({SUBCOMMANDS[name][1]})\n")
    print(flags.FLAGS.module_help(module))
    sys.exit(0)
  app.run(module.main, argv=[f"ringflash {name}"] + argv[2:])


if __name__ == "__main__":
  run()
