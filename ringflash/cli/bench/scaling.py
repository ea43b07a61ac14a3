"""`ringflash bench --mode=scaling`: weak scaling of ring_attention over the job's devices.

The per-device length T_local is fixed (--seq_lens) and the ring grows, P = 1, 2, 4, ...;
efficiency is the per-device TFLOP/s at P over that of the ring of one device at the same
T_local: the programs of every P take turns call by call (harness.time_in_turns), and the
efficiency is the median over rounds of the two rates in one round. Causal rows use
--layout. For P > 1 the compiled program (the one that is timed) is read for whether each
ring step's K/V permute is in flight around a kernel (ringflash.cli.hlo). In a
multi-process job (one process per GPU) P is 1 (each process's own device, a local program
every process runs at once) and then all devices.
"""

from __future__ import annotations

import os
import statistics

import jax
import numpy as np
from jax.sharding import Mesh

from ringflash.cli import hlo
from ringflash.cli.bench import harness


def ring_sizes() -> list[tuple[int, list]]:
  """(P, its devices) of the mode. One process: 1, 2, 4, ... of its devices. Several
  processes: each process's own first device, then all global devices."""
  devs = jax.devices()
  if jax.process_count() > 1:
    return [(1, jax.local_devices()[:1]), (len(devs), devs)]
  return [(p, devs[:p]) for p in (1, 2, 4, 8, 16, 32, 64, 128, 256) if p <= len(devs)]


def run(f) -> list[dict]:
  """Runs the mode; prints a line per row and returns the rows.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes).
  """
  rows = []
  for tl in map(int, f.seq_lens):
    for kh in map(int, f.kv_heads):
      for causal in [c.lower() == "true" for c in f.causal]:
        rows += _ring_sizes_in_turns(f, tl, kh, causal)
  return rows


def _ring_sizes_in_turns(f, tl: int, kh: int, causal: bool) -> list[dict]:
  """The rows of one (T_local, K, causal): every ring size's program compiled first, then
  timed in turns (harness.time_in_turns), so that each efficiency is the median over rounds
  of P's per-device rate over P = 1's in the same round."""
  layout = f.layout if causal else "contiguous"
  progs = {}
  for p, devs in ring_sizes():
    mesh = Mesh(np.array(devs), ("sp",))
    q, k, v, do = harness.sharded_inputs(mesh, f.batch, tl * p, f.heads, kh, f.head_dim)
    fwd, fwd_bwd = harness.attention_fns("ringflash", causal, mesh, layout)
    # compiled once, ahead of time: the program that is timed is the one whose HLO is read
    fwd = harness.compile_ahead(fwd, q, k, v, collectives_in_flight=f.collectives_in_flight)
    if f.backward:
      fwd_bwd = harness.compile_ahead(fwd_bwd, q, k, v, do,
                                      collectives_in_flight=f.collectives_in_flight)
    progs[p] = (fwd, fwd_bwd if f.backward else None, (q, k, v), do)
  times = {}
  for what in ("fwd", "fwdbwd")[:2 if f.backward else 1]:
    calls = {p: ((fwd, args) if what == "fwd" else (fwd_bwd, args + (do,)))
             for p, (fwd, fwd_bwd, args, do) in progs.items()}
    times[what], _ = harness.time_in_turns(calls, warmup=f.warmup, iters=f.iters, peers=())
  one = next(iter(progs))                       # P = 1 (each process's own device)
  rows = []
  for p, (fwd, fwd_bwd, _, _) in progs.items():
    t = tl * p
    flops = harness.flops(f.batch, f.heads, t, t, f.head_dim, causal) / p     # per device
    flops_one = harness.flops(f.batch, f.heads, tl * one, tl * one, f.head_dim, causal) / one
    rate = {what: factor * flops / statistics.median(ts[p]) / 1e12
            for (what, ts), factor in zip(times.items(), (1.0, 3.5))}
    eff = {what: flops / flops_one * harness.ratio_by_round(ts[p], ts[one])
           for what, ts in times.items()}
    tf, tb = rate["fwd"], rate.get("fwdbwd")
    row = {"P": p, "T_local": tl, "K": kh, "causal": causal, "layout": layout,
           "fwd_tflops": tf, "fwdbwd_tflops": tb, "fwd_eff": eff["fwd"],
           "fwdbwd_eff": eff.get("fwdbwd")}
    line = (f"P={p} T/P={tl} K={kh} causal={causal}: fwd {tf:.1f} TFLOP/s/dev "
            f"(eff {harness.figure(row['fwd_eff'], 3)}) fwd+bwd {harness.figure(tb, 1)} "
            f"(eff {harness.figure(row['fwdbwd_eff'], 3)})")
    if p > 1:
      texts = [fwd.as_text()] + ([fwd_bwd.as_text()] if fwd_bwd is not None else [])
      found = [o for text in texts for o in hlo.permute_overlap(text)]
      # every permute of the programs; those spanning a kernel only where the backend
      # runs kernels (custom calls) for one to span: None for the xla backend's fusions
      row["permutes"] = sum(hlo.is_permute(line) for text in texts
                            for line in text.splitlines())
      row["permutes_spanning_kernel"] = (sum(o.encloses_kernel for o in found)
                                         if found else None)
      line += f"; {hlo.overlap_summary(found)}"
      if f.hlo_dir:
        write_hlo(f.hlo_dir, texts, f"P{p}_T{tl}_K{kh}_{'causal' if causal else 'full'}")
    rows.append(row)
    print(line, flush=True)
  return rows


def write_hlo(folder: str, texts: list[str], tag: str) -> None:
  """Writes folder/<tag>_fwd.txt (and _fwdbwd.txt) on process 0 of the job."""
  if jax.process_index() != 0:
    return
  os.makedirs(folder, exist_ok=True)
  for text, what in zip(texts, ("fwd", "fwdbwd")):
    with open(os.path.join(folder, f"{tag}_{what}.txt"), "w") as out:
      out.write(text)
