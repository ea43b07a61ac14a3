"""`ringflash bench --mode=virtual`: the ring's per-step cost, on one device.

A device of a ring of P runs P steps, each the kernel on its queries and the K/V block it
holds then, merged into fp32 (o, lse). Here one device runs those P steps alone
(introspect.device_steps: the ring's own step code) over P blocks of T_local keys, block s
at step s, against one kernel call over the same P * T_local keys (a ring of one device:
one step, whose merge into the empty accumulators is free next to the kernel). Non-causal,
so every step has the same work: the difference is the cost of splitting. (Each step takes
its own block: with one block at every step, XLA computed the non-causal kernel once,
outside the loop, and timed one call and P merges.)
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

from ringflash import introspect
from ringflash.cli.bench import harness


def run(f) -> list[dict]:
  """Runs the mode; prints a line per row and returns the rows.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes).
  """
  dev = jax.devices()[0]
  rows = []
  n, h, b = f.heads, f.head_dim, f.batch
  for tl in map(int, f.seq_lens):
    for p in map(int, f.ring_sizes):
      for kh in map(int, f.kv_heads):
        q, k, v, _ = harness.inputs(b, tl, n, kh, h)
        ring = introspect.ring_spec(q, k, v, ring_size=p, device=dev)
        pos = jnp.arange(tl, dtype=jnp.int32)
        # Step s: block s of the P * tl keys stands in for the one received from device
        # i - s, with its positions (non-causal: all valid). P = 4, tl = 256: the held
        # positions are 0..255 at step 0, 256..511 at step 1, ..., 768..1023 at step 3.
        held = pos[None, :] + tl * jnp.arange(p, dtype=jnp.int32)[:, None]     # [P, tl]
        steps = introspect.device_steps(ring)
        kw, vw = (jax.random.normal(jax.random.key(i), (b, tl * p, kh, h), k.dtype)
                  for i in (1, 2))                                        # [B, P * tl]

        @jax.jit
        def ring_steps(q, k, v, steps=steps, held=held):
          o, lse = steps(q, k, v, pos, held)
          return o.astype(q.dtype), lse

        whole = introspect.device_steps(introspect.ring_spec(q, kw, vw, ring_size=1, device=dev))
        pos_w = jnp.arange(tl * p, dtype=jnp.int32)[None, :]                     # [1, P * tl]

        @jax.jit
        def one_call(q, k, v, whole=whole, pos_w=pos_w):
          o, lse = whole(q, k, v, pos, pos_w)
          return o.astype(q.dtype), lse

        times, _ = harness.time_in_turns(
            {"ring_steps": (ring_steps, (q, kw, vw)), "one_call": (one_call, (q, kw, vw))},
            warmup=f.warmup, iters=f.iters, peers=())
        t_ring, t_one = (statistics.median(times[x]) for x in ("ring_steps", "one_call"))
        flops = harness.flops(b, n, tl, tl * p, h, False)
        overhead = statistics.median(   # by round: ring steps over one call in one round
            r / o for r, o in zip(times["ring_steps"], times["one_call"])) - 1.0
        row = {"T_local": tl, "P": p, "K": kh, "ring_ms": t_ring * 1e3, "one_ms": t_one * 1e3,
               "overhead": overhead, "ring_tflops": flops / t_ring / 1e12,
               "one_tflops": flops / t_one / 1e12, "backend": ring.backend}
        rows.append(row)
        print(f"T_local={tl:>6} P={p} K={kh:>2}: {p} ring steps {t_ring * 1e3:8.2f} ms "
              f"({row['ring_tflops']:.1f} TFLOP/s) vs one call {t_one * 1e3:8.2f} ms "
              f"({row['one_tflops']:.1f} TFLOP/s): overhead {100 * row['overhead']:+.1f}%",
              flush=True)
  return rows
