"""The `ringflash` programs' handling of mistakes: one line and status 2 for a bad flag, before
any work; status 1 with the error when ringflash's own implementation fails in the bench."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _run(*args, script=None, platforms="cpu"):
  env = dict(os.environ, JAX_PLATFORMS=platforms)
  cmd = [sys.executable] + (["-c", script] if script else ["-m", "ringflash.cli"]) + list(args)
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("sub,args,names", [
    ("plan", ["--seq_len=-8"], "--seq_len"),
    ("plan", ["--topology=nonsense"], "--topology"),
    ("plan", ["--topology=v5p:2x2x0"], "--topology"),        # libtpu would abort on the 0
    ("plan", ["--topology=v5p:2x2x2", "--seq_len=1004"], "--seq_len"),
    ("plan", ["--heads=32", "--kv_heads=5"], "--kv_heads"),
    ("plan", ["--head_dim=0"], "--head_dim"),
    ("plan", ["v5p:2x2x2"], "argument"),
    ("plan", ["v5p:2x2x2\n--seq_len=8"], "argument"),        # a line break in the argument
    ("demo", ["--seq_len=-8"], "--seq_len"),
    ("demo", ["--seq_len=100"], "--seq_len"),                  # 8 simulated devices
    ("demo", ["--heads=4", "--kv_heads=3"], "--kv_heads"),
    ("demo", ["--batch=0"], "--batch"),
    ("bench", ["--seq_lens=4096,-8"], "--seq_lens"),
    ("bench", ["--seq_lens=4k"], "--seq_lens"),
    ("bench", ["--heads=16", "--kv_heads=16,3"], "--kv_heads"),
    ("bench", ["--causal=true,maybe"], "--causal"),
    ("bench", ["--impls=ringflash,flash"], "--impls"),
    ("bench", ["--iters=0"], "--iters"),
    ("bench", ["--mode=layouts", "--seq_lens=255"], "--seq_lens"),
    ("bench", ["--mode=kernels", "extra"], "argument"),
    ("bench", ["--mode=features", "--impls=ringflash,cudnn"], "--impls"),   # kernels' only
    ("bench", ["--mode=decode", "--seq_lens=4096"], "--seq_lens"),          # --cache_lens
    ("bench", ["--mode=virtual", "--causal=true"], "--causal"),             # non-causal
    ("bench", ["--mode=features", "--variants="], "--variants"),            # runs nothing
    ("bench", ["--mode=kernels", "--impls=xla", "--xla_max_len=8", "--seq_lens=16"],
     "--xla_max_len"),                                                      # every cell skipped
    ("bench", ["--mode=virtual", "--out=/dev/null/x"], "--out"),            # under a file
    ("bench", ["--mode=virtual", "--out=/proc/nosuch/dir"], "--out"),
    ("bench", ["--mode=scaling", "--hlo_dir=/proc/nosuch/x"], "--hlo_dir"),
    # libtpu aborts the process compiling for v5e:4x4x4; v6e:2x2x2 is no slice that exists
    ("plan", ["--topology=v5e:4x4x4", "--seq_len=1024"], "--topology"),
    ("plan", ["--topology=v6e:2x2x2", "--seq_len=1024"], "--topology"),
    # NaN and infinities: absl's bounds let NaN through, and both would turn the flag off
    ("launch", ["local", "--timeout_s=nan", "--", "check"], "--timeout_s"),
    ("launch", ["local", "--stop_timeout_s=nan", "--", "check"], "--stop_timeout_s"),
    ("launch", ["local", "--timeout_s=inf", "--", "check"], "--timeout_s"),
    ("check", ["--tolerance=inf"], "--tolerance"),
    ("check", ["--out_dir=/proc/nosuch/x"], "--out_dir"),
    ("generate", ["--tie_tolerance=nan"], "--tie_tolerance"),
    ("train", ["--learning_rate=inf"], "--learning_rate"),
    ("train", ["--rope_base=inf"], "--rope_base"),
    ("train", ["--save_every=5"], "--checkpoint_dir"),
    # absl's `--noflag=value` is a ValueError, not a flags.Error: it was a traceback
    ("demo", ["--nocausal=1"], "--nocausal=1"),
    ("plan", ["--nocausal=false"], "--nocausal=false"),
    ("launch", ["local", "--nodry_run=1", "--", "check"], "--nodry_run=1"),
    ("launch", ["local", "--", "check", "--nocausal=1"], "--nocausal=1"),
    # Sizes past the bounds: host arrays of 512 GiB, device counts that took minutes to build,
    # a vocabulary whose allocation never came back, and floats that float32 makes 0 or inf
    # (the runs trained on NaN and exited 0)
    ("plan", ["--seq_len=1099511627776"], "--seq_len"),
    ("plan", ["--seq_len=9223372036854775800"], "--seq_len"),
    ("bench", ["--mode=longest", "--seq_lens=99999999998"], "--seq_lens"),
    ("demo", ["--devices=100000"], "--devices"),
    ("train", ["--cpu_devices=100000"], "--cpu_devices"),
    ("generate", ["--cpu_devices=100000"], "--cpu_devices"),
    ("launch", ["local", "--processes=100000", "--", "check"], "--processes"),
    ("launch", ["local", "--devices_per_process=100000", "--", "check"],
     "--devices_per_process"),
    ("train", ["--num_values=1000000000"], "--num_values"),
    ("train", ["--num_fillers=3000000000"], "--num_fillers"),
    ("train", ["--rope_base=1e-300"], "--rope_base"),
    ("train", ["--learning_rate=1e300"], "--learning_rate"),
    ("check", ["--tolerance=1e-45"], "--tolerance"),
    # a mode that runs one K given several: all but one were dropped silently
    ("bench", ["--mode=longest", "--seq_lens=64", "--heads=4", "--kv_heads=2,4"],
     "--kv_heads"),
    ("bench", ["--mode=features", "--kv_heads=16,4"], "--kv_heads"),
])
def test_a_bad_flag_is_one_line_and_status_2(sub, args, names):
  done = _run(sub, *args)
  assert done.returncode == 2, (done.stdout[-1000:], done.stderr[-2000:])
  assert "Traceback" not in done.stderr
  lines = done.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"ringflash {sub}: "), done.stderr[-2000:]
  assert names in lines[0]
  assert not done.stdout       # nothing ran


@pytest.mark.skipif(not _LIBTPU, reason="needs libtpu (the `tpu` extra) to ask it")
def test_a_topology_libtpu_rejects_is_a_usage_error():
  # The form is right and 27648 divides over 27 chips, but v5p hosts hold 2x2x1 chips.
  done = _run("plan", "--topology=v5p:3x3x3", "--seq_len=27648")
  assert done.returncode == 2 and "Traceback" not in done.stderr
  assert done.stderr.splitlines() == [done.stderr.strip()]
  assert done.stderr.startswith("ringflash plan: --topology=v5p:3x3x3 is not one libtpu knows")


_BROKEN_RINGFLASH = """
import sys
from ringflash.cli import run
from ringflash.cli.bench import harness

real = harness.attention_fns

def attention_fns(impl, *args, **kwargs):
  if impl != "ringflash":
    return real(impl, *args, **kwargs)
  def fails(*_):
    raise NotImplementedError("backend 'pallas_gpu' supports head_dim in (64, 128, 256), "
                              "got 32\\nsecond line")
  return fails, fails

harness.attention_fns = attention_fns
run(["ringflash", "bench"] + sys.argv[1:])
"""


def test_bench_fails_when_ringflash_fails_but_skips_a_failing_peer(tmp_path):
  done = _run("--mode=kernels", "--seq_lens=128", "--kv_heads=2", "--heads=2", "--head_dim=32",
              "--causal=true", "--impls=cudnn,xla,ringflash", "--warmup=0", "--iters=1",
              f"--out={tmp_path}", script=textwrap.dedent(_BROKEN_RINGFLASH))
  assert done.returncode == 1, done.stderr[-2000:]
  assert "Traceback" not in done.stderr
  assert done.stderr.splitlines()[-1] == (
      "ringflash bench: implementation 'ringflash' failed: NotImplementedError: backend "
      "'pallas_gpu' supports head_dim in (64, 128, 256), got 32")
  assert not os.path.exists(tmp_path / "bench_kernels.json")


def test_bench_flags_are_checked_in_process():
  """The checks behind the bench's usage errors, without a process per case."""
  import types

  from ringflash.cli import UsageError
  from ringflash.cli import bench

  good = dict(mode="kernels", seq_lens=["128"], gqa_seq_lens=["128"], ring_sizes=["2"],
              kv_heads=["4", "1"], heads=4, head_dim=32, batch=1, iters=1, warmup=0,
              xla_max_len=0, run_max_len=0, causal=["True", "false"], impls=["ringflash"],
              out="bench_out", hlo_dir="", layout="zigzag", variants=["plain", "mla"],
              ulysses_size=2)
  bench.check_flags(types.SimpleNamespace(**good))
  for change, flag in [({"ring_sizes": ["0"]}, "--ring_sizes"),
                       ({"variants": ["plain", "fast"]}, "--variants"),
                       ({"gqa_seq_lens": []}, "--gqa_seq_lens"),
                       ({"warmup": -1}, "--warmup"),
                       ({"batch": 0}, "--batch"),
                       ({"impls": []}, "--impls"),
                       ({"mode": "scaling", "seq_lens": ["129"]}, "--seq_lens"),
                       ({"mode": "longest", "seq_lens": ["129"]}, "--seq_lens"),
                       # a ring of 2^30 devices of 16 tokens each: a traceback from the API
                       ({"mode": "virtual", "seq_lens": ["16"], "ring_sizes": ["1073741824"]},
                        "--seq_lens x --ring_sizes: 16 tokens per device on 1073741824 devices "
                        "make 17179869184, more than 2\\*\\*30")]:
    with pytest.raises(UsageError, match=flag):
      bench.check_flags(types.SimpleNamespace(**(good | change)))
  # a flag given on the command line must be one that the mode reads
  for mode, name in [("features", "impls"), ("kernels", "variants"), ("scaling", "ring_sizes"),
                     ("strategies", "layout"), ("longest", "causal"), ("decode", "seq_lens")]:
    with pytest.raises(UsageError, match=f"--{name} applies to --mode=.*, not --mode={mode}"):
      bench.check_flags(types.SimpleNamespace(**(good | {"mode": mode})), given=[name])
  for mode, name in [("kernels", "impls"), ("features", "variants"), ("virtual", "ring_sizes"),
                     ("longest", "layout"), ("decode", "cache_lens"), ("decode", "heads")]:
    bench.check_flags(types.SimpleNamespace(**(good | {"mode": mode, "cache_lens": ["256"],
                                                       "new_tokens": 1})), given=[name])
  # odd per-device lengths are fine where nothing cuts them in zigzag chunks
  for change in ({"seq_lens": ["129"]}, {"mode": "scaling", "seq_lens": ["129"],
                                         "causal": ["false"]},
                 {"mode": "longest", "seq_lens": ["129"], "layout": "contiguous"}):
    bench.check_flags(types.SimpleNamespace(**(good | change)))


def test_bench_refuses_what_would_run_nothing_in_process():
  """An empty --variants list, and a kernels row in which no implementation would run (the
  xla backend alone, above --xla_max_len), refused without a process per case."""
  import types

  from ringflash.cli import UsageError
  from ringflash.cli import bench

  good = dict(mode="kernels", seq_lens=["128"], gqa_seq_lens=["256"], ring_sizes=["2"],
              kv_heads=["4", "1"], heads=4, head_dim=32, batch=1, iters=1, warmup=0,
              xla_max_len=256, run_max_len=0, causal=["false"], impls=["xla"],
              out="bench_out", hlo_dir="", layout="zigzag", variants=["plain"],
              ulysses_size=2)
  bench.check_flags(types.SimpleNamespace(**good))
  for change, says in [({"mode": "features", "variants": []}, "--variants must list"),
                       ({"xla_max_len": 128}, "--impls=xla runs nothing at T=256"),  # GQA row
                       ({"seq_lens": ["512"]}, "--impls=xla runs nothing at T=512")]:
    with pytest.raises(UsageError, match=says):
      bench.check_flags(types.SimpleNamespace(**(good | change)))
  # another implementation runs where xla is left out; the GQA lengths only with K != N
  for change in ({"xla_max_len": 0, "impls": ["xla", "ringflash"]},
                 {"kv_heads": ["4"], "gqa_seq_lens": ["4096"]}):
    bench.check_flags(types.SimpleNamespace(**(good | change)))


@pytest.mark.parametrize("where", ["one", "all"])
def test_demo_fails_when_the_ring_gives_nan(where):
  """A NaN in the ring's output (one element, or all) is a FAIL with status 1: the demo
  printed PASS, its max over a large CPU array dropping the NaN (all-NaN gave -inf) and
  Python's max keeping its first argument beside one."""
  script = textwrap.dedent(f"""
      import sys
      import jax, jax.numpy as jnp
      import ringflash
      real = ringflash.ring_attention
      def broken(*args, **kwargs):
        out = real(*args, **kwargs)
        nan = jnp.zeros(out.shape, out.dtype)
        nan = nan.at[0, 3, 0, 0].set(jnp.nan) if {where!r} == "one" else nan + jnp.nan
        return out + jax.lax.stop_gradient(nan)
      ringflash.ring_attention = broken
      from ringflash.cli import run
      sys.argv = ["ringflash", "demo", "--seq_len=256", "--reference_chunk=64"]
      run()
      """)
  done = _run(script=script)
  assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
  assert "\nFAIL: largest error relative to max(1, |reference|) = nan" in done.stdout, (
      done.stdout[-2000:])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,k,h,hv", [(4, 4, 16, 16), (4, 2, 32, 16), (2, 1, 16, 32)])
def test_demo_reference_matches_the_oracle(causal, n, k, h, hv):
  """`demo` and `check` measure the ring against ringflash.reference, a second dense
  implementation; it agrees with the tests' oracle, GQA and a value head dim unlike the
  query's among the shapes (it reshaped its output to the query's head dim)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from ringflash import reference  # pylint: disable=g-import-not-at-top
  import oracle  # pylint: disable=g-import-not-at-top
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(7), 3)
  q = jax.random.normal(kq, (2, 48, n, h))
  keys = jax.random.normal(kk, (2, 48, k, h))
  values = jax.random.normal(kv, (2, 48, k, hv))
  got = reference.dense_attention(q, keys, values, causal, chunk=16)
  want, _ = oracle.attention(q, keys, values, causal=causal)
  assert got.shape == (2, 48, n, hv)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sub,names", [
    ("train", ["--steps", "--checkpoint_dir", "--learning_rate", "--resume"]),
    ("check", ["--tolerance", "--seq_len"]),
    ("generate", ["--tie_tolerance"]),
    ("launch", ["--stop_timeout_s", "--timeout_s", "--log_dir", "--processes"]),
    ("bench", ["--mode", "--warmup", "--ulysses_size"]),
    ("plan", ["--topology", "--max_seq_len"]),
    ("demo", ["--seq_len"]),
])
def test_help_lists_every_flag_of_the_subcommand(sub, names):
  """`ringflash <sub> --help` lists its flags wherever they are defined: train's (in
  launch/train_flags.py) and every finite float (defined through ringflash.cli) were missing,
  and launch's --log_dir (absl's own); it also prints what the subcommand does."""
  done = _run(sub, "--help")
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.startswith(f"usage: ringflash {sub} [--flags]")
  for name in names:
    assert f"\n  {name}: " in done.stdout, (name, done.stdout[-3000:])
  assert "(default: " in done.stdout and f"`ringflash {sub}" in done.stdout


@pytest.mark.parametrize("sub", ["train", "bench"])
def test_help_into_a_closed_pipe_ends_without_a_traceback(sub):
  """`ringflash train --help | head -1`: the reader gone, the help's writes raised
  BrokenPipeError, and Python printed its traceback. Here the pipe is closed before the
  command writes anything."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen([sys.executable, "-m", "ringflash.cli", sub, "--help"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  proc.stdout.close()
  err = proc.stderr.read()
  assert proc.wait(timeout=120) == 1
  assert err == "", err[-2000:]


def test_the_commands_bound_sequences_as_the_library_does():
  from ringflash import _validate  # pylint: disable=g-import-not-at-top
  from ringflash import cli  # pylint: disable=g-import-not-at-top
  assert cli.MAX_SEQ_LEN == _validate.MAX_TOKENS


def test_devices_per_process_past_the_bound_is_one_line():
  env = dict(os.environ, JAX_PLATFORMS="cpu", RINGFLASH_DEVICES_PER_PROCESS="100000")
  done = subprocess.run([sys.executable, "-m", "ringflash.cli", "check", "--seq_len=8"],
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2 and done.stderr.splitlines() == [
      "ringflash check: RINGFLASH_DEVICES_PER_PROCESS must be in 1..4096, got 100000"], (
          done.stderr[-2000:])


@pytest.mark.parametrize("platforms,says", [("cpux", "Unable to initialize backend 'cpux'"),
                                            ("cuda", "")])
def test_a_jax_platforms_that_starts_no_backend_is_one_line(platforms, says):
  """JAX_PLATFORMS naming an unknown platform (RuntimeError) or one whose plugin is missing
  (JAX's AssertionError): each was a traceback of some 40 lines through JAX."""
  if platforms == "cuda" and importlib.util.find_spec("jax_cuda12_plugin") is not None:
    pytest.skip("a CUDA plugin is installed")
  done = _run("demo", "--seq_len=64", platforms=platforms)
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert done.stderr.splitlines() == [done.stderr.strip()]
  assert done.stderr.startswith(f"ringflash demo: JAX_PLATFORMS={platforms}: no JAX backend")
  assert says in done.stderr


def test_host_memory_that_valid_sizes_exceed_is_one_line():
  """numpy's allocation error (a MemoryError) for sizes no flag bound refuses, e.g. `plan`'s
  [P, P] tables for a topology of a million chips: a traceback before, now one line and
  status 1 (no flag is wrong)."""
  script = textwrap.dedent("""
      import sys
      from ringflash.cli import run
      from ringflash.cli import demo
      def main(argv):
        raise MemoryError("Unable to allocate 7.28 TiB for an array with shape (1000000, "
                          "1000000, 1) and data type int64")
      demo.main = main
      run(["ringflash", "demo"] + sys.argv[1:])
      """)
  done = _run("--seq_len=64", script=script)
  assert done.returncode == 1 and done.stderr.splitlines() == [
      "ringflash demo: out of host memory: Unable to allocate 7.28 TiB for an array with "
      "shape (1000000, 1000000, 1) and data type int64"], done.stderr[-2000:]


def test_an_allocation_past_memory_at_dispatch_is_one_line():
  """The runtime reports an allocation at dispatch as INTERNAL ("Error dispatching
  computation: Out of memory allocating ..."), not RESOURCE_EXHAUSTED: it came with the
  traceback; now one line and status 1, as the other out-of-memory errors."""
  run = _run("demo", "--head_dim=100000000", "--seq_len=64")     # 102 GB at dispatch
  assert run.returncode == 1, run.stderr[-2000:]
  assert "Traceback" not in run.stderr, run.stderr[-3000:]
  assert run.stderr.splitlines()[-1].startswith("ringflash demo: out of memory: INTERNAL: "), (
      run.stderr[-2000:])
  assert "Out of memory allocating" in run.stderr.splitlines()[-1]


def test_valid_flags_past_the_devices_memory_are_one_line():
  """A length the host cannot hold: the runtime's RESOURCE_EXHAUSTED came with some 40 lines
  of traceback through JAX; now its message in one line, and status 1 (no flag is wrong).
  A device's share (2^54 bytes) is past any host's address space: smaller shares can be
  granted by an overcommitting kernel and then end in its OOM killer (SIGKILL, a 128 GiB
  host) instead of the runtime's error."""
  run = _run("demo", "--seq_len=1073741824", "--reference_chunk=1073741824",
             "--batch=131072")
  assert run.returncode == 1, run.stderr[-2000:]
  assert "Traceback" not in run.stderr, run.stderr[-3000:]
  assert run.stderr.splitlines()[-1].startswith(
      "ringflash demo: out of memory: RESOURCE_EXHAUSTED: Out of memory allocating"), (
          run.stderr[-2000:])
