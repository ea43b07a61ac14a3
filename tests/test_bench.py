"""`ringflash bench` runs end to end on CPU at tiny sizes (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

import ringflash


@pytest.mark.parametrize("mode", ["virtual", "layouts"])
def test_bench_mode_writes_rows(tmp_path, mode):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "ringflash.cli", "bench", f"--mode={mode}", "--seq_lens=256",
         "--ring_sizes=2", "--kv_heads=1", "--heads=2", "--head_dim=32", "--warmup=0",
         "--iters=1", f"--out={tmp_path}"]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  rows = json.load(open(tmp_path / f"bench_{mode}.json"))["rows"]
  if mode == "layouts":
    assert [r["layout"] for r in rows] == ["contiguous", "zigzag", "striped"]
    assert all(len(r["per_device_ms"]) == 2 and r["max_over_mean"] >= 1.0 for r in rows)
  else:
    assert len(rows) == 1 and rows[0]["P"] == 2 and rows[0]["one_ms"] > 0


def _timing(flags) -> list[str]:
  """The fewest timed calls, for the modes that time calls (longest runs each length once and
  refuses --warmup and --iters)."""
  return [] if "--mode=longest" in flags else ["--warmup=0", "--iters=1"]


def _bench(tmp_path, *flags, devices=2):
  env = dict(os.environ, JAX_PLATFORMS="cpu", RINGFLASH_DEVICES_PER_PROCESS=str(devices))
  cmd = [sys.executable, "-m", "ringflash.cli", "bench", "--kv_heads=1", "--heads=2",
         "--head_dim=32", *_timing(flags), f"--out={tmp_path}", *flags]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  return done.stdout


@pytest.mark.slow
def test_scaling_mode_rows_per_ring_size(tmp_path):
  out = _bench(tmp_path, "--mode=scaling", "--seq_lens=128", "--causal=false,true",
               f"--hlo_dir={tmp_path / 'hlo'}", devices=4)
  rows = json.load(open(tmp_path / "bench_scaling.json"))["rows"]
  assert [(r["P"], r["causal"], r["layout"]) for r in rows] == [
      (1, False, "contiguous"), (2, False, "contiguous"), (4, False, "contiguous"),
      (1, True, "zigzag"), (2, True, "zigzag"), (4, True, "zigzag")]
  assert all(r["fwd_eff"] > 0 and r["fwdbwd_eff"] > 0 for r in rows)
  assert [r["fwd_eff"] for r in rows if r["P"] == 1] == [1.0, 1.0]
  # the ring's permutes are counted (the JSON said 0); the xla backend's programs have no
  # Pallas kernel for a permute to span, so that count is None
  assert all(r["permutes"] > 0 and r["permutes_spanning_kernel"] is None
             for r in rows if r["P"] > 1)
  assert "permutes spanning a kernel: none found" in out
  assert len(os.listdir(tmp_path / "hlo")) == 8       # fwd and fwd+bwd of each P > 1 ring


def test_longest_mode_compiles_each_length_and_runs_the_short_ones(tmp_path):
  out = _bench(tmp_path, "--mode=longest", "--seq_lens=256,128", "--run_max_len=256")
  written = json.load(open(tmp_path / "bench_longest.json"))
  rows = written["rows"]
  assert "warmup" not in written["meta"] and "iters" not in written["meta"]   # not read
  assert [(r["T"], r["T_local"]) for r in rows] == [(256, 128), (512, 256)]
  assert rows[0]["seconds"] > 0 and rows[1]["seconds"] is None      # 512 > --run_max_len
  assert rows[0]["bytes_per_device"] < rows[1]["bytes_per_device"]
  assert "compiled only" in out


@pytest.mark.parametrize("backend,platform,kind", [("pallas_gpu", "gpu", "NVIDIA H200"),
                                                   ("pallas_tpu", "tpu", "TPU v6 lite"),
                                                   ("xla", "cpu", "cpu")])
def test_layouts_mode_uses_tiles_the_backend_accepts(backend, platform, kind):
  """The layouts mode once asked the GPU kernel for 512 x 512 tiles (more shared memory than
  Hopper has); it now runs the zigzag spec's tiles, which divide the zigzag chunk."""
  import jax
  import jax.numpy as jnp

  from ringflash import introspect
  from ringflash.cli.bench import layouts
  dev = types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability="9.0")
  for tl in (1536, 16384):
    q, k, v = (jax.ShapeDtypeStruct((1, tl, 16, 128), jnp.bfloat16) for _ in range(3))
    spec = layouts.layout_spec(q, k, v, ring_size=4, device=dev, backend=backend).kernel
    assert (tl // 2) % spec.block_q == 0 and (tl // 2) % spec.block_k == 0, spec
    default = introspect.ring_spec(q, k, v, ring_size=4, device=dev, is_causal=True,
                                   backend=backend).kernel
    assert spec.block_q <= default.block_q and spec.block_k <= default.block_k


def test_implementations_take_turns_and_a_failing_peer_is_left_out():
  from ringflash.cli.bench import harness
  log = []

  def call(name):
    def fn():
      log.append(name)
      if name == "cudnn":
        raise RuntimeError("no such library")
      return 0.0
    return fn, ()

  times, errors = harness.time_in_turns({n: call(n) for n in ("a", "cudnn", "b", "c")},
                                        warmup=0, iters=4)
  assert errors == {"cudnn": "RuntimeError: no such library"}
  assert sorted(times) == ["a", "b", "c"] and all(len(t) == 4 for t in times.values())
  # one untimed call each (the compile) even with warmup=0, then rotating rounds
  assert log == ["a", "cudnn", "b", "c"] + ["a", "b", "c", "b", "c", "a", "c", "a", "b",
                                            "a", "b", "c"]


@pytest.mark.parametrize("name", ["ringflash", "xla"])
def test_a_failing_implementation_of_ours_is_an_error(name):
  from ringflash.cli.bench import harness

  def fails():
    raise NotImplementedError("backend 'pallas_gpu' supports head_dim in (64, 128, 256)")

  calls = {"cudnn": (lambda: 0.0, ()), name: (fails, ())}
  with pytest.raises(harness.ImplementationError, match=f"'{name}' failed: NotImplementedError"):
    harness.time_in_turns(calls, warmup=1, iters=2)


def test_a_row_in_which_nothing_ran_is_an_error():
  """--impls=cudnn on a CPU: the peer failed, and the bench wrote a row of dashes with status
  0; nothing measured is a failure."""
  from ringflash.cli.bench import harness

  def fails():
    raise RuntimeError("cuDNN is not detected.")

  with pytest.raises(harness.ImplementationError,
                     match="no implementation ran: cudnn: RuntimeError: cuDNN is not"):
    harness.time_in_turns({"cudnn": (fails, ())}, warmup=0, iters=2)


@pytest.mark.parametrize("mode", ["virtual", "layouts", "scaling"])
def test_modes_time_what_they_compare_in_turns(mode, monkeypatch):
  """Each mode's figures are ratios (ring steps over one call, the slowest simulated device
  over the mean, P devices over one): what they compare takes turns call by call, after an
  untimed first call of each. These modes timed one side's calls all before the other's."""
  from ringflash.cli.bench import harness, layouts, scaling, virtual
  timed = []
  seconds = harness.seconds

  def logged(fn, *args):
    timed.append((id(fn),) + tuple(id(a) for a in args))
    return seconds(fn, *args)

  monkeypatch.setattr(harness, "seconds", logged)
  f = types.SimpleNamespace(seq_lens=["32"], ring_sizes=["4"], kv_heads=["1"], heads=2,
                            head_dim=16, batch=1, warmup=0, iters=3, causal=["false"],
                            layout="contiguous", backward=True, collectives_in_flight=None,
                            hlo_dir=None)
  {"virtual": virtual, "layouts": layouts, "scaling": scaling}[mode].run(f)
  # one set of turns: virtual's; layouts', one per layout; scaling's, the forward's and
  # then the forward+backward's
  sets = {"virtual": 1, "layouts": 3, "scaling": 2}[mode]
  size = len(timed) // sets
  for part in (timed[i * size:(i + 1) * size] for i in range(sets)):
    n = len(set(part))
    assert n > 1
    assert len(part) == n * (1 + f.iters)                 # one untimed call each
    for r in range(f.iters):
      assert len(set(part[n * (r + 1):n * (r + 2)])) == n, (mode, r)   # each once a round


def test_ratio_is_the_median_of_the_rounds_ratios():
  from ringflash.cli.bench import harness
  # round ratios 2.0, 0.5, 1.5: the median 1.5, not the ratio of the medians (1.0)
  assert harness.ratio_by_round([1.0, 2.0, 2.0], [2.0, 1.0, 3.0]) == 1.5
  with pytest.raises(ValueError):
    harness.ratio_by_round([1.0, 2.0], [1.0])


def test_tflops_count_flash_attentions_convention(monkeypatch):
  """A row's TFLOP/s are the convention's FLOPs over the median time: 4 B N T S H forward (2
  B N T S (H + Hv) where the value head dim is its own, the features mode's MLA row), halved
  when causal, 3.5 times that forward+backward. Every call takes 0.25 s here by the clock
  the harness reads."""
  from ringflash.cli.bench import features, harness, kernels

  def quarter_second(fn, *args):
    jax.block_until_ready(fn(*args))
    return 0.25

  monkeypatch.setattr(harness, "seconds", quarter_second)
  f = types.SimpleNamespace(seq_lens=["32"], gqa_seq_lens=[], kv_heads=["2"], heads=2,
                            head_dim=16, batch=1, causal=["false", "true"],
                            impls=["ringflash"], xla_max_len=0, warmup=0, iters=2,
                            backward=True, variants=["mla"])
  for rows, h, hv in ((kernels.run(f), 16, 16), (features.run(f), 192, 128)):
    assert [row["causal"] for row in rows] == [False, True]
    for row in rows:
      fwd = 2 * 1 * 2 * 32 * 32 * (h + hv) / (2 if row["causal"] else 1) / 0.25 / 1e12
      assert row["ringflash_fwd"] == pytest.approx(fwd, rel=1e-12), row
      assert row["ringflash_fwdbwd"] == pytest.approx(3.5 * fwd, rel=1e-12), row


def test_gpu_compiler_options_follow_the_flag():
  from ringflash.cli.bench import harness
  option = harness.OVERLAP_OPTION
  assert harness.compiler_options("cpu", 2) is None
  assert harness.compiler_options("gpu") == ringflash.GPU_XLA_OPTIONS
  assert harness.compiler_options("gpu", 4)[option] == 4
  assert option not in (harness.compiler_options("gpu", 0) or {})      # XLA's default


def test_kernels_mode_keeps_other_implementations_when_one_fails(tmp_path):
  out = _bench(tmp_path, "--mode=kernels", "--gqa_seq_lens=128",
               "--causal=true", "--impls=ringflash,cudnn,xla", devices=1)
  rows = json.load(open(tmp_path / "bench_kernels.json"))["rows"]
  assert len(rows) == 1 and "cudnn_error" in rows[0]
  assert rows[0]["ringflash_fwd"] > 0 and rows[0]["xla_fwdbwd"] > 0
  assert "fwd_ratio" not in rows[0]       # no cuDNN on CPU: no ratio to it
  assert "cudnn_error" in out


@pytest.mark.slow
def test_strategies_mode_rows_with_every_strategy_and_baseline(tmp_path):
  """On 4 CPU devices (jax.nn's XLA attention stands in for cuDNN there): every strategy, the
  plain Ulysses and all-gather baselines, efficiencies against one device, auto's choice."""
  _bench(tmp_path, "--mode=strategies", "--seq_lens=32", "--causal=false,true",
         "--kv_heads=2", "--heads=4", devices=4)
  rows = json.load(open(tmp_path / "bench_strategies.json"))["rows"]
  assert [(r["P"], r["causal"], r["layout"]) for r in rows] == [(4, False, "contiguous"),
                                                                (4, True, "zigzag")]
  for row in rows:
    names = {"ring", "allgather", "ulysses", "hybrid", "auto", "ulysses_cudnn"} | (
        set() if row["causal"] else {"allgather_cudnn"})
    for name in names:
      assert row[f"{name}_fwd_eff"] > 0 and row[f"{name}_fwdbwd_eff"] > 0, name
    assert row["auto_choice"] == "ring"          # CPU meshes: the ring (parallel/cost.py)


@pytest.mark.slow
def test_features_mode_rows_per_variant(tmp_path):
  """One CPU device: each variant's row with ringflash's figures and its ratios to the
  row's other implementations (the plain kernel, and jax.nn's attention: named jax_nn on
  CPU, where it stands in for cuDNN; it was named cudnn)."""
  _bench(tmp_path, "--mode=features", "--seq_lens=32", "--causal=true", "--heads=4",
         "--kv_heads=2", "--variants=sinks,softcap,mla,h80", devices=1)
  rows = json.load(open(tmp_path / "bench_features.json"))["rows"]
  assert [(r["variant"], r["H"], r["Hv"]) for r in rows] == [
      ("sinks", 32, 32), ("softcap", 32, 32), ("mla", 192, 128), ("h80", 80, 80)]
  assert rows[0]["plain_fwdbwd_ratio"] > 0 and rows[1]["plain_fwd_ratio"] > 0
  assert rows[2]["jax_nn_padded_fwd_ratio"] > 0 and rows[2]["xla_fwdbwd_ratio"] > 0
  assert rows[3]["jax_nn_fwdbwd_ratio"] > 0
  assert not any(key.startswith("cudnn") for row in rows for key in row)


def test_features_mode_takes_the_head_dim_of_its_plain_rows(tmp_path):
  """--head_dim sets H = Hv of the plain, sinks and soft-cap rows (the fixed shapes of mla,
  h80 and h96 stay theirs)."""
  _bench(tmp_path, "--mode=features", "--seq_lens=32", "--causal=false", "--heads=2",
         "--kv_heads=1", "--head_dim=64", "--variants=plain,softcap,h80", "--nobackward",
         devices=1)
  rows = json.load(open(tmp_path / "bench_features.json"))["rows"]
  assert [(r["variant"], r["H"], r["Hv"]) for r in rows] == [
      ("plain", 64, 64), ("softcap", 64, 64), ("h80", 80, 80)]


def _refused(tmp_path, *flags, devices=4):
  """The one line of a bench that refuses its flags (status 2) before anything ran."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", RINGFLASH_DEVICES_PER_PROCESS=str(devices))
  cmd = [sys.executable, "-m", "ringflash.cli", "bench", *_timing(flags),
         f"--out={tmp_path / 'out'}", *flags]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert not done.stdout and len(done.stderr.splitlines()) == 1, done.stderr[-2000:]
  return done.stderr.strip()


@pytest.mark.parametrize("flags,says", [
    # the hybrid strategy runs on the 4 devices as (4 / U, U): U = 3 and U = 4 do not fit
    (["--ulysses_size=3"], "ringflash bench: --ulysses_size=3 must divide the 4 devices"),
    (["--ulysses_size=4"], "ringflash bench: --ulysses_size=4 must divide the 4 devices"),
    # Ulysses shards the query heads over the 4 devices
    (["--heads=2", "--kv_heads=2"], "ringflash bench: --heads=2 and --kv_heads=2 do not fit "
                                    "strategy 'ulysses' on the 4 devices"),
])
def test_strategies_mode_refuses_what_the_devices_refute(tmp_path, flags, says):
  line = _refused(tmp_path, "--mode=strategies", "--seq_lens=32", "--heads=4",
                  "--kv_heads=2", "--head_dim=32", *flags)
  assert line.startswith(says), line
  assert not os.path.exists(tmp_path / "out")        # refused before its folder was made


_SMALL = ("--seq_lens=64", "--kv_heads=2", "--heads=2", "--head_dim=16")


@pytest.mark.parametrize("flags,says", [
    # longest compiles each length and runs it once: no untimed calls, no median
    (["--mode=longest", "--iters=1000"], "--iters applies to --mode=kernels | "),
    (["--mode=longest", "--warmup=50"], "--warmup applies to --mode=kernels | "),
    # the layout of causal rows, and none is run (non-causal rows are contiguous)
    (["--mode=scaling", "--causal=false", "--layout=striped", "--warmup=0", "--iters=1"],
     "--layout=striped applies to causal rows, and --causal=false runs none"),
    # an option of XLA's GPU compiler, on CPU devices
    (["--mode=scaling", "--collectives_in_flight=5", "--warmup=0", "--iters=1"],
     "--collectives_in_flight is an option of XLA's GPU compiler, and this job's devices "
     "are cpu"),
    (["--mode=longest", "--collectives_in_flight=2"], "--collectives_in_flight is an option "
                                                      "of XLA's GPU compiler"),
    # kernels: --seq_lens are the K = N rows' lengths, --gqa_seq_lens the others'
    (["--kv_heads=1"], "--seq_lens are the lengths of the rows with K = N (--kv_heads=2), and "
                       "--kv_heads=1 has none"),
    (["--gqa_seq_lens=64"], "--gqa_seq_lens are the lengths of the GQA rows"),
    (["--impls=ringflash", "--xla_max_len=8"], "--xla_max_len limits the xla implementation"),
    # features: mla, h80 and h96 have head dims of their own; only mla runs xla
    (["--mode=features", "--variants=mla,h80"], "--head_dim applies to the variants plain, "
                                                "sinks, softcap"),
    (["--mode=features", "--variants=plain", "--xla_max_len=8"],
     "--xla_max_len limits the mla variant's xla row"),
])
def test_a_flag_that_cannot_take_effect_is_refused(tmp_path, flags, says):
  line = _refused(tmp_path, *_SMALL, *flags, devices=2)
  assert line.startswith(f"ringflash bench: {says}"), line
  assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("flags", [
    ["--mode=scaling", "--causal=false", "--layout=contiguous"],   # what its rows run
    ["--mode=scaling", "--causal=false,true", "--layout=striped"],
    ["--mode=longest", "--layout=striped"],                         # every row causal
    ["--mode=scaling", "--causal=false"],     # the default layout (zigzag): not given
])
def test_a_layout_that_can_take_effect_or_was_not_given_is_taken(flags):
  from ringflash.cli import bench
  f = types.SimpleNamespace(
      mode="scaling", seq_lens=["64"], heads=2, kv_heads=["2"], head_dim=16, batch=1,
      causal=["false", "true"], impls=["ringflash"], xla_max_len=16, gqa_seq_lens=["64"],
      warmup=2, iters=5, ring_sizes=["2"], out="out", layout="zigzag", run_max_len=64,
      variants=["plain"], new_tokens=1, cache_lens=["64"])
  given = ["seq_lens"]
  for flag in flags:
    name, value = flag[2:].split("=")
    setattr(f, name, value.split(",") if name == "causal" else value)
    given += [name] if name != "mode" else []
  bench.check_flags(f, given=given)


def test_scaling_mode_refuses_an_hlo_dir_it_cannot_use(tmp_path):
  # one device: no ring of P > 1, whose programs are what --hlo_dir receives
  line = _refused(tmp_path, "--mode=scaling", "--seq_lens=128",
                  f"--hlo_dir={tmp_path / 'hlo'}", devices=1)
  assert line.startswith("ringflash bench: --hlo_dir: the scaling mode writes"), line
  assert not os.path.exists(tmp_path / "hlo")
  # a folder that cannot be made, though os.access allows it to root: before any run
  line = _refused(tmp_path, "--mode=scaling", "--seq_lens=128", "--hlo_dir=/proc/nosuch/x",
                  devices=2)
  assert line.startswith("ringflash bench: --hlo_dir=/proc/nosuch/x: "), line


def test_bench_out_under_a_file_is_a_usage_error(tmp_path):
  (tmp_path / "afile").write_text("")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-m", "ringflash.cli", "bench", "--mode=virtual",
                         f"--out={tmp_path / 'afile' / 'out'}"], env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 2 and not done.stdout, done.stderr[-2000:]
  assert done.stderr.splitlines() == [f"ringflash bench: --out={tmp_path / 'afile' / 'out'}: "
                                      f"{tmp_path / 'afile'} is a file, not a directory"]


def test_scaling_mode_without_backward_prints_a_dash_for_it(tmp_path):
  out = _bench(tmp_path, "--mode=scaling", "--seq_lens=128", "--causal=false",
               "--nobackward", devices=2)
  lines = [line for line in out.splitlines() if line.startswith("P=")]
  assert len(lines) == 2 and all("fwd+bwd - (eff -)" in line for line in lines), out
  rows = json.load(open(tmp_path / "bench_scaling.json"))["rows"]
  assert [r["fwdbwd_tflops"] for r in rows] == [None, None]


def test_strategies_row_without_backward_prints_a_dash_for_it(capsys):
  from ringflash.cli.bench import strategies
  strategies._print({"P": 4, "T_local": 32, "K": 2, "causal": False, "auto_choice": "ring",
                     "ring_fwd_eff": 0.5, "auto_fwd_eff": 0.5, "ring_fwdbwd_eff": 0.25})
  assert "ring 0.50|0.25 auto 0.50|-;" in capsys.readouterr().out


def test_strategies_mode_leaves_hybrid_out_where_the_default_ulysses_size_cannot_fit(tmp_path):
  """On 2 devices the hybrid strategy has no (P / U, U) with U = 2 below P: the bench refused
  --ulysses_size, a flag not given; it now runs the other strategies and says so."""
  out = _bench(tmp_path, "--mode=strategies", "--seq_lens=32", "--causal=false",
               "--nobackward", devices=2)
  assert "--ulysses_size: the default 2 does not fit 2 device(s); hybrid left out" in out
  rows = json.load(open(tmp_path / "bench_strategies.json"))["rows"]
  assert len(rows) == 1 and "hybrid_fwd_eff" not in rows[0]
  assert rows[0]["ring_fwd_eff"] > 0 and rows[0]["ulysses_fwd_eff"] > 0



def test_device_steps_take_block_s_at_step_s_and_run_the_kernel_in_the_loop():
  """bench --mode=virtual gave every step the same K/V: non-causal, the kernel's result did
  not depend on the step, XLA computed it once outside the loop, and the mode timed one
  call and P merges (its overhead fell to -87% at P = 8). device_steps now takes P blocks,
  block s at step s: exact against the oracle over all P blocks, with the kernel inside the
  compiled loop."""
  import jax                                     # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp                        # pylint: disable=g-import-not-at-top
  import numpy as np                             # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.dirname(__file__))
  import oracle                                  # pylint: disable=g-import-not-at-top
  from ringflash import introspect               # pylint: disable=g-import-not-at-top
  from ringflash.cli import hlo                  # pylint: disable=g-import-not-at-top
  b, t, n, kh, h, p = 1, 64, 4, 2, 32, 4
  q = jax.random.normal(jax.random.key(0), (b, t, n, h))
  k, v = (jax.random.normal(jax.random.key(i), (b, t * p, kh, h)) for i in (1, 2))
  ring = introspect.ring_spec(q, k[:, :t], v[:, :t], ring_size=p, device=jax.devices()[0])
  steps = introspect.device_steps(ring)
  pos = jnp.arange(t, dtype=jnp.int32)
  held = pos[None, :] + t * jnp.arange(p, dtype=jnp.int32)[:, None]
  o, lse = steps(q, k, v, pos, held)
  ref_o, ref_lse = oracle.attention(q, k, v, scale=h ** -0.5)
  np.testing.assert_allclose(o, ref_o, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=2e-5)
  comps, _ = hlo.computations(steps.lower(q, k, v, pos, held).compile().as_text())
  inside, todo = set(), list(hlo.loop_bodies(comps))      # the loop and what it calls
  while todo:
    name = todo.pop()
    if name in comps and name not in inside:
      inside.add(name)
      todo += hlo.callees(comps[name])
  dots = [line for name in comps for line in comps[name] if " dot(" in line]
  assert dots and all(any(line in comps[name] for name in inside) for line in dots)
  with pytest.raises(ValueError, match="k and v must hold S=64 keys"):
    steps(q, k[:, :100], v[:, :100], pos, held)


def test_plain_ulysses_baseline_copies_kv_heads_up_to_a_multiple_of_the_devices(capsys):
  """6 kv heads on 4 devices: the baseline copies each kv head twice (12), as many as Ulysses
  needs; it repeated each 4 // 6 = 0 times and left itself out with an error. A row without
  one GPU's time prints no comparison of auto (it printed +0.000 against the best)."""
  import helpers
  import oracle
  from ringflash.cli.bench import strategies
  q, k, v, _ = helpers.inputs(3, 1, 64, 64, 12, 6, 16, jnp.float32)
  got = jax.jit(strategies._baseline("ulysses_cudnn", helpers.mesh_of(4), False))(q, k, v)
  want, _ = oracle.attention(q, k, v)
  assert helpers.max_err(got, want) <= helpers.fp32_tol(want)
  strategies._print({"P": 4, "T_local": 16, "K": 6, "causal": False, "auto_choice": "ring",
                     "one_gpu_error": "RuntimeError: out of memory"})
  printed = capsys.readouterr().out
  assert "auto took ring (no efficiency: one GPU's cuDNN did not run)" in printed, printed
