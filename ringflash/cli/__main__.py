"""`python -m ringflash.cli <subcommand>`: the same as the `ringflash` command."""

from ringflash.cli import run

run()
