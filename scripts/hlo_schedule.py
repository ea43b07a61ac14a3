"""Collectives and kernels of compiled HLO modules, in scheduled order, per computation.

  python3 scripts/hlo_schedule.py HLO_TEXT_FILE...

Reads the files `ringflash bench --mode=scaling --hlo_dir=D` writes (or any compiled module's
text). For every computation that holds a collective, a kernel or a loop, it prints one line
of `name:op[custom-call target]` events, then each ring permute and whether its transfer spans
a kernel (ringflash.cli.hlo.permute_overlap). Run 22 of docs/GPU_NOTES.md used it to see which of
a step's transfers XLA's GPU scheduler left synchronous.
"""

from __future__ import annotations

import re
import sys

from ringflash.cli import hlo


def schedule(text: str) -> list[str]:
  """Lines: per computation, its events in order; then the ring permutes."""
  comps, entry = hlo.computations(text)
  out = [f"entry {entry}, {len(text)} characters"]
  for name, lines in comps.items():
    events = []
    for line in lines:
      # the op is the first lowercase word before "(" after " = " (a type has none:
      # "bf16[..]{..}", "((bf16[..]{..}), ..)"; TPU tiles "T(8,128)" are upper case)
      op = re.search(r"\s([a-z][a-z0-9\-]*)\(", line.split(" = ", 1)[-1])
      op = op.group(1) if op else "?"
      if not (op.startswith(("collective-", "all-", "send", "recv")) or op == "while"
              or hlo.runs_kernel(comps, line)):
        continue
      target = re.search(r'custom_call_target="([^"]+)"', line)
      events.append(f"{hlo.instruction_name(line) or '?'}:{op}"
                    + (f"[{target.group(1)}]" if target else ""))
    if events:
      out.append(f"  {name} ({len(lines)} instructions): " + " | ".join(events))
  for p in hlo.permute_overlap(text):
    out.append(f"    {p.body}: {p.start} {p.shape or '?'} "
               f"{'spans a kernel' if p.encloses_kernel else 'spans no kernel'}")
  return out


def main(paths: list[str]) -> int:
  if not paths:
    print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
    return 2
  for path in paths:
    with open(path) as f:
      print(f"## {path}: " + "\n".join(schedule(f.read())))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
