"""`ringflash bench --mode=features`: what the vocabulary of real models costs, on one device.

For each T = S in --seq_lens and each --causal setting, N = --heads, K = the first
--kv_heads, bf16, one row per variant (--variants), the implementations of the row taking
turns (harness.time_in_turns), forward and forward+backward:
  sinks     ringflash with per-head sinks beside ringflash plain (H = --head_dim, 128 by
            default): the feature's cost;
  softcap   ringflash with logits_soft_cap = 30 beside ringflash plain: the same;
  mla       H = 192, Hv = 128 (DeepSeek's MLA): ringflash beside cuDNN on V padded to 192
            (jax.nn takes V of K's head dim only; the padding is the user's alternative) and
            the xla backend up to --xla_max_len;
  h80, h96  head dim 80 or 96: ringflash beside cuDNN at the same head dim;
  plain     H = --head_dim: ringflash beside cuDNN (the kernels mode's row).
TFLOP/s count the FlashAttention convention with the real head dims: 2 B N T S (H + Hv),
halved when causal, 3.5x for forward+backward. Ratios are medians of the rounds' ratios:
`<impl>_<phase>_ratio` is ringflash's throughput over that implementation's. Without a GPU
there is no cuDNN: jax.nn's own implementation takes its place, named jax_nn (and
jax_nn_padded), not cudnn.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import ringflash
from ringflash.cli.bench import harness

VARIANTS = ("plain", "sinks", "softcap", "mla", "h80", "h96")
# The variants of fixed head dims (H, Hv); the others run --head_dim.
FIXED_HEAD_DIMS = {"mla": (192, 128), "h80": (80, 80), "h96": (96, 96)}
OWN_HEAD_DIM = tuple(v for v in VARIANTS if v not in FIXED_HEAD_DIMS)


def _peer() -> tuple[str, str | None]:
  """(the name of jax.nn's column, its implementation): cuDNN on a GPU, else jax.nn's own."""
  return ("cudnn", "cudnn") if jax.devices()[0].platform == "gpu" else ("jax_nn", None)


def _cudnn(causal, impl, pad_to=None):

  def f(q, k, v):
    hv = v.shape[-1]
    if pad_to is not None:
      v = jnp.pad(v, [(0, 0)] * 3 + [(0, pad_to - hv)])
    out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
    return out[..., :hv]
  return f


def _ours(mesh, causal, backend="auto", **options):
  def f(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal, backend=backend,
                                    **options)
  return f


def _inputs(b, t, n, kh, h, hv):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, t, kh, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, kh, hv), jnp.bfloat16)
  do = jax.random.normal(keys[3], (b, t, n, hv), jnp.bfloat16)
  return q, k, v, do


def run(f) -> list[dict]:
  """Runs the mode; prints a line per row and returns the rows."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  kh = int(f.kv_heads[0])
  n, b = f.heads, f.batch
  sinks = jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32)
  peer, impl = _peer()
  rows = []
  for variant in f.variants:
    h, hv = FIXED_HEAD_DIMS.get(variant, (f.head_dim, f.head_dim))
    for t in map(int, f.seq_lens):
      for causal in [c.lower() == "true" for c in f.causal]:
        q, k, v, do = _inputs(b, t, n, kh, h, hv)
        impls = {"ringflash": _ours(mesh, causal)}
        if variant == "sinks":
          impls = {"ringflash": _ours(mesh, causal, sinks=sinks),
                   "plain": _ours(mesh, causal)}
        elif variant == "softcap":
          impls = {"ringflash": _ours(mesh, causal, logits_soft_cap=30.0),
                   "plain": _ours(mesh, causal)}
        elif variant == "mla":
          impls[f"{peer}_padded"] = _cudnn(causal, impl, pad_to=h)
          if t <= f.xla_max_len:
            impls["xla"] = _ours(mesh, causal, backend="xla")
        else:
          impls[peer] = _cudnn(causal, impl)
        fns = {name: harness.jitted_pair(fn) for name, fn in impls.items()}
        flops = harness.flops(b, n, t, t, h, causal, hv=hv)
        row = {"variant": variant, "T": t, "N": n, "K": kh, "H": h, "Hv": hv,
               "causal": causal}
        passes = [("fwd", 0, (q, k, v), 1.0)]
        if f.backward:
          passes.append(("fwdbwd", 1, (q, k, v, do), 3.5))
        for what, which, args, factor in passes:
          times, errors = harness.time_in_turns(
              {name: (fn[which], args) for name, fn in fns.items()},
              warmup=f.warmup, iters=f.iters,
              peers=("cudnn", "cudnn_padded"))
          for name, err in errors.items():
            row[f"{name}_error"] = err
          for name, ts in times.items():
            row[f"{name}_{what}"] = factor * flops / statistics.median(ts) / 1e12
            if name != "ringflash":
              row[f"{name}_{what}_ratio"] = harness.ratio_by_round(times["ringflash"], ts)
        rows.append(row)
        _print(row)
  return rows


def _print(row: dict) -> None:
  parts = []
  for what in ("fwd", "fwdbwd"):
    if f"ringflash_{what}" not in row:
      continue
    ratios = " ".join(f"/{key[:-len(f'_{what}_ratio')]} {val:.3f}x"
                      for key, val in row.items() if key.endswith(f"_{what}_ratio"))
    parts.append(f"{what} ours {row[f'ringflash_{what}']:.1f} TFLOP/s {ratios}")
  print(f"{row['variant']:<8} T={row['T']:>6} H={row['H']}/{row['Hv']} "
        f"causal={str(row['causal']):<5} | " + " | ".join(parts), flush=True)
  for key, val in row.items():
    if key.endswith("_error"):
      print(f"    {key}: {val}", flush=True)
