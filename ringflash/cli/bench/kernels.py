"""`ringflash bench --mode=kernels`: TFLOP/s of each implementation on one device.

For each row (T = S in --seq_lens with K = N, in --gqa_seq_lens with the other --kv_heads;
each --causal setting) the implementations in --impls take turns (harness.time_in_turns):
forward, then forward+backward. A row records each one's TFLOP/s and the ratio of ringflash
to cuDNN, the median of the rounds' ratios. The xla backend is left out above --xla_max_len.
"""

from __future__ import annotations

import statistics

import jax
import numpy as np
from jax.sharding import Mesh

from ringflash.cli.bench import harness


def run(f) -> list[dict]:
  """Runs the mode; prints a line per row and returns the rows.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes).

  Raises:
    harness.ImplementationError: ringflash's own implementation failed.
  """
  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  rows = []
  groups = [(kh, [int(x) for x in (f.seq_lens if kh == f.heads else f.gqa_seq_lens)])
            for kh in map(int, f.kv_heads)]
  for kh, lens in groups:
    for t in lens:
      for causal in [c.lower() == "true" for c in f.causal]:
        q, k, v, do = harness.inputs(f.batch, t, f.heads, kh, f.head_dim)
        flops = harness.flops(f.batch, f.heads, t, t, f.head_dim, causal)
        row = {"T": t, "N": f.heads, "K": kh, "H": f.head_dim, "causal": causal}
        impls = [i for i in f.impls if not (i == "xla" and t > f.xla_max_len)]
        fns = {impl: harness.attention_fns(impl, causal, mesh) for impl in impls}
        passes = [("fwd", 0, (q, k, v), 1.0)]
        if f.backward:
          passes.append(("fwdbwd", 1, (q, k, v, do), 3.5))
        for what, which, args, factor in passes:
          times, errors = harness.time_in_turns(
              {i: (fns[i][which], args) for i in impls if f"{i}_error" not in row},
              warmup=f.warmup, iters=f.iters)
          for impl, err in errors.items():
            row[f"{impl}_error"] = err
          for impl, ts in times.items():
            row[f"{impl}_{what}"] = factor * flops / statistics.median(ts) / 1e12
          if "ringflash" in times and "cudnn" in times:
            row[f"{what}_ratio"] = harness.ratio_by_round(times["ringflash"], times["cudnn"])
        rows.append(row)
        print_row(row)
  return rows


def print_row(row: dict) -> None:
  """One table line of a row, then a line per implementation left out with its error."""
  def get(key):
    x = row.get(key)
    return f"{x:7.1f}" if isinstance(x, float) else "      -"

  def ratio(what):
    x = row.get(f"{what}_ratio")
    return f"{x:5.2f}x" if isinstance(x, float) else "    -"

  print(f"T={row['T']:>6} N={row['N']:>2} K={row['K']:>2} causal={str(row['causal']):<5} | "
        f"fwd ours {get('ringflash_fwd')} cudnn {get('cudnn_fwd')} xla {get('xla_fwd')} "
        f"ratio {ratio('fwd')} | fwd+bwd ours "
        f"{get('ringflash_fwdbwd')} cudnn {get('cudnn_fwdbwd')} xla {get('xla_fwdbwd')} "
        f"ratio {ratio('fwdbwd')}", flush=True)
  for key, val in row.items():
    if key.endswith("_error"):
      print(f"    {key}: {val}", flush=True)
