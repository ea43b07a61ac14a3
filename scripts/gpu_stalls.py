"""Where the warps of a Mosaic GPU attention kernel stall, from Nsight Compute's source page.

Reads the per-instruction CSV of one or more kernels and, for each kernel, splits its SASS
by address order into three roles of the warp-specialized kernel: "compute" (the consumer
warpgroups, before the memory warpgroup's USETMAXREG.DEALLOC), "memory" (the TMA producer,
from that DEALLOC through the last EXIT) and "retry" (the out-of-line barrier-wait loops
after the last EXIT). Per role it prints the share of all samples, the top stall reasons
and the share spent in wgmma waits (WARPGROUP.DEPBAR), mbarrier waits (the "@!Pn BRA" of a
try-wait, a few instructions after the SYNCS.PHASECHK that set Pn), spill (LDL/STL), fences
(MEMBAR/FENCE) and named barriers (BAR.SYNC/ARV/RED); then the compute instructions with
the most samples. Run from the repository root on a Hopper GPU:

  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --profile-from-start off \\
      -k regex:mosaic --launch-count 2 --section SourceCounters --section WarpStateStats \\
      -o REPORT python3 scripts/gpu_profile.py 16384
  ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
  python3 scripts/gpu_stalls.py sass.csv [--top N]
"""

import argparse
import csv
import re

ROLES = ("compute", "memory", "retry")
CATEGORIES = ("wgmma waits", "mbarrier waits", "spill", "fences", "named barriers")
_SAMPLES = ("Warp Stall Sampling (All Samples)", "# Samples")
# How many instructions before its BRA a try-wait's SYNCS.PHASECHK may be: ptxas moves
# up to 4 unrelated instructions in between in the backward (3 would miss 1.4% of its
# compute samples).
_PHASECHK_WINDOW = 5


def _number(text: str) -> int:
  """A counter's value; ncu may print thousands separators, and "-" where none applies."""
  text = text.strip().replace(",", "")
  return int(float(text)) if text and text != "-" else 0


def _opcode(sass: str) -> str:
  """The opcode with its modifiers, without the predicate ("@!P2  BRA 0x..." -> "BRA")."""
  words = sass.split()
  if words and words[0].startswith("@"):
    words = words[1:]
  return words[0] if words else ""


def parse(path) -> list:
  """The kernels in an `ncu --page source --csv` file, each a dict with its name and rows.

  Each row is a dict: address (int), sass (the instruction text), samples, and stalls
  (reason without the "stall_" prefix -> samples, "(Not Issued)" columns left out).
  """
  kernels = []
  header = None
  with open(path, newline="") as f:
    for row in csv.reader(f):
      if not row or not any(cell.strip() for cell in row):
        continue
      if row[0] == "Kernel Name":
        kernels.append({"name": row[1] if len(row) > 1 else "?", "rows": []})
        header = None
      elif row[0] == "Address":
        header = row
      elif header is not None and kernels:
        cells = dict(zip(header, row))
        samples = next((cells[c] for c in _SAMPLES if c in cells), "0")
        stalls = {name[len("stall_"):]: _number(value) for name, value in cells.items()
                  if name.startswith("stall_") and "(Not Issued)" not in name}
        kernels[-1]["rows"].append({"address": int(cells["Address"], 16),
                                    "sass": " ".join(cells["Source"].split()),
                                    "samples": _number(samples), "stalls": stalls})
  return kernels


def _roles(rows: list) -> list:
  """Each row's role, by address order: compute, then memory from DEALLOC, then retry."""
  exits = [i for i, r in enumerate(rows) if _opcode(r["sass"]) == "EXIT"]
  last_exit = exits[-1] if exits else len(rows) - 1
  dealloc = next((i for i, r in enumerate(rows)
                  if _opcode(r["sass"]).startswith("USETMAXREG.DEALLOC")), last_exit + 1)
  return ["compute" if i < dealloc else "memory" if i <= last_exit else "retry"
          for i in range(len(rows))]


def _phasechk_before(rows: list, i: int):
  """For a BRA closing an mbarrier try-wait ("@!P1 BRA" after "SYNCS.PHASECHK... P1, ..."),
  the PHASECHK row it tests; None for other rows."""
  branch = re.match(r"@!(U?P\d)\s+BRA\b", rows[i]["sass"])
  if not branch:
    return None
  for j in range(i - 1, max(i - 1 - _PHASECHK_WINDOW, -1), -1):
    check = re.match(r"(?:@\S+\s+)?SYNCS\.PHASECHK\S*\s+(U?P\d)\b", rows[j]["sass"])
    if check and check.group(1) == branch.group(1):
      return rows[j]
  return None


def _categories(rows: list, i: int) -> list:
  """The categories of CATEGORIES that row i falls in."""
  op = _opcode(rows[i]["sass"])
  found = []
  if "WARPGROUP.DEPBAR" in op:
    found.append("wgmma waits")
  if _phasechk_before(rows, i) is not None:
    found.append("mbarrier waits")
  if op.startswith(("LDL", "STL")):
    found.append("spill")
  if op.startswith(("MEMBAR", "FENCE")):
    found.append("fences")
  if op.startswith(("BAR.SYNC", "BAR.ARV", "BAR.RED")):
    found.append("named barriers")
  return found


def _share(part: float, whole: float) -> float:
  return part / whole if whole else 0.0


def analyse(kernel: dict, top: int = 8) -> dict:
  """Shares (fractions) of samples per role, stall reason and category, and the top rows.

  Returns {"name", "samples", "roles": {role: {"samples", "share", "stalls": [(reason,
  share of the role's samples)] (largest 6), "categories": {category: share}}}, "top":
  [{"share" (of compute samples), "address", "sass", "stalls": [(reason, share of the
  row's samples)] (largest 2), "phasechk" (text or None)}]}.
  """
  rows = kernel["rows"]
  roles = _roles(rows)
  total = sum(r["samples"] for r in rows)
  result = {"name": kernel["name"], "samples": total, "roles": {}, "top": []}
  for role in ROLES:
    picked = [i for i, r in enumerate(roles) if r == role]
    samples = sum(rows[i]["samples"] for i in picked)
    stalls = {}
    categories = dict.fromkeys(CATEGORIES, 0)
    for i in picked:
      for reason, n in rows[i]["stalls"].items():
        stalls[reason] = stalls.get(reason, 0) + n
      for category in _categories(rows, i):
        categories[category] += rows[i]["samples"]
    largest = sorted(stalls.items(), key=lambda kv: -kv[1])[:6]
    result["roles"][role] = {
        "samples": samples, "share": _share(samples, total),
        "stalls": [(reason, _share(n, samples)) for reason, n in largest if n],
        "categories": {c: _share(n, samples) for c, n in categories.items()}}
  compute = [i for i, r in enumerate(roles) if r == "compute"]
  compute_samples = result["roles"]["compute"]["samples"]
  for i in sorted(compute, key=lambda i: -rows[i]["samples"])[:top]:
    row = rows[i]
    largest = sorted(row["stalls"].items(), key=lambda kv: -kv[1])[:2]
    phasechk = _phasechk_before(rows, i)
    result["top"].append({
        "share": _share(row["samples"], compute_samples), "address": row["address"],
        "sass": row["sass"],
        "stalls": [(reason, _share(n, row["samples"])) for reason, n in largest if n],
        "phasechk": phasechk["sass"] if phasechk else None})
  return result


def _percent(share: float) -> str:
  return f"{100 * share:.1f}%"


def report(path, top: int = 8) -> None:
  """Prints analyse()'s findings for every kernel in the CSV at path."""
  for k, kernel in enumerate(parse(path)):
    a = analyse(kernel, top)
    print(f"kernel {k}: {a['name']}, {len(kernel['rows'])} instructions, "
          f"{a['samples']} samples")
    for role in ROLES:
      r = a["roles"][role]
      print(f"  {role:<8} {_percent(r['share']):>6} of samples")
      print("    stalls:    " + "  ".join(f"{reason} {_percent(s)}" for reason, s in r["stalls"]))
      print("    waits in:  " + "  ".join(f"{c} {_percent(s)}"
                                          for c, s in r["categories"].items()))
    print(f"  top {top} compute instructions (share of compute samples):")
    for t in a["top"]:
      stalls = ", ".join(f"{reason} {_percent(s)}" for reason, s in t["stalls"])
      print(f"    {_percent(t['share']):>6}  {t['address'] & 0xfffff:05x}  "
            f"{t['sass'][:60]:<60}  {stalls}")
      if t["phasechk"]:
        print(f"{'':<22}after {t['phasechk'][:60]}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("csv", help="output of ncu --page source --csv --print-source sass")
  parser.add_argument("--top", type=int, default=8, help="compute instructions to list")
  args = parser.parse_args(argv)
  report(args.csv, args.top)


if __name__ == "__main__":
  main()
