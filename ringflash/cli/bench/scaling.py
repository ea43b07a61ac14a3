"""`ringflash bench --mode=scaling`: weak scaling of ring_attention over the job's devices.

The per-device length T_local is fixed (--seq_lens) and the ring grows, P = 1, 2, 4, ...;
efficiency is the per-device TFLOP/s at P over that of the ring of one device at the same
T_local, measured in the same run. Causal rows use --layout. For P > 1 the compiled
program (the one that is timed) is read for whether each ring step's K/V permute is in
flight around a kernel (ringflash.cli.hlo). In a multi-process job (one process per GPU)
P is 1 (each process's own device, a local program every process runs at once) and then all
devices.
"""

from __future__ import annotations

import os

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
        base = (None, None)
        for p, devs in ring_sizes():
          mesh = Mesh(np.array(devs), ("sp",))
          t = tl * p
          q, k, v, do = harness.sharded_inputs(mesh, f.batch, t, f.heads, kh, f.head_dim)
          layout = f.layout if causal else "contiguous"
          fwd, fwd_bwd = harness.attention_fns("ringflash", causal, mesh, layout)
          # compiled once, ahead of time: the program that is timed is the one whose HLO is read
          fwd = harness.compile_ahead(fwd, q, k, v, collectives_in_flight=f.collectives_in_flight)
          flops = harness.flops(f.batch, f.heads, t, t, f.head_dim, causal) / p
          tf = flops / harness.time_median(fwd, q, k, v, warmup=f.warmup, iters=f.iters) / 1e12
          tb, texts = None, [fwd.as_text()]
          if f.backward:
            fwd_bwd = harness.compile_ahead(fwd_bwd, q, k, v, do,
                                            collectives_in_flight=f.collectives_in_flight)
            tb = 3.5 * flops / harness.time_median(fwd_bwd, q, k, v, do, warmup=f.warmup,
                                                   iters=f.iters) / 1e12
            texts.append(fwd_bwd.as_text())
          if p == 1:
            base = (tf, tb)
          row = {"P": p, "T_local": tl, "K": kh, "causal": causal, "layout": layout,
                 "fwd_tflops": tf, "fwdbwd_tflops": tb,
                 "fwd_eff": tf / base[0] if base[0] else None,
                 "fwdbwd_eff": tb / base[1] if (tb and base[1]) else None}
          line = (f"P={p} T/P={tl} K={kh} causal={causal}: fwd {tf:.1f} TFLOP/s/dev "
                  f"(eff {harness.figure(row['fwd_eff'], 3)}) fwd+bwd {harness.figure(tb, 1)} "
                  f"(eff {harness.figure(row['fwdbwd_eff'], 3)})")
          if p > 1:
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
