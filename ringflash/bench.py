"""`ringflash bench`: per-device attention throughput against cuDNN, measured in one process.

Modes (--mode):
  kernels  TFLOP/s of ringflash's kernel (the native backend, pallas_gpu on Hopper), cuDNN
           (jax.nn.dot_product_attention(implementation="cudnn")) and the xla backend, for
           B=1, N=16, H=128, T=S in --seq_lens, causal and non-causal, bf16, plus GQA rows
           (16 query heads, 4 kv heads). Forward and forward+backward. A table with the
           ratio to cuDNN, JSON, and a PNG plot (TFLOP/s against sequence length).
  virtual  the ring's per-step cost on one GPU: P ring steps (the local K/V block standing
           in for the received one; kernel + LSE merge, as parallel/ring.py runs them)
           against one kernel call over the whole length P * T_local.
  layouts  the causal ring per layout (contiguous, zigzag, striped) on one device: each
           simulated device's P steps with its own positions, timed; max/mean shows balance.
  scaling  weak scaling: ring_attention on P = 1, 2, 4, ... of the job's devices with T/P per
           device in --seq_lens; efficiency = per-device TFLOP/s of the ring at P over the
           ring of one device at the same per-device length, measured in the same run.
           Causal rows use --layout (zigzag: balanced). For P > 1 the compiled program is
           read for whether each ring step's K/V permute is in flight around a kernel.
           In a multi-process job (`ringflash launch local --platform=gpu -- bench ...`,
           one process per GPU) P is 1 (each process's own device) and all devices.
  longest  the longest sequence whose forward+backward fits on all of the job's devices:
           per-device lengths in --seq_lens (ascending), causal, K = last --kv_heads; each
           is compiled and its per-device memory (memory_analysis) compared with the
           device's; those that fit and have T <= --run_max_len are also run once, timed.

FLOP convention (FlashAttention): forward 4 * B * N * T * S * H, halved when causal;
forward+backward = 3.5x forward. Time: median of --iters calls after --warmup calls, wall
clock around block_until_ready. In the kernels mode the implementations of a row take turns:
each round times one call of each, in an order that rotates between rounds, so that a drift
of the device's clock falls on all of them alike; the ratio to cuDNN is the median of the
rounds' ratios.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

from absl import flags

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines this command's flags on absl's FLAGS. The ringflash command calls it once
  before parsing; importing the module (as tests do) defines nothing."""
  flags.DEFINE_enum("mode", "kernels", ["kernels", "virtual", "layouts", "scaling", "longest"],
                    "what to run")
  flags.DEFINE_list("seq_lens", ["4096", "16384", "65536"],
                    "sequence lengths (kernels: T = S; virtual, scaling: per device)")
  flags.DEFINE_integer("heads", 16, "query heads N")
  flags.DEFINE_list("kv_heads", ["16", "4"], "kv heads K per row group (16:4 = GQA)")
  flags.DEFINE_integer("head_dim", 128, "head dim H")
  flags.DEFINE_integer("batch", 1, "batch B")
  flags.DEFINE_list("causal", ["false", "true"], "causal settings to run")
  flags.DEFINE_list("impls", ["ringflash", "cudnn", "xla"], "implementations")
  flags.DEFINE_integer("xla_max_len", 16384, "skip the xla backend above this T")
  flags.DEFINE_list("gqa_seq_lens", ["16384"], "sequence lengths of the GQA rows")
  flags.DEFINE_integer("warmup", 2, "untimed calls (kernels mode: at least one, the compile)")
  flags.DEFINE_integer("iters", 5, "timed calls (median); kernels mode: rounds")
  flags.DEFINE_list("ring_sizes", ["2", "4", "8"], "virtual: ring steps P")
  flags.DEFINE_string("out", "bench_out", "folder for JSON and PNG")
  flags.DEFINE_bool("backward", True, "also time forward+backward")
  flags.DEFINE_enum("layout", "zigzag", ["contiguous", "zigzag", "striped"],
                    "scaling, longest: layout of the causal rows")
  flags.DEFINE_string("hlo_dir", "", "scaling: write each ring program's compiled HLO here")
  from ringflash.parallel import ring  # pylint: disable=g-import-not-at-top
  option, value = ring.GPU_COLLECTIVES_IN_FLIGHT
  flags.DEFINE_integer("collectives_in_flight", value, "scaling, longest, on GPUs: how many "
                       f"collectives XLA may keep in flight at once (its option {option}); "
                       "0 leaves XLA's default, one", lower_bound=0)
  flags.DEFINE_integer("run_max_len", 1 << 20, "longest: run (not only compile) total "
                       "lengths T up to this")


def _compile(jitted, *args):
  """jitted.lower(*args).compile(), on GPUs with --collectives_in_flight applied."""
  import jax  # pylint: disable=g-import-not-at-top
  from ringflash.parallel import ring  # pylint: disable=g-import-not-at-top
  options = {}
  if jax.devices()[0].platform == "gpu" and FLAGS.collectives_in_flight:
    options[ring.GPU_COLLECTIVES_IN_FLIGHT[0]] = FLAGS.collectives_in_flight
  return jitted.lower(*args).compile(compiler_options=options or None)


def _flops(b, n, t, s, h, causal):
  f = 4.0 * b * n * t * s * h
  return f / 2 if causal else f


def _seconds(fn, *args):
  """Wall-clock seconds of one call of fn, up to block_until_ready of its result."""
  import jax  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def _time(fn, *args):
  for _ in range(FLAGS.warmup):
    _seconds(fn, *args)
  return statistics.median(_seconds(fn, *args) for _ in range(FLAGS.iters))


def _time_in_turns(calls):
  """Times several implementations of one computation in turns.

  calls: {name: (fn, args)}. Each is called max(--warmup, 1) times untimed; one that raises
  there is left out, with its error. Then --iters rounds each time one call of every
  remaining implementation, round r starting at the (r mod count)-th. Returns
  ({name: [seconds per round]}, {name: error text}).
  """
  names, errors = [], {}
  for name, (fn, args) in calls.items():
    try:
      for _ in range(max(FLAGS.warmup, 1)):
        _seconds(fn, *args)
      names.append(name)
    except (RuntimeError, ValueError, NotImplementedError) as err:
      # One implementation failing (e.g. cuDNN unavailable) must not hide the others.
      errors[name] = f"{type(err).__name__}: {str(err)[:200]}"
  times = {name: [] for name in names}
  for r in range(FLAGS.iters):
    for j in range(len(names)):
      name = names[(r + j) % len(names)]
      fn, args = calls[name]
      times[name].append(_seconds(fn, *args))
  return times, errors


def _ratio_by_round(ours, theirs):
  """Our throughput over theirs: the median over rounds of their time over ours."""
  return statistics.median(t / o for o, t in zip(ours, theirs, strict=True))


def _inputs(b, t, n, kh, h):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(kk, (b, t, kh, h), jnp.bfloat16)
  v = jax.random.normal(kv, (b, t, kh, h), jnp.bfloat16)
  do = jax.random.normal(kd, (b, t, n, h), jnp.bfloat16)
  return q, k, v, do


def _attention_fns(impl, causal, mesh, layout="contiguous"):
  """(forward, forward+backward) jitted callables of q, k, v, do for one implementation."""
  import jax  # pylint: disable=g-import-not-at-top
  import ringflash  # pylint: disable=g-import-not-at-top

  if impl == "cudnn":
    def f(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  else:
    backend = "auto" if impl == "ringflash" else impl

    def f(q, k, v):
      return ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal, backend=backend,
                                      layout=layout)

  fwd = jax.jit(f)

  @jax.jit
  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp(do)
    return out, dq, dk, dv

  return fwd, fwd_bwd


def _run_kernels(mesh):
  rows = []
  groups = [(kh, [int(x) for x in (FLAGS.seq_lens if kh == FLAGS.heads else FLAGS.gqa_seq_lens)])
            for kh in map(int, FLAGS.kv_heads)]
  for kh, lens in groups:
    for t in lens:
      for causal in [c.lower() == "true" for c in FLAGS.causal]:
        q, k, v, do = _inputs(FLAGS.batch, t, FLAGS.heads, kh, FLAGS.head_dim)
        flops = _flops(FLAGS.batch, FLAGS.heads, t, t, FLAGS.head_dim, causal)
        row = {"T": t, "N": FLAGS.heads, "K": kh, "H": FLAGS.head_dim, "causal": causal}
        impls = [i for i in FLAGS.impls if not (i == "xla" and t > FLAGS.xla_max_len)]
        fns = {impl: _attention_fns(impl, causal, mesh) for impl in impls}
        passes = [("fwd", 0, (q, k, v), 1.0)]
        if FLAGS.backward:
          passes.append(("fwdbwd", 1, (q, k, v, do), 3.5))
        for what, which, args, factor in passes:
          times, errors = _time_in_turns({i: (fns[i][which], args) for i in impls
                                          if f"{i}_error" not in row})
          for impl, err in errors.items():
            row[f"{impl}_error"] = err
          for impl, ts in times.items():
            row[f"{impl}_{what}"] = factor * flops / statistics.median(ts) / 1e12
          if "ringflash" in times and "cudnn" in times:
            row[f"{what}_ratio"] = _ratio_by_round(times["ringflash"], times["cudnn"])
        rows.append(row)
        _print_row(row)
  return rows


def _print_row(row):
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


def _plot(rows, path):
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print("matplotlib is not installed: no PNG written (pip install 'ringflash[bench]')")
    return
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, phase in zip(axes, ("fwd", "fwdbwd")):
    for impl in FLAGS.impls:
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


def _spec(kernel, dev, *, causal, blocks, q_len, kv_len, n, kh, h, dtype):
  from ringflash import _validate  # pylint: disable=g-import-not-at-top
  return _validate.resolve_spec(kernel, scale=h ** -0.5, causal=causal, block_sizes=blocks,
                                q_len=q_len, kv_len=kv_len, head_dim=h, kv_heads=kh,
                                group=n // kh, dtype=dtype, platform=dev.platform,
                                device_kind=dev.device_kind)


def _device_steps(kernel, spec, b, tl, n, h):
  """Jitted (q, k, v, q_pos [tl], k_pos [P, tl]) -> (o float32, lse): one device's P ring
  steps as parallel/ring.py runs them (kernel + LSE merge), its own K/V standing in for the
  block it holds at step s, whose positions are k_pos[s]."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ringflash.parallel.merge import merge  # pylint: disable=g-import-not-at-top

  @jax.jit
  def steps(q, k, v, q_pos, k_pos):
    def body(s, carry):
      o_i, lse_i = kernel.forward(q, k, v, q_pos, k_pos[s], None, None, spec)
      return merge(*carry, o_i, lse_i)
    init = (jnp.zeros((b, tl, n, h), jnp.float32), jnp.full((b, n, tl), -jnp.inf, jnp.float32))
    return jax.lax.fori_loop(0, k_pos.shape[0], body, init)

  return steps


def _run_virtual():
  """P ring steps on one device vs one kernel call over P * T_local keys."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ringflash import _validate  # pylint: disable=g-import-not-at-top
  from ringflash.kernels import base, get_backend  # pylint: disable=g-import-not-at-top

  dev = jax.devices()[0]
  kernel = get_backend(_validate.resolve_backend("auto", dev.platform, dev))
  rows = []
  n, h, b = FLAGS.heads, FLAGS.head_dim, FLAGS.batch
  for tl in map(int, FLAGS.seq_lens):
    for p in map(int, FLAGS.ring_sizes):
      for kh in map(int, FLAGS.kv_heads):
        q, k, v, _ = _inputs(b, tl, n, kh, h)
        shape = dict(n=n, kh=kh, h=h, dtype=q.dtype)
        spec = _spec(kernel, dev, causal=False, blocks=base.BlockSizes(), q_len=tl, kv_len=tl,
                     **shape)
        pos = jnp.arange(tl, dtype=jnp.int32)
        # step s: the local block stands in for the one received from device i - s; its
        # positions move with it (non-causal: all valid).
        held = pos[None, :] + tl * jnp.arange(p, dtype=jnp.int32)[:, None]
        steps = _device_steps(kernel, spec, b, tl, n, h)

        @jax.jit
        def ring_steps(q, k, v, steps=steps, held=held):
          o, lse = steps(q, k, v, pos, held)
          return o.astype(q.dtype), lse

        kw, vw = jnp.tile(k, (1, p, 1, 1)), jnp.tile(v, (1, p, 1, 1))
        spec_w = _spec(kernel, dev, causal=False, blocks=base.BlockSizes(), q_len=tl,
                       kv_len=tl * p, **shape)
        pos_w = jnp.arange(tl * p, dtype=jnp.int32)

        @jax.jit
        def one_call(q, k, v, spec_w=spec_w, pos_w=pos_w):
          o, lse = kernel.forward(q, k, v, pos, pos_w, None, None, spec_w)
          return o.astype(q.dtype), lse

        t_ring = _time(ring_steps, q, k, v)
        t_one = _time(one_call, q, kw, vw)
        flops = _flops(b, n, tl, tl * p, h, False)
        row = {"T_local": tl, "P": p, "K": kh, "ring_ms": t_ring * 1e3, "one_ms": t_one * 1e3,
               "overhead": t_ring / t_one - 1.0, "ring_tflops": flops / t_ring / 1e12,
               "one_tflops": flops / t_one / 1e12, "backend": kernel.NAME}
        rows.append(row)
        print(f"T_local={tl:>6} P={p} K={kh:>2}: {p} ring steps {t_ring * 1e3:8.2f} ms "
              f"({row['ring_tflops']:.1f} TFLOP/s) vs one call {t_one * 1e3:8.2f} ms "
              f"({row['one_tflops']:.1f} TFLOP/s): overhead {100 * row['overhead']:+.1f}%",
              flush=True)
  return rows


def _layout_spec(kernel, dev, *, tl, n, kh, h, dtype):
  """The causal spec of the layouts mode: the backend's default tiles for tl tokens, cut to
  divide the zigzag chunk tl / 2 too, so that every layout runs the same tiles."""
  from ringflash.kernels import base  # pylint: disable=g-import-not-at-top
  spec = _spec(kernel, dev, causal=True, blocks=base.BlockSizes(), q_len=tl, kv_len=tl, n=n,
               kh=kh, h=h, dtype=dtype)
  chunk = tl // 2
  blocks = base.BlockSizes(math.gcd(spec.block_q, chunk), math.gcd(spec.block_k, chunk))
  return _spec(kernel, dev, causal=True, blocks=blocks, q_len=tl, kv_len=tl, n=n, kh=kh, h=h,
               dtype=dtype)


def _run_layouts():
  """Causal ring time of each layout, on one device: every device's P steps (kernel + merge,
  with that device's positions and those of the block it holds at each step), timed one
  device at a time. The ring runs as long as its slowest device; max/mean shows balance.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ringflash import _validate, layouts  # pylint: disable=g-import-not-at-top
  from ringflash.kernels import get_backend  # pylint: disable=g-import-not-at-top

  dev = jax.devices()[0]
  kernel = get_backend(_validate.resolve_backend("auto", dev.platform, dev))
  n, h, b = FLAGS.heads, FLAGS.head_dim, FLAGS.batch
  rows = []
  for tl in map(int, FLAGS.seq_lens):
    for p in map(int, FLAGS.ring_sizes):
      for kh in map(int, FLAGS.kv_heads):
        q, k, v, _ = _inputs(b, tl, n, kh, h)
        spec = _layout_spec(kernel, dev, tl=tl, n=n, kh=kh, h=h, dtype=q.dtype)
        device_steps = _device_steps(kernel, spec, b, tl, n, h)

        for layout in layouts.LAYOUTS:
          pos = layouts.layout_positions(layout, p, tl * p)           # [P, tl]
          times = []
          for i in range(p):
            # at step s device i holds the block of device (i - s) mod P
            held = jnp.asarray(pos[[(i - s) % p for s in range(p)]])
            times.append(_time(device_steps, q, k, v, jnp.asarray(pos[i]), held))
          ring_ms, mean_ms = 1e3 * max(times), 1e3 * sum(times) / p
          row = {"layout": layout, "T_local": tl, "P": p, "K": kh, "ring_ms": ring_ms,
                 "mean_ms": mean_ms, "max_over_mean": ring_ms / mean_ms,
                 "per_device_ms": [1e3 * t for t in times], "backend": kernel.NAME}
          rows.append(row)
          print(f"T_local={tl:>6} P={p} K={kh:>2} {layout:<10}: ring (slowest device) "
                f"{ring_ms:9.2f} ms, mean {mean_ms:9.2f} ms, max/mean "
                f"{row['max_over_mean']:.2f}", flush=True)
  return rows


def _sharded_inputs(mesh, b, t, n, kh, h):
  """bf16 q, k, v, do generated already split over the mesh's "sp" axis: no device holds the
  whole sequence, and every process of a multi-process job makes the same call."""
  import functools  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  sh = NamedSharding(mesh, P(None, "sp", None, None))
  return jax.jit(functools.partial(_inputs, b, t, n, kh, h), out_shardings=(sh,) * 4)()


def _ring_sizes():
  """(P, its devices) of the scaling mode. One process: 1, 2, 4, ... of its devices. Several
  processes: each process's own first device (a local program every process runs at once),
  then all global devices."""
  import jax  # pylint: disable=g-import-not-at-top
  devs = jax.devices()
  if jax.process_count() > 1:
    return [(1, jax.local_devices()[:1]), (len(devs), devs)]
  return [(p, devs[:p]) for p in (1, 2, 4, 8, 16, 32, 64, 128, 256) if p <= len(devs)]


def _run_scaling():
  """Weak scaling: per-device length fixed, P = 1, 2, 4, ... devices."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top

  from ringflash import hlo  # pylint: disable=g-import-not-at-top

  rows = []
  for tl in map(int, FLAGS.seq_lens):
    for kh in map(int, FLAGS.kv_heads):
      for causal in [c.lower() == "true" for c in FLAGS.causal]:
        base = (None, None)
        for p, devs in _ring_sizes():
          mesh = Mesh(np.array(devs), ("sp",))
          t = tl * p
          q, k, v, do = _sharded_inputs(mesh, FLAGS.batch, t, FLAGS.heads, kh, FLAGS.head_dim)
          layout = FLAGS.layout if causal else "contiguous"
          fwd, fwd_bwd = _attention_fns("ringflash", causal, mesh, layout)
          # compiled once, ahead of time: the program that is timed is the one whose HLO is read
          fwd = _compile(fwd, q, k, v)
          flops = _flops(FLAGS.batch, FLAGS.heads, t, t, FLAGS.head_dim, causal) / p
          tf = flops / _time(fwd, q, k, v) / 1e12
          tb, texts = None, [fwd.as_text()]
          if FLAGS.backward:
            fwd_bwd = _compile(fwd_bwd, q, k, v, do)
            tb = 3.5 * flops / _time(fwd_bwd, q, k, v, do) / 1e12
            texts.append(fwd_bwd.as_text())
          if p == 1:
            base = (tf, tb)
          row = {"P": p, "T_local": tl, "K": kh, "causal": causal, "layout": layout,
                 "fwd_tflops": tf, "fwdbwd_tflops": tb,
                 "fwd_eff": tf / base[0] if base[0] else None,
                 "fwdbwd_eff": tb / base[1] if (tb and base[1]) else None}
          line = (f"P={p} T/P={tl} K={kh} causal={causal}: fwd {tf:.1f} TFLOP/s/dev "
                  f"(eff {row['fwd_eff'] or 0:.3f}) fwd+bwd {tb or 0:.1f} "
                  f"(eff {row['fwdbwd_eff'] or 0:.3f})")
          if p > 1:
            found = [o for text in texts for o in hlo.permute_overlap(text)]
            row["permutes"] = len(found)
            row["permutes_spanning_kernel"] = sum(o.encloses_kernel for o in found)
            line += f"; {hlo.overlap_summary(found)}"
            if FLAGS.hlo_dir:
              _write_hlo(texts, f"P{p}_T{tl}_K{kh}_{'causal' if causal else 'full'}")
          rows.append(row)
          print(line, flush=True)
  return rows


def _write_hlo(texts, tag):
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() != 0:
    return
  os.makedirs(FLAGS.hlo_dir, exist_ok=True)
  for text, what in zip(texts, ("fwd", "fwdbwd")):
    with open(os.path.join(FLAGS.hlo_dir, f"{tag}_{what}.txt"), "w") as f:
      f.write(text)


def _run_longest():
  """Causal forward+backward over all devices at growing lengths: memory, and time if run."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  devs = jax.devices()
  p, n, h, b, kh = len(devs), FLAGS.heads, FLAGS.head_dim, FLAGS.batch, int(FLAGS.kv_heads[-1])
  mesh = Mesh(np.array(devs), ("sp",))
  sh = NamedSharding(mesh, P(None, "sp", None, None))
  stats = jax.local_devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  rows = []
  for tl in sorted(map(int, FLAGS.seq_lens)):
    t = tl * p
    shapes = [jax.ShapeDtypeStruct((b, t, heads, h), jnp.bfloat16, sharding=sh)
              for heads in (n, kh, kh, n)]
    _, fwd_bwd = _attention_fns("ringflash", True, mesh, FLAGS.layout)
    compiled = _compile(fwd_bwd, *shapes)
    mem = compiled.memory_analysis()
    need = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
    row = {"P": p, "T": t, "T_local": tl, "N": n, "K": kh, "layout": FLAGS.layout,
           "bytes_per_device": need, "bytes_limit": limit,
           "fits": limit is None or need <= limit, "seconds": None}
    if row["fits"] and t <= FLAGS.run_max_len:
      q, k, v, do = _sharded_inputs(mesh, b, t, n, kh, h)
      row["seconds"] = _seconds(compiled, q, k, v, do)
      row["fwdbwd_tflops"] = 3.5 * _flops(b, n, t, t, h, True) / p / row["seconds"] / 1e12
      del q, k, v, do
    rows.append(row)
    limit_text = f"{limit / 2**30:.1f}" if limit else "?"
    ran = (f"ran in {row['seconds']:.2f} s ({row['fwdbwd_tflops']:.1f} TFLOP/s/dev)"
           if row["seconds"] is not None else "compiled only")
    print(f"T={t} ({tl} per device, P={p}, N={n} K={kh} causal {FLAGS.layout}): "
          f"{need / 2**30:.2f} of {limit_text} GiB per device, "
          f"{'fits' if row['fits'] else 'does not fit'}; {ran}", flush=True)
    if not row["fits"]:
      break
  return rows


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top

  from ringflash.launch import distributed  # pylint: disable=g-import-not-at-top

  distributed.initialize()      # a multi-process job (RINGFLASH_* set) joins before any device use
  os.makedirs(FLAGS.out, exist_ok=True)
  dev = jax.devices()[0]
  print(f"jax {jax.__version__}, {len(jax.devices())} x {dev.device_kind}", flush=True)
  if FLAGS.mode == "kernels":
    rows = _run_kernels(Mesh(np.array([dev]), ("sp",)))
  elif FLAGS.mode == "virtual":
    rows = _run_virtual()
  elif FLAGS.mode == "layouts":
    rows = _run_layouts()
  elif FLAGS.mode == "scaling":
    rows = _run_scaling()
  else:
    rows = _run_longest()
  if jax.process_index() != 0:     # process 0 of a multi-process job writes the files
    return
  meta = {"jax": jax.__version__, "device": dev.device_kind, "mode": FLAGS.mode,
          "warmup": FLAGS.warmup, "iters": FLAGS.iters, "processes": jax.process_count(),
          "devices": len(jax.devices())}
  path = os.path.join(FLAGS.out, f"bench_{FLAGS.mode}.json")
  with open(path, "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  print(f"wrote {path}")
  if FLAGS.mode == "kernels":
    _plot(rows, os.path.join(FLAGS.out, "bench_kernels.png"))
