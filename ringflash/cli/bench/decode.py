"""`ringflash bench --mode=decode`: per-token decode attention over a sequence-sharded cache.

For each cache length S in --cache_lens and each K in --kv_heads: a cache [B, S, K, H] of
bfloat16 sharded over all of the job's devices (the "sp" axis, S / P slots each, every slot
filled: cache_lengths = S) and --new_tokens query tokens [B, t, N, H], attended four ways, in
one process, taking turns call by call (harness.time_in_turns):

  reduce     ringflash.decode_attention: each device runs the kernel on its own slots, one
             max and one sum reduction combine the results; the cache does not move.
  cache      the same through ringflash.KVCache.attention: K/V were guarded when written, so
             no pass over the cache precedes the kernel.
  allgather  decode_attention(strategy="allgather"): every device gathers the whole cache,
             then attends it.
  ring       decode_attention(strategy="ring"): the shards travel P - 1 hops around the ring,
             each hop's kernel overlapping the next transfer, merged by their LSE.

Per row: the median milliseconds per call (one layer, one decode step), the speed-up of
reduce over allgather and ring (median of the rounds' ratios), and per-device memory from
the compiled programs (memory_analysis: arguments + outputs + temporaries - aliased; the
temporaries alone show what each strategy adds to the cache it reads). "auto" picks the
backend (pallas_gpu on Hopper: its 128-row query tiles are padded).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ringflash
from ringflash.cli import UsageError
from ringflash.cli.bench import harness

IMPLS = ("reduce", "cache", "allgather", "ring")


def _memory(compiled) -> tuple[int, int]:
  """(bytes per device, temporary bytes per device) of a compiled program."""
  mem = compiled.memory_analysis()
  if mem is None:
    return -1, -1
  need = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          - mem.alias_size_in_bytes)
  return int(need), int(mem.temp_size_in_bytes)


def run(f) -> list[dict]:
  """Runs the mode; prints a line per row and returns the rows.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes).

  Raises:
    UsageError: a cache length that does not divide over the devices.
  """
  devs = jax.devices()
  p = len(devs)
  mesh = Mesh(np.array(devs), ("sp",))
  b, t, n, h = f.batch, f.new_tokens, f.heads, f.head_dim
  lens = [int(s) for s in f.cache_lens]
  bad = [s for s in lens if s % p or s < t]
  if bad:
    raise UsageError(f"--cache_lens entries must be divisible by the {p} devices and at "
                     f"least --new_tokens={t}, got {bad[0]}")
  seq = NamedSharding(mesh, P(None, "sp", None, None))
  rep = NamedSharding(mesh, P())
  rows = []
  for s in lens:
    for kh in map(int, f.kv_heads):
      def make(s=s, kh=kh):
        kq, kk, kv = jax.random.split(jax.random.key(0), 3)
        return (jax.random.normal(kq, (b, t, n, h), jnp.bfloat16),
                jax.random.normal(kk, (b, s, kh, h), jnp.bfloat16),
                jax.random.normal(kv, (b, s, kh, h), jnp.bfloat16))

      q, k, v = jax.jit(make, out_shardings=(rep, seq, seq))()
      lengths = jax.device_put(jnp.full((b,), s, jnp.int32), rep)
      cache = ringflash.KVCache.create(b, s, kh, h, mesh=mesh, dtype=jnp.bfloat16)
      cache = jax.jit(lambda c, k, v: c.prefill(k, v), donate_argnums=0)(cache, k, v)

      def strategy(name):
        return jax.jit(lambda q, k, v, n_: ringflash.decode_attention(
            q, k, v, cache_lengths=n_, mesh=mesh, strategy=name))

      calls = {"reduce": (strategy("reduce"), (q, k, v, lengths)),
               "cache": (jax.jit(lambda c, q: c.attention(q)), (cache, q)),
               "allgather": (strategy("allgather"), (q, k, v, lengths)),
               "ring": (strategy("ring"), (q, k, v, lengths))}
      row = {"P": p, "S": s, "S_local": s // p, "B": b, "t": t, "N": n, "K": kh, "H": h}
      compiled = {}
      for name, (fn, args) in calls.items():
        compiled[name] = harness.compile_ahead(fn, *args)
        row[f"{name}_bytes"], row[f"{name}_temp_bytes"] = _memory(compiled[name])
      times, _ = harness.time_in_turns(
          {name: (compiled[name], args) for name, (_, args) in calls.items()},
          warmup=f.warmup, iters=f.iters, peers=())
      for name in IMPLS:
        row[f"{name}_ms"] = 1e3 * float(np.median(times[name]))
      for other in ("allgather", "ring"):
        row[f"speedup_vs_{other}"] = harness.ratio_by_round(times["reduce"], times[other])
      rows.append(row)
      mem = " ".join(f"{name} {row[f'{name}_bytes'] / 2**20:.1f}" for name in IMPLS)
      print(f"S={s} (P={p}, {s // p} per device) B={b} t={t} N={n} K={kh} H={h}: ms/token "
            + " ".join(f"{name} {row[f'{name}_ms']:.3f}" for name in IMPLS)
            + f"; reduce x{row['speedup_vs_allgather']:.2f} vs allgather, "
            f"x{row['speedup_vs_ring']:.2f} vs ring; MiB/device {mem}", flush=True)
      del q, k, v, cache, calls, compiled
  return rows
