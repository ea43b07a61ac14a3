"""`ringflash bench`: per-device attention throughput against cuDNN, measured in one process.

Modes (--mode), one module each in this package, sharing the timing harness (harness.py):
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
  decode   per-token decode attention over a cache of --cache_lens tokens sharded over all
           devices: ringflash.decode_attention (and through ringflash.KVCache) against
           all-gathering the cache and rotating it around the ring, in turns; milliseconds
           per call and memory per device (decode.py).
  features what sinks, soft-cap, MLA head dims (192 / 128) and head dims 80 and 96 cost,
           beside the plain kernel and cuDNN (features.py).
  strategies  every strategy (ring, allgather, ulysses, hybrid, auto) against one device's
           cuDNN on the whole sequence / P, beside plain Ulysses+cuDNN and all-gather+cuDNN,
           turns interleaved; efficiency table, JSON and PNG (strategies.py).

FLOP convention (FlashAttention): forward 4 * B * N * T * S * H, halved when causal;
forward+backward = 3.5x forward. Time: median of --iters calls after max(--warmup, 1), wall
clock around block_until_ready. In the kernels mode the implementations of a row take turns:
each round times one call of each, in an order that rotates between rounds, so that a drift
of the device's clock falls on all of them alike; the ratio to cuDNN is the median of the
rounds' ratios.

Failures: a flag out of range, or given where it cannot take effect (a mode that does not
read it, --layout without a causal row), is a usage error (status 2) before any work; what
only the devices can refute (the strategies mode's --heads and --ulysses_size, --hlo_dir on
one device, --collectives_in_flight off GPUs) once they are known, before anything compiles.
When ringflash's own implementation (ringflash or xla) fails, the command prints its error
and exits with status 1; a peer baseline that fails (cuDNN on a CPU) is left out of its rows,
its error printed and recorded, unless nothing else was to run (--impls=cudnn on a CPU: status
1 too).
"""

from __future__ import annotations

import importlib
import os

import jax
from absl import flags

from ringflash.cli import MAX_SEQ_LEN
from ringflash.cli import UsageError
from ringflash.cli import command_flags
from ringflash.cli.bench import harness

FLAGS = flags.FLAGS

MODES = ("kernels", "features", "virtual", "layouts", "scaling", "longest", "strategies",
         "decode")


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """Defines this command's flags on `flag_values` (absl's FLAGS by default). The ringflash
  command calls it once before parsing; importing the module (as tests do) defines nothing.
  `ringflash launch` defines them on a FlagValues of its own to check a job's flags before
  it starts any process (job_from_flags)."""
  fv = {"flag_values": flag_values}
  flags.DEFINE_enum("mode", "kernels", list(MODES), "what to run", **fv)
  flags.DEFINE_list("seq_lens", ["4096", "16384", "65536"],
                    "sequence lengths, every mode but decode (kernels: T = S; virtual, "
                    "scaling: per device)", **fv)
  flags.DEFINE_integer("heads", 16, "query heads N", **fv)
  flags.DEFINE_list("kv_heads", ["16", "4"], "kv heads K per row group (16:4 = GQA)", **fv)
  flags.DEFINE_integer("head_dim", 128, "head dim H", **fv)
  flags.DEFINE_integer("batch", 1, "batch B", **fv)
  flags.DEFINE_list("causal", ["false", "true"],
                    "kernels, features, scaling, strategies: causal settings to run", **fv)
  flags.DEFINE_list("impls", list(harness.IMPLEMENTATIONS), "kernels: implementations", **fv)
  flags.DEFINE_integer("xla_max_len", 16384, "kernels, features: skip the xla backend above "
                       "this T", **fv)
  flags.DEFINE_list("gqa_seq_lens", ["16384"], "kernels: sequence lengths of the GQA rows", **fv)
  flags.DEFINE_integer("warmup", 2, "every mode but longest (which runs each length once): "
                       "untimed calls, at least one (the first call compiles)", **fv)
  flags.DEFINE_integer("iters", 5, "every mode but longest: timed calls (median); kernels "
                       "mode: rounds", **fv)
  flags.DEFINE_list("ring_sizes", ["2", "4", "8"], "virtual, layouts: ring sizes P", **fv)
  flags.DEFINE_string("out", "bench_out", "folder for JSON and PNG", **fv)
  flags.DEFINE_bool("backward", True,
                    "kernels, features, scaling, strategies: also time forward+backward", **fv)
  flags.DEFINE_enum("layout", "zigzag", ["contiguous", "zigzag", "striped"],
                    "scaling (with a causal row), longest: layout of the causal rows", **fv)
  flags.DEFINE_string("hlo_dir", "", "scaling, on 2 or more devices: write each ring "
                      "program's compiled HLO here", **fv)
  option = harness.OVERLAP_OPTION
  flags.DEFINE_integer("collectives_in_flight", harness.default_collectives_in_flight(),
                       "scaling, longest, on GPUs: how many collectives XLA may keep in "
                       f"flight at once (its option {option}); 0 leaves XLA's default, one",
                       lower_bound=0, **fv)
  flags.DEFINE_integer("run_max_len", 1 << 20, "longest: run (not only compile) total "
                       "lengths T up to this", **fv)
  flags.DEFINE_list("cache_lens", ["131072", "524288", "1048576"],
                    "decode: tokens in the cache (over all devices)", **fv)
  flags.DEFINE_integer("new_tokens", 1, "decode: query tokens t per step", **fv)
  flags.DEFINE_list("variants", ["plain", "sinks", "softcap", "mla", "h80", "h96"],
                    "features: the variants to run (plain, sinks, softcap, mla, h80, h96)", **fv)
  flags.DEFINE_integer("ulysses_size", 2, "strategies: devices of the hybrid strategy's "
                       "Ulysses axis (the devices as (P / U, U)), a divisor of P below P; 0 "
                       "leaves hybrid out (so does the default 2 where it does not fit: on "
                       "1, 2 or an odd number of devices)", lower_bound=0, **fv)


# The flags that only some modes read, and those modes: given on the command line with any
# other mode, such a flag is a usage error, not silently ignored (as are --layout given to
# scaling without a causal row, and --collectives_in_flight off GPUs: check_flags,
# check_devices).
MODE_FLAGS = {
    "seq_lens": tuple(m for m in MODES if m != "decode"),
    # longest compiles each length and runs it once (harness.seconds), untimed calls none
    "warmup": tuple(m for m in MODES if m != "longest"),
    "iters": tuple(m for m in MODES if m != "longest"),
    "causal": ("kernels", "features", "scaling", "strategies"),
    "backward": ("kernels", "features", "scaling", "strategies"),
    "impls": ("kernels",),
    "gqa_seq_lens": ("kernels",),
    "xla_max_len": ("kernels", "features"),
    "variants": ("features",),
    "ring_sizes": ("virtual", "layouts"),
    "layout": ("scaling", "longest"),
    "hlo_dir": ("scaling",),
    "collectives_in_flight": ("scaling", "longest"),
    "run_max_len": ("longest",),
    "cache_lens": ("decode",),
    "new_tokens": ("decode",),
    "ulysses_size": ("strategies",),
}


# The modes that run one kv-head count (the others run a row per --kv_heads entry).
ONE_KV_HEADS = ("features", "longest")


def _ints(f, name: str) -> list[int]:
  """The entries of list flag --name as ints, each >= 1."""
  values = getattr(f, name)
  if not values:
    raise UsageError(f"--{name} must list at least one integer >= 1")
  out = []
  for text in values:
    try:
      value = int(text)
    except ValueError:
      value = None
    if value is None or value < 1:
      raise UsageError(f"--{name} takes integers >= 1, got {text!r}")
    if value > MAX_SEQ_LEN:
      raise UsageError(f"--{name} takes integers up to 2**30 = {MAX_SEQ_LEN}, got {text}")
    out.append(value)
  return out


def _at_least(f, name: str, low: int) -> None:
  value = getattr(f, name)
  if value < low:
    raise UsageError(f"--{name} must be >= {low}, got {value}")


def check_flags(f, given=()) -> None:
  """Checks every flag before any work.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes).
    given: the names of the flags set on the command line.

  Raises:
    UsageError: one line naming the flag and what it allows.
  """
  for name in given:
    if f.mode not in MODE_FLAGS.get(name, MODES):
      raise UsageError(f"--{name} applies to --mode={' | '.join(MODE_FLAGS[name])}, not "
                       f"--mode={f.mode}")
  for name in ("heads", "head_dim", "batch", "iters"):
    _at_least(f, name, 1)
  for name in ("warmup", "xla_max_len", "run_max_len"):
    _at_least(f, name, 0)
  seq_lens = _ints(f, "seq_lens")
  _ints(f, "gqa_seq_lens")
  ring_sizes = _ints(f, "ring_sizes")
  if f.mode in ("virtual", "layouts") and max(seq_lens) * max(ring_sizes) > MAX_SEQ_LEN:
    # each row is a ring of P devices of seq_len tokens: P * seq_len in all, past the bound
    # of a sequence (the API refused it, with a traceback through the mode)
    raise UsageError(f"--seq_lens x --ring_sizes: {max(seq_lens)} tokens per device on "
                     f"{max(ring_sizes)} devices make {max(seq_lens) * max(ring_sizes)}, more "
                     f"than 2**30 = {MAX_SEQ_LEN} tokens")
  if f.mode == "decode":
    _at_least(f, "new_tokens", 1)
    _ints(f, "cache_lens")
  for kh in _ints(f, "kv_heads"):
    if f.heads % kh:
      raise UsageError(f"--kv_heads entries must divide --heads={f.heads} (GQA), got {kh}")
  if f.mode in ONE_KV_HEADS and "kv_heads" in given and len(f.kv_heads) != 1:
    # Without the flag each takes its entry of the default (features the first, longest
    # the last); given, the others would be dropped silently.
    raise UsageError(f"--mode={f.mode} runs one K: give --kv_heads one entry, got "
                     f"{','.join(f.kv_heads)}")
  causal = [c.lower() for c in f.causal]
  if not causal or any(c not in ("true", "false") for c in causal):
    raise UsageError(f"--causal takes entries true or false, got {','.join(f.causal)!r}")
  if not f.impls or any(i not in harness.IMPLEMENTATIONS for i in f.impls):
    raise UsageError(f"--impls takes entries of {','.join(harness.IMPLEMENTATIONS)}, got "
                     f"{','.join(f.impls)!r}")
  from ringflash.cli.bench import features  # pylint: disable=g-import-not-at-top
  if not f.variants:
    raise UsageError(f"--variants must list at least one of {','.join(features.VARIANTS)}")
  if any(x not in features.VARIANTS for x in f.variants):
    raise UsageError(f"--variants takes entries of {','.join(features.VARIANTS)}, got "
                     f"{','.join(f.variants)!r}")
  if not f.out:
    raise UsageError("--out must name a folder")
  if f.mode == "kernels":
    _check_kernel_rows(f, seq_lens, given)
  if f.mode == "features":
    _check_feature_rows(f, given)
  # scaling runs non-causal rows in the contiguous layout; longest's rows are all causal.
  if (f.mode == "scaling" and "layout" in given and f.layout != "contiguous"
      and "true" not in causal):
    raise UsageError(f"--layout={f.layout} applies to causal rows, and --causal="
                     f"{','.join(f.causal)} runs none (the others run contiguous)")
  # The zigzag layout cuts each device's rows in two chunks: the layouts mode always runs
  # its tiles; scaling (causal rows) and longest run it when --layout=zigzag.
  zigzag = f.mode == "layouts" or (f.layout == "zigzag" and (
      f.mode == "longest" or (f.mode == "scaling" and "true" in causal)))
  odd = [t for t in seq_lens if t % 2]
  if zigzag and odd:
    why = "--mode=layouts" if f.mode == "layouts" else f"--layout=zigzag (--mode={f.mode})"
    raise UsageError(f"--seq_lens must be even per device with {why}: the zigzag layout "
                     f"cuts them in two chunks, got {odd[0]}")


def _check_kernel_rows(f, seq_lens: list[int], given=()) -> None:
  """The kernels mode reads --seq_lens for the rows of K = N, --gqa_seq_lens for the other
  --kv_heads and --xla_max_len where --impls has xla: a length list given for rows that
  --kv_heads does not have, or --xla_max_len without xla, would be ignored. Every length must
  run some implementation: the xla backend is left out above --xla_max_len, and a length with
  nothing else to run would be a row of dashes."""
  kv = [int(kh) for kh in f.kv_heads]
  if "seq_lens" in given and f.heads not in kv:
    raise UsageError(f"--seq_lens are the lengths of the rows with K = N (--kv_heads="
                     f"{f.heads}), and --kv_heads={','.join(f.kv_heads)} has none; "
                     f"--gqa_seq_lens gives the lengths of the others")
  if "gqa_seq_lens" in given and all(kh == f.heads for kh in kv):
    raise UsageError(f"--gqa_seq_lens are the lengths of the GQA rows (--kv_heads below "
                     f"--heads={f.heads}), and --kv_heads={','.join(f.kv_heads)} has none")
  if "xla_max_len" in given and "xla" not in f.impls:
    raise UsageError(f"--xla_max_len limits the xla implementation, and --impls="
                     f"{','.join(f.impls)} does not run it")
  if set(f.impls) != {"xla"}:
    return
  lens = [t for kh in f.kv_heads
          for t in (seq_lens if int(kh) == f.heads else map(int, f.gqa_seq_lens))]
  over = [t for t in lens if t > f.xla_max_len]
  if over:
    raise UsageError(f"--impls=xla runs nothing at T={over[0]}: the xla backend is left out "
                     f"above --xla_max_len={f.xla_max_len}")


def _check_feature_rows(f, given=()) -> None:
  """The features mode's fixed-shape variants (mla: H = 192 / 128, h80, h96) ignore
  --head_dim, and only mla runs the xla backend (--xla_max_len): either flag given where no
  variant of --variants reads it would be ignored."""
  from ringflash.cli.bench import features  # pylint: disable=g-import-not-at-top
  if "head_dim" in given and all(v in features.FIXED_HEAD_DIMS for v in f.variants):
    raise UsageError(f"--head_dim applies to the variants {', '.join(features.OWN_HEAD_DIM)}; "
                     f"--variants={','.join(f.variants)} run head dims of their own")
  if "xla_max_len" in given and "mla" not in f.variants:
    raise UsageError(f"--xla_max_len limits the mla variant's xla row, and --variants="
                     f"{','.join(f.variants)} has no mla")


def given_flags(f) -> list[str]:
  """The flags of check_flags' `given` that the command line set."""
  return [name for name in (*MODE_FLAGS, "head_dim", "kv_heads") if f[name].present]


def job_from_flags(values: flags.FlagValues, *, folders: bool = True) -> None:
  """check_flags for `ringflash launch`, which checks a job's flags before it starts any
  process (as it does those of check and train). What the devices can refute, and the
  folders, are the processes' (check_devices, main)."""
  del folders
  check_flags(values, given=given_flags(values))


# The modes a job of several processes runs (each process its share of the devices); the
# others time one device's kernels (jax.devices()[0]: process 0's), or a baseline on it.
JOINT_MODES = ("scaling", "longest")


def check_processes(f, processes: int) -> None:
  """Refuses, by name, a mode that cannot run in a job of `processes` processes.

  Raises:
    UsageError: one line naming --mode.
  """
  if processes > 1 and f.mode not in JOINT_MODES:
    raise UsageError(f"--mode={f.mode} runs in one process (on its first device, or with a "
                     f"baseline there); a job of {processes} processes runs --mode="
                     f"{' or --mode='.join(JOINT_MODES)}: run {f.mode} without the launcher")


def check_devices(f, devices: list, given=()) -> None:
  """Checks what only the job's devices can refute, before anything compiles.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes).
    devices: the job's devices.
    given: the names of the flags set on the command line.

  Raises:
    UsageError: one line naming the flag.
  """
  # harness.compiler_options passes XLA options on GPUs only: elsewhere the flag is read by none
  platform = devices[0].platform
  if "collectives_in_flight" in given and platform != "gpu":
    raise UsageError(f"--collectives_in_flight is an option of XLA's GPU compiler, and this "
                     f"job's devices are {platform}")
  if f.mode == "scaling" and f.hlo_dir and len(devices) < 2:
    raise UsageError("--hlo_dir: the scaling mode writes the programs of rings of 2 or more "
                     "devices, and this job has 1 device")
  if f.mode == "strategies":
    from ringflash.cli.bench import strategies  # pylint: disable=g-import-not-at-top
    if "ulysses_size" not in given and not strategies.hybrid_fits(len(devices), f.ulysses_size):
      print(f"--ulysses_size: the default {f.ulysses_size} does not fit {len(devices)} "
            f"device(s); hybrid left out", flush=True)
      f.ulysses_size = 0
    strategies.check_devices(f, devices)


def main(argv):
  """Checks the flags, runs the mode, writes bench_<mode>.json (and the kernels plot)."""
  del argv
  given = given_flags(FLAGS)
  check_flags(FLAGS, given=given)
  from ringflash.launch import distributed  # pylint: disable=g-import-not-at-top

  distributed.initialize()      # a multi-process job (RINGFLASH_* set) joins before any device use
  with distributed.exit_promptly_on_error("bench"):
    # Processes started by hand may differ (another --mode or --seq_lens would leave a peer
    # waiting in a collective); --out and --hlo_dir are each process's own.
    distributed.agree_on_settings("bench", command_flags(exclude=("out", "hlo_dir")))
    check_processes(FLAGS, jax.process_count())
    check_devices(FLAGS, jax.devices(), given=given)
    # Last, as checking a folder creates it.
    for name in ("out", "hlo_dir"):
      problem = FLAGS[name].value and distributed.directory_problem(FLAGS[name].value)
      if problem:
        raise UsageError(f"--{name}={FLAGS[name].value}: {problem}")
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {len(jax.devices())} x {dev.device_kind}", flush=True)
    mode = importlib.import_module(f"ringflash.cli.bench.{FLAGS.mode}")
    try:
      rows = mode.run(FLAGS)
    except harness.ImplementationError as err:
      raise SystemExit(f"ringflash bench: {err}") from err
  if jax.process_index() != 0:     # process 0 of a multi-process job writes the files
    return
  meta = {"jax": jax.__version__, "device": dev.device_kind, "mode": FLAGS.mode,
          "processes": jax.process_count(), "devices": len(jax.devices())}
  if FLAGS.mode in MODE_FLAGS["iters"]:       # longest runs each length once
    meta |= {"warmup": FLAGS.warmup, "iters": FLAGS.iters}
  harness.write_json(FLAGS.out, FLAGS.mode, rows, meta)
  if FLAGS.mode == "kernels":
    harness.plot_kernels(rows, FLAGS.impls, os.path.join(FLAGS.out, "bench_kernels.png"))
  if FLAGS.mode == "strategies":
    mode.plot(rows, os.path.join(FLAGS.out, "bench_strategies.png"))
