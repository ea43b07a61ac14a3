"""Random calls of ringflash checked against the independent oracle (tests/oracle.py).

Draws cases at random, runs each on one backend and compares it with the oracle (dense
attention in float32 at HIGHEST precision, written from the definition), until --cases
cases or --seconds have passed. Prints one line per failure and per refusal, then a summary;
exits 1 if any case failed. The contract tests check each feature on a fixed grid; this
checks their combinations, which no grid covers.

Two kinds of case:
- "api": `ring_attention(..., return_residual=True)` over a 1-D mesh of P devices (P drawn
  from 1, 2, 4, 8, as many as there are): strategy ring (also bidirectional), allgather,
  ulysses or auto; layout contiguous, zigzag or striped (inputs permuted with to_layout,
  results restored with from_layout); no, one or two leading batch dims; GQA / MQA; value
  head dim unlike the query's; causal, windows, segment ids, per-row sequence lengths,
  sinks, soft-caps (queries scaled so that scores pass the cap), other scales, sequence
  lengths that do not divide by P. Checked: out, lse (and which rows are -inf), and the
  gradients of q, k, v and sinks.
- "hop": the backend's forward and backward kernels alone (the kernel contract of
  ringflash/kernels/base.py), as one ring hop: key positions offset from the queries' (keys
  partly after, entirely after or before them, positions near 2^31, query positions
  permuted), out and lse (rows with no valid key exactly 0 and -inf), then dq, dk, dv from
  the oracle's out and lse.

In three fifths of the api cases one entry of q, k or v is then set to NaN, +Inf or -Inf
(the non-finite rule of ringflash/kernels/base.py): the rows that see it must be
non-finite (a NaN anywhere, an infinity in v; an infinity in q or k may give a score of
-inf, or a finite one under a soft-cap, so those rows are not checked), every other row
finite and exact, and the gradients, with a zero cotangent on the rows that see it, finite
and exact.

Tolerances: float32 inputs within 2e-4 max(1, max |ref|) (every array); 16-bit inputs
within 3x the error of the same dense attention computed in the inputs' dtype (the oracle
with upcast=False) plus 1e-3 max(1, max |ref|), 4e-3 for dsinks (one sum over every row of a
head, computed from the rounded output). A case the library refuses (NotImplementedError,
or a ValueError naming an argument) is counted as refused and printed, not failed.

  # CPU, simulated devices (xla, or the Pallas backends interpreted), in the test venv:
  JAX_PLATFORMS=cpu .venv-test/bin/python scripts/random_check.py --backend=xla \
      --seconds=600 --seed=1
  JAX_PLATFORMS=cpu .venv-test/bin/python scripts/random_check.py --backend=pallas_tpu \
      --seconds=600 --seed=1
  # one H200 (api cases on one device, larger shapes, 16-bit inputs):
  XLA_FLAGS=--xla_gpu_autotune_level=0 python3 scripts/random_check.py \
      --backend=pallas_gpu --size=large --seconds=300 --seed=1

docs/GPU_NOTES.md, run 93, has the H200's results (of the scratch script this one was
written from, with the same criteria and kinds of case).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import random
import sys
import time

_TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"

# (H, Hv) pairs drawn; large shapes on GPUs, small ones on CPU (interpret mode is slow).
_DIMS = {"large": [(64, 64), (128, 128), (72, 72), (80, 80), (96, 96), (112, 112),
                   (160, 160), (192, 128), (128, 64), (64, 128), (256, 256), (256, 128)],
         "small": [(8, 8), (16, 16), (24, 24), (16, 8), (8, 16)]}
_LENGTHS = {"large": [128, 256, 512, 1000, 1024, 1537, 2048, 4096],
            "small": [8, 16, 24, 32]}      # small: per device, times P (plus 0 or 3)
_HOP_LENGTHS = {"large": [128, 256, 512, 1024, 2048], "small": [16, 32, 128]}


@dataclasses.dataclass
class Case:
  """One random call. t, s: query and key lengths; n, kh: query and kv heads."""
  kind: str
  ring_size: int
  strategy: str
  layout: str
  bidirectional: bool
  h: int
  hv: int
  t: int
  s: int
  n: int
  kh: int
  lead: tuple
  dtype: str
  causal: bool
  window: object
  segments: bool
  lengths: bool
  sinks: bool
  softcap: float | None
  q_scale: float
  scale: float | None
  poison: str | None
  poison_value: float
  seed: int


def draw(rng: random.Random, devices: int, size: str) -> Case:
  """A random case on up to `devices` devices, of `size` shapes."""
  kind = "hop" if rng.random() < 0.4 else "api"
  sizes = [p for p in (1, 2, 4, 8) if p <= devices]
  p = rng.choice(sizes) if kind == "api" else 1
  strategy = rng.choice(["ring", "ring", "allgather", "ulysses", "auto"])
  layout = rng.choice(["contiguous", "contiguous", "zigzag", "striped"]) if p > 1 else (
      "contiguous")
  kh, g = rng.choice([1, 2, 4]), rng.choice([1, 2])
  if strategy == "ulysses" and (kh * g) % p:
    kh = max(1, p // g)
  h, hv = rng.choice(_DIMS[size])
  causal = rng.random() < 0.5
  if kind == "hop":
    t = rng.choice(_HOP_LENGTHS[size])
    s = rng.choice([t] + _HOP_LENGTHS[size][:2])
  elif size == "small":
    unit = 2 * p if layout == "zigzag" else p
    t = rng.choice(_LENGTHS[size]) * unit
    if layout == "contiguous" and p > 1:
      t += rng.choice([0, 0, 3])
    s = t
  else:
    t = rng.choice(_LENGTHS[size])
    s = t if causal or rng.random() < 0.6 else rng.choice([128, 384, 1024, 3000])
  if size == "large" and t * max(t, s) > 2048 * 2048:
    kh, g = min(kh, 2), min(g, 2)
  lead = rng.choice([(1,), (2,), (), (2, 1)]) if kind == "api" else (2,)
  short = max(4, t // 8)
  return Case(
      kind=kind, ring_size=p, strategy=strategy, layout=layout,
      bidirectional=strategy == "ring" and rng.random() < 0.3, h=h, hv=hv, t=t, s=s,
      n=kh * g, kh=kh, lead=lead,
      dtype="float32" if size == "small" and rng.random() < 0.5 else rng.choice(
          ["bfloat16"] * 3 + ["float16"]),
      causal=causal,
      window=rng.choice([None, None, short, (2 * short, 0), (short // 2, 3 * short)]),
      segments=rng.random() < 0.3 and t == s,
      lengths=kind == "api" and rng.random() < 0.3 and bool(lead),
      sinks=kind == "api" and rng.random() < 0.35,
      softcap=rng.choice([None, None, 5.0, 30.0, 50.0]),
      q_scale=rng.choice([1.0, 1.0, 4.0, 12.0]), scale=rng.choice([None, None, 0.05]),
      poison=rng.choice([None, None, "q", "k", "v"]) if kind == "api" else None,
      poison_value=rng.choice([math.nan, math.inf, -math.inf]),
      seed=rng.randrange(1 << 30))


def compare(name, got, want, plain, dtype) -> str | None:
  """Why `got` is not close enough to the oracle's `want` (None: it is)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  got, want, plain = (np.asarray(x, np.float32) for x in (got, want, plain))
  if got.shape != want.shape:
    return f"{name}: shape {got.shape}, the oracle's {want.shape}"
  if not np.all(np.isfinite(got)):
    return f"{name}: {int(np.sum(~np.isfinite(got)))} non-finite entries"
  scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
  if np.dtype(dtype).itemsize == 4:
    bound = 2e-4 * scale
  else:
    floor = 4e-3 if name.endswith("dsinks") else 1e-3
    bound = 3 * float(np.max(np.abs(plain - want), initial=0.0)) + floor * scale
  err = float(np.max(np.abs(got - want), initial=0.0))
  if err > bound:
    return f"{name}: error {err:.3g} over its bound {bound:.3g}"
  return None


class _Checker:
  """Runs cases on one backend (imports jax lazily: main() configures devices first)."""

  def __init__(self, backend: str):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    sys.path.insert(0, str(_TESTS))
    import oracle  # pylint: disable=g-import-not-at-top
    import ringflash  # pylint: disable=g-import-not-at-top
    self.jax, self.jnp, self.np, self.oracle, self.rf = jax, jnp, np, oracle, ringflash
    self.backend = backend

  def inputs(self, c: Case, b_shape):
    jax, jnp = self.jax, self.jnp
    ks = jax.random.split(jax.random.key(c.seed), 5)
    dt = jnp.dtype(c.dtype)
    q = (jax.random.normal(ks[0], b_shape + (c.t, c.n, c.h)) * c.q_scale).astype(dt)
    k = jax.random.normal(ks[1], b_shape + (c.s, c.kh, c.h)).astype(dt)
    v = jax.random.normal(ks[2], b_shape + (c.s, c.kh, c.hv)).astype(dt)
    dout = jax.random.normal(ks[3], b_shape + (c.t, c.n, c.hv)).astype(dt).astype(jnp.float32)
    sinks = jax.random.normal(ks[4], (c.n,)) * 2 if c.sinks else None
    return q, k, v, dout, sinks

  # ------------------------------------------------------------------------- api cases

  def api(self, c: Case) -> list[str]:
    jax, jnp, np, rf = self.jax, self.jnp, self.np, self.rf
    lead, b = c.lead, math.prod(c.lead)
    q, k, v, dout, sinks = self.inputs(c, lead)
    nr = np.random.RandomState(c.seed % (1 << 30))
    seg = np.sort(nr.randint(1, 4, (b, c.t)), axis=-1).astype(np.int32) if c.segments else None
    q_len = nr.randint(0, c.t + 1, b).astype(np.int32) if c.lengths else None
    kv_len = nr.randint(0, c.s + 1, b).astype(np.int32) if c.lengths else None
    aux = {"seg": seg, "q_len": q_len, "kv_len": kv_len}
    aux = {name: None if x is None else jnp.asarray(x) for name, x in aux.items()}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:c.ring_size]), ("sp",))
    user = lambda x: x.reshape(lead + x.shape[1:])          # [B, ...] -> [*lead, ...]
    flat = lambda x: x.reshape((b,) + x.shape[len(lead):])  # [*lead, ...] -> [B, ...]
    nat = len(lead)                                         # the sequence axis of q, k, v

    def ours(q, k, v, sinks, aux):
      to = lambda x, axis: (x if c.layout == "contiguous" else
                            rf.to_layout(x, c.layout, c.ring_size, axis=axis))
      seg_u = None if aux["seg"] is None else to(user(aux["seg"]), nat)
      out, lse = rf.ring_attention(
          to(q, nat), to(k, nat), to(v, nat), mesh=mesh, axis_name="sp", is_causal=c.causal,
          scale=c.scale, segment_ids=seg_u, return_residual=True, backend=self.backend,
          layout=c.layout, local_window_size=c.window, bidirectional=c.bidirectional,
          sinks=sinks, logits_soft_cap=c.softcap, strategy=c.strategy,
          query_seq_lengths=None if aux["q_len"] is None else user(aux["q_len"]),
          key_value_seq_lengths=None if aux["kv_len"] is None else user(aux["kv_len"]))
      back = lambda x, axis: (x if c.layout == "contiguous" else
                              rf.from_layout(x, c.layout, c.ring_size, axis=axis))
      return back(out, nat), back(lse, lse.ndim - 1)

    def dense(upcast):
      def f(q, k, v, sinks, aux):
        out, lse = self.oracle.attention(
            flat(q), flat(k), flat(v), causal=c.causal, scale=c.scale, upcast=upcast,
            q_seg=aux["seg"], kv_seg=aux["seg"], window=c.window, softcap=c.softcap,
            sinks=sinks, q_lengths=aux["q_len"], kv_lengths=aux["kv_len"])
        return user(out), user(lse)
      return f

    def run(f, q, k, v, keep):
      def loss(q, k, v, sinks, aux, keep, dout):
        return jnp.sum(jnp.where(keep, f(q, k, v, sinks, aux)[0].astype(jnp.float32) * dout,
                                 0.0))
      argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
      res = jax.jit(f)(q, k, v, sinks, aux)
      grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, sinks, aux, keep, dout)
      return res, grads

    names = ("dq", "dk", "dv", "dsinks")
    keep = jnp.ones(lead + (c.t, c.n, 1), bool)
    (o, lse), g = run(ours, q, k, v, keep)
    (ro, rl), rg = run(dense(True), q, k, v, keep)
    (po, pl), pg = run(dense(False), q, k, v, keep)
    fails = []
    finite = np.isfinite(np.asarray(rl))
    if not np.array_equal(np.isfinite(np.asarray(lse)), finite):
      fails.append("lse: -inf where the oracle's is finite, or the other way")
    else:
      zero = lambda x: np.where(finite, np.asarray(x, np.float32), 0.0)
      fails.append(compare("lse", zero(lse), zero(rl), zero(pl), c.dtype))
    fails.append(compare("out", o, ro, po, c.dtype))
    fails += [compare(n_, *x, c.dtype) for n_, *x in zip(names, g, rg, pg)]
    fails = [f for f in fails if f]
    if fails or c.poison is None:
      return fails
    return self.poisoned(c, (q, k, v), aux, nr, ours, dense, run, names)

  def poisoned(self, c, qkv, aux, nr, ours, dense, run, names) -> list[str]:
    """One NaN or Inf entry: the rows that see it, and nothing else, become non-finite."""
    jnp, np = self.jnp, self.np
    lead, b = c.lead, math.prod(c.lead)
    valid = self.valid_mask(c, aux, b)                                  # [B, T, S]
    row = nr.randint(b)
    where_b = np.unravel_index(row, lead) if lead else ()
    seeing = np.zeros((b, c.t, c.n), bool)
    bad = dict(zip("qkv", qkv))
    if c.poison == "q":
      i, head = nr.randint(c.t), nr.randint(c.n)
      bad["q"] = bad["q"].at[where_b + (i, head, nr.randint(c.h))].set(c.poison_value)
      seeing[row, i, head] = True
      must = valid[row, i].any() and math.isnan(c.poison_value)
    else:
      j, kv_head, g = nr.randint(c.s), nr.randint(c.kh), c.n // c.kh
      width = c.h if c.poison == "k" else c.hv
      bad[c.poison] = bad[c.poison].at[where_b + (j, kv_head, nr.randint(width))].set(
          c.poison_value)
      seeing[row, :, kv_head * g:(kv_head + 1) * g] = valid[row, :, j][:, None]
      must = math.isnan(c.poison_value) or c.poison == "v"
    seeing = seeing.reshape(lead + (c.t, c.n))
    keep = jnp.asarray(~seeing)[..., None]
    (o, _), g = run(ours, bad["q"], bad["k"], bad["v"], keep)
    (ro, _), rg = run(dense(True), *qkv, keep)
    (po, _), pg = run(dense(False), *qkv, keep)
    o, ro, po = (np.asarray(x, np.float32) for x in (o, ro, po))
    broken = np.any(~np.isfinite(o), axis=-1)
    what = f"{c.poison}={c.poison_value}"
    if must and not np.all(broken[seeing]):
      return [f"{what}: {int(np.sum(~broken[seeing]))} rows that see it are finite"]
    if np.any(broken[~seeing]):
      return [f"{what}: reached {int(np.sum(broken[~seeing]))} rows that do not see it"]
    fails = [compare(f"{what}: out", o[~seeing], ro[~seeing], po[~seeing], c.dtype)]
    fails += [compare(f"{what}: {n_}", *x, c.dtype) for n_, *x in zip(names, g, rg, pg)]
    return [f for f in fails if f]

  def valid_mask(self, c: Case, aux, b):
    """[B, T, S] bool: query i sees key j, from the mask's definition."""
    np = self.np
    i, j = np.arange(c.t)[:, None], np.arange(c.s)[None, :]
    valid = np.ones((b, c.t, c.s), bool)
    if c.causal:
      valid &= (j <= i)[None]
    if c.window is not None:
      left, right = (c.window, c.window) if isinstance(c.window, int) else c.window
      valid &= ((i - j <= left) & (j - i <= right))[None]
    if aux["seg"] is not None:
      seg = np.asarray(aux["seg"])
      valid &= seg[:, :, None] == seg[:, None, :]
    if aux["kv_len"] is not None:
      valid &= (np.arange(c.s)[None, :] < np.asarray(aux["kv_len"])[:, None])[:, None, :]
      valid &= (np.arange(c.t)[None, :] < np.asarray(aux["q_len"])[:, None])[:, :, None]
    return valid

  # ------------------------------------------------------------------------- hop cases

  def hop(self, c: Case) -> list[str]:
    jax, jnp, np = self.jax, self.jnp, self.np
    from ringflash.kernels import base, pallas_gpu, pallas_tpu, xla  # pylint: disable=g-import-not-at-top
    module = {"xla": xla, "pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}[self.backend]
    q, k, v, dout, _ = self.inputs(c, c.lead)
    nr = np.random.RandomState(c.seed % (1 << 30))
    start = nr.choice([0, 4096, 2**31 - 1 - c.t - c.s - 8192])
    offset = int(nr.choice([0, c.t // 2, c.t, c.t + 64, -c.s, -(c.s // 2), -37]))
    q_pos = np.arange(c.t) + start + max(0, -offset)
    k_pos = np.arange(c.s) + start + max(0, -offset) + offset
    if nr.rand() < 0.2:
      q_pos = nr.permutation(q_pos)
    seg = np.sort(nr.randint(1, 4, (c.lead[0], c.t + c.s)), axis=-1).astype(np.int32)
    segs = (jnp.asarray(seg[:, :c.t]), jnp.asarray(seg[:, -c.s:])) if c.segments else (
        None, None)
    args = (jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)) + segs
    window = (c.window, c.window) if isinstance(c.window, int) else c.window
    device = jax.devices()[0]
    problem = base.Problem(
        q_len=c.t, kv_len=c.s, head_dim=c.h, kv_heads=c.kh, group=c.n // c.kh,
        dtype=jnp.dtype(c.dtype), platform=device.platform, device_kind=device.device_kind,
        compute_capability=getattr(device, "compute_capability", None), causal=c.causal,
        window=window, segments=c.segments, head_dim_v=c.hv, softcap=c.softcap)
    why = module.unsupported(problem)
    if why:
      raise NotImplementedError(why)
    spec = base.KernelSpec(scale=c.h ** -0.5 if c.scale is None else c.scale,
                           causal=c.causal, tiles=module.resolve_tiles(None, problem),
                           interpret=problem.interpret, window=window, softcap=c.softcap)

    def dense(upcast):
      return lambda q, k, v, a: self.oracle.attention(
          q, k, v, causal=c.causal, scale=spec.scale, upcast=upcast, q_seg=a[2],
          kv_seg=a[3], window=window, q_pos=a[0], kv_pos=a[1], softcap=c.softcap)

    o, lse = jax.jit(lambda q, k, v, a: module.forward(q, k, v, *a, spec))(q, k, v, args)
    (ro, rl), (po, pl) = (jax.jit(dense(u))(q, k, v, args) for u in (True, False))
    o, lse, rl, pl = (np.asarray(x, np.float32) for x in (o, lse, rl, pl))
    finite = np.isfinite(rl)
    if not np.array_equal(np.isfinite(lse), finite):
      return ["hop lse: -inf where the oracle's is finite, or the other way"]
    if np.any(o[~finite.transpose(0, 2, 1)] != 0):
      return ["hop out: a row with no valid key is not 0"]
    zero = lambda x: np.where(finite, x, 0.0)
    fails = [compare("hop out", o, ro, po, c.dtype),
             compare("hop lse", zero(lse), zero(rl), zero(pl), c.dtype)]
    got = jax.jit(lambda q, k, v, o_, l_, d_, a: module.backward(q, k, v, o_, l_, d_, *a, spec))(
        q, k, v, ro, jnp.asarray(rl), dout.astype(q.dtype), args)

    def grads(f):
      loss = lambda q, k, v, a, d: jnp.sum(f(q, k, v, a)[0].astype(jnp.float32) * d)
      return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, args, dout)

    want, plain = grads(dense(True)), grads(dense(False))
    fails += [compare(f"hop {n_}", *x, c.dtype)
              for n_, *x in zip(("dq", "dk", "dv"), got, want, plain)]
    return [f for f in fails if f]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--backend", default="xla", choices=["xla", "pallas_tpu", "pallas_gpu"])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--seconds", type=float, default=None, help="stop drawing after this")
  parser.add_argument("--cases", type=int, default=None, help="stop after this many cases")
  parser.add_argument("--size", choices=["small", "large"], default=None,
                      help="shapes (default: small on CPU, large on GPUs)")
  parser.add_argument("--cpu_devices", type=int, default=8,
                      help="simulated CPU devices when the platform is CPU (set before jax "
                           "initializes; ignored if it already has)")
  args = parser.parse_args(argv)
  if args.seconds is None and args.cases is None:
    parser.error("give --seconds or --cases")
  import jax  # pylint: disable=g-import-not-at-top
  if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu") and args.backend != "pallas_gpu":
    try:
      jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    except RuntimeError:
      pass                                       # jax already initialized (under pytest)
  checker = _Checker(args.backend)
  platform = jax.devices()[0].platform
  size = args.size or ("small" if platform == "cpu" else "large")
  devices = len(jax.devices())
  rng = random.Random(args.seed)
  counts = {"passed": 0, "failed": 0, "refused": 0}
  start = time.time()
  while ((args.cases is None or sum(counts.values()) < args.cases) and
         (args.seconds is None or time.time() - start < args.seconds)):
    case = draw(rng, devices, size)
    text = json.dumps(dataclasses.asdict(case))
    try:
      fails = checker.hop(case) if case.kind == "hop" else checker.api(case)
    except (NotImplementedError, ValueError) as err:
      counts["refused"] += 1
      print(f"REFUSED {text} {type(err).__name__}: {str(err)[:300]}", flush=True)
      continue
    counts["failed" if fails else "passed"] += 1
    if fails:
      print(f"FAILED {text} {'; '.join(fails)}", flush=True)
  print(f"random_check backend={args.backend} seed={args.seed} size={size}: "
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['refused']} refused "
        f"in {time.time() - start:.0f} s", flush=True)
  return 1 if counts["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
