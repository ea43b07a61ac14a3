"""The timing harness of `ringflash bench`, shared by its modes (and by scripts/).

Time is wall clock around `jax.block_until_ready`: `seconds` for one call, `time_in_turns`
for several implementations of one computation timed round by round after --warmup calls
of each (at least one: the first compiles), so that a drift of the device's clock falls on
all of them alike, and `ratio_by_round` for the ratio of two implementations from those
rounds. Every mode times what it compares this way.

The implementations (`attention_fns`): "ringflash" is `ringflash.ring_attention` with the
backend picked for the device ("auto"), "xla" the same with backend="xla", "cudnn"
`jax.nn.dot_product_attention(implementation="cudnn")`. ringflash's own (ringflash, xla)
must run; a peer baseline (cudnn) may be missing, e.g. on a CPU, and is then left out.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ringflash

IMPLEMENTATIONS = ("ringflash", "cudnn", "xla")
PEERS = ("cudnn",)          # baselines that may fail (and are then left out)

# XLA's option for how many collectives its GPU scheduler keeps in flight; the bench's
# --collectives_in_flight sets it (ringflash.GPU_XLA_OPTIONS has the value ringflash wants).
OVERLAP_OPTION = "xla_gpu_experimental_parallel_collective_overlap_limit"

# Errors an implementation that cannot run raises (XLA's runtime errors are RuntimeErrors).
_FAILURES = (RuntimeError, ValueError, NotImplementedError)


class ImplementationError(RuntimeError):
  """One of ringflash's own implementations failed: the benchmark cannot stand in for it."""


def seconds(fn, *args) -> float:
  """Wall-clock seconds of one call of fn, up to block_until_ready of its result."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def _first_line(err: BaseException) -> str:
  lines = str(err).strip().splitlines()
  return f"{type(err).__name__}: {lines[0] if lines else ''}"


def time_in_turns(calls: dict, *, warmup: int, iters: int,
                  peers: tuple[str, ...] = PEERS) -> tuple[dict, dict]:
  """Times several implementations of one computation in turns.

  Each is called max(warmup, 1) times untimed (the first call compiles). Then `iters`
  rounds each time one call of every implementation, round r starting at the
  (r mod count)-th, so that the order rotates.

  Args:
    calls: {name: (fn, args)}.
    warmup, iters: untimed calls, timed rounds.
    peers: the names that may fail: one that raises in its untimed calls is left out, with
      its error. Any other (ringflash's own) that raises is an error.

  Returns:
    ({name: [seconds per round]}, {name: error text of a left-out peer}).

  Raises:
    ImplementationError: one of ringflash's own implementations raised, naming it; or every
      implementation was a peer and every one failed (nothing to time).
  """
  names, errors = [], {}
  for name, (fn, args) in calls.items():
    try:
      for _ in range(max(warmup, 1)):
        seconds(fn, *args)
      names.append(name)
    except _FAILURES as err:
      if name not in peers:
        raise ImplementationError(f"implementation {name!r} failed: {_first_line(err)}") from err
      # A baseline failing (e.g. cuDNN unavailable) must not hide the others.
      errors[name] = f"{type(err).__name__}: {str(err)[:200]}"
  if calls and not names:         # a row of dashes measures nothing: say so, as a failure
    raise ImplementationError("no implementation ran: " + "; ".join(
        f"{name}: {err.splitlines()[0] if err else ''}" for name, err in errors.items()))
  times = {name: [] for name in names}
  for r in range(iters):
    for j in range(len(names)):
      name = names[(r + j) % len(names)]
      fn, args = calls[name]
      times[name].append(seconds(fn, *args))
  return times, errors


def ratio_by_round(ours: list[float], theirs: list[float]) -> float:
  """Our throughput over theirs: the median over rounds of their time over ours."""
  return statistics.median(t / o for o, t in zip(ours, theirs, strict=True))


def figure(x: float | None, digits: int) -> str:
  """A measured figure, or "-" for one not measured (forward+backward with --nobackward)."""
  return "-" if x is None else f"{x:.{digits}f}"


def flops(b: int, n: int, t: int, s: int, h: int, causal: bool, hv: int | None = None) -> float:
  """Forward FLOPs (FlashAttention's convention): 2 * B * N * T * S * (H + Hv), Hv = H unless
  given (4 * B * N * T * S * H), halved if causal."""
  f = 2.0 * b * n * t * s * (h + (h if hv is None else hv))
  return f / 2 if causal else f


def inputs(b: int, t: int, n: int, kh: int, h: int):
  """bf16 q [B, T, N, H], k, v [B, T, K, H] and do [B, T, N, H], from a fixed key."""
  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(kk, (b, t, kh, h), jnp.bfloat16)
  v = jax.random.normal(kv, (b, t, kh, h), jnp.bfloat16)
  do = jax.random.normal(kd, (b, t, n, h), jnp.bfloat16)
  return q, k, v, do


def sharded_inputs(mesh, b: int, t: int, n: int, kh: int, h: int):
  """`inputs`, generated already split over the mesh's "sp" axis: no device holds the
  whole sequence, and every process of a multi-process job makes the same call."""
  sh = NamedSharding(mesh, P(None, "sp", None, None))
  return jax.jit(functools.partial(inputs, b, t, n, kh, h), out_shardings=(sh,) * 4)()


def attention_fns(impl: str, causal: bool, mesh, layout: str = "contiguous"):
  """(forward, forward+backward) jitted callables for one implementation.

  Args:
    impl: "ringflash" (ring_attention, the device's native backend), "xla"
      (ring_attention, backend="xla") or "cudnn" (jax.nn.dot_product_attention).
    causal: causal masking.
    mesh: the mesh of ring_attention; its axis "sp" is the ring (unused by cudnn).
    layout: ring_attention's layout.

  Returns:
    forward(q, k, v) -> out and fwd_bwd(q, k, v, do) -> (out, dq, dk, dv), jitted.
  """
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
  if impl == "cudnn":
    def f(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  else:
    backend = "auto" if impl == "ringflash" else impl

    def f(q, k, v):
      return ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal, backend=backend,
                                      layout=layout)

  return jitted_pair(f)


def jitted_pair(f):
  """(forward, forward+backward) jitted from f(q, k, v) -> out: forward(q, k, v) -> out,
  fwd_bwd(q, k, v, do) -> (out, dq, dk, dv)."""
  fwd = jax.jit(f)

  @jax.jit
  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(f, q, k, v)
    return (out,) + vjp(do)

  return fwd, fwd_bwd


def default_collectives_in_flight() -> int:
  """ringflash.GPU_XLA_OPTIONS's value of OVERLAP_OPTION (XLA's default, 1, if not set)."""
  return int(ringflash.GPU_XLA_OPTIONS.get(OVERLAP_OPTION, 1))


def compiler_options(platform: str, collectives_in_flight: int | None = None) -> dict | None:
  """XLA options for a compile on `platform`: on GPUs ringflash.GPU_XLA_OPTIONS, with
  OVERLAP_OPTION set to `collectives_in_flight` when given (0: left to XLA, which keeps
  one); None elsewhere."""
  if platform != "gpu":
    return None
  options = dict(ringflash.GPU_XLA_OPTIONS)
  if collectives_in_flight is not None:
    options.pop(OVERLAP_OPTION, None)
    if collectives_in_flight:
      options[OVERLAP_OPTION] = collectives_in_flight
  return options or None


def compile_ahead(jitted, *args, collectives_in_flight: int | None = None):
  """jitted.lower(*args).compile(), with `compiler_options` for the platform of the devices."""
  options = compiler_options(jax.devices()[0].platform, collectives_in_flight)
  return jitted.lower(*args).compile(compiler_options=options)


def write_json(folder: str, mode: str, rows: list[dict], meta: dict) -> str:
  """Writes {"meta": meta, "rows": rows} to folder/bench_<mode>.json; returns the path."""
  path = os.path.join(folder, f"bench_{mode}.json")
  with open(path, "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  print(f"wrote {path}")
  return path


def plot_kernels(rows: list[dict], impls, path: str) -> None:
  """PNG of the kernels mode: TFLOP/s against T, forward and forward+backward, one line per
  implementation and causal setting (rows with K = N). Needs matplotlib (the bench extra)."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print("matplotlib is not installed: no PNG written (pip install 'ringflash[bench]')")
    return
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, phase in zip(axes, ("fwd", "fwdbwd")):
    for impl in impls:
      for causal in (False, True):
        pts = sorted((r["T"], r[f"{impl}_{phase}"]) for r in rows
                     if r["K"] == r["N"] and r["causal"] == causal and f"{impl}_{phase}" in r)
        if pts:
          ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                  linestyle="--" if causal else "-",
                  label=f"{impl}{' causal' if causal else ''}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T = S")
    ax.set_ylabel("TFLOP/s per device")
    ax.set_title("forward" if phase == "fwd" else "forward + backward")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")
