"""Reading compiled HLO text in tests."""

from __future__ import annotations

import re


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
  """({computation name: its instruction lines, in scheduled order}, the ENTRY's name)."""
  comps, name, entry = {}, None, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      name = head.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif line.startswith("}"):
      name = None
    elif name is not None and line.strip():
      comps[name].append(line)
  return comps, entry
