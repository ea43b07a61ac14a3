"""Random calls of ringflash checked against the independent oracle (tests/oracle.py).

Draws cases at random, runs each on one backend and compares it with the oracle (dense
attention in float32 at HIGHEST precision, written from the definition), until --cases
cases or --seconds have passed. Prints one line per failure and per refusal, then a summary;
exits 1 if any case failed. The contract tests check each feature on a fixed grid; this
checks their combinations, which no grid covers.

Three kinds of case:
- "api": `ring_attention(..., return_residual=True)` (or, in three tenths of the cases whose
  lengths divide by the ring, `ring_attention_sharded` inside the caller's shard_map) over
  P devices (P drawn from 1, 2, 4, 8, as many as there are), a 1-D mesh or, for P >= 4, a
  2-D mesh ("r", "u") with the sequence over both axes: strategy ring (also bidirectional),
  allgather, ulysses, auto, and on the 2-D mesh hybrid (Ulysses over "u", the ring over
  "r"); layout contiguous, zigzag
  or striped (inputs permuted with to_layout, results restored with from_layout); no, one or
  two leading batch dims; GQA / MQA; value head dim unlike the query's; causal, windows,
  segment ids, per-row sequence lengths, sinks, soft-caps (queries scaled so that scores
  pass the cap), other scales, sequence lengths that do not divide by P (in any layout).
  Checked: out, lse (and which rows are -inf), and the gradients of q, k, v and sinks, from
  a cotangent on out and, in three tenths of the cases, on lse as well.
- "hop": the backend's forward and backward kernels alone (the kernel contract of
  ringflash/kernels/base.py), as one ring hop: key positions offset from the queries' (keys
  partly after, entirely after or before them, positions near 2^31, query positions
  permuted), out and lse (rows with no valid key exactly 0 and -inf), then dq, dk, dv from
  the oracle's out and lse.
- "decode": `decode_attention` of t new tokens per row (t 1-8, rows whose length is below t
  or the whole cache among them) against a cache of S_max slots sharded over P devices,
  strategy reduce, allgather or ring, the cache filled one of three ways: slot j holding
  position j; each row's tokens in random slots, the others free (cache_positions); a
  ringflash.KVCache prefilled in a layout (rows padded, prompts of lengths the layout does
  not always fit) and appended to. GQA / MQA, value
  head dims, windows (also with a right side, which causality cuts), sinks, soft-caps,
  scales. Checked: out and lse against the oracle given the tokens at their positions.

In half the hop cases, and in half the api cases of the ring, all-gather and Ulysses
strategies whose lengths divide by the devices, the kernels run on tiles smaller than the
lengths they see (several tiles a hop; all-gather's key tiles and Ulysses' tiles may be
larger than a device's share):
all four of the xla backend's sizes, pallas_tpu's query tiles (its key tiles are 128 or whole).

In three fifths of the api and decode cases one entry of q, k or v (in decode cases: of the
query or of a cache slot, also a free slot or one no row sees) is set to NaN, +Inf or -Inf
(the non-finite rule of ringflash/kernels/base.py): the rows that see it must be
non-finite (a NaN anywhere, an infinity in v; an infinity in q or k may give a score of
-inf, or a finite one under a soft-cap, so those rows are not checked), every other row
finite and exact, and (api) the gradients, with a zero cotangent on the rows that see it,
finite and exact.

Tolerances: float32 inputs within 2e-4 max(1, max |ref|) (every array); 16-bit inputs
within 3x the error of the same dense attention computed in the inputs' dtype (the oracle
with upcast=False) plus 1e-3 max(1, max |ref|), both errors measured from the oracle's float32
values: its out and lse, and its gradients taken with respect to float32 copies of the inputs
(`upcast`), not rounded to the inputs' dtype. The api cases' reference gradients are the
oracle's for the kernel contract's backward (ringflash/kernels/base.py): its D_i = dout_i .
out_i is taken from the output as ringflash stores and returns it, in the inputs' dtype,
which differs from the oracle's float32 output by delta_i = dout_i . (out_i - ref_i). That
moves ds_ij = p_ij (dp_ij - D_i) by -p_ij delta_i, which is what a cotangent -delta_i on
lse_i gives (d lse_i / d s_ij = p_ij), so the oracle's gradients are taken with that
cotangent besides (`stored_output_shift`); dsinks moves the same way, through lse. With
sinks, the output as stored is the strategy's, without them, in the inputs' dtype, times each
row's sink scaling, unrounded (`as_stored`: the returned output is that rounded again). Where a
row's softmax is nearly one-hot, dp_ij - D_i cancels to a small fraction of D_i's terms and
this term is most of the gradient: seed 58003's float16 case (a query scaled 12x, p = 0.9998
on one key) had dk within 7e-7 of the gradient with D from the stored output and 0.0021 off
the one with the float32 output's D (run 94's dsinks case was the same: 0.0107 off on xla
and on pallas_gpu alike). Dense attention in the inputs' dtype never rounds the output
before its gradient, so its error is no measure of this one. A case the library refuses
(NotImplementedError, or a ValueError naming an argument, raised by ringflash's own code) is
counted as refused and printed, not failed; any other exception is a failure.

  # CPU, simulated devices (xla, or the Pallas backends interpreted), in the test venv:
  JAX_PLATFORMS=cpu .venv-test/bin/python scripts/random_check.py --backend=xla \
      --seconds=600 --seed=1
  JAX_PLATFORMS=cpu .venv-test/bin/python scripts/random_check.py --backend=pallas_tpu \
      --seconds=600 --seed=1
  # one H200 (api and decode cases on one device, larger shapes, 16-bit inputs):
  XLA_FLAGS=--xla_gpu_autotune_level=0 python3 scripts/random_check.py \
      --backend=pallas_gpu --size=large --seconds=300 --seed=1

docs/GPU_NOTES.md has the H200's results: run 93 (the scratch script this one was written
from), run 94 (this script).
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
  axes: int = 1            # api: 1 (mesh ("sp",)) or 2 (mesh ("r", "u"), axis_name ("r", "u"))
  lse_grad: bool = False   # api: a cotangent on lse too, not only on out
  path: str = "-"          # decode: "slots", "positions" or "cache" (see decode())
  entry: str = "ring_attention"   # api: or "ring_attention_sharded" in a shard_map
  tiles: tuple | None = None       # (block_q, block_k, backward's q, k): see block_sizes()


def draw(rng: random.Random, devices: int, size: str) -> Case:
  """A random case on up to `devices` devices, of `size` shapes."""
  kind = rng.choices(["api", "hop", "decode"], weights=[45, 30, 25])[0]
  sizes = [p for p in (1, 2, 4, 8) if p <= devices]
  p = rng.choice(sizes) if kind != "hop" else 1
  axes = 2 if kind == "api" and p >= 4 and rng.random() < 0.3 else 1
  strategy = rng.choice(["ring", "ring", "allgather", "ulysses", "auto"] +
                        ["hybrid"] * (2 if axes == 2 else 0))
  layout = rng.choice(["contiguous", "contiguous", "zigzag", "striped"]) if p > 1 else (
      "contiguous")
  kh, g = rng.choice([1, 2, 4]), rng.choice([1, 2])
  heads_split = {"ulysses": p, "hybrid": 2}.get(strategy, 1)  # hybrid: Ulysses over "u" (2)
  if (kh * g) % heads_split:
    kh = max(1, heads_split // g)
  h, hv = rng.choice(_DIMS[size])
  causal = rng.random() < 0.5
  if kind == "decode":
    return _draw_decode(rng, p, size, kh, g, h, hv)
  if kind == "hop":
    t = rng.choice(_HOP_LENGTHS[size])
    s = rng.choice([t] + _HOP_LENGTHS[size][:2])
  elif size == "small":
    unit = 2 * p if layout == "zigzag" else p
    t = rng.choice(_LENGTHS[size]) * unit
    if p > 1:                  # lengths that do not fit the layout: padded inside
      t += rng.choice([0, 0, 3])
    s = t
  else:
    t = rng.choice(_LENGTHS[size])
    s = t if causal or rng.random() < 0.6 else rng.choice([128, 384, 1024, 3000])
  if size == "large" and t * max(t, s) > 2048 * 2048:
    kh, g = min(kh, 2), min(g, 2)
  lead = rng.choice([(1,), (2,), (), (2, 1)]) if kind == "api" else (2,)
  short = max(4, t // 8)
  bidirectional = strategy == "ring" and rng.random() < 0.3
  # Tiles smaller than the lengths the kernels see (several tiles a hop), where those
  # lengths are known here: a hop's; when the sequence divides by the devices, the ring's,
  # one hop a device (a zigzag chunk or a bidirectional half when those split it),
  # all-gather's (a device's queries, a zigzag chunk of them, against every key) and
  # Ulysses' (the whole sequence): the last two gather in natural order, so their tiles may
  # span devices' shares.
  unit = p * (2 if layout == "zigzag" or bidirectional else 1)
  fits = kind == "api" and axes == 1 and t % unit == 0 and s % unit == 0
  seen = ((t, s) if kind == "hop" or (fits and strategy == "ulysses") else
          (t // unit, s // unit) if fits and strategy == "ring" else
          (t // unit, s) if fits and strategy == "allgather" else None)
  tiles = None
  if seen and rng.random() < 0.5:
    pick = lambda n: rng.choice([d for d in (8, 16, 32, 64) if n % d == 0 and d < n] or [None])
    tiles = (pick(seen[0]), pick(seen[1]), pick(seen[0]), pick(seen[1]))
    tiles = tiles if any(tiles) else None
  return Case(
      kind=kind, ring_size=p, strategy=strategy, layout=layout,
      bidirectional=bidirectional, h=h, hv=hv, t=t, s=s,
      n=kh * g, kh=kh, lead=lead, dtype=_draw_dtype(rng, size), causal=causal,
      window=rng.choice([None, None, short, (2 * short, 0), (short // 2, 3 * short)]),
      segments=rng.random() < 0.3 and t == s,
      lengths=kind == "api" and rng.random() < 0.3 and bool(lead),
      sinks=kind == "api" and rng.random() < 0.35,
      softcap=rng.choice([None, None, 5.0, 30.0, 50.0]),
      q_scale=rng.choice([1.0, 1.0, 4.0, 12.0]), scale=rng.choice([None, None, 0.05]),
      poison=rng.choice([None, None, "q", "k", "v"]) if kind == "api" else None,
      poison_value=rng.choice([math.nan, math.inf, -math.inf]),
      seed=rng.randrange(1 << 30), axes=axes,
      lse_grad=kind == "api" and rng.random() < 0.3,
      entry="ring_attention_sharded" if (kind == "api" and rng.random() < 0.3 and
                                         t % (2 * p if layout == "zigzag" else p) == 0)
      else "ring_attention", tiles=tiles)


def _draw_dtype(rng: random.Random, size: str) -> str:
  return "float32" if size == "small" and rng.random() < 0.5 else rng.choice(
      ["bfloat16"] * 3 + ["float16"])


def _draw_decode(rng: random.Random, p: int, size: str, kh: int, g: int, h: int,
                 hv: int) -> Case:
  """A decode case: t new tokens of B rows against a cache of S_max slots over P devices
  (strategy: decode's; layout: the prompt's, for the "cache" path)."""
  path = rng.choice(["slots", "positions", "cache"])
  share = rng.choice([128, 256, 40] if size == "small" else [256, 1024, 4096, 16384])
  s = p * share
  t = rng.choice([1, 1, 2, 3, 4, 8])
  short = max(2, rng.choice([s // 16, s // 3]))
  return Case(
      kind="decode", ring_size=p, strategy=rng.choice(["reduce", "reduce", "allgather", "ring"]),
      layout=rng.choice(["contiguous", "zigzag", "striped"]) if path == "cache" else (
          "contiguous"),
      bidirectional=False, h=h, hv=hv, t=t, s=s, n=kh * g, kh=kh,
      lead=(rng.choice([1, 2, 3]),), dtype=_draw_dtype(rng, size), causal=True,
      window=rng.choice([None, None, short, (short, 0), (short, 5)]), segments=False,
      lengths=True, sinks=rng.random() < 0.35, softcap=rng.choice([None, None, 5.0, 30.0]),
      q_scale=rng.choice([1.0, 1.0, 4.0, 12.0]), scale=rng.choice([None, None, 0.05]),
      poison=rng.choice([None, None, "q", "k", "v"]),
      poison_value=rng.choice([math.nan, math.inf, -math.inf]),
      seed=rng.randrange(1 << 30), path=path)


class Refused(Exception):
  """The backend does not run the case (its kernels' `unsupported` says why)."""


def _raised_by_ringflash(err: BaseException) -> bool:
  """Whether the innermost frame of err's traceback is ringflash's own code: its checks'
  ValueError or NotImplementedError is a refusal; one from JAX or from this script is not."""
  tb = err.__traceback__
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("ringflash")


def compare(name, got, want, plain, dtype, exact=None) -> str | None:
  """Why `got` is not close enough to the oracle's `want` (None: it is). exact: the oracle's
  float32 value that `plain` (dense attention in the inputs' dtype) is measured against,
  where `want` is the kernel contract's (gradients: D from the stored output); default want."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  exact = want if exact is None else exact
  got, want, plain, exact = (np.asarray(x, np.float32) for x in (got, want, plain, exact))
  if got.shape != want.shape:
    return f"{name}: shape {got.shape}, the oracle's {want.shape}"
  if not np.all(np.isfinite(got)):
    return f"{name}: {int(np.sum(~np.isfinite(got)))} non-finite entries"
  scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
  if np.dtype(dtype).itemsize == 4:
    bound = 2e-4 * scale
  else:
    bound = 3 * float(np.max(np.abs(plain - exact), initial=0.0)) + 1e-3 * scale
  err = float(np.max(np.abs(got - want), initial=0.0))
  if err > bound:
    return f"{name}: error {err:.3g} over its bound {bound:.3g}"
  return None


def _nonfinite_rows(what: str, out, seeing, must: bool) -> str | None:
  """The non-finite rule on out [..., rows, heads, Hv] (None: kept): every row that sees the
  poisoned entry non-finite where it must be, no row that does not see it non-finite."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  broken = np.any(~np.isfinite(out), axis=-1)
  if must and not np.all(broken[seeing]):
    return f"{what}{int(np.sum(~broken[seeing]))} rows that see it are finite"
  if np.any(broken[~seeing]):
    return f"{what}reached {int(np.sum(broken[~seeing]))} rows that do not see it"
  return None


class _Checker:
  """Runs cases on one backend (imports jax lazily: main() configures devices first)."""

  def __init__(self, backend: str):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.sharding import PartitionSpec  # pylint: disable=g-import-not-at-top
    sys.path.insert(0, str(_TESTS))
    import oracle  # pylint: disable=g-import-not-at-top
    import ringflash  # pylint: disable=g-import-not-at-top
    self.jax, self.jnp, self.np, self.oracle, self.rf = jax, jnp, np, oracle, ringflash
    self.P = PartitionSpec
    self.backend = backend

  def block_sizes(self, c: Case):
    """c.tiles as the backend's configuration: xla takes all four; pallas_tpu the query
    tiles that are multiples of its sublanes (its key tiles are multiples of 128 or the whole
    length, so its keys stay whole here); pallas_gpu its defaults (None)."""
    if c.tiles is None or self.backend == "pallas_gpu":
      return None
    if self.backend == "xla":
      return self.rf.XlaBlockSizes(*c.tiles)
    sub = 16 if self.jnp.dtype(c.dtype).itemsize == 2 else 8
    rows = lambda n: n if n is not None and n % sub == 0 else None
    return self.rf.TpuBlockSizes(block_q=rows(c.tiles[0]), block_q_dkv=rows(c.tiles[2]),
                                 block_q_dq=rows(c.tiles[2]))

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

  def upcast(self, *xs):
    """xs in float32, for the oracle: its gradients are then its float32 values, as its out
    and lse are, not rounded to the inputs' dtype. Rounded, a gradient exact to a small
    fraction of a unit in the last place can land on the other side of a rounding midpoint
    and read as a whole unit off (a bfloat16 dv of 2.195372, 6e-5 above the midpoint
    between 2.1875 and 2.203125: ours 2.1875, the rounded oracle's 2.203125)."""
    return tuple(x.astype(self.jnp.float32) for x in xs)

  # ------------------------------------------------------------------------- api cases

  def api(self, c: Case) -> list[str]:
    jax, jnp, np, rf = self.jax, self.jnp, self.np, self.rf
    lead, b = c.lead, math.prod(c.lead)
    q, k, v, dout, sinks = self.inputs(c, lead)
    nr = np.random.RandomState(c.seed % (1 << 30))
    dlse = jnp.asarray(nr.standard_normal(lead + (c.n, c.t)), jnp.float32)
    seg = np.sort(nr.randint(1, 4, (b, c.t)), axis=-1).astype(np.int32) if c.segments else None
    q_len = nr.randint(0, c.t + 1, b).astype(np.int32) if c.lengths else None
    kv_len = nr.randint(0, c.s + 1, b).astype(np.int32) if c.lengths else None
    aux = {"seg": seg, "q_len": q_len, "kv_len": kv_len}
    aux = {name: None if x is None else jnp.asarray(x) for name, x in aux.items()}
    devices = np.array(jax.devices()[:c.ring_size])
    if c.axes == 2:                 # the sequence over ("r", "u"), "u" the minor axis of 2
      mesh, axis = jax.sharding.Mesh(devices.reshape(-1, 2), ("r", "u")), ("r", "u")
    else:
      mesh, axis = jax.sharding.Mesh(devices, ("sp",)), "sp"
    user = lambda x: x.reshape(lead + x.shape[1:])          # [B, ...] -> [*lead, ...]
    flat = lambda x: x.reshape((b,) + x.shape[len(lead):])  # [*lead, ...] -> [B, ...]
    nat = len(lead)                                         # the sequence axis of q, k, v

    def ours(q, k, v, sinks, aux):
      to = lambda x, axis: (x if c.layout == "contiguous" else
                            rf.to_layout(x, c.layout, c.ring_size, axis=axis))
      seg_u = None if aux["seg"] is None else to(user(aux["seg"]), nat)
      lengths = tuple(None if aux[n_] is None else user(aux[n_]) for n_ in ("q_len", "kv_len"))
      options = dict(
          axis_name=axis, is_causal=c.causal, scale=c.scale, return_residual=True,
          backend=self.backend, layout=c.layout, local_window_size=c.window,
          bidirectional=c.bidirectional, logits_soft_cap=c.softcap, strategy=c.strategy,
          block_sizes=self.block_sizes(c))

      def call(q, k, v, seg, sinks, q_len, kv_len):
        entry = getattr(rf, c.entry)
        return entry(q, k, v, segment_ids=seg, sinks=sinks, query_seq_lengths=q_len,
                     key_value_seq_lengths=kv_len, **options,
                     **({"mesh": mesh} if c.entry == "ring_attention" else {}))

      if c.entry == "ring_attention_sharded":    # the caller's shard_map, local shards
        P = self.P
        seq = P(*[None] * nat, axis)
        call = jax.shard_map(
            call, mesh=mesh, in_specs=(seq,) * 3 + (P() if seg_u is None else seq,) + (P(),) * 3,
            out_specs=(seq, P(*[None] * (nat + 1), axis)),
            check_vma=not (self.backend == "pallas_tpu" and jax.devices()[0].platform == "cpu"))
      out, lse = call(to(q, nat), to(k, nat), to(v, nat), seg_u, sinks, *lengths)
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

    def as_stored(q, k, v, out, lse):
      """The output whose D = dout . out our backward takes (the contract's): out itself;
      with sinks, the output without them (computed again: as the strategy returns it, in the
      inputs' dtype, before the sinks are added) times each row's sink scaling
      w = exp(lse_without - lse), unrounded. The returned out is that product rounded once
      more, which D never sees: a reference taking D from it is off by that rounding, which
      dsinks (a sum over every row of a head) accumulates."""
      if sinks is None:
        return out
      bare, bare_lse = jax.jit(ours)(q, k, v, None, aux)
      bare_lse, lse = np.asarray(bare_lse, np.float64), np.asarray(lse, np.float64)
      w = np.exp(bare_lse - np.where(bare_lse == -np.inf, 0.0, lse))   # 0 for a row without keys
      return np.asarray(bare, np.float64) * np.moveaxis(w, -1, -2)[..., None]

    def stored_output_shift(stored, ref, keep):
      """-delta [*lead, N, T], delta_i = dout_i . (stored_i - ref_i): our output as stored
      against the oracle's (the module docstring says why); 0 where either is not finite
      (our output's own check reports that)."""
      diff = np.where(keep, (np.asarray(stored, np.float64) - np.asarray(ref, np.float64))
                      * np.asarray(dout, np.float64), 0.0)
      shift = -np.moveaxis(np.sum(diff, -1), -1, -2)
      return jnp.asarray(np.where(np.isfinite(shift), shift, 0.0), jnp.float32)

    def run(f, q, k, v, keep, stored=None):
      """f's results and gradients; given our output as stored, the gradients are a pair:
      the exact ones and those of the contract's backward (stored_output_shift), in one
      program (one forward of f)."""
      def loss(q, k, v, sinks, aux, keep, dout, dlse, shift):
        out, lse = f(q, k, v, sinks, aux)
        total = jnp.sum(jnp.where(keep, out.astype(jnp.float32) * dout, 0.0))
        seen = jnp.moveaxis(keep[..., 0], -1, -2) & jnp.isfinite(lse)  # kept, with a key
        if c.lse_grad:
          total += jnp.sum(jnp.where(seen, lse, 0.0) * dlse)
        if shift is not None:
          total += jnp.sum(jnp.where(seen, lse, 0.0) * shift)
        return total
      argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
      res = jax.jit(f)(q, k, v, sinks, aux)
      grad = jax.grad(loss, argnums=argnums)
      args = (q, k, v, sinks, aux, keep, dout, dlse)
      if stored is None:
        return res, jax.jit(grad)(*args, None)
      shift = stored_output_shift(stored, res[0], keep)
      return res, jax.jit(lambda *a: (grad(*a, jnp.zeros_like(shift)), grad(*a, shift)))(*args)

    names = ("dq", "dk", "dv", "dsinks")

    def grads_close(what, g, rg, pg, eg):
      """dq, dk, dv (and dsinks) against the oracle's of the contract's backward (rg), the
      bound from dense attention in the inputs' dtype (pg) against the exact ones (eg)."""
      return [compare(what + n_, a, b, p_, c.dtype, exact=e)
              for n_, a, b, p_, e in zip(names, g, rg, pg, eg)]

    keep = jnp.ones(lead + (c.t, c.n, 1), bool)
    (o, lse), g = run(ours, q, k, v, keep)
    (ro, rl), (eg, rg) = run(dense(True), *self.upcast(q, k, v), keep,
                             stored=as_stored(q, k, v, o, lse))
    (po, pl), pg = run(dense(False), q, k, v, keep)
    fails = []
    finite = np.isfinite(np.asarray(rl))
    if not np.array_equal(np.isfinite(np.asarray(lse)), finite):
      fails.append("lse: -inf where the oracle's is finite, or the other way")
    else:
      zero = lambda x: np.where(finite, np.asarray(x, np.float32), 0.0)
      fails.append(compare("lse", zero(lse), zero(rl), zero(pl), c.dtype))
    fails.append(compare("out", o, ro, po, c.dtype))
    fails += grads_close("", g, rg, pg, eg)
    fails = [f for f in fails if f]
    if fails or c.poison is None:
      return fails
    return self.poisoned(c, (q, k, v), aux, nr, ours, dense, run, grads_close, as_stored)

  def poisoned(self, c, qkv, aux, nr, ours, dense, run, grads_close, as_stored) -> list[str]:
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
    (o, lse), g = run(ours, bad["q"], bad["k"], bad["v"], keep)
    (ro, rl), (eg, rg) = run(dense(True), *self.upcast(*qkv), keep,
                             stored=as_stored(bad["q"], bad["k"], bad["v"], o, lse))
    (po, _), pg = run(dense(False), *qkv, keep)
    o, ro, po = (np.asarray(x, np.float32) for x in (o, ro, po))
    what = f"{c.poison}={c.poison_value}"
    wrong = _nonfinite_rows(f"{what}: ", o, seeing, must)
    if wrong:
      return [wrong]
    fails = [compare(f"{what}: out", o[~seeing], ro[~seeing], po[~seeing], c.dtype)]
    fails += grads_close(f"{what}: ", g, rg, pg, eg)
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
      raise Refused(f"NotImplementedError: {why}")
    spec = base.KernelSpec(scale=c.h ** -0.5 if c.scale is None else c.scale,
                           causal=c.causal,
                           tiles=module.resolve_tiles(self.block_sizes(c), problem),
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

    def grads(f, q, k, v):
      loss = lambda q, k, v, a, d: jnp.sum(f(q, k, v, a)[0].astype(jnp.float32) * d)
      return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, args, dout)

    want, plain = grads(dense(True), *self.upcast(q, k, v)), grads(dense(False), q, k, v)
    fails += [compare(f"hop {n_}", *x, c.dtype)
              for n_, *x in zip(("dq", "dk", "dv"), got, want, plain)]
    return [f for f in fails if f]

  # ------------------------------------------------------------------------ decode cases

  def decode(self, c: Case) -> list[str]:
    """decode_attention of t new tokens per row, three ways of filling the cache:
    "slots": slot j holds position j (cache_positions None); "positions": each row's
    tokens in random slots, the rest free (cache_positions given, EMPTY); "cache": a
    ringflash.KVCache prefilled in `c.layout` (rows padded) and appended to, its t new
    tokens the last appended. The oracle sees the tokens themselves at their positions."""
    jax, jnp, np, rf = self.jax, self.jnp, self.np, self.rf
    from ringflash.kvcache import EMPTY  # pylint: disable=g-import-not-at-top
    b, t, s = c.lead[0], c.t, c.s
    nr = np.random.RandomState(c.seed % (1 << 30))
    ks = jax.random.split(jax.random.key(c.seed), 4)
    dt = jnp.dtype(c.dtype)
    q = (jax.random.normal(ks[0], (b, t, c.n, c.h)) * c.q_scale).astype(dt)
    k = jax.random.normal(ks[1], (b, s, c.kh, c.h)).astype(dt)
    v = jax.random.normal(ks[2], (b, s, c.kh, c.hv)).astype(dt)
    sinks = jax.random.normal(ks[3], (c.n,)) * 2 if c.sinks else None
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:c.ring_size]), ("sp",))
    seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sp"))
    if c.path == "cache":            # prompt of t0 tokens (rows padded), then appends
      unit = 2 * c.ring_size if c.layout == "zigzag" else c.ring_size
      t0 = unit * nr.randint(0, (s - 12) // unit + 1)
      if unit > 1 and t0 > unit and nr.rand() < 0.4:   # a length the layout does not fit
        t0 -= nr.randint(1, unit)
      prompt = nr.randint(0, t0 + 1, b)
      appends = [int(a) for a in nr.randint(1, 5, nr.randint(0, 3))]
      t = min(t, appends[-1]) if appends else t
      q = q[:, :t]
      lengths = prompt + sum(appends)
      positions = np.broadcast_to(np.arange(s), (b, s))        # the tokens, in order
    else:
      lengths = nr.randint(0, s + 1, b)
      lengths[nr.randint(b)] = nr.choice([nr.randint(0, t + 1), s])    # short, or full
      positions = np.broadcast_to(np.arange(s), (b, s))
      if c.path == "positions":      # token i of row r in slot order[r][i], the rest free
        slots = np.full((b, s), EMPTY, np.int32)
        for r in range(b):
          order = nr.permutation(s)[:lengths[r]]
          slots[r, order] = np.arange(lengths[r])
        positions = slots
    lengths = lengths.astype(np.int32)
    q_pos = lengths[:, None] - t + np.arange(t)[None, :]               # [B, t]
    left, right = ((c.window, c.window) if isinstance(c.window, int) else c.window or
                   (None, None))
    dist = q_pos[:, :, None] - positions[:, None, :]                  # [B, t, S]
    valid = (dist >= 0) & (positions[:, None, :] != EMPTY)
    if left is not None:
      valid &= (dist <= left) & (-dist <= right)
    clean = {"q": q, "k": k, "v": v}
    seeing = np.zeros((b, t, c.n), bool)
    must = False
    if c.poison is not None:
      r = nr.randint(b)
      if c.poison == "q":
        i, head = nr.randint(t), nr.randint(c.n)
        q = q.at[r, i, head, nr.randint(c.h)].set(c.poison_value)
        seeing[r, i, head] = True
        must = valid[r, i].any() and math.isnan(c.poison_value)
      else:                           # a token seen by some rows (or by none: a free slot)
        j, kv_head, grp = nr.randint(s), nr.randint(c.kh), c.n // c.kh
        arr = k if c.poison == "k" else v
        arr = arr.at[r, j, kv_head, nr.randint(arr.shape[-1])].set(c.poison_value)
        k, v = (arr, v) if c.poison == "k" else (k, arr)
        seeing[r, :, kv_head * grp:(kv_head + 1) * grp] = valid[r, :, j][:, None]
        must = math.isnan(c.poison_value) or c.poison == "v"
    options = dict(scale=c.scale, sinks=sinks, logits_soft_cap=c.softcap,
                   local_window_size=c.window, backend=self.backend, strategy=c.strategy,
                   return_residual=True)
    if c.path == "cache":
      cache = rf.KVCache.create(b, s, c.kh, c.h, mesh=mesh, dtype=dt, value_head_dim=c.hv)
      if t0:
        def put(x):   # a prompt the layout does not fit goes in unsharded; prefill pads it
          laid = rf.to_layout(x[:, :t0], c.layout, c.ring_size)
          return jax.device_put(laid, seq) if t0 % unit == 0 else laid
        cache = cache.prefill(put(k), put(v), jnp.asarray(prompt.astype(np.int32)),
                              layout=c.layout)
      done = prompt.copy()
      for a in appends:
        new = lambda x: jnp.stack([x[r, done[r]:done[r] + a] for r in range(b)])
        cache = cache.append(new(k), new(v))
        done += a
      out, lse = cache.attention(q, **options)
    else:
      out, lse = rf.decode_attention(
          q, jax.device_put(k, seq), jax.device_put(v, seq),
          cache_lengths=jnp.asarray(lengths), mesh=mesh, axis_name="sp",
          cache_positions=None if c.path == "slots" else jax.device_put(
              jnp.asarray(positions), seq),
          **options)

    def dense(upcast):
      outs, lses = [], []
      for r in range(b):
        o_, l_ = self.oracle.attention(
            clean["q"][r:r + 1], clean["k"][r:r + 1], clean["v"][r:r + 1], causal=True,
            scale=c.scale, upcast=upcast, window=c.window, q_pos=q_pos[r],
            kv_pos=positions[r], softcap=c.softcap, sinks=sinks)
        outs.append(o_)
        lses.append(l_)
      return np.concatenate(outs), np.concatenate(lses)

    (ro, rl), (po, pl) = dense(True), dense(False)
    out, lse, ro, rl, po, pl = (np.asarray(x, np.float32) for x in (out, lse, ro, rl, po, pl))
    what = f"decode {c.poison}={c.poison_value}: " if c.poison else "decode "
    wrong = _nonfinite_rows(what, out, seeing, must)
    if wrong:
      return [wrong]
    ok = np.moveaxis(~seeing, -1, -2)                                   # [B, N, t]
    finite = np.isfinite(rl)
    if not np.array_equal(np.isfinite(lse)[ok], finite[ok]):
      return [f"{what}lse: -inf where the oracle's is finite, or the other way"]
    zero = lambda x: np.where(finite & ok, x, 0.0)
    fails = [compare(f"{what}out", out[~seeing], ro[~seeing], po[~seeing], c.dtype),
             compare(f"{what}lse", zero(lse), zero(rl), zero(pl), c.dtype)]
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
  kinds = {kind: dict(counts) for kind in ("api", "hop", "decode")}
  start = time.time()
  while ((args.cases is None or sum(counts.values()) < args.cases) and
         (args.seconds is None or time.time() - start < args.seconds)):
    case = draw(rng, devices, size)
    text = json.dumps(dataclasses.asdict(case))
    try:
      fails = getattr(checker, case.kind)(case)
      outcome = "failed" if fails else "passed"
      if fails:
        print(f"FAILED {text} {'; '.join(fails)}", flush=True)
    except Exception as err:  # pylint: disable=broad-exception-caught
      why = f"{type(err).__name__}: {str(err)[:300]}"
      if isinstance(err, Refused) or (isinstance(err, (NotImplementedError, ValueError)) and
                                      _raised_by_ringflash(err)):
        outcome = "refused"
        print(f"REFUSED {text} {why}", flush=True)
      else:                     # not one of the library's own refusals: a failure
        outcome = "failed"
        print(f"FAILED {text} raised {why}", flush=True)
    counts[outcome] += 1
    kinds[case.kind][outcome] += 1
  split = "; ".join(f"{kind} {n['passed']} / {n['failed']} / {n['refused']}"
                    for kind, n in kinds.items())
  print(f"random_check backend={args.backend} seed={args.seed} size={size}: "
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['refused']} refused "
        f"in {time.time() - start:.0f} s (passed / failed / refused by kind: {split})",
        flush=True)
  return 1 if counts["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
