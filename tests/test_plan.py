"""`ringflash plan`: deviceless TPU compile reporting per-device memory, what the temporaries
are at their peak, the ring's shape, and the longest sequence that fits (--max_seq_len)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import os
import re
import subprocess
import sys
import types

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402

from ringflash.cli import UsageError  # noqa: E402
from ringflash.cli import memory as compiler_memory  # noqa: E402
from ringflash.cli import plan as planner  # noqa: E402

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="needs libtpu (the `tpu` extra) for deviceless compile")


@needs_libtpu
@pytest.mark.slow       # two training-step compiles with the memory breakdown: 90 s on two cores
def test_plan_reports_memory_fit_and_ring_permutes():
  small = planner.plan("v5e:2x4", batch=1, seq_len=65536, heads=8, kv_heads=2, head_dim=128,
                       dtype="bfloat16", causal=True, mode="train", backend="auto")
  assert small["backend"] == "pallas_tpu" and small["chips"] == 8
  assert small["tokens_per_device"] == 8192
  # One loop body per ring: forward sends k and v (one array); backward also the dk/dv
  # accumulators (one array). Positions are computed, not sent.
  assert small["permutes_per_step"] == [1, 2]
  assert small["all_gathers"] == 0
  assert small["fits"] and 0 < small["total"] < small["hbm"]
  assert small["out_of_memory"] is None
  # What the temporaries are at their peak: the backward's fp32 dq (accumulator and one hop's
  # kernel output), dK/dV accumulators, K/V; at least the unavoidable arrays in all.
  found = small["breakdown"]
  assert found is not None and 0 < found.peak <= found.allocated <= small["temporaries"]
  roles = {role: size for role, size, _, _ in found.groups}
  assert roles["o or dq, fp32: accumulator, or one hop's kernel output"] >= 2 * 8192 * 8 * 128 * 4
  assert sum(roles.values()) == found.peak
  assert 0 < small["unavoidable"] <= small["total"]
  big = planner.plan("v5e:2x4", batch=1, seq_len=131072, heads=8, kv_heads=2, head_dim=128,
                     dtype="bfloat16", causal=True, mode="train", backend="auto")
  # Twice the tokens per chip: every buffer is linear in the length (measured 2.4x, as the
  # compiler keeps a shrinking share of small buffers on chip); scores would make it 4x.
  assert 1.5 < big["temporaries"] / small["temporaries"] < 3.0


@needs_libtpu
def test_auto_plans_the_cost_models_choice_and_shows_every_strategy(capsys):
  """On 64 chips of v5p, GQA 32/8: Ulysses cannot shard 32 heads over 64 chips; auto
  compiles the strategy explain() chose, and the plan prints its table."""
  model = dict(batch=1, seq_len=64 * 2048, heads=32, kv_heads=8, head_dim=128,
               dtype="bfloat16", causal=True, mode="forward", backend="auto", breakdown=False)
  with pytest.raises(UsageError, match="--strategy=ulysses.*multiple of 64"):
    planner.plan("v5p:4x4x4", strategy="ulysses", **model)
  r = planner.plan("v5p:4x4x4", strategy="auto", **model)
  assert r["requested"] == "auto" and r["strategy"] in ("ring", "allgather"), r["strategy"]
  assert r["fits"] and r["chips"] == 64
  # The ring's loop permutes K/V each step; all-gather has no ring loop (on TPU its gather
  # compiles to an all-reduce).
  assert bool(r["permutes_per_step"]) == (r["strategy"] == "ring"), r["permutes_per_step"]
  planner.print_plan(r)
  out = capsys.readouterr().out
  assert f"strategy {r['strategy']}," in out
  tiles = re.search(r"block_q=(\d+), block_k=(\d+)", r["explain"])    # the chosen kernel's
  assert f"blocks bq={tiles[1]} bk={tiles[2]}" in out
  assert f"* {r['strategy']}" in out and "ulysses    not possible" in out



_TINY = dict(batch=1, seq_len=96, heads=8, kv_heads=8, head_dim=128, dtype="bfloat16",
             causal=False, mode="forward", breakdown=False)


@needs_libtpu
def test_a_length_whose_kernel_grid_passes_mosaics_bound_cannot_run(capsys):
  """2^27 tokens a device of one head: 2^18 x 2^18 tiles of 512, past the 2**31 - 1 grid
  steps Mosaic counts. libtpu's RET_CHECK ("Iteration bounds are too large") ended --max_seq_len's
  search in a traceback; the report now says the call cannot run, and the search counts it
  as not fitting."""
  model = dict(batch=1, heads=1, kv_heads=1, head_dim=8, dtype="bfloat16", causal=False,
               mode="forward", breakdown=False)
  r = planner.plan("v5p:2x2x1", seq_len=4 * 2**27, backend="pallas_tpu", **model)
  assert r["fits"] is False and r["total"] is None, r
  assert "as a grid of 1 x 1 x 262144 x 262144 = 68719476736 steps" in r["cannot_run"]
  planner.print_plan(r)
  assert "cannot run: backend 'pallas_tpu' runs a kernel call" in capsys.readouterr().out


@needs_libtpu
def test_the_plan_reports_the_backend_and_tiles_ring_attention_runs(capsys):
  """12 tokens per chip of v5p:2x2x2 are not a multiple of the TPU kernel's 8 rows:
  ring_attention pads each shard to 16 and runs the Mosaic kernel. The plan once read the
  backend off the unpadded shard, said xla (auto) and refused --backend=pallas_tpu."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax import sharding  # pylint: disable=g-import-not-at-top
  import ringflash  # pylint: disable=g-import-not-at-top

  # The oracle: what ring_attention compiles to for these arrays (Mosaic kernels are
  # tpu_custom_calls in the compiled module).
  mesh = sharding.Mesh(np.array(planner.topology_devices("v5p:2x2x2")), ("sp",))
  shards = sharding.NamedSharding(mesh, sharding.PartitionSpec(None, "sp", None, None))
  args = [jax.ShapeDtypeStruct((1, 96, 8, 128), "bfloat16", sharding=shards)] * 3
  text = jax.jit(lambda q, k, v: ringflash.ring_attention(q, k, v, mesh=mesh)).lower(
      *args).compile().as_text()
  assert "tpu_custom_call" in text
  for backend in ("auto", "pallas_tpu"):
    r = planner.plan("v5p:2x2x2", backend=backend, **_TINY)
    assert r["backend"] == "pallas_tpu" and r["fits"], (backend, r["backend"])
    assert (r["block_q"], r["block_k"]) == (16, 16)        # the padded shard, whole
  r = planner.plan("v5p:2x2x2", backend="auto", strategy="auto", **_TINY)
  planner.print_plan(r)
  header, table = capsys.readouterr().out.splitlines()[:2]
  said = re.search(r"backend (\w+), tiles \w+\(block_q=(\d+), block_k=(\d+)", table)
  assert f"backend {said[1]}, strategy {r['strategy']}," in header, (header, table)
  assert f"blocks bq={said[2]} bk={said[3]}" in header, (header, table)


@needs_libtpu
@pytest.mark.parametrize("backend,strategy,heads,says", [
    # pallas_gpu refuses TPU devices; auto runs the ring: the backend's refusal.
    ("pallas_gpu", "ring", 8, "--backend=pallas_gpu cannot run these flags: backend "
                              "'pallas_gpu' runs on GPUs"),
    # Ulysses shards 4 heads over 8 chips: the strategy's, whatever the backend.
    ("auto", "ulysses", 4, "--strategy=ulysses cannot run these flags: .*multiple of 8"),
    ("pallas_tpu", "ulysses", 4, "--strategy=ulysses cannot run these flags: .*multiple of 8"),
    # Neither alone: both named.
    ("pallas_gpu", "ulysses", 4, "--backend=pallas_gpu --strategy=ulysses cannot run these "
                                 "flags: "),
])
def test_a_refusal_names_the_flags_that_refuse(backend, strategy, heads, says):
  model = _TINY | {"heads": heads, "kv_heads": heads}
  with pytest.raises(UsageError, match=says) as refused:
    planner.plan("v5p:2x2x2", backend=backend, strategy=strategy, **model)
  assert "\n" not in str(refused.value)
  if backend == "auto":
    assert "--backend" not in str(refused.value)
  if strategy == "ring":
    assert "--strategy" not in str(refused.value)


@needs_libtpu
def test_a_plan_the_compiler_cannot_fit_says_which_memory_and_exits_1():
  # GQA 32/8, d128, causal forward, 1,048,576 tokens per chip of v5e:2x4 (16 GB): the
  # compiler runs out of HBM (the compile fails; such a failure once ended in a traceback).
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run(
      [sys.executable, "-m", "ringflash.cli", "plan", "--topology=v5e:2x4",
       f"--seq_len={2**20 * 8}", "--heads=32", "--kv_heads=8", "--head_dim=128", "--causal",
       "--mode=forward"], env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 1, done.stderr[-3000:]
  assert "Traceback" not in done.stderr
  assert "1048576 tokens per device" in done.stdout
  assert "does not fit: HBM needs" in done.stdout or "DOES NOT FIT" in done.stdout


# The TPU compiler's messages, as libtpu printed them for the plans in the comments.
_SMEM = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
         "space smem. Used 1.13M of 1.00M smem. Exceeded smem capacity by 129.1K.\n\n"
         "Program smem requirement 1.13M:\n    scoped            1.13M\n")   # v5p, 196,608/chip
_HBM = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
        "memory required for HLO temporaries (124.91G) exceeds available HBM (95.73G). HLO "
        "module: jit__lambda.\nSee https://openxla.org/xla/errors/error_1000 for more "
        "details.")                                                        # v5p, 1,048,576/chip
_VMEM = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
         "space vmem. Used 322.06M of 128.00M vmem. Exceeded vmem capacity by 194.06M.")
# (v5e, TpuBlockSizes(8192, 8192))


@pytest.mark.parametrize("message,memory,needed,available", [
    (_SMEM, "SMEM", 1.13 * 2**20, 2**20),
    (_HBM, "HBM", 124.91 * 2**30, 95.73 * 2**30),
    (_VMEM, "VMEM", 322.06 * 2**20, 128 * 2**20),
    ("Ran out of memory in memory space hbm. Used 130.81G of 95.74G hbm.", "HBM",
     130.81 * 2**30, 95.74 * 2**30),
])
def test_out_of_memory_messages_are_parsed(message, memory, needed, available):
  oom = compiler_memory.parse_out_of_memory(message)
  assert oom.memory == memory
  assert oom.needed == round(needed) and oom.available == round(available)
  assert str(oom).startswith(f"{memory} needs ")


def test_other_errors_are_not_out_of_memory():
  assert compiler_memory.parse_out_of_memory(
      "INTERNAL: Mosaic failed to compile TPU kernel") is None
  assert compiler_memory.parse_out_of_memory("Ran out of memory in memory space host.") is None
  vague = compiler_memory.parse_out_of_memory("Ran out of memory in memory space vmem while ...")
  assert vague.memory == "VMEM" and vague.needed is None
  assert (str(compiler_memory.parse_out_of_memory(_SMEM))
          == "SMEM needs 1.13 MiB of 1.00 MiB available")


@needs_libtpu
def test_a_v4_plan_is_per_device_with_its_share_of_the_chips_hbm():
  """libtpu lists a v4 chip's two TensorCores as two devices: the plan counts tokens and
  memory per device and compares them with half the chip's 32 GiB (it compared a device's
  total with the whole chip's HBM, and --max_seq_len counted tokens per chip)."""
  r = planner.plan("v4:2x2x1", batch=1, seq_len=8192, heads=4, kv_heads=4, head_dim=64,
                   dtype="bfloat16", causal=False, mode="forward")
  assert (r["chips"], r["devices"], r["tokens_per_device"]) == (4, 8, 1024)
  assert r["hbm"] == 16 * 2**30
  shown = io.StringIO()
  with contextlib.redirect_stdout(shown):
    planner.print_plan(r)
  assert "(8 x TPU v4, 4 chips)" in shown.getvalue()
  assert "1024 tokens per device" in shown.getvalue()


@needs_libtpu
def test_the_cost_model_gives_a_v4_tensorcore_half_the_chip():
  """The strategy estimates compare with the device's memory as the plan does: a v4 device
  of one TensorCore holds 16 GiB (the cost model took the chip's 32 GiB, and `auto`'s table
  called strategies of 18 and 24 GiB fitting beside a compiled 16 GiB bound)."""
  from jax.experimental import topologies
  from ringflash.parallel import cost
  device = topologies.get_topology_desc(platform="tpu", topology_name="v4:2x2x1").devices[0]
  assert device.num_cores == 1
  half = cost.platform_of("tpu", device.device_kind, device.num_cores)
  whole = cost.platform_of("tpu", "TPU v4", 2)            # a megacore v4 device: the chip
  assert (half.memory, whole.memory) == (16 * 2**30, 32 * 2**30)
  assert half.rate == whole.rate / 2
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  import ringflash
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v4:2x2x1").devices
  mesh = Mesh(np.array(devices), ("sp",))
  seq = NamedSharding(mesh, PartitionSpec(None, "sp"))
  args = [jax.ShapeDtypeStruct((1, 1572864, h, 128), "bfloat16", sharding=seq)
          for h in (32, 8, 8)]
  choice = ringflash.explain(*args, mesh=mesh, is_causal=True, strategy="auto")
  fits = {e.strategy: e.fits for e in choice.estimates}
  assert fits == {"ring": False, "allgather": False, "ulysses": True}, str(choice)


def test_a_buffer_size_two_roles_share_is_named_as_either():
  """With N = K, dq (fp32) is as large as dk; with N = 2K, q as large as K/V together: the
  breakdown names every role of the size (it kept the last one, calling dq dk)."""
  same = compiler_memory.Shapes(batch=1, tokens=8, heads=4, kv_heads=4, head_dim=16,
                                dtype="bfloat16", train=True)
  assert same.role("f32", 8 * 4 * 16) == ("o or dq, fp32: accumulator, or one hop's kernel "
                                          "output; or dk or dv, fp32")
  assert same.role("bf16", 8 * 4 * 16) == ("q, out, dout (or their copies) (bf16); or k or v "
                                           "(bf16)")
  half = dataclasses.replace(same, kv_heads=2)
  assert half.role("bf16", 8 * 4 * 16) == ("q, out, dout (or their copies) (bf16); or K/V: "
                                           "held, in flight (bf16)")
  assert half.role("f32", 8 * 2 * 16) == "dk or dv, fp32"
  assert half.role("f16", 8 * 2 * 16) == "other"


def test_float32_inputs_count_their_accumulators_once_and_name_both_roles():
  """With float32 inputs the fp32 accumulators are out and the gradients themselves: the
  unavoidable figure added them again (13.02 GiB where the compiled step held 12.00 on
  v6e:1x1), and every float32 buffer was named an accumulator or a gradient, even in a
  forward that has none."""
  b, t, n, k, h = 1, 8, 4, 1, 16                 # sizes apart: q 512, K/V 256, k 128, lse 32
  train = compiler_memory.Shapes(batch=b, tokens=t, heads=n, kv_heads=k, head_dim=h,
                                 dtype="float32", train=True)
  qo, kv, lse = b * t * n * h, 2 * b * t * k * h, 4 * b * n * t
  assert train.unavoidable() == 2 * (2 * qo + kv) * 4 + lse      # q k v out dout dq dk dv
  forward = dataclasses.replace(train, train=False)
  assert forward.unavoidable() == (2 * qo + kv) * 4 + lse        # q k v out
  bf16 = dataclasses.replace(train, dtype="bfloat16")
  assert bf16.unavoidable() == 2 * (2 * qo + kv) * 2 + lse + 4 * (qo + kv)
  assert train.role("f32", kv) == ("K/V: held, in flight (f32); or dK/dV, fp32: accumulator, "
                                    "in flight")
  assert forward.role("f32", kv) == "K/V: held, in flight (f32)"
  assert forward.role("f32", qo) == ("q, out (f32); or o, fp32: accumulator, or one hop's "
                                     "kernel output")
  assert forward.role("f32", b * n * t) == "row statistics (lse), fp32"


def _report(**changes):
  report = {"topology": "v5p:2x2x2", "chips": 8, "devices": 8, "device_kind": "TPU v5",
            "backend": "pallas_tpu", "strategy": "ring", "mode": "train",
            "tokens_per_device": 196608, "block_q": 512, "block_k": 512, "hbm": 95 * 2**30,
            "arguments": 2**30, "temporaries": 2**30, "outputs": 2**30, "total": 3 * 2**30,
            "fits": True, "permutes_per_step": [1, 2], "all_gathers": 0, "out_of_memory": None,
            "breakdown": None, "unavoidable": 2 * 2**30}
  return report | changes


def _flags(**changes):
  return types.SimpleNamespace(**({
      "topology": "v5p:2x2x2", "batch": 1, "seq_len": 196608 * 8, "heads": 32,
      "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "causal": True, "mode": "train",
      "backend": "auto", "strategy": "ring", "max_seq_len": False} | changes))


@pytest.mark.parametrize("report,status,says", [
    (_report(), None, "fits (92.00 GiB left)"),
    (_report(total=96 * 2**30, fits=False), 1, "DOES NOT FIT (1.00 GiB short)"),
    (_report(fits=False, out_of_memory=compiler_memory.parse_out_of_memory(_HBM)), 1,
     "does not fit: HBM needs 124.91 GiB of 95.73 GiB available"),
])
def test_main_exits_1_when_the_plan_does_not_fit(monkeypatch, capsys, report, status, says):
  monkeypatch.setattr(planner, "FLAGS", _flags())
  monkeypatch.setattr(planner, "plan", lambda *args, **kwargs: report)
  if status is None:
    planner.main([])
  else:
    with pytest.raises(SystemExit) as exit_:
      planner.main([])
    assert exit_.value.code == status
  assert says in capsys.readouterr().out


@pytest.mark.parametrize("topology,chips", [("v5p:2x2x2", 8), ("v5e:2x4", 8), ("v4:4x4x8", 128),
                                            ("v6e:16x16", 256), ("v5p:4x4x8_twisted", 128)])
def test_topology_names_give_their_chips(topology, chips):
  assert planner.topology_chips(topology) == chips


@pytest.mark.parametrize("topology", ["nonsense", "v5p", "v5p:2x2x0", "v9:2x2x2", "v5p:2",
                                      "v5p:2x2x2x2", "V5P:2x2x2", "v5p:2x2x2 ",
                                      "v5litepod:2x2", "v5p:1000x1000x1000", "v4:32x32x32"])
def test_malformed_topologies_are_usage_errors(topology):
  with pytest.raises(UsageError, match="--topology"):
    planner.topology_chips(topology)


@needs_libtpu
def test_every_generation_the_help_names_is_one_libtpu_knows():
  """--topology's help lists the generations of HBM_BYTES; each must give devices (it listed
  v5litepod, a name of Cloud TPU's accelerator types that libtpu rejects)."""
  for gen in planner.HBM_BYTES:
    topology = f"{gen}:2x2" if gen in planner.PLANAR else f"{gen}:2x2x1"
    assert len(planner.topology_devices(topology)) in (4, 8), topology


@pytest.mark.parametrize("topology", ["v5e:4x4x4", "v5e:4x4x2", "v5e:2x2x2", "v6e:2x2x2",
                                      "v6e:4x4x4"])
def test_a_third_size_of_a_2d_generation_is_a_usage_error(topology):
  """v5e and v6e slices are 2-D. libtpu takes v5e:2x2x2 as hosts of 2x2 chips stacked along
  an axis these chips do not have, and aborts the process compiling for v5e:4x4x4."""
  with pytest.raises(UsageError, match=f"--topology={topology}: .* slices are 2-D"):
    planner.topology_chips(topology)


@pytest.mark.parametrize("topology,chips", [("v5e:4x4x1", 16), ("v6e:2x4x1", 8),
                                            ("v5e:16x16", 256), ("v5p:2x2x4", 16)])
def test_a_third_size_of_1_or_a_3d_generation_is_taken(topology, chips):
  assert planner.topology_chips(topology) == chips


def _linear_probe(per_token, fixed, hbm, calls):
  """A plan whose total is fixed + per_token * n, as compiled programs are (about)."""
  def probe(n):
    calls.append(n)
    total = fixed + per_token * n
    return _report(tokens_per_device=n, total=total, hbm=hbm, fits=total <= hbm)
  return probe


@pytest.mark.parametrize("per_token,start", [(112 * 2**10, 16384), (600 * 2**10, 16384),
                                             (2 * 2**20, 1024)])
def test_longest_finds_the_limit_in_a_few_compiles(per_token, start):
  hbm, fixed, calls = 95 * 2**30, 2**30, []
  best, runs = planner.longest(_linear_probe(per_token, fixed, hbm, calls), start=start)
  exact = (hbm - fixed) // per_token
  assert best % planner.SEARCH_QUANTUM == 0 and best <= exact
  assert exact - best <= max(planner.SEARCH_QUANTUM, exact * planner.SEARCH_PRECISION)
  assert len(runs) == len(calls) <= 8, calls
  assert any(r["fits"] for r in runs) and not all(r["fits"] for r in runs)


def test_longest_says_none_when_nothing_fits():
  best, runs = planner.longest(lambda n: _report(tokens_per_device=n, fits=False), start=8192)
  assert best is None and [r["tokens_per_device"] for r in runs] == [8192, 4096, 2048, 1024]


def test_main_max_seq_len_prints_every_compile_and_the_longest(monkeypatch, capsys):
  calls = []
  probe = _linear_probe(112 * 2**10, 2**30, 95 * 2**30, calls)

  def fake_plan(topology, *, seq_len, breakdown=True, **model):
    del topology, breakdown, model
    return probe(seq_len // 8) | {"tokens_per_device": seq_len // 8}

  monkeypatch.setattr(planner, "FLAGS", _flags(max_seq_len=True, seq_len=1004))
  monkeypatch.setattr(planner, "plan", fake_plan)
  monkeypatch.setattr(planner, "topology_devices", lambda topology: [None] * 8)   # no libtpu
  planner.main([])
  out = capsys.readouterr().out
  best = calls[-1]
  assert f"longest: {best * 8} tokens ({best} per device)" in out
  assert out.count("tokens per device (") == len(calls) - 1      # the last is the plan itself
  assert f"{calls[0]} tokens per device ({calls[0] * 8} in all)" in out
