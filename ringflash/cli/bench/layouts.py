"""`ringflash bench --mode=layouts`: the causal ring's balance per layout, on one device.

For each layout (contiguous, zigzag, striped) every device of a ring of P runs its P steps
(introspect.device_steps: kernel and merge as the ring runs them) with its own query
positions and, at step s, the positions of the block it holds then
(introspect.held_source); the simulated devices take turns call by call
(harness.time_in_turns). The ring runs as long as its slowest device; max/mean shows the
balance. P = 4, zigzag, T_local = 256 (chunks of 128): device 1
holds positions 128..255 and 768..895; at step 1 it holds device 0's block, 0..127 and
896..1023.

All layouts run the same tiles: those of the causal zigzag ring spec, which divide the
zigzag chunk T_local / 2 and so every layout's rows.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

from ringflash import introspect
from ringflash import layouts
from ringflash.cli.bench import harness


def layout_spec(q, k, v, *, ring_size: int, device, backend: str = "auto"):
  """The one RingSpec of the mode: causal, zigzag (its tiles divide the chunk T_local / 2).

  Args:
    q, k, v: local shards (arrays or jax.ShapeDtypeStruct), [B, T_local, N, H] and
      [B, T_local, K, H].
    ring_size: P.
    device: the device that runs (its platform and kind choose backend and tiles).
    backend: as ring_attention's.
  """
  return introspect.ring_spec(q, k, v, ring_size=ring_size, device=device, is_causal=True,
                              layout="zigzag", backend=backend)


def run(f) -> list[dict]:
  """Runs the mode; prints a line per row and returns the rows.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes).
  """
  dev = jax.devices()[0]
  n, h, b = f.heads, f.head_dim, f.batch
  rows = []
  for tl in map(int, f.seq_lens):
    for p in map(int, f.ring_sizes):
      for kh in map(int, f.kv_heads):
        q, k, v, _ = harness.inputs(b, tl, n, kh, h)
        ring = layout_spec(q, k, v, ring_size=p, device=dev)
        device_steps = introspect.device_steps(ring)
        for layout in layouts.LAYOUTS:
          pos = introspect.layout_positions(layout, p, tl * p)           # [P, tl]
          calls = {}
          for i in range(p):
            held = jnp.asarray(pos[[introspect.held_source(ring, tl, tl, i, s)
                                    for s in range(p)]])                  # [P steps, tl]
            calls[i] = (device_steps, (q, k, v, jnp.asarray(pos[i]), held))
          rounds, _ = harness.time_in_turns(calls, warmup=f.warmup, iters=f.iters, peers=())
          times = [statistics.median(rounds[i]) for i in range(p)]
          ring_ms, mean_ms = 1e3 * max(times), 1e3 * sum(times) / p
          row = {"layout": layout, "T_local": tl, "P": p, "K": kh, "ring_ms": ring_ms,
                 "mean_ms": mean_ms, "max_over_mean": ring_ms / mean_ms,
                 "per_device_ms": [1e3 * t for t in times], "backend": ring.backend}
          rows.append(row)
          print(f"T_local={tl:>6} P={p} K={kh:>2} {layout:<10}: ring (slowest device) "
                f"{ring_ms:9.2f} ms, mean {mean_ms:9.2f} ms, max/mean "
                f"{row['max_over_mean']:.2f}", flush=True)
  return rows
