"""`ringflash bench --mode=longest`: the longest sequence whose training step fits the job.

Causal forward+backward of ring_attention over all of the job's devices, at per-device
lengths --seq_lens (ascending; K = the last --kv_heads, layout --layout). Each length is
compiled ahead of time and its per-device memory (memory_analysis: arguments + outputs +
temporaries - aliased) compared with the device's limit; the lengths that fit with
T <= --run_max_len also run once, timed. The first length that does not fit ends the mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ringflash.cli.bench import harness


def run(f) -> list[dict]:
  """Runs the mode; prints a line per row and returns the rows.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes).
  """
  devs = jax.devices()
  p, n, h, b, kh = len(devs), f.heads, f.head_dim, f.batch, int(f.kv_heads[-1])
  mesh = Mesh(np.array(devs), ("sp",))
  sh = NamedSharding(mesh, P(None, "sp", None, None))
  stats = jax.local_devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  rows = []
  for tl in sorted(map(int, f.seq_lens)):
    t = tl * p
    shapes = [jax.ShapeDtypeStruct((b, t, heads, h), jnp.bfloat16, sharding=sh)
              for heads in (n, kh, kh, n)]
    _, fwd_bwd = harness.attention_fns("ringflash", True, mesh, f.layout)
    compiled = harness.compile_ahead(fwd_bwd, *shapes,
                                     collectives_in_flight=f.collectives_in_flight)
    mem = compiled.memory_analysis()
    need = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
    row = {"P": p, "T": t, "T_local": tl, "N": n, "K": kh, "layout": f.layout,
           "bytes_per_device": need, "bytes_limit": limit,
           "fits": limit is None or need <= limit, "seconds": None}
    if row["fits"] and t <= f.run_max_len:
      q, k, v, do = harness.sharded_inputs(mesh, b, t, n, kh, h)
      row["seconds"] = harness.seconds(compiled, q, k, v, do)
      row["fwdbwd_tflops"] = (3.5 * harness.flops(b, n, t, t, h, True) / p / row["seconds"]
                              / 1e12)
      del q, k, v, do
    rows.append(row)
    limit_text = f"{limit / 2**30:.1f}" if limit else "?"
    ran = (f"ran in {row['seconds']:.2f} s ({row['fwdbwd_tflops']:.1f} TFLOP/s/dev)"
           if row["seconds"] is not None else "compiled only")
    print(f"T={t} ({tl} per device, P={p}, N={n} K={kh} causal {f.layout}): "
          f"{need / 2**30:.2f} of {limit_text} GiB per device, "
          f"{'fits' if row['fits'] else 'does not fit'}; {ran}", flush=True)
    if not row["fits"]:
      break
  return rows
