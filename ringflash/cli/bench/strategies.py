"""`ringflash bench --mode=strategies`: every strategy against the user's real alternatives.

For each per-device length (--seq_lens), kv head count (--kv_heads) and causal setting, on all
P devices of the process, side by side with turns interleaved (harness.time_in_turns):
  one_gpu      cuDNN (jax.nn.dot_product_attention(implementation="cudnn")) on ONE device
               over the WHOLE sequence: the reference; its time / P is the ideal;
  ring, allgather, ulysses, hybrid, auto
               ringflash.ring_attention(strategy=...) over the P devices (hybrid: the
               devices as (P / U, U) with U = --ulysses_size, Ulysses over the second axis);
  ulysses_cudnn  plain Ulysses: an all-to-all sequence -> heads, cuDNN on the whole sequence
               per device, an all-to-all back;
  allgather_cudnn  gather K/V, cuDNN on the local queries against all keys (non-causal
               rows only: cuDNN's causal mask cannot be placed at a device's offset).
Efficiency = (one_gpu's time / P) / the implementation's time, forward and forward+backward,
the median over rounds of the ratio in each round (harness.ratio_by_round).
Causal rows give ringflash's strategies the zigzag layout (inputs permuted once, as a data
loader does) and the baselines the natural order (they attend the whole sequence per device
or are non-causal). The table says which strategy "auto" took and how far it is from the
best implementation of the row.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ringflash
from ringflash.cli import UsageError
from ringflash.cli.bench import harness

OURS = ("ring", "allgather", "ulysses", "hybrid", "auto")
BASELINES = ("ulysses_cudnn", "allgather_cudnn")


def _cudnn(q, k, v, causal):
  """cuDNN's attention on GPUs; XLA's (jax.nn's default) elsewhere, so the mode runs on CPU
  meshes too (its rows there say nothing about speed)."""
  impl = "cudnn" if jax.devices()[0].platform == "gpu" else None
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def _baseline(name: str, mesh: Mesh, causal: bool):
  """Plain Ulysses + cuDNN or all-gather + cuDNN on the 1-D mesh "sp" (natural order)."""
  spec = P(None, "sp")

  def ulysses(q, k, v):
    p = jax.lax.axis_size("sp")
    kh = k.shape[2]
    if kh % p:        # each kv head copied up to a multiple of P (K = 6, P = 4: twice, 12)
      k, v = (jnp.repeat(x, p // math.gcd(kh, p), axis=2) for x in (k, v))
    to = functools.partial(jax.lax.all_to_all, axis_name="sp", split_axis=2, concat_axis=1,
                           tiled=True)
    out = _cudnn(to(q), to(k), to(v), causal)
    return jax.lax.all_to_all(out, "sp", split_axis=1, concat_axis=2, tiled=True)

  def allgather(q, k, v):
    gather = functools.partial(jax.lax.all_gather, axis_name="sp", axis=1, tiled=True)
    return _cudnn(q, gather(k), gather(v), False)

  body = ulysses if name == "ulysses_cudnn" else allgather
  return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)


def _meshes(devices: list, u: int) -> dict:
  """strategy -> (mesh, axis_name) of ringflash's strategies: the devices as one axis "sp";
  hybrid's as (P / U, U), its Ulysses axis "u" the second (only when U = --ulysses_size > 0)."""
  mesh = Mesh(np.array(devices), ("sp",))
  grid = Mesh(np.array(devices).reshape(len(devices) // u, u), ("ring", "u")) if u else None
  return {name: (grid, ("ring", "u")) if name == "hybrid" else (mesh, "sp")
          for name in OURS if name != "hybrid" or u}


def _ours(name: str, mesh: Mesh, axis, causal: bool, layout: str):
  def attention(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, axis_name=axis, is_causal=causal,
                                    layout=layout, strategy=name)
  return attention


def hybrid_fits(p: int, u: int) -> bool:
  """Whether the hybrid strategy runs on P devices as (P / U, U): U divides P, below it."""
  return p % u == 0 and u < p


def check_devices(f, devices: list) -> None:
  """--ulysses_size, --heads and --kv_heads against the P devices, before anything compiles:
  each strategy of ringflash is traced on the abstract inputs of every row (the ulysses and
  hybrid strategies shard the heads over their devices).

  Raises:
    UsageError: one line naming the flag.
  """
  p, u = len(devices), f.ulysses_size
  if u and not hybrid_fits(p, u):
    raise UsageError(f"--ulysses_size={u} must divide the {p} devices and be smaller than "
                     f"them (the hybrid strategy runs on the devices as (P / U, U), a ring of "
                     f"P / U >= 2); 0 leaves hybrid out")
  meshes = _meshes(devices, u)
  for tl in map(int, f.seq_lens):
    for kh in map(int, f.kv_heads):
      for causal in [c.lower() == "true" for c in f.causal]:
        for name, (mesh, axis) in meshes.items():
          sharding = NamedSharding(mesh, P(None, axis))
          shapes = [jax.ShapeDtypeStruct((f.batch, tl * p, heads, f.head_dim), jnp.bfloat16,
                                         sharding=sharding) for heads in (f.heads, kh, kh)]
          layout = "zigzag" if causal else "contiguous"
          try:
            jax.eval_shape(_ours(name, mesh, axis, causal, layout), *shapes)
          except (ValueError, NotImplementedError) as err:
            raise UsageError(f"--heads={f.heads} and --kv_heads={kh} do not fit strategy "
                             f"{name!r} on the {p} devices: {err}") from None


def run(f) -> list[dict]:
  """Runs the mode; prints a line per row and returns the rows.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes), checked by
      check_devices.
  """
  devices = jax.devices()
  p = len(devices)
  meshes = _meshes(devices, f.ulysses_size)
  mesh = meshes["ring"][0]
  rows = []
  for tl in map(int, f.seq_lens):
    for kh in map(int, f.kv_heads):
      for causal in [c.lower() == "true" for c in f.causal]:
        t = tl * p
        q, k, v, do = harness.inputs(f.batch, t, f.heads, kh, f.head_dim)
        layout = "zigzag" if causal else "contiguous"
        seq = NamedSharding(mesh, P(None, "sp"))
        natural = [jax.device_put(x, seq) for x in (q, k, v, do)]
        laid = [jax.device_put(ringflash.to_layout(x, layout, p), seq) for x in (q, k, v, do)]
        whole = [jax.device_put(x, devices[0]) for x in (q, k, v, do)]
        calls = {"one_gpu": (harness.jitted_pair(functools.partial(_cudnn, causal=causal)),
                             whole)}
        for name, (m, axis) in meshes.items():
          args = laid if m is mesh else [
              jax.device_put(x, NamedSharding(m, P(None, axis))) for x in laid]
          calls[name] = (harness.jitted_pair(_ours(name, m, axis, causal, layout)), args)
        for name in BASELINES:
          if name == "allgather_cudnn" and causal:
            continue
          calls[name] = (harness.jitted_pair(_baseline(name, mesh, causal)), natural)
        row = {"P": p, "T_local": tl, "T": t, "N": f.heads, "K": kh, "H": f.head_dim,
               "causal": causal, "layout": layout}
        passes = [("fwd", 0, 3)] + ([("fwdbwd", 1, 4)] if f.backward else [])
        for phase, which, nargs in passes:
          times, errors = harness.time_in_turns(
              {name: (fns[which], args[:nargs]) for name, (fns, args) in calls.items()},
              warmup=f.warmup, iters=f.iters, peers=("one_gpu",) + BASELINES)
          for name, err in errors.items():
            row[f"{name}_error"] = err
          if "one_gpu" not in times:
            continue
          for name, ts in times.items():     # (one GPU's time / P) / ours, by round
            if name != "one_gpu":
              row[f"{name}_{phase}_eff"] = harness.ratio_by_round(ts, times["one_gpu"]) / p
        q_l, k_l, v_l = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        row["auto_choice"] = ringflash.explain(q_l, k_l, v_l, mesh=mesh, is_causal=causal,
                                               layout=layout).strategy
        rows.append(row)
        _print(row)
  return rows


def _print(row: dict) -> None:
  names = [n for n in OURS + BASELINES if f"{n}_fwd_eff" in row]
  cells = " ".join(
      f"{n} {row[f'{n}_fwd_eff']:.2f}|{harness.figure(row.get(f'{n}_fwdbwd_eff'), 2)}"
      for n in names)
  best = max((row.get(f"{n}_fwdbwd_eff", row[f"{n}_fwd_eff"]) for n in names if n != "auto"),
             default=None)
  auto = row.get("auto_fwdbwd_eff", row.get("auto_fwd_eff"))
  versus = (f" ({auto - best:+.3f} vs the best)" if auto is not None and best is not None
            else " (no efficiency: one GPU's cuDNN did not run)")
  print(f"P={row['P']} T/P={row['T_local']} K={row['K']} causal={row['causal']}: {cells}; "
        f"auto took {row['auto_choice']}{versus}", flush=True)
  for key, val in row.items():
    if key.endswith("_error"):
      print(f"    {key}: {val}", flush=True)



def plot(rows: list[dict], path: str) -> None:
  """PNG: forward+backward efficiency against tokens per device, one line per
  implementation and (K, causal) group."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print("matplotlib is not installed: no PNG written (pip install 'ringflash[bench]')")
    return
  groups = sorted({(r["K"], r["causal"]) for r in rows})
  fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
  for ax, (kh, causal) in zip(axes[0], groups):
    for name in OURS + BASELINES:
      key = f"{name}_fwdbwd_eff" if any(f"{name}_fwdbwd_eff" in r for r in rows) else (
          f"{name}_fwd_eff")
      pts = sorted((r["T_local"], r[key]) for r in rows
                   if r["K"] == kh and r["causal"] == causal and key in r)
      if pts:
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name,
                linestyle="--" if name in BASELINES else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per device")
    ax.set_ylabel("efficiency vs one device's cuDNN / P")
    ax.set_title(f"K={kh} {'causal' if causal else 'full'}")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")

