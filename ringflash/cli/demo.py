"""`ringflash demo`: causal ring attention at 16k tokens, forward and backward, checked.

Runs on the devices present; with only a CPU it simulates --devices CPU devices. Prints the
largest error against an independent single-device reference, the wall time, and the
compiled program's per-device memory next to what one device would need for the scores.
Flags are checked before any work; a mistake is one line and status 2.
"""

from __future__ import annotations

import time

import numpy as np
from absl import flags

from ringflash import introspect
from ringflash.cli import MAX_CPU_DEVICES
from ringflash.cli import MAX_SEQ_LEN
from ringflash.cli import UsageError

FLAGS = flags.FLAGS

BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_gpu")


def define_flags() -> None:
  """Defines this command's flags on absl's FLAGS. The ringflash command calls it once
  before parsing; importing the module (as tests do) defines nothing."""
  flags.DEFINE_integer("seq_len", 16384, "tokens in the sequence (T = S)",
                       upper_bound=MAX_SEQ_LEN)
  flags.DEFINE_integer("batch", 1, "batch size B")
  flags.DEFINE_integer("heads", 4, "query heads N")
  flags.DEFINE_integer("kv_heads", 2, "key/value heads K (N % K == 0)")
  flags.DEFINE_integer("head_dim", 64, "head dimension H")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "input dtype")
  flags.DEFINE_bool("causal", True, "causal masking")
  flags.DEFINE_integer("devices", 8, "simulated CPU devices when no accelerator is present",
                       upper_bound=MAX_CPU_DEVICES)
  flags.DEFINE_enum("backend", "auto", list(BACKENDS), "kernel backend")
  flags.DEFINE_integer("reference_chunk", 1024, "query rows per step of the dense reference")


def print_work_table(ring_size: int = 8, seq_len: int = 8192, block: int = 128, *,
                     causal: bool = True, window: tuple[int, int] | None = None) -> dict:
  """Prints the per-device work (tiles computed) of each layout and max/mean; returns it."""
  table = introspect.work_table(ring_size, seq_len, block, causal=causal, window=window)
  print(f"per-device work in {block}x{block} tiles: P={ring_size}, T={seq_len}, "
        f"causal={causal}, window={window}")
  print(f"{'layout':<11} {'max':>6} {'mean':>8} {'max/mean':>8}  per device")
  for layout, work in table.items():
    mean = float(np.mean(work))
    print(f"{layout:<11} {int(work.max()):>6} {mean:>8.1f} {work.max() / mean:>8.3f}  "
          f"{' '.join(str(int(w)) for w in work)}")
  return table


def check_flags(f) -> None:
  """Checks the flags that need no device, before any work.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes).

  Raises:
    UsageError: one line naming the flag and what it allows.
  """
  for name in ("seq_len", "batch", "heads", "kv_heads", "head_dim", "devices",
               "reference_chunk"):
    if getattr(f, name) < 1:
      raise UsageError(f"--{name} must be > 0, got {getattr(f, name)}")
  if f.heads % f.kv_heads:
    raise UsageError(f"--kv_heads={f.kv_heads} must divide --heads={f.heads} (GQA)")
  if f.seq_len % min(f.reference_chunk, f.seq_len):
    raise UsageError(f"--reference_chunk={f.reference_chunk} must divide --seq_len={f.seq_len} "
                     "(or be at least it)")


def check_devices(f, devices) -> None:
  """Checks the flags against the devices that run: the sequence divides over them and the
  backend runs these shapes on them (introspect.ring_spec, without running anything).

  Raises:
    UsageError: one line naming the flag.
  """
  import jax  # pylint: disable=g-import-not-at-top
  p = len(devices)
  if f.seq_len % p:
    simulated = " (--devices)" if devices[0].platform == "cpu" else ""
    raise UsageError(f"--seq_len={f.seq_len} must be divisible by the {p} devices{simulated}")
  if f.causal and f.seq_len % (2 * p):
    raise UsageError(f"--seq_len={f.seq_len} must be divisible by 2 x the {p} devices with "
                     "--causal (the zigzag layout of the load-balance table)")
  local = [jax.ShapeDtypeStruct((f.batch, f.seq_len // p, h, f.head_dim), f.dtype)
           for h in (f.heads, f.kv_heads, f.kv_heads)]
  try:
    introspect.ring_spec(*local, ring_size=p, device=devices[0], is_causal=f.causal,
                         backend=f.backend)
  except (ValueError, NotImplementedError) as err:
    raise UsageError(f"--backend={f.backend} cannot run these flags: {err}") from None


def _gib(n: float) -> str:
  return f"{n / 2**30:8.3f} GiB"


def main(argv):
  """Checks the flags, runs the ring and the reference, prints; exits 1 if they disagree."""
  del argv
  check_flags(FLAGS)
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_num_cpu_devices", FLAGS.devices)   # only affects a CPU-only host
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from ringflash import reference  # pylint: disable=g-import-not-at-top

  import ringflash  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  check_devices(FLAGS, devices)
  mesh = Mesh(np.array(devices), ("sp",))
  p = len(devices)
  b, t, n, kh, h = FLAGS.batch, FLAGS.seq_len, FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim
  dtype = jnp.dtype(FLAGS.dtype)
  print(f"ringflash demo: {p} x {devices[0].device_kind} ({devices[0].platform}), "
        f"B={b} T=S={t} N={n} K={kh} H={h} {dtype.name} causal={FLAGS.causal}")

  keys = jax.random.split(jax.random.key(0), 4)
  seq = NamedSharding(mesh, P(None, "sp"))
  q = jax.device_put(jax.random.normal(keys[0], (b, t, n, h), dtype), seq)
  k = jax.device_put(jax.random.normal(keys[1], (b, t, kh, h), dtype), seq)
  v = jax.device_put(jax.random.normal(keys[2], (b, t, kh, h), dtype), seq)
  dout = jax.device_put(jax.random.normal(keys[3], (b, t, n, h), dtype), seq)

  def ring_step(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: ringflash.ring_attention(
        q, k, v, mesh=mesh, is_causal=FLAGS.causal, backend=FLAGS.backend), q, k, v)
    return (out,) + vjp(dout)

  start = time.perf_counter()
  compiled = jax.jit(ring_step).lower(q, k, v, dout).compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  got = jax.block_until_ready(compiled(q, k, v, dout))
  ring_s = time.perf_counter() - start

  def ref_step(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: reference.dense_attention(
        q, k, v, FLAGS.causal, FLAGS.reference_chunk), q, k, v)
    return (out,) + vjp(dout.astype(jnp.float32))

  host = [jax.device_put(x, devices[0]) for x in (q, k, v, dout)]
  ref_compiled = jax.jit(ref_step).lower(*host).compile()   # timed without its compile,
  start = time.perf_counter()                                # as the ring is
  want = jax.block_until_ready(ref_compiled(*host))
  ref_s = time.perf_counter() - start

  print(f"\n{'':6}{'max |ring - reference|':>24}{'max |reference|':>18}")
  relative = []
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    g = jnp.asarray(g, jnp.float32)
    # A non-finite result is an error of its own: a max over a large CPU array can drop NaN
    # (all-NaN gave -inf), and Python's max keeps its first argument beside a NaN.
    err = (float(jnp.max(jnp.abs(g - jax.device_put(w, g.sharding))))
           if bool(jnp.all(jnp.isfinite(g))) else float("nan"))
    size = float(jnp.max(jnp.abs(w)))
    relative.append(err / max(1.0, size))
    print(f"{name:<6}{err:>24.3e}{size:>18.3f}")
  worst = float("nan") if any(np.isnan(relative)) else max(relative)

  mem = compiled.memory_analysis()
  scores = b * n * t * t * 4
  print(f"\nwall time, forward+backward over {p} devices: {ring_s:8.2f} s "
        f"(compile {compile_s:.1f} s; single-device dense reference {ref_s:.2f} s)")
  print("per-device memory of the compiled ring program (memory_analysis):")
  print(f"  arguments   {_gib(mem.argument_size_in_bytes)}")
  print(f"  temporaries {_gib(mem.temp_size_in_bytes)}")
  print(f"  outputs     {_gib(mem.output_size_in_bytes)}")
  print(f"one device holding the full [B, N, T, S] fp32 scores: {_gib(scores)} "
        f"({scores / max(mem.temp_size_in_bytes, 1):.0f}x the ring's temporaries)")
  if FLAGS.causal:
    print("\nthe ring waits for its busiest device; causal load balance of each layout:")
    print_work_table(p, t, introspect.balance_block(t, p))

  tol = 1e-4 if dtype == jnp.float32 else 5e-2
  verdict = "PASS" if all(e <= tol for e in relative) else "FAIL"
  print(f"\n{verdict}: largest error relative to max(1, |reference|) = {worst:.2e} "
        f"(tolerance {tol:g})")
  if verdict != "PASS":
    raise SystemExit(1)
