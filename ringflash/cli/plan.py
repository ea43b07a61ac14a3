"""`ringflash plan`: per-device memory of ring attention on a TPU slice, compiled without a TPU.

Example:
  ringflash plan --topology v5p:4x4x4 --batch 1 --seq_len 1048576 --heads 32 --kv_heads 8 \
      --head_dim 128 --dtype bfloat16 --causal --mode train

Compiles deviceless for the topology (libtpu's TPU compiler, Mosaic kernels included), with the
sequence sharded over a ring of all its chips, and prints per-device memory from the compiled
program (arguments, temporaries, outputs), whether it fits the chip's HBM, the number of
collective-permutes per ring step and the kernel block sizes.

When it does not fit, the command says so and exits with status 1: either the compiled
program's total exceeds the chip's HBM, or the TPU compiler itself ran out of a memory
(HBM, or a kernel's VMEM or SMEM), e.g.

  does not fit: SMEM needs 1.13 MiB of 1.00 MiB available (the TPU compiler ran out of memory)

Flags are checked before anything is compiled; a mistake is one line and status 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile

from absl import flags

from ringflash.cli import UsageError
from ringflash.cli import hlo

FLAGS = flags.FLAGS

BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_gpu")


def define_flags() -> None:
  """Defines this command's flags on absl's FLAGS. The ringflash command calls it once
  before parsing; importing the module (as tests do) defines nothing."""
  flags.DEFINE_string("topology", "v5p:2x2x2", "TPU topology name <generation>:<AxBxC> or "
                      f"<AxB>, generation one of {', '.join(HBM_BYTES)}; e.g. v5p:4x4x4")
  flags.DEFINE_integer("batch", 1, "batch size B")
  flags.DEFINE_integer("seq_len", 131072, "global sequence length T (= S)")
  flags.DEFINE_integer("heads", 32, "query heads N")
  flags.DEFINE_integer("kv_heads", 8, "key/value heads K (N % K == 0)")
  flags.DEFINE_integer("head_dim", 128, "head dimension H")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32", "float16"],
                    "input dtype")
  flags.DEFINE_boolean("causal", False, "causal masking")
  flags.DEFINE_enum("mode", "train", ["forward", "train"],
                    "forward only, or forward + backward (value_and_grad)")
  flags.DEFINE_enum("backend", "auto", list(BACKENDS), "ringflash backend")


# HBM per chip, by the topology name's prefix.
HBM_BYTES = {"v4": 32 * 2**30, "v5e": 16 * 10**9, "v5litepod": 16 * 10**9,
             "v5p": 95 * 2**30, "v6e": 32 * 10**9}

# <generation>:<AxB> or <AxBxC>, each size >= 1 (libtpu aborts the process on a 0), with
# libtpu's optional twist suffix.
_TOPOLOGY = re.compile(r"(?P<gen>[a-z0-9]+):(?P<dims>[1-9][0-9]*(?:x[1-9][0-9]*){1,2})"
                       r"(?:_twisted|_untwisted)?")


def topology_chips(topology: str) -> int:
  """The number of chips a topology name describes (the product of its sizes).

  Raises:
    UsageError: naming --topology, unless it is <generation>:<AxBxC> (or <AxB>) with a
      generation of HBM_BYTES.
  """
  match = _TOPOLOGY.fullmatch(topology)
  if match is None or match["gen"] not in HBM_BYTES:
    raise UsageError(f"--topology must be a TPU topology <generation>:<AxBxC> or <AxB> with "
                     f"sizes >= 1 and a generation of {', '.join(HBM_BYTES)} (e.g. "
                     f"v5p:2x2x2), got {topology!r}")
  return math.prod(int(d) for d in match["dims"].split("x"))


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
  if f.seq_len % chips:
    raise UsageError(f"--seq_len={f.seq_len} must be divisible by the {chips} chips of "
                     f"--topology={f.topology}")


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
  """What the TPU compiler said when a program did not fit one of the chip's memories.

  Attributes:
    memory: "HBM", "VMEM" or "SMEM".
    needed: bytes the program needs (None when the message did not say).
    available: bytes the memory has (None when the message did not say).
  """

  memory: str
  needed: int | None
  available: int | None

  def __str__(self) -> str:
    if self.needed is None or self.available is None:
      return f"{self.memory} needs more than it has"
    return f"{self.memory} needs {_size(self.needed)} of {_size(self.available)} available"


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)i?B?"
_MEMORIES = ("hbm", "vmem", "smem")
# The compiler's wording, one pattern per form of its message: (memory, needed, available).
_OOM_FORMS = (
    # "Ran out of memory in memory space smem. Used 1.13M of 1.00M smem." (also vmem, hbm)
    re.compile(rf"Ran out of memory in memory space (\w+)\. Used {_SIZE} of {_SIZE}"),
    # "Ran out of memory on HBM, the total memory required for HLO temporaries (124.91G)
    # exceeds available HBM (95.73G)."
    re.compile(rf"Ran out of memory on (\w+)\b.*?\({_SIZE}\) exceeds available \w+ "
               rf"\({_SIZE}\)", re.S),
)
_OOM_NAME = re.compile(r"Ran out of memory (?:in memory space|on) (\w+)")


def parse_out_of_memory(message: str) -> OutOfMemory | None:
  """The memory and sizes of the TPU compiler's out-of-memory error; None if `message` is
  not one. Sizes are XLA's (K = 1024 bytes): "Used 1.13M of 1.00M smem" -> SMEM, 1184891,
  1048576 bytes."""
  for form in _OOM_FORMS:
    match = form.search(message)
    if match and match[1].lower() in _MEMORIES:
      need = float(match[2]) * _UNITS[match[3]]
      have = float(match[4]) * _UNITS[match[5]]
      return OutOfMemory(match[1].upper(), round(need), round(have))
  match = _OOM_NAME.search(message)
  if match and match[1].lower() in _MEMORIES:
    return OutOfMemory(match[1].upper(), None, None)
  return None


def _size(n: float) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


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
         head_dim: int, dtype: str, causal: bool, mode: str, backend: str = "auto") -> dict:
  """Compiles the attention step for `topology` without a TPU; returns the figures.

  Returns:
    {topology, chips, device_kind, backend, tokens_per_chip, block_q, block_k, arguments,
    temporaries, outputs, total, hbm, fits, permutes_per_step, all_gathers, out_of_memory}.
    When the TPU compiler ran out of memory, out_of_memory is its OutOfMemory, fits is
    False and the compiled program's figures (arguments ... all_gathers) are None.

  Raises:
    UsageError: libtpu rejects the topology, seq_len does not divide over its devices, or
      ringflash cannot run these shapes with this backend.
  """
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import ringflash  # pylint: disable=g-import-not-at-top
  from ringflash import introspect  # pylint: disable=g-import-not-at-top

  devices = topology_devices(topology)
  ring = len(devices)
  if seq_len % ring:
    raise UsageError(f"--seq_len={seq_len} must be divisible by the {ring} devices of "
                     f"--topology={topology}")
  dt = jnp.dtype(dtype)
  local = [jax.ShapeDtypeStruct((batch, seq_len // ring, h, head_dim), dt)
           for h in (heads, kv_heads, kv_heads)]
  try:
    spec = introspect.ring_spec(*local, ring_size=ring, device=devices[0], is_causal=causal,
                                backend=backend)
  except (ValueError, NotImplementedError) as err:
    raise UsageError(f"--backend={backend} cannot run these flags: {err}") from None
  hbm = HBM_BYTES.get(topology.split(":")[0])
  report = {
      "topology": topology, "chips": ring, "device_kind": devices[0].device_kind,
      "backend": spec.backend, "tokens_per_chip": seq_len // ring,
      "block_q": spec.kernel.block_q, "block_k": spec.kernel.block_k, "hbm": hbm,
      "arguments": None, "temporaries": None, "outputs": None, "total": None, "fits": None,
      "permutes_per_step": None, "all_gathers": None, "out_of_memory": None,
  }

  mesh = Mesh(np.array(devices), ("sp",))
  sharding = NamedSharding(mesh, P(None, "sp", None, None))
  args = [jax.ShapeDtypeStruct((batch, seq_len, h, head_dim), dt, sharding=sharding)
          for h in (heads, kv_heads, kv_heads)]

  def attn(q, k, v):
    return ringflash.ring_attention(q, k, v, mesh=mesh, is_causal=causal, backend=backend)

  if mode == "train":
    fn = jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2),
                            argnums=(0, 1, 2))
  else:
    fn = attn
  try:
    compiled = jax.jit(fn).lower(*args).compile()
  except jax.errors.JaxRuntimeError as err:
    oom = parse_out_of_memory(str(err))
    if oom is None:
      raise
    return report | {"fits": False, "out_of_memory": oom}
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  total = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
  return report | {
      "arguments": mem.argument_size_in_bytes, "temporaries": mem.temp_size_in_bytes,
      "outputs": mem.output_size_in_bytes, "total": total,
      "fits": None if hbm is None else total <= hbm,
      "permutes_per_step": _permutes_per_loop_body(text),
      "all_gathers": len(re.findall(r" all-gather(?:-start)?\(", text)),
  }


def _permutes_per_loop_body(text: str) -> list[int]:
  """Collective-permutes in each while-loop body of a compiled module, in order.

  A ring loop body runs one step; it sends one permute per array that travels (k and v as
  one array; in the backward also the dk/dv accumulators, one array; segment ids if given).
  Asynchronous permutes are counted by their start, synchronous ones as they are.
  """
  comps, _ = hlo.computations(text)
  bodies = hlo.loop_bodies(comps)
  counts = [sum(map(hlo.is_permute, lines)) for name, lines in comps.items() if name in bodies]
  return [c for c in counts if c]


def _gib(x):
  return f"{x / 2**30:8.2f} GiB"


def main(argv):
  """Checks the flags, compiles, prints the plan; exits with status 1 when it does not fit."""
  del argv
  check_flags(FLAGS)
  r = plan(FLAGS.topology, batch=FLAGS.batch, seq_len=FLAGS.seq_len, heads=FLAGS.heads,
           kv_heads=FLAGS.kv_heads, head_dim=FLAGS.head_dim, dtype=FLAGS.dtype,
           causal=FLAGS.causal, mode=FLAGS.mode, backend=FLAGS.backend)
  print(f"{r['topology']} ({r['chips']} x {r['device_kind']}), backend {r['backend']}, "
        f"{r['tokens_per_chip']} tokens per chip, blocks bq={r['block_q']} bk={r['block_k']}")
  if r["out_of_memory"] is not None:
    print(f"  does not fit: {r['out_of_memory']} (the TPU compiler ran out of memory)",
          flush=True)
    raise SystemExit(1)
  print(f"  per device  arguments {_gib(r['arguments'])}  temporaries {_gib(r['temporaries'])}"
        f"  outputs {_gib(r['outputs'])}  total {_gib(r['total'])}")
  if r["hbm"] is not None:
    room = r["hbm"] - r["total"]
    print(f"  HBM {_gib(r['hbm'])}: {'fits' if r['fits'] else 'DOES NOT FIT'} "
          f"({_gib(abs(room)).strip()} {'left' if room >= 0 else 'short'})")
  print(f"  collective-permutes per ring step (per loop body): {r['permutes_per_step']}; "
        f"all-gathers: {r['all_gathers']}", flush=True)
  if r["fits"] is False:
    raise SystemExit(1)
