"""`ringflash plan`: per-device memory of ring attention on a TPU slice, compiled without a TPU.

Example:
  ringflash plan --topology v5p:4x4x4 --batch 1 --seq_len 1048576 --heads 32 --kv_heads 8 \
      --head_dim 128 --dtype bfloat16 --causal --mode train

  ringflash plan --topology v5p:2x2x2 --heads 32 --kv_heads 8 --head_dim 128 --causal \
      --max_seq_len

Compiles deviceless for the topology (libtpu's TPU compiler, Mosaic kernels included), with the
sequence sharded over a ring of all its devices, and prints per-device memory from the compiled
program (arguments, temporaries, outputs), whether it fits a device's HBM, the number of
collective-permutes per ring step and the kernel block sizes; then what the temporaries are at
their peak (the buffers live at that point of the schedule, from the compiler's buffer
assignment, grouped by what they hold), against the step's unavoidable arrays (q, k, v, out,
lse, dout, the gradients and their fp32 accumulators).

--max_seq_len (or --max-seq-len) finds the longest sequence that fits the topology instead, by
compiling (`longest`: --seq_len first, then extrapolation, as memory is linear in the length,
then bisection to 1/64, in multiples of 1024 tokens per device); it prints every length it
compiled and the plan of the longest.

A device is what libtpu lists for the topology: a chip on v5e, v5p and v6e; on v4 each of a
chip's two TensorCores (v4:2x2x1 is 8 devices), each with half the chip's HBM.

When it does not fit, the command says so and exits with status 1: either the compiled
program's total exceeds a device's HBM, or the TPU compiler itself ran out of a memory
(HBM, or a kernel's VMEM or SMEM), e.g.

  does not fit: HBM needs 124.91 GiB of 95.73 GiB available (the TPU compiler ran out of memory)

--strategy (default ring) picks the strategy over the devices; with --strategy=auto the plan
compiles the cost model's choice and prints ringflash.explain's estimate of every strategy.

Flags are checked before anything is compiled; a mistake is one line and status 2.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile

from absl import flags

from ringflash.cli import MAX_SEQ_LEN
from ringflash.cli import UsageError
from ringflash.cli import hlo
from ringflash.cli.memory import Shapes
from ringflash.cli.memory import parse_out_of_memory
from ringflash.cli.memory import read_breakdown

FLAGS = flags.FLAGS

BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_gpu")
STRATEGIES = ("ring", "auto", "allgather", "ulysses")
# --max_seq_len: tokens per device are multiples of this, and the search stops within 1/64.
SEARCH_QUANTUM = 1024
SEARCH_PRECISION = 1 / 64


def define_flags() -> None:
  """Defines this command's flags on absl's FLAGS. The ringflash command calls it once
  before parsing; importing the module (as tests do) defines nothing."""
  flags.DEFINE_string("topology", "v5p:2x2x2", "TPU topology name <generation>:<AxBxC> or "
                      f"<AxB>, generation one of {', '.join(HBM_BYTES)}; e.g. v5p:4x4x4 "
                      f"({', '.join(PLANAR)}: 2-D, e.g. v5e:4x8)")
  flags.DEFINE_integer("batch", 1, "batch size B")
  flags.DEFINE_integer("seq_len", 131072, "global sequence length T (= S)",
                       upper_bound=MAX_SEQ_LEN)
  flags.DEFINE_integer("heads", 32, "query heads N")
  flags.DEFINE_integer("kv_heads", 8, "key/value heads K (N % K == 0)")
  flags.DEFINE_integer("head_dim", 128, "head dimension H")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32", "float16"],
                    "input dtype")
  flags.DEFINE_boolean("causal", False, "causal masking")
  flags.DEFINE_enum("mode", "train", ["forward", "train"],
                    "forward only, or forward + backward (value_and_grad)")
  flags.DEFINE_enum("backend", "auto", list(BACKENDS), "ringflash backend")
  flags.DEFINE_enum("strategy", "ring", list(STRATEGIES), "ringflash strategy (a 1-D mesh)")
  flags.DEFINE_boolean("max_seq_len", False, "find the longest sequence that fits, by "
                       "compiling (--seq_len is the first length tried)")
  flags.DEFINE_alias("max-seq-len", "max_seq_len")


# HBM per chip, by the topology name's prefix.
HBM_BYTES = {"v4": 32 * 2**30, "v5e": 16 * 10**9, "v5p": 95 * 2**30, "v6e": 32 * 10**9}

# The generations whose slices are 2-D (chips linked along x and y only). libtpu still takes
# a third size there and reads v5e:2x2x2 as two hosts of 2x2 chips stacked along a z axis that
# these chips do not have (chip coordinates z = 0, 1): no slice that exists. And it aborts the
# process (`Check failed: Topology()->chip_bounds().z == 1`) when it compiles for some of
# them, v5e:4x4x2 and v5e:4x4x4 among them. So a third size must be 1.
PLANAR = ("v5e", "v6e")
# More chips than any slice has (v5p's largest is 8960, v4's 4096): libtpu crashed on a
# topology of 10^9 chips (a SystemError from its bindings, after half a minute).
MAX_CHIPS = 2**14

# <generation>:<AxB> or <AxBxC>, each size >= 1 (libtpu aborts the process on a 0), with
# libtpu's optional twist suffix.
_TOPOLOGY = re.compile(r"(?P<gen>[a-z0-9]+):(?P<dims>[1-9][0-9]*(?:x[1-9][0-9]*){1,2})"
                       r"(?:_twisted|_untwisted)?")


def topology_chips(topology: str) -> int:
  """The number of chips a topology name describes (the product of its sizes).

  Raises:
    UsageError: naming --topology, unless it is <generation>:<AxBxC> (or <AxB>) with a
      generation of HBM_BYTES, and 2-D (<AxB> or <AxBx1>) for one of PLANAR.
  """
  match = _TOPOLOGY.fullmatch(topology)
  if match is None or match["gen"] not in HBM_BYTES:
    raise UsageError(f"--topology must be a TPU topology <generation>:<AxBxC> or <AxB> with "
                     f"sizes >= 1 and a generation of {', '.join(HBM_BYTES)} (e.g. "
                     f"v5p:2x2x2), got {topology!r}")
  dims = [int(d) for d in match["dims"].split("x")]
  if match["gen"] in PLANAR and dims[2:] not in ([], [1]):
    raise UsageError(f"--topology={topology}: {match['gen']} slices are 2-D, give <AxB> "
                     f"(e.g. {match['gen']}:2x4 for 8 chips); libtpu reads a third size as "
                     f"hosts stacked along an axis these chips do not have, and aborts on some")
  chips = math.prod(dims)
  if chips > MAX_CHIPS:
    raise UsageError(f"--topology={topology} names {chips} chips, more than any TPU slice "
                     f"(at most 2**14 = {MAX_CHIPS} here)")
  return chips


def check_flags(f) -> None:
  """Checks every flag before anything is compiled.

  Args:
    f: the parsed flags (absl's FLAGS, or anything with the same attributes).

  Raises:
    UsageError: one line naming the flag and what it allows.
  """
  chips = topology_chips(f.topology)
  for name in ("batch", "seq_len", "heads", "kv_heads", "head_dim"):
    if getattr(f, name) < 1:
      raise UsageError(f"--{name} must be > 0, got {getattr(f, name)}")
  if f.heads % f.kv_heads:
    raise UsageError(f"--kv_heads={f.kv_heads} must divide --heads={f.heads} (GQA)")
  if f.seq_len % chips and not getattr(f, "max_seq_len", False):
    raise UsageError(f"--seq_len={f.seq_len} must be divisible by the {chips} chips of "
                     f"--topology={f.topology}")


@contextlib.contextmanager
def _stderr_to(sink):
  """Sends what is written to file descriptor 2 (C++ included) to `sink` meanwhile."""
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    os.dup2(sink.fileno(), 2)
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def topology_devices(topology: str) -> list:
  """The devices of a TPU topology, from libtpu, without a TPU.

  libtpu's start-up on a host without TPUs logs warnings about the TPU VM it is not on
  (worker hostnames, host bounds); they are not news to a deviceless compile and are
  dropped, unless the call fails for another reason than the name.

  Raises:
    UsageError: naming --topology, when libtpu rejects it.
  """
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryFile("w+") as sink:
    said = False          # whether the log can be dropped: the outcome says all there is
    try:
      with _stderr_to(sink):
        devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
      said = True
    except jax.errors.JaxRuntimeError as err:
      if "INVALID_ARGUMENT" not in str(err):
        raise
      said = True
      reason = str(err).replace("INVALID_ARGUMENT:", "").strip().splitlines()[0]
      raise UsageError(f"--topology={topology} is not one libtpu knows: {reason}") from None
    finally:
      if not said:
        sink.seek(0)
        sys.stderr.write(sink.read())
  return devices


def plan(topology: str, *, batch: int, seq_len: int, heads: int, kv_heads: int,
         head_dim: int, dtype: str, causal: bool, mode: str, backend: str = "auto",
         strategy: str = "ring", breakdown: bool = True) -> dict:
  """Compiles the attention step for `topology` without a TPU; returns the figures.

  Args:
    breakdown: also read what the temporaries are at their peak (the compiler's buffer
      assignment, dumped to a temporary directory).

  Returns:
    {topology, chips, devices, device_kind, backend, strategy (the one compiled: auto's
    choice), requested, explain (ringflash.explain's table), mode, tokens_per_device, block_q,
    block_k,
    arguments, temporaries, outputs, total, hbm, fits, permutes_per_step, all_gathers,
    out_of_memory, cannot_run, breakdown, unavoidable}. When the TPU compiler ran out of
    memory, out_of_memory is its OutOfMemory, fits is False and the compiled program's
    figures (arguments ... all_gathers, breakdown) are None; so they are when tracing found
    that the call cannot run (a kernel's grid past its bound), and cannot_run says why.
    breakdown is a Breakdown (None when not asked or not readable); unavoidable the bytes
    of the step's unavoidable arrays.

  backend, block_q and block_k are those ringflash.explain resolves for the global arrays,
  which ring_attention runs (it pads a sequence its kernels do not tile).

  Raises:
    UsageError: libtpu rejects the topology, seq_len does not divide over its devices, or
      ringflash.explain refuses the flags (naming --backend, --strategy or both: _refusal).
  """
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import ringflash  # pylint: disable=g-import-not-at-top

  devices = topology_devices(topology)
  ring = len(devices)
  if seq_len % ring:
    raise UsageError(f"--seq_len={seq_len} must be divisible by the {ring} devices of "
                     f"--topology={topology}")
  dt = jnp.dtype(dtype)
  mesh = Mesh(np.array(devices), ("sp",))
  sharding = NamedSharding(mesh, P(None, "sp", None, None))
  args = [jax.ShapeDtypeStruct((batch, seq_len, h, head_dim), dt, sharding=sharding)
          for h in (heads, kv_heads, kv_heads)]

  def explain(backend, strategy):
    return ringflash.explain(*args, mesh=mesh, is_causal=causal, backend=backend,
                             strategy=strategy)

  try:     # what ring_attention runs: the strategy (auto: the cost model's), backend, tiles
    choice = explain(backend, strategy)
  except (ValueError, NotImplementedError) as err:
    raise UsageError(_refusal(explain, backend, strategy, err)) from None
  # HBM_BYTES is a chip's; a v4 chip is two devices (a TensorCore each), sharing it.
  hbm = HBM_BYTES[topology.split(":")[0]] * topology_chips(topology) // ring
  shapes = Shapes(batch=batch, tokens=seq_len // ring, heads=heads, kv_heads=kv_heads,
                  head_dim=head_dim, dtype=dtype, train=mode == "train")
  report = {
      "topology": topology, "chips": topology_chips(topology), "devices": ring,
      "device_kind": devices[0].device_kind,
      "backend": choice.backend, "strategy": choice.strategy, "requested": strategy,
      "explain": str(choice), "mode": mode, "tokens_per_device": seq_len // ring,
      # the tiles of the strategy's kernel calls (Ulysses': over the whole sequence)
      "block_q": getattr(choice.tiles, "block_q", None),
      "block_k": getattr(choice.tiles, "block_k", None), "hbm": hbm,
      "arguments": None, "temporaries": None, "outputs": None, "total": None, "fits": None,
      "permutes_per_step": None, "all_gathers": None, "out_of_memory": None,
      "cannot_run": None,
      "breakdown": None, "unavoidable": shapes.unavoidable(),
  }

  def attn(q, k, v):      # the backend and strategy resolved: what the report says
    return ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal,
                                    backend=choice.backend, strategy=choice.strategy)

  if mode == "train":
    fn = jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2),
                            argnums=(0, 1, 2))
  else:
    fn = attn
  with tempfile.TemporaryDirectory(prefix="ringflash_plan_") as dump:
    try:
      lowered = jax.jit(fn).lower(*args)
      compiled = (lowered.compile(compiler_options={"xla_dump_to": dump}) if breakdown
                  else lowered.compile())
    except jax.errors.JaxRuntimeError as err:
      oom = parse_out_of_memory(str(err))
      if oom is None:
        raise
      return report | {"fits": False, "out_of_memory": oom}
    except NotImplementedError as err:   # found while tracing: a kernel's grid bound
      return report | {"fits": False, "cannot_run": str(err)}
    found = read_breakdown(dump, shapes) if breakdown else None
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  total = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
  return report | {
      "arguments": mem.argument_size_in_bytes, "temporaries": mem.temp_size_in_bytes,
      "outputs": mem.output_size_in_bytes, "total": total,
      "fits": None if hbm is None else total <= hbm,
      "permutes_per_step": _permutes_per_loop_body(text),
      "all_gathers": len(re.findall(r" all-gather(?:-start)?\(", text)),
      "breakdown": found,
  }


def _refusal(explain, backend: str, strategy: str, err: Exception) -> str:
  """The one line of a refusal by ringflash.explain, naming the flags that refuse.

  The flag is the one whose automatic choice runs: --backend when explain runs these flags with
  backend "auto" (the named backend refuses them), else --strategy when it runs them with
  strategy "auto"; else both, as given.

  Args:
    explain: explain(backend, strategy) -> the choice of ringflash.explain for these flags.
  """
  def runs(b, s):
    try:
      explain(b, s)
    except (ValueError, NotImplementedError):
      return False
    return True

  if backend != "auto" and runs("auto", strategy):
    return f"--backend={backend} cannot run these flags: {err}"
  if strategy != "auto" and runs(backend, "auto"):
    return f"--strategy={strategy} cannot run these flags: {err}"
  return f"--backend={backend} --strategy={strategy} cannot run these flags: {err}"


def _permutes_per_loop_body(text: str) -> list[int]:
  """Collective-permutes in each while-loop body of a compiled module, in order: a ring step
  sends one per array that travels (k and v as one; in the backward also the dk/dv
  accumulators; segment ids if given); asynchronous ones counted by their start."""
  comps, _ = hlo.computations(text)
  bodies = hlo.loop_bodies(comps)
  counts = [sum(map(hlo.is_permute, lines)) for name, lines in comps.items() if name in bodies]
  return [c for c in counts if c]


# ---------------------------------------------------------------------------------------------
# The longest sequence that fits.

def longest(probe, *, start: int, quantum: int = SEARCH_QUANTUM,
            precision: float = SEARCH_PRECISION):
  """The largest tokens-per-device n (a multiple of `quantum`) with probe(n)["fits"], and every
  probe's report, in the order they ran.

  probe(n) compiles at n tokens per device and returns a plan's report. Memory is about linear
  in n: from the last two lengths that fit, the next is just below where their line reaches
  the HBM (at most 64 times the longest that fits; without a line, twice it), or, once that
  point fits, just above it; the first that does not fit brackets the limit, and bisection
  narrows the bracket to `precision` of the answer. A length that fails for another memory
  (VMEM, SMEM) counts as not fitting; its report says which.

  Returns:
    (n, or None when not even `quantum` tokens fit; [report, ...]).
  """
  runs = []

  def fits(n):
    runs.append(probe(n))
    return bool(runs[-1]["fits"])

  def down(n):
    return max(quantum, int(n) // quantum * quantum)

  n = down(start)
  if fits(n):
    lo, hi = n, None
  else:
    lo, hi = None, n
    while lo is None:
      if hi <= quantum:
        return None, runs
      n = down(hi // 2)
      if fits(n):
        lo = n
      else:
        hi = n
  while hi is None:
    ok = [r for r in runs if r["fits"]]
    guess = 2 * lo
    if len(ok) >= 2 and ok[-1]["hbm"] and ok[-1]["total"] > ok[-2]["total"]:
      a, b = ok[-2], ok[-1]
      slope = (b["total"] - a["total"]) / (b["tokens_per_device"] - a["tokens_per_device"])
      line = b["tokens_per_device"] + (b["hbm"] - b["total"]) / slope
      guess = line * (1 - precision)
      if guess <= lo * (1 + precision):
        guess = lo * (1 + 2 * precision) + quantum
    n = max(down(min(guess, 64 * lo)), lo + quantum)
    if fits(n):
      lo = n
    else:
      hi = n
  while hi - lo > max(quantum, precision * lo):
    n = down((lo + hi) // 2)
    if n <= lo:
      break
    if fits(n):
      lo = n
    else:
      hi = n
  return lo, runs


# ---------------------------------------------------------------------------------------------
# Printing.

def _gib(x):
  return f"{x / 2**30:8.2f} GiB"


def _kib(x):
  return f"{x / 2**10:.1f} KiB"


def _model(f) -> str:
  return (f"{f.mode}, {'causal' if f.causal else 'full'}, B={f.batch}, N={f.heads}, "
          f"K={f.kv_heads}, H={f.head_dim}, {f.dtype}")


def print_plan(r) -> None:
  """The plan's figures, breakdown included."""
  shared = f", {r['chips']} chips" if r["chips"] != r["devices"] else ""
  print(f"{r['topology']} ({r['devices']} x {r['device_kind']}{shared}), backend "
        f"{r['backend']}, strategy {r['strategy']}, {r['tokens_per_device']} tokens per device, "
        f"blocks "
        f"bq={r['block_q']} bk={r['block_k']}")
  if r.get("requested") == "auto":
    print("  " + r["explain"].replace("\n", "\n  "))
  if r["out_of_memory"] is not None:
    print(f"  does not fit: {r['out_of_memory']} (the TPU compiler ran out of memory)",
          flush=True)
    return
  if r.get("cannot_run") is not None:
    print(f"  cannot run: {r['cannot_run']}", flush=True)
    return
  per_token = r["total"] / r["tokens_per_device"]
  print(f"  per device  arguments {_gib(r['arguments'])}  temporaries {_gib(r['temporaries'])}"
        f"  outputs {_gib(r['outputs'])}  total {_gib(r['total'])}  ({_kib(per_token)} per "
        f"token)")
  if r["hbm"] is not None:
    room = r["hbm"] - r["total"]
    print(f"  HBM {_gib(r['hbm'])}: {'fits' if r['fits'] else 'DOES NOT FIT'} "
          f"({_gib(abs(room)).strip()} {'left' if room >= 0 else 'short'})")
  print(f"  collective-permutes per ring step (per loop body): {r['permutes_per_step']}; "
        f"all-gathers: {r['all_gathers']}")
  b = r["breakdown"]
  if b is not None:
    print(f"  temporaries at their peak: {_gib(b.peak).strip()} live of "
          f"{_gib(b.allocated).strip()} allocated")
    for role, size, count, members in b.groups:
      shown = ", ".join(members[:3]) + (", ..." if len(members) > 3 else "")
      print(f"    {_gib(size)}  {count} x {role}   [{shown}]")
  arrays = ("q, k, v, out, lse, dout, the gradients, fp32 accumulators of dq, dk, dv"
            if r["mode"] == "train" else "q, k, v, out, lse, the fp32 accumulator of out")
  print(f"  unavoidable ({arrays}): {_gib(r['unavoidable']).strip()}; total / unavoidable "
        f"{r['total'] / r['unavoidable']:.2f}", flush=True)


def main(argv):
  """Checks the flags, compiles, prints the plan; exits with status 1 when it does not fit."""
  del argv
  check_flags(FLAGS)
  model = dict(batch=FLAGS.batch, heads=FLAGS.heads, kv_heads=FLAGS.kv_heads,
               head_dim=FLAGS.head_dim, dtype=FLAGS.dtype, causal=FLAGS.causal,
               mode=FLAGS.mode, backend=FLAGS.backend, strategy=FLAGS.strategy)
  if FLAGS.max_seq_len:
    ring = len(topology_devices(FLAGS.topology))
    print(f"longest sequence that fits {FLAGS.topology} ({_model(FLAGS)}), by compiling:",
          flush=True)

    def probe(n):
      r = plan(FLAGS.topology, seq_len=n * ring, breakdown=False, **model)
      said = (f"does not fit: {r['out_of_memory']}" if r["out_of_memory"] is not None else
              f"cannot run: {r['cannot_run']}" if r.get("cannot_run") is not None else
              f"{_gib(r['total']).strip()}  {'fits' if r['fits'] else 'DOES NOT FIT'}")
      print(f"  {n:>9} tokens per device ({n * ring} in all): {said}", flush=True)
      return r

    best, _ = longest(probe, start=max(SEARCH_QUANTUM, FLAGS.seq_len // ring))
    if best is None:
      print(f"  not even {SEARCH_QUANTUM} tokens per device fit", flush=True)
      raise SystemExit(1)
    print(f"longest: {best * ring} tokens ({best} per device)\n", flush=True)
    print_plan(plan(FLAGS.topology, seq_len=best * ring, **model))
    return
  r = plan(FLAGS.topology, seq_len=FLAGS.seq_len, **model)
  print_plan(r)
  if r["fits"] is False:               # so it is where the compiler ran out or it cannot run
    raise SystemExit(1)
