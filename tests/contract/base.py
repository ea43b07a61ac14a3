"""The contract test base: every case of the kernel contract and of the ring, written once.

Each backend subclasses ContractTests in tests/contract/test_<backend>.py and sets its
capability flags; pytest collects the subclasses only (this class's name does not start with
"Test"). A case that needs a feature the backend does not claim is skipped with the reason,
never silently. Sizes are given in units of the backend's UNIT (tokens per device of the
smallest case), so one case list serves backends whose tiles differ (xla and interpreted
pallas_tpu: 16 tokens; the Mosaic GPU kernels: 256).

Every numerical check is against tests/oracle.py, dense fp32 attention written from the
definition (helpers.check: fp32 ~1e-4 absolute; bf16 and fp16 FlashAttention's criterion,
error <= 2x (outputs) or 3x (gradients) that of a plain low-precision dense implementation).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import helpers
import oracle
import ringflash
from ringflash.kernels import base
from ringflash.kernels import get_backend

N = 4


@dataclasses.dataclass(frozen=True)
class RingCase:
  """One ring_attention call. t, s: local query and key lengths in units of UNIT; window in
  sixteenths of UNIT (so that it spans the same fraction of a shard on every backend)."""

  name: str
  ring_size: int
  kv_heads: int = 2
  causal: bool = False
  segments: str | None = None          # None, "packed" (one [B, T] array), "pair"
  layout: str = "contiguous"
  window: int | tuple[int, int] | None = None
  bidirectional: bool = False
  t: int = 1
  s: int = 1
  low_precision: bool = False          # the backend's LOW_DTYPE instead of its DTYPE
  batch: int = 1

  def __str__(self):
    return self.name


RING_CASES = [
    RingCase("mha-P8", 8, kv_heads=4),
    RingCase("gqa-causal-seg-P8", 8, causal=True, segments="packed"),
    RingCase("mqa-seg-P4", 4, kv_heads=1, segments="packed", batch=2),
    RingCase("cross-causal-T<S-P4", 4, causal=True, t=1, s=2),
    RingCase("cross-seg-pair-T<S-P2", 2, segments="pair", t=1, s=2),
    RingCase("zigzag-causal-P8", 8, causal=True, layout="zigzag"),
    RingCase("striped-causal-seg-P4", 4, kv_heads=4, causal=True, segments="packed",
             layout="striped"),
    RingCase("window-short-causal-P8", 8, causal=True, window=(5, 0)),
    RingCase("zigzag-window-P4", 4, layout="zigzag", window=10),
    RingCase("bidi-causal-seg-P4", 4, causal=True, segments="packed", bidirectional=True),
    RingCase("low-precision-gqa-causal-P4", 4, causal=True, low_precision=True, t=2, s=2),
]

# One block pair: (id, B, T, S in units, N, K, causal, query offset in units, segments).
KERNEL_CASES = [
    ("gqa-causal", 1, 16, 16, 4, 2, True, 0, False),
    # Queries placed before part of the keys: the first 6 units of rows see no key at all.
    ("causal-dead-rows", 1, 16, 16, 4, 2, True, -6, False),
    # Per-row segment ids; batch rows with different documents skip different tiles.
    ("mha-seg-b2", 2, 16, 16, 2, 2, False, 0, True),
    # MQA (the G = 4 query heads of one kv head share its tiles), T < S, queries after keys.
    ("mqa-cross", 1, 8, 16, 4, 1, True, 4, False),
]

@dataclasses.dataclass(frozen=True)
class VocabCase:
  """A call with the vocabulary of real models: sinks, soft-cap, head dims, value head dims,
  sequence lengths, batch dims, lengths that do not divide by the ring. Lengths as RingCase;
  `trim` tokens are cut from the end of the natural sequence (uneven lengths, in any
  layout); `lead` are the batch dims (() for none)."""

  name: str
  ring_size: int
  kv_heads: int = 2
  causal: bool = True
  layout: str = "contiguous"
  window: int | tuple[int, int] | None = None
  segments: bool = False
  bidirectional: bool = False
  head_dim: int | None = None          # None: the backend's HEAD_DIM
  head_dim_v: int | None = None        # None: the head dim
  softcap: float | None = None
  sinks: bool = False
  lengths: bool = False
  lead: tuple[int, ...] = (2,)
  trim: int = 0
  t: int = 1
  s: int = 1
  gain: float = 1.0                    # q scaled: scores of about +-gain

  def __str__(self):
    return self.name


VOCAB_CASES = [
    VocabCase("sinks-gqa-P4", 4, sinks=True),
    VocabCase("softcap-P4", 4, softcap=2.0, kv_heads=4),
    VocabCase("sinks-softcap-window-zigzag-P4", 4, layout="zigzag", sinks=True, softcap=3.0,
              window=(20, 0)),
    VocabCase("mla-192-128-P2", 2, head_dim=192, head_dim_v=128, lead=(1,)),
    VocabCase("value-64-128-P4", 4, head_dim=64, head_dim_v=128, causal=False, lead=(1,)),
    VocabCase("head-dim-80-P4", 4, head_dim=80, lead=(1,)),
    VocabCase("head-dim-96-seg-P2", 2, head_dim=96, segments=True, causal=False, lead=(1,)),
    VocabCase("lengths-P4", 4, lengths=True),
    VocabCase("uneven-seg-P8", 8, trim=5, segments=True, causal=False, lead=(1,)),
    VocabCase("batch-dims-2x2-P2", 2, lead=(2, 2), sinks=True),
    VocabCase("no-batch-dim-P2", 2, lead=()),
    # a zigzag sequence of 4 UNIT - 5 tokens: not divisible by 2P, padded inside
    VocabCase("zigzag-uneven-sinks-seg-P4", 4, layout="zigzag", trim=5, sinks=True,
              segments=True, lead=(1,)),
    # causal, one token short: the padding is hidden by the causal mask, no ids
    VocabCase("causal-uneven-zigzag-sinks-P4", 4, layout="zigzag", trim=1, sinks=True),
    # cross attention, S = 2T + 3, both padded inside, zigzag: the keys' padding starts at
    # S, not at T, and so do their layout's positions; a window's right reach (100
    # sixteenths of UNIT) past T but within S is not cut to T
    VocabCase("cross-uneven-zigzag-wide-right-window-P4", 4, causal=False, layout="zigzag",
              t=1, s=2, trim=3, window=(8, 100), lead=(1,)),
]

SLOW_VOCAB_CASES = [
    # striped, divisible by P but an odd share a device (UNIT - 1), which the bidirectional
    # ring cannot halve: padded inside (it died in the ring's planner)
    VocabCase("striped-odd-share-bidi-P2", 2, layout="striped", trim=2, bidirectional=True,
              lead=(1,)),
    VocabCase("everything-P4", 4, sinks=True, softcap=2.5, head_dim_v=48, lengths=True,
              window=(24, 4), segments=True, bidirectional=True, trim=3),
    VocabCase("striped-sinks-lengths-P8", 8, layout="striped", sinks=True, lengths=True),
    VocabCase("mqa-softcap-uneven-P8", 8, kv_heads=1, softcap=1.0, trim=7, t=2, s=2),
    VocabCase("head-dim-112-sinks-P4", 4, head_dim=112, sinks=True, causal=False),
    VocabCase("mla-192-128-softcap-lengths-P4", 4, head_dim=192, head_dim_v=128, softcap=4.0,
              lengths=True),
    # scores spread beyond the cap (Gemma 2's 50): tanh saturated, rows' scores far apart
    VocabCase("softcap-50-wide-scores-seg-P4", 4, softcap=50.0, gain=40.0, segments=True,
              lead=(1,)),
    VocabCase("striped-uneven-bidi-softcap-lengths-P8", 8, layout="striped", trim=3,
              bidirectional=True, softcap=2.0, lengths=True, window=(40, 0), kv_heads=1),
]

SLOW_RING_CASES = [
    RingCase("bidi-zigzag-seg-P8", 8, kv_heads=1, segments="packed", layout="zigzag",
             bidirectional=True),
    RingCase("window-spanning-seg-P8", 8, kv_heads=1, segments="packed", window=(40, 20)),
    RingCase("striped-window-bidi-P8", 8, causal=True, segments="packed", layout="striped",
             window=(20, 0), bidirectional=True),
    RingCase("window-wide-P8", 8, window=(70, 70)),
    RingCase("zigzag-window-seg-P8", 8, kv_heads=4, causal=True, segments="packed",
             layout="zigzag", window=(12, 0), t=2, s=2, batch=2),
    RingCase("low-precision-seg-pair-P2", 2, segments="pair", low_precision=True, t=2, s=1),
]


class ContractTests:
  """The cases; subclasses set the capability flags below.

  Flags:
    BACKEND: the backend's name.
    DTYPE / LOW_DTYPE: the dtype of the cases / of the low-precision cases.
    HEAD_DIM: head dim of the cases.
    UNIT: tokens per device of the smallest case (the backend's tiles must divide it, half
      of it for zigzag and bidirectional).
    FEATURES: what the backend claims, of "window", "segments", "layouts", "bidirectional",
      "cross" (T != S), "ring" (runs inside ring_attention on this host's devices),
      "kernel" (its forward/backward callable on this host), "softcap", "value_dim" (Hv !=
      H), "head_dims" (any multiple of 8 up to 256), "sinks", "lengths" (sequence lengths,
      padding of uneven lengths), "batch_dims".
    SKIP: None, or why nothing here can run on this host (e.g. no Hopper GPU).
    SHARD_MAP_CHECK_VMA: the check_vma a caller's shard_map needs around
      ring_attention_sharded (False for Pallas kernels interpreted on CPU devices).
  """

  BACKEND: str = ""
  DTYPE = jnp.float32
  LOW_DTYPE = jnp.bfloat16
  HEAD_DIM = 32
  UNIT = 16
  FEATURES = frozenset({"window", "segments", "layouts", "bidirectional", "cross", "ring",
                        "kernel", "softcap", "value_dim", "head_dims", "sinks", "lengths",
                        "batch_dims"})
  SKIP: str | None = None
  SHARD_MAP_CHECK_VMA = True

  # ---------------------------------------------------------------------------------------
  # Capability helpers.

  def require(self, *features):
    if self.SKIP:
      pytest.skip(self.SKIP)
    missing = [f for f in features if f not in self.FEATURES]
    if missing:
      pytest.skip(f"backend {self.BACKEND!r} does not claim {', '.join(missing)}")

  def block_sizes(self, q_len: int, kv_len: int):
    """The tile configuration of the cases (None: the backend's defaults)."""
    del q_len, kv_len
    return None

  def mesh(self, ring_size):
    return helpers.mesh_of(ring_size)

  def options(self) -> dict:
    """Extra keyword options of every ring_attention call (a strategy, its axes)."""
    return {}

  def adapt(self, case: RingCase) -> RingCase:
    """The case as this host runs it (a backend with fewer devices than the case's ring may
    run it on a smaller ring; the oracle follows)."""
    return case

  def kernel_spec(self, *, q_len, kv_len, kv_heads, causal, scale, window=None,
                  segments=False, n=N):
    """A KernelSpec with this backend's tiles resolved for one block pair."""
    from ringflash import _validate  # pylint: disable=g-import-not-at-top
    device = jax.devices()[0]
    problem = base.Problem(
        q_len=q_len, kv_len=kv_len, head_dim=self.HEAD_DIM, kv_heads=kv_heads,
        group=n // kv_heads, dtype=jnp.dtype(self.DTYPE), platform=device.platform,
        device_kind=getattr(device, "device_kind", ""),
        compute_capability=getattr(device, "compute_capability", None), causal=causal,
        window=window, segments=segments)
    kernel = get_backend(self.BACKEND)
    return _validate.resolve_spec(kernel, problem, scale=scale,
                                  block_sizes=self.block_sizes(q_len, kv_len))

  def check(self, got, ref, plain, low_precision=None):
    """helpers.check: fp32 tolerance for float32 inputs, FlashAttention's criterion for
    bf16/fp16 (low_precision: whether the inputs were 16-bit; default got[0]'s dtype)."""
    if low_precision is None:
      low_precision = jnp.dtype(got[0].dtype) != jnp.float32
    helpers.check(got, ref, plain if low_precision else None)

  # ---------------------------------------------------------------------------------------
  # Kernel level: one block pair at global positions, no mesh.

  @pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c[0])
  def test_block_pair_matches_oracle(self, case):
    """forward and backward (from the oracle's out and lse, with an lse cotangent) of one
    block pair at global positions, against the oracle."""
    self.require("kernel")
    _, b, t, s, n, kh, causal, off, seg = case
    t, s, off = t * self.UNIT, s * self.UNIT, off * self.UNIT
    if seg:
      self.require("segments")
    q, k, v, dout = helpers.inputs(0, b, t, s, n, kh, self.HEAD_DIM, self.DTYPE)
    q_pos = jnp.arange(t, dtype=jnp.int32) + off
    k_pos = jnp.arange(s, dtype=jnp.int32)
    q_seg = k_seg = None
    if seg:
      q_seg = helpers.packed_segments(b, t, seed=4)
      k_seg = helpers.packed_segments(b, s, seed=4) if s != t else q_seg
    spec = self.kernel_spec(q_len=t, kv_len=s, kv_heads=kh, causal=causal, scale=0.125,
                            segments=seg, n=n)
    kernel = get_backend(self.BACKEND)

    def dense(upcast):
      return functools.partial(oracle.attention, causal=causal, scale=0.125, q_seg=q_seg,
                               kv_seg=k_seg, q_pos=q_pos, kv_pos=k_pos, upcast=upcast)

    o, lse = jax.jit(kernel.forward, static_argnums=7)(q, k, v, q_pos, k_pos, q_seg, k_seg,
                                                       spec)
    ref_o, ref_lse = dense(True)(q, k, v)
    plain_o, _ = dense(False)(q, k, v)
    assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert o.shape == q.shape and lse.shape == (b, n, t)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    low = jnp.dtype(self.DTYPE) != jnp.float32
    assert helpers.max_err(o, ref_o) <= (2 * helpers.max_err(plain_o, ref_o) if low
                                         else helpers.fp32_tol(ref_o))
    assert helpers.max_err(lse, ref_lse) <= helpers.fp32_tol(ref_lse)     # float32 always
    dead = np.asarray(jnp.isneginf(ref_lse))                      # [B, N, T]
    if off < 0:
      assert dead.any()
    assert np.all(np.asarray(o).transpose(0, 2, 1, 3)[dead] == 0.0)

    dlse = jnp.where(jnp.isfinite(ref_lse), 0.3, 0.0)
    grads = jax.jit(kernel.backward, static_argnums=10)(
        q, k, v, ref_o.astype(q.dtype), ref_lse, dout, q_pos, k_pos, q_seg, k_seg, spec, dlse)

    def loss(upcast):
      def f(q_, k_, v_):
        o_, l_ = dense(upcast)(q_, k_, v_)
        return (jnp.sum(o_.astype(jnp.float32) * dout.astype(jnp.float32))
                + jnp.sum(jnp.where(jnp.isfinite(l_), l_, 0.0) * dlse))
      return f

    want = jax.grad(loss(True), argnums=(0, 1, 2))(q, k, v)
    plain = jax.grad(loss(False), argnums=(0, 1, 2))(q, k, v)
    for name, g, w, p in zip(("dq", "dk", "dv"), grads, want, plain):
      assert g.dtype == jnp.float32 and g.shape == w.shape, name
      assert bool(jnp.all(jnp.isfinite(g))), name
      assert helpers.max_err(g, w) <= (3 * helpers.max_err(p, w) if low
                                       else helpers.fp32_tol(w)), name
    dq_rows = np.asarray(grads[0]).transpose(0, 2, 1, 3)           # [B, N, T, H]
    assert np.all(dq_rows[dead] == 0.0)

  def test_block_pair_backward_from_global_statistics(self):
    """Two block pairs' gradients, each from the GLOBAL out and lse (with an lse cotangent),
    add up to the gradients of attention over both."""
    self.require("kernel")
    t, half = 2 * self.UNIT, 2 * self.UNIT
    q, k, v, dout = helpers.inputs(2, 1, t, 2 * half, N, 2, self.HEAD_DIM, self.DTYPE)
    q_pos = jnp.arange(t, dtype=jnp.int32) + half
    pos = jnp.arange(2 * half, dtype=jnp.int32)
    spec = self.kernel_spec(q_len=t, kv_len=half, kv_heads=2, causal=True, scale=0.25)
    out, lse = oracle.attention(q, k, v, causal=True, scale=0.25, q_pos=q_pos, kv_pos=pos)
    dlse = jnp.where(jnp.isfinite(lse), 0.3, 0.0)
    kernel = get_backend(self.BACKEND)
    parts = [jax.jit(kernel.backward, static_argnums=10)(
        q, k[:, sl], v[:, sl], out.astype(q.dtype), lse, dout, q_pos, pos[sl], None, None,
        spec, dlse) for sl in (slice(0, half), slice(half, 2 * half))]
    got = (parts[0][0] + parts[1][0], jnp.concatenate([parts[0][1], parts[1][1]], axis=1),
           jnp.concatenate([parts[0][2], parts[1][2]], axis=1))

    def loss(upcast):
      def f(q_, k_, v_):
        o_, l_ = oracle.attention(q_, k_, v_, causal=True, scale=0.25, q_pos=q_pos,
                                  kv_pos=pos, upcast=upcast)
        return (jnp.sum(o_.astype(jnp.float32) * dout.astype(jnp.float32))
                + jnp.sum(jnp.where(jnp.isfinite(l_), l_, 0.0) * dlse))
      return f

    want = jax.grad(loss(True), argnums=(0, 1, 2))(q, k, v)
    plain = jax.grad(loss(False), argnums=(0, 1, 2))(q, k, v)
    for name, g, w, p in zip(("dq", "dk", "dv"), got, want, plain):
      assert g.dtype == jnp.float32 and g.shape == w.shape, name
      if jnp.dtype(self.DTYPE) == jnp.float32:
        assert helpers.max_err(g, w) <= helpers.fp32_tol(w), name
      else:
        assert helpers.max_err(g, w) <= 3 * helpers.max_err(p, w), name

  # ---------------------------------------------------------------------------------------
  # Through the ring.

  def _inputs(self, case: RingCase):
    """Natural-order q, k, v, dout and segment ids (None, one array, or a pair)."""
    p = case.ring_size
    t, s = case.t * self.UNIT * p, case.s * self.UNIT * p
    dtype = self.LOW_DTYPE if case.low_precision else self.DTYPE
    q, k, v, dout = helpers.inputs(len(case.name) + p, case.batch, t, s, N, case.kv_heads,
                                   self.HEAD_DIM, dtype)
    seg = None
    if case.segments == "packed":
      seg = helpers.packed_segments(case.batch, t, seed=t)
    elif case.segments == "pair":
      # Query ids 0..2 against key ids 1..3: rows of document 0 see no key at all.
      seg = (helpers.packed_segments(case.batch, t, seed=2),
             helpers.packed_segments(case.batch, s, seed=3) + 1)
    return q, k, v, dout, seg

  def _window(self, case: RingCase):
    if case.window is None:
      return None
    w = (case.window, case.window) if isinstance(case.window, int) else case.window
    return tuple(x * self.UNIT // 16 for x in w)

  def _ring(self, case: RingCase, args, **extra):
    """(out, lse, dq, dk, dv) of ring_attention on layout-ordered args, one compiled program."""
    p = case.ring_size
    mesh = self.mesh(p)
    pair = case.segments == "pair"
    local = args[0].shape[1] // p, args[1].shape[1] // p

    def run(q, k, v, dout, *segs):
      ids = None if not segs else (tuple(segs) if pair else segs[0])

      def attn(q, k, v):
        return ringflash.ring_attention(
            q, k, v, mesh=mesh, **self.options(), is_causal=case.causal, segment_ids=ids,
            return_residual=True,
            backend=self.BACKEND, block_sizes=self.block_sizes(*local), layout=case.layout,
            local_window_size=self._window(case), bidirectional=case.bidirectional, **extra)

      (out, lse), vjp = jax.vjp(attn, q, k, v)
      return (out, lse) + vjp((dout, jnp.zeros_like(lse)))

    return jax.jit(run)(*args)

  def _ring_natural(self, case: RingCase, inputs=None, **extra):
    q, k, v, dout, seg = self._inputs(case) if inputs is None else inputs
    segs = () if seg is None else (seg if isinstance(seg, tuple) else (seg,))
    to = functools.partial(ringflash.to_layout, layout=case.layout, ring_size=case.ring_size)
    args = [to(x) for x in (q, k, v, dout)] + [to(x) for x in segs]
    out, lse, dq, dk, dv = self._ring(case, args, **extra)
    back = functools.partial(ringflash.from_layout, layout=case.layout,
                             ring_size=case.ring_size)
    return back(out), back(lse, axis=2), back(dq), back(dk), back(dv)

  def _oracle(self, case: RingCase, inputs=None, upcast=True):
    q, k, v, dout, seg = self._inputs(case) if inputs is None else inputs
    q_seg, kv_seg = (seg if isinstance(seg, tuple) else (seg, seg)) if seg is not None else (
        None, None)

    def attn(q, k, v):
      return oracle.attention(q, k, v, causal=case.causal, q_seg=q_seg, kv_seg=kv_seg,
                              window=self._window(case), upcast=upcast)

    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return (out, lse) + vjp((dout.astype(out.dtype), jnp.zeros_like(lse)))

  def _features(self, case: RingCase):
    need = ["ring"]
    if case.window is not None:
      need.append("window")
    if case.segments is not None:
      need.append("segments")
    if case.layout != "contiguous":
      need.append("layouts")
    if case.bidirectional:
      need.append("bidirectional")
    if case.t != case.s:
      need.append("cross")
    return need

  def _check_case(self, case: RingCase):
    self.require(*self._features(case))
    case = self.adapt(case)
    got = self._ring_natural(case)
    ref = self._oracle(case)
    plain = self._oracle(case, upcast=False)
    q = self._inputs(case)[0]
    assert got[0].dtype == q.dtype and got[1].dtype == jnp.float32
    assert got[0].shape == q.shape and got[1].shape == (q.shape[0], N, q.shape[1])
    self.check(got, ref, plain)
    if case.segments == "pair":
      seg = self._inputs(case)[4][0]
      dead = np.asarray(seg[0] == 0)                  # query ids absent from the keys
      assert dead.any()
      assert np.all(np.asarray(got[0])[0, dead] == 0)
      assert np.all(np.isneginf(np.asarray(got[1])[0][:, dead]))
      assert np.all(np.asarray(got[2])[0, dead] == 0)

  @pytest.mark.parametrize("case", RING_CASES, ids=str)
  def test_ring_matches_oracle(self, case):
    self._check_case(case)

  @pytest.mark.slow
  @pytest.mark.parametrize("case", SLOW_RING_CASES, ids=str)
  def test_ring_matches_oracle_slow(self, case):
    self._check_case(case)

  # ---------------------------------------------------------------------------------------
  # The vocabulary of real models.

  def _vocab_inputs(self, case: VocabCase):
    """Natural-order (q, k, v, dout, seg | None, q_lengths | None, kv_lengths | None,
    sinks | None): q [*lead, T, N, H], k [*lead, S, K, H], v [*lead, S, K, Hv]."""
    p = case.ring_size
    t = case.t * self.UNIT * p - case.trim
    s = case.s * self.UNIT * p - case.trim
    h = case.head_dim or self.HEAD_DIM
    hv = case.head_dim_v or h
    b = int(np.prod(case.lead)) if case.lead else 1
    dtype = self.DTYPE
    q, k, _, dout = helpers.inputs(len(case.name) + p, b, t, s, N, case.kv_heads, h, dtype)
    q = (q.astype(jnp.float32) * case.gain).astype(dtype)
    v = jax.random.normal(jax.random.key(len(case.name)), (b, s, case.kv_heads, hv),
                          jnp.float32).astype(dtype)
    dout = jax.random.normal(jax.random.key(p), (b, t, N, hv), jnp.float32).astype(dtype)
    seg = helpers.packed_segments(b, t, seed=t) if case.segments else None
    rng = np.random.default_rng(t + s)
    q_len = jnp.asarray(rng.integers(t // 2, t + 1, b), jnp.int32) if case.lengths else None
    kv_len = jnp.asarray(rng.integers(s // 3, s + 1, b), jnp.int32) if case.lengths else None
    sinks = jnp.asarray(rng.normal(size=N) * 2, jnp.float32) if case.sinks else None

    def shaped(x, tail):
      return None if x is None else x.reshape(case.lead + x.shape[tail:])

    return (shaped(q, 1), shaped(k, 1), shaped(v, 1), shaped(dout, 1), shaped(seg, 1),
            shaped(q_len, 1), shaped(kv_len, 1), sinks)

  def _vocab_features(self, case: VocabCase):
    need = ["ring"]
    for flag, feature in ((case.softcap is not None, "softcap"), (case.sinks, "sinks"),
                          (case.head_dim_v is not None, "value_dim"),
                          (case.head_dim is not None, "head_dims"),
                          (case.lengths or case.trim > 0, "lengths"),
                          (case.lead != (1,), "batch_dims"),
                          (case.window is not None, "window"), (case.segments, "segments"),
                          (case.layout != "contiguous", "layouts"),
                          (case.bidirectional, "bidirectional")):
      if flag:
        need.append(feature)
    return need

  def _check_vocab(self, case: VocabCase):
    self.require(*self._vocab_features(case))
    case = self.adapt(case)
    q, k, v, dout, seg, q_len, kv_len, sinks = self._vocab_inputs(case)
    p = case.ring_size
    mesh = self.mesh(p)
    lead = len(case.lead)
    to = functools.partial(ringflash.to_layout, layout=case.layout, ring_size=p)
    back = functools.partial(ringflash.from_layout, layout=case.layout, ring_size=p)
    laid = (lambda x, axis=lead: x) if case.layout == "contiguous" else (
        lambda x, axis=lead: to(x, axis=axis))
    unlaid = (lambda x, axis=lead: x) if case.layout == "contiguous" else (
        lambda x, axis=lead: back(x, axis=axis))
    window = self._window(case)
    local = (-(-q.shape[lead] // p), -(-k.shape[lead] // p))

    def ring(q, k, v, seg, sinks):
      return ringflash.ring_attention(
          q, k, v, mesh=mesh, **self.options(), is_causal=case.causal, segment_ids=seg,
          return_residual=True,
          backend=self.BACKEND, block_sizes=self.block_sizes(*local), layout=case.layout,
          local_window_size=window, bidirectional=case.bidirectional, sinks=sinks,
          logits_soft_cap=case.softcap, query_seq_lengths=q_len,
          key_value_seq_lengths=kv_len)

    def dense(upcast):
      def f(q, k, v, seg, sinks):
        flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[lead:])  # noqa
        out, lse = oracle.attention(
            flat(q), flat(k), flat(v), causal=case.causal, q_seg=flat(seg), kv_seg=flat(seg),
            window=window, softcap=case.softcap, sinks=sinks, q_lengths=flat(q_len),
            kv_lengths=flat(kv_len), upcast=upcast)
        return (out.reshape(q.shape[:-2] + out.shape[-2:]),
                lse.reshape(q.shape[:-3] + lse.shape[-2:]))
      return f

    def with_grads(attn, layout_in, layout_out):
      def run(q, k, v, dout, seg, sinks):
        args = (layout_in(q), layout_in(k), layout_in(v))
        seg_l = None if seg is None else layout_in(seg)

        def f(q, k, v, sinks):
          return attn(q, k, v, seg_l, sinks)

        (out, lse), vjp = jax.vjp(f, *args, sinks)
        grads = vjp((layout_in(dout).astype(out.dtype), jnp.zeros_like(lse)))
        lse_axis = lse.ndim - 1
        return ((layout_out(out), layout_out(lse, axis=lse_axis))
                + tuple(layout_out(g) for g in grads[:3]) + (grads[3],))
      return jax.jit(run)(q, k, v, dout, seg, sinks)

    same = lambda x, axis=None: x  # noqa: E731
    got = with_grads(ring, laid, unlaid)
    ref = with_grads(dense(True), same, same)
    plain = with_grads(dense(False), same, same)
    hv = v.shape[-1]
    assert got[0].shape == q.shape[:-1] + (hv,) and got[0].dtype == q.dtype
    assert got[1].shape == q.shape[:-3] + (N, q.shape[lead])
    flat = lambda x: np.asarray(x, np.float32).reshape((-1,) + x.shape[lead:])  # noqa: E731
    self.check(tuple(flat(x) for x in got[:5]), tuple(flat(x) for x in ref[:5]),
               tuple(flat(x) for x in plain[:5]),
               low_precision=jnp.dtype(q.dtype) != jnp.float32)
    if case.sinks:
      g, r, pl_ = (np.asarray(x[5], np.float32) for x in (got, ref, plain))
      low = jnp.dtype(q.dtype) != jnp.float32
      tol = 3 * float(np.max(np.abs(pl_ - r))) if low else helpers.fp32_tol(r)
      assert np.max(np.abs(g - r)) <= max(tol, 1e-6), ("dsinks", g, r)
    if q_len is not None:        # rows past their length give 0
      out = flat(got[0])
      past = np.arange(out.shape[1])[None, :] >= np.asarray(q_len).reshape(-1)[:, None]
      assert np.all(out[past] == 0.0)

  @pytest.mark.parametrize("case", VOCAB_CASES, ids=str)
  def test_vocabulary_matches_oracle(self, case):
    self._check_vocab(case)

  @pytest.mark.slow
  @pytest.mark.parametrize("case", SLOW_VOCAB_CASES, ids=str)
  def test_vocabulary_matches_oracle_slow(self, case):
    self._check_vocab(case)

  def test_error_does_not_grow_with_ring_size(self):
    self.require("ring")
    errs, ref = {}, None
    sizes = sorted({self.adapt(RingCase("", p)).ring_size for p in (1, 2, 4, 8)})
    if len(sizes) < 2:         # e.g. one GPU: one ring size, nothing to compare
      pytest.skip(f"needs rings of two sizes; the backend's devices give only {sizes}")
    for p in sizes:
      # the same global problem on every ring: 8 units of tokens
      case = RingCase("grow", p, causal=True, t=8 // p, s=8 // p)
      inputs = self._inputs(dataclasses.replace(case, ring_size=8, t=1, s=1))
      if ref is None:
        ref = self._oracle(case, inputs)
      got = self._ring_natural(case, inputs)
      errs[p] = [helpers.max_err(g, r) for g, r in zip(got, ref)]
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
      # Same tiles, different merge order: rounding may move by a few fp32 ulps (lse is fp32
      # for every input dtype), but must not grow with P.
      fp32_quantity = jnp.dtype(self.DTYPE) == jnp.float32 or name == "lse"
      ulps = 32 * np.finfo(np.float32).eps * max(1.0, float(jnp.max(jnp.abs(ref[i]))))
      bound = max(1.5 * errs[1][i], ulps if fp32_quantity else 0.0)
      for p in sizes[1:]:
        assert errs[p][i] <= bound, (name, p, errs[p][i], errs[1][i])

  def test_rows_without_valid_key_give_zero_and_zero_gradients(self):
    self.require("ring", "segments", "cross")
    case = self.adapt(RingCase("empty-rows", 8, causal=True, segments="pair"))
    q, k, v, dout, _ = self._inputs(case)
    t, s = q.shape[1], k.shape[1]
    # Query ids 0..3 by quarter; key ids 0..1 only: queries of ids 2, 3 have no key at all.
    q_ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), t // 4)[None]
    kv_ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), s // 2)[None]
    inputs = (q, k, v, dout, (q_ids, kv_ids))
    got = self._ring_natural(case, inputs)
    out, lse, dq = (np.asarray(x, np.float32) for x in got[:3])
    empty = np.asarray(q_ids[0] >= 2)
    assert np.all(out[0, empty] == 0.0) and np.all(np.isneginf(lse[0][:, empty]))
    assert np.all(dq[0, empty] == 0.0)
    for g in got[2:]:
      assert np.all(np.isfinite(np.asarray(g, np.float32)))
    self.check(got, self._oracle(case, inputs), self._oracle(case, inputs, upcast=False))

  def _nonfinite_vocab(self, softcap, sinks: bool):
    """(ring_attention options, oracle options) of a non-finite case with a soft-cap and/or
    sinks; skips where the backend does not claim them."""
    if softcap is not None:
      self.require("softcap")
    if sinks:
      self.require("sinks")
    sink = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32) if sinks else None
    return dict(logits_soft_cap=softcap, sinks=sink), dict(softcap=softcap, sinks=sink)

  @pytest.mark.parametrize("where,softcap,sinks", [
      ("q", None, False), ("k", None, False), ("v", None, False), ("k", 2.0, True)],
      ids=["q", "k", "v", "k-softcap-sinks"])
  def test_nonfinite_values_a_row_does_not_see_never_reach_it(self, where, softcap, sinks):
    """NaN in the query, key or value rows of one document never reaches the rows of the
    other, forward or backward (documents interleave so that every tile mixes them). With a
    soft-cap and sinks too."""
    self.require("ring", "segments")
    vocab, oracle_vocab = self._nonfinite_vocab(softcap, sinks)
    case = self.adapt(RingCase("masked-nan", 8, causal=True, segments="packed"))
    q, k, v, dout, _ = self._inputs(case)
    t = q.shape[1]
    seg = ((jnp.arange(t) // 5) % 2).astype(jnp.int32)[None]
    bad = np.asarray(seg[0] == 1)
    poison = jnp.asarray(bad)[None, :, None, None]
    q_n, k_n, v_n = (jnp.where(poison, jnp.nan, x) if name == where else x
                     for name, x in (("q", q), ("k", k), ("v", v)))
    keep = jnp.asarray(~bad)[None, :, None, None]
    mesh = self.mesh(case.ring_size)

    def ring(a, b_, c):
      return ringflash.ring_attention(a, b_, c, mesh=mesh, **self.options(), is_causal=True,
                                      segment_ids=seg, **vocab,
                                      backend=self.BACKEND,
                                      block_sizes=self.block_sizes(*(
                                          [t // case.ring_size] * 2)))

    def grads(attn, q_, k_, v_):
      def loss(a, b_, c):
        return jnp.sum(jnp.where(keep, attn(a, b_, c).astype(jnp.float32) * dout, 0.0))
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q_, k_, v_)

    def dense(upcast):
      return lambda a, b_, c: oracle.attention(a, b_, c, causal=True, q_seg=seg, kv_seg=seg,
                                               upcast=upcast, **oracle_vocab)[0]

    # The rows of the clean document, and their gradients: finite and exact against the
    # oracle on clean inputs, at the contract's tolerances.
    low = jnp.dtype(q.dtype) != jnp.float32
    out = np.asarray(jax.jit(ring)(q_n, k_n, v_n), np.float32)
    assert np.all(np.isfinite(out[0, ~bad])), "NaN reached rows that do not see it"
    ref_out, plain_out = (np.asarray(jax.jit(dense(u))(q, k, v), np.float32)[0, ~bad]
                          for u in (True, False))
    bound = 2 * helpers.max_err(plain_out, ref_out) if low else helpers.fp32_tol(ref_out)
    assert helpers.max_err(out[0, ~bad], ref_out) <= bound, "out"
    val, got = grads(ring, q_n, k_n, v_n)
    assert np.isfinite(float(val))
    (_, want), (_, plain) = grads(dense(True), q, k, v), grads(dense(False), q, k, v)
    for name, g, r, pl_ in zip(("dq", "dk", "dv"), got, want, plain):
      g, r, pl_ = (np.asarray(x, np.float32)[0, ~bad] for x in (g, r, pl_))
      assert np.all(np.isfinite(g)), f"{name}: NaN reached rows that do not see it"
      bound = 3 * helpers.max_err(pl_, r) if low else helpers.fp32_tol(r)
      assert helpers.max_err(g, r) <= max(bound, 1e-6), name

  def test_nonfinite_padding_past_the_lengths_never_reaches_a_row(self):
    """Padded batches whose padding holds NaN (never written, or garbage): with query and
    key lengths, the queries, keys and values at or past them never reach a row; rows past
    their length give 0; outputs and gradients are finite and exact."""
    self.require("ring", "lengths")
    case = self.adapt(RingCase("padding-nan", 4, causal=True, batch=2))
    q, k, v, dout, _ = self._inputs(case)
    t = q.shape[1]
    q_len = jnp.array([5 * t // 8, t], jnp.int32)
    kv_len = jnp.array([t // 2 + 3, 7 * t // 8], jnp.int32)
    pos = jnp.arange(t)

    def past(lengths):
      return (pos[None, :] >= lengths[:, None])[..., None, None]

    q_n, k_n, v_n = (jnp.where(past(n), jnp.nan, x)
                     for n, x in ((q_len, q), (kv_len, k), (kv_len, v)))
    mesh = self.mesh(case.ring_size)

    def ring(a, b_, c):
      return ringflash.ring_attention(a, b_, c, mesh=mesh, **self.options(), is_causal=True,
                                      query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                                      return_residual=True, backend=self.BACKEND,
                                      block_sizes=self.block_sizes(t // case.ring_size,
                                                                   t // case.ring_size))

    def dense(upcast):
      return lambda a, b_, c: oracle.attention(a, b_, c, causal=True, upcast=upcast,
                                               q_lengths=q_len, kv_lengths=kv_len)

    def with_grads(attn, q_, k_, v_):
      def loss(a, b_, c):
        return jnp.sum(attn(a, b_, c)[0].astype(jnp.float32) * dout)
      out, lse = jax.jit(attn)(q_, k_, v_)
      return (out, lse) + tuple(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q_, k_, v_))

    got = with_grads(ring, q_n, k_n, v_n)
    for name, x in zip(("out", "dq", "dk", "dv"), got[:1] + got[2:]):
      assert bool(jnp.all(jnp.isfinite(x))), f"{name}: NaN of the padding reached it"
    assert not bool(jnp.any(jnp.isnan(got[1]))), "lse: NaN of the padding reached it"
    assert bool(jnp.all(got[0][0, 5 * t // 8:] == 0)), "rows past their length give 0"
    self.check(got, with_grads(dense(True), q, k, v), with_grads(dense(False), q, k, v),
               low_precision=jnp.dtype(q.dtype) != jnp.float32)

  @pytest.mark.parametrize("where,softcap,sinks,value", [
      pytest.param("q", None, False, np.nan, id="q"),
      pytest.param("k", None, False, np.nan, id="k"),
      pytest.param("v", None, False, np.nan, id="v", marks=pytest.mark.slow),
      pytest.param("q", 2.0, False, np.nan, id="q-softcap", marks=pytest.mark.slow),
      pytest.param("q", 2.0, False, np.inf, id="q-inf-softcap"),
      pytest.param("k", 2.0, False, -np.inf, id="k-inf-softcap"),
      pytest.param("v", None, True, np.nan, id="v-sinks"),
      pytest.param("q", None, True, -np.inf, id="q-neginf-sinks")])
  def test_nonfinite_values_a_row_sees_reach_it(self, where, softcap, sinks, value):
    """NaN (or Inf) in one query, key or value entry: every row that sees it is non-finite,
    and so are the gradients that depend on it; every other row and gradient is finite and
    exact (no block is dropped as if it had no key). With a soft-cap (the pallas_gpu backward
    evaluates part of its exponentials differently there; tanh would turn an infinite score
    into a finite cap) and with sinks too. A query's -Inf meets keys that are positive in
    its component: every score of its row is -inf, as if they lay below float32's range,
    and only the Inf itself says that the row saw a non-finite value (with a sink, an
    underflowed row's answer is finite: the sink takes the weight)."""
    self.require("ring")
    self._check_seen_nonfinite(where, value, *self._nonfinite_vocab(softcap, sinks))

  def test_nonfinite_row_of_large_scores_that_the_loss_ignores(self):
    """A query row holding a NaN whose other entries give scores far past exp's range (a
    loss that masks that row, as a padded or filtered batch does): the gradients of the
    other rows and of every key stay finite and exact. A backward that weighs that row's
    pairs overflows (exp of a score past 88) and multiplies the overflow by the row's zero
    cotangent: NaN in the keys' gradients, which O(1) scores never show."""
    self.require("ring")
    self._check_seen_nonfinite("q", np.nan, *self._nonfinite_vocab(None, False), large=True)

  @pytest.mark.parametrize("where", ["dout", "dlse"])
  def test_nonfinite_cotangents_reach_the_gradients_that_read_them(self, where):
    """NaN in one entry of the output's cotangent (or of lse's, with return_residual): the
    dq of that row and head and the dk of the keys it sees are non-finite (and the dv of
    those keys, for the output's); every other gradient is finite and equal to the
    oracle's with that entry 0. A NaN in a loss's gradient is never zeroed on the way."""
    self.require("ring")
    case = self.adapt(RingCase("nan-cotangent", 4, causal=True))
    q, k, v, dout, _ = self._inputs(case)
    t, p, g = q.shape[1], case.ring_size, N // case.kv_heads
    r, h = t // 2 + 3, 1                 # a row on the third device, query head 1
    dlse = jnp.zeros((q.shape[0], N, t), jnp.float32)
    nan_dout = dout.at[0, r, h, 3].set(jnp.nan) if where == "dout" else dout
    nan_dlse = dlse.at[0, h, r].set(jnp.nan) if where == "dlse" else dlse
    mesh = self.mesh(p)

    def ring(a, b_, c):
      return ringflash.ring_attention(a, b_, c, mesh=mesh, **self.options(), is_causal=True,
                                      return_residual=True, backend=self.BACKEND,
                                      block_sizes=self.block_sizes(t // p, t // p))

    def grads(attn, d_out, d_lse):
      (out, lse), back = jax.vjp(jax.jit(attn), q, k, v)
      return [np.asarray(x, np.float32)
              for x in back((d_out.astype(out.dtype), d_lse.astype(lse.dtype)))]

    def dense(upcast):
      return lambda a, b_, c: oracle.attention(a, b_, c, causal=True, upcast=upcast)

    dq, dk, dv = grads(ring, nan_dout, nan_dlse)
    assert np.all(~np.isfinite(dq[0, r, h])), "the row's dq reads the NaN"
    seen = np.arange(t) <= r                      # the keys row r sees (causal)
    reads = [dk] + ([dv] if where == "dout" else [])
    for x in reads:
      assert np.all(np.any(~np.isfinite(x[0, seen, h // g]), axis=-1)), "a seen key's grad"
    clean = (nan_dout.at[0, r, h].set(0.0) if where == "dout" else dout,
             nan_dlse.at[0, h, r].set(0.0))
    want, plain = grads(dense(True), *clean), grads(dense(False), *clean)
    low = jnp.dtype(q.dtype) != jnp.float32
    others_q = np.ones(dq.shape, bool)
    others_q[0, r, h] = False
    others_kv = np.ones(dk.shape, bool)
    others_kv[0, seen, h // g] = False
    for name, got, w, pl_, where_ok in zip(
        ("dq", "dk", "dv"), (dq, dk, dv), want, plain,
        (others_q, others_kv, others_kv)):
      assert np.all(np.isfinite(got[where_ok])), f"{name}: NaN reached a gradient it is not in"
      bound = 3 * helpers.max_err(pl_[where_ok], w[where_ok]) if low else helpers.fp32_tol(w)
      assert helpers.max_err(got[where_ok], w[where_ok]) <= max(bound, 1e-6), name

  @pytest.mark.parametrize("where,layout,trim,causal,window,softcap,sinks,value", [
      pytest.param("k", "zigzag", (9, 5), True, None, None, False, np.nan, id="zigzag-k"),
      pytest.param("k", "zigzag", (0, 1), True, None, 2.0, False, -np.inf,
                   id="zigzag-hidden-k-inf-softcap", marks=pytest.mark.slow),
      pytest.param("q", "striped", (0, 3), False, (20, 12), None, False, np.nan,
                   id="striped-window-q", marks=pytest.mark.slow),
      pytest.param("v", "striped", (0, 3), False, (20, 12), 2.0, True, np.nan,
                   id="striped-window-v-softcap-sinks")])
  def test_nonfinite_rule_holds_through_layout_padding(self, where, layout, trim, causal,
                                                       window, softcap, sinks, value):
    """The same rule where a zigzag or striped sequence of a length that does not fit the
    layout is padded inside: with ids for the padding (zigzag, 9/16 UNIT + 5 tokens short;
    striped, 3 short, a window both ways and the bidirectional ring) and without them where
    the causal mask hides it (zigzag, 1 short: the padding rows see every key, the bad one
    among them, and are trimmed). trim: (sixteenths of UNIT, tokens)."""
    self.require("ring", "layouts", "lengths", *(["window", "bidirectional"] if window
                                                  else []))
    self._check_seen_nonfinite(where, value, *self._nonfinite_vocab(softcap, sinks),
                               layout=layout, trim=trim, causal=causal, window=window,
                               bidirectional=window is not None)

  @pytest.mark.parametrize("policy", [
      pytest.param("names", id="names"),
      pytest.param("nothing", id="nothing", marks=pytest.mark.slow)])
  def test_nonfinite_rule_holds_under_remat(self, policy):
    """The rule, and exactness, where ring_attention runs under jax.checkpoint as large
    models call it: with ringflash.RESIDUAL_NAMES saved (the backward reads the forward's
    named out, lse and inputs) and with nothing saved (the backward runs the forward again).
    A NaN key and sinks."""
    self.require("ring", "sinks")
    names = jax.checkpoint_policies.save_only_these_names(*ringflash.RESIDUAL_NAMES)
    self._check_seen_nonfinite(
        "k", np.nan, *self._nonfinite_vocab(None, True),
        remat=names if policy == "names" else jax.checkpoint_policies.nothing_saveable)

  def _check_seen_nonfinite(self, where, value, vocab, oracle_vocab, *, layout="contiguous",
                            trim=(0, 0), causal=True, window=None, bidirectional=False,
                            remat=None, large=False):
    """One bad entry (`value`) in q, k or v of a 4-device ring: the rows that see it, and
    the gradients that depend on them, are non-finite; every other row and gradient is
    finite and equal to the oracle's on clean inputs. Natural order in and out (to_layout /
    from_layout around the ring); window in sixteenths of UNIT. remat: a jax.checkpoint
    policy the ring call runs under (None: no jax.checkpoint). large: the bad query row is
    otherwise 100 x the sign of key 5's (head 0), so that its clean scores lie far past
    exp's range (88)."""
    case = self.adapt(RingCase("seen-nan", 4, causal=causal, layout=layout))
    q, k, v, dout, _ = self._inputs(case)
    t0 = q.shape[1]
    trim = trim[0] * self.UNIT // 16 + trim[1]
    q, k, v, dout = (x[:, :t0 - trim] for x in (q, k, v, dout))
    t, g = q.shape[1], N // case.kv_heads
    window = None if window is None else tuple(w * self.UNIT // 16 for w in window)
    j0 = t // 2 + 3                        # a position on the third device (contiguous)
    if where == "q" and value == -np.inf:
      k = k.at[..., 0].set(jnp.abs(k[..., 0]) + 0.5)   # every score of the row is -inf
    if large:
      q = q.at[0, j0, 0].set((100.0 * jnp.sign(k[0, 5, 0].astype(jnp.float32))).astype(q.dtype))
    bad = {"q": q, "k": k, "v": v}
    bad[where] = bad[where].at[0, j0, 0, 0].set(value)
    # sees[i, j]: row i sees key j; seeing [T, N]: the rows that see the bad entry
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    sees = (j <= i) if causal else np.ones((t, t), bool)
    if window is not None:
      sees &= (j >= i - window[0]) & (j <= i + window[1])
    heads = np.arange(N)[None, :]
    seeing = ((i == j0) & (heads == 0)) if where == "q" else (sees[:, j0:j0 + 1] & (heads < g))
    mesh = self.mesh(case.ring_size)
    p = case.ring_size
    local = -(-t // p)
    to = functools.partial(ringflash.to_layout, layout=layout, ring_size=p)
    back = functools.partial(ringflash.from_layout, layout=layout, ring_size=p)

    def ring(a, b_, c):
      out, lse = ringflash.ring_attention(
          to(a), to(b_), to(c), mesh=mesh, **self.options(), is_causal=causal,
          return_residual=True, backend=self.BACKEND, **vocab, layout=layout,
          local_window_size=window, bidirectional=bidirectional,
          block_sizes=self.block_sizes(local, local))
      return back(out), back(lse, axis=2)

    if remat is not None:
      ring = jax.checkpoint(ring, policy=remat)
    out, lse = (np.asarray(x, np.float32) for x in jax.jit(ring)(bad["q"], bad["k"], bad["v"]))
    lse = lse[0].T                                                        # [T, N]
    assert np.all(np.any(~np.isfinite(out[0]), axis=-1)[seeing]), "a row that saw NaN"
    assert np.all(~np.isfinite(lse[seeing]))
    assert np.all(np.isfinite(out[0][~seeing])) and np.all(np.isfinite(lse[~seeing]))

    keep = jnp.asarray(~seeing)[None, :, :, None]

    def grads(attn, q_, k_, v_, mask):
      def loss(a, b_, c):
        return jnp.sum(jnp.where(mask, attn(a, b_, c)[0].astype(jnp.float32) * dout, 0.0))
      return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q_, k_, v_)

    def dense(upcast):
      return lambda a, b_, c: oracle.attention(a, b_, c, causal=causal, upcast=upcast,
                                               window=window, **oracle_vocab)

    # Rows that do not see it: finite and exact, against the oracle on clean inputs (the
    # NaN entry never matters to them).
    got = grads(ring, bad["q"], bad["k"], bad["v"], keep)
    want = grads(dense(True), q, k, v, keep)
    plain = grads(dense(False), q, k, v, keep)
    low = jnp.dtype(q.dtype) != jnp.float32
    for name, gv, w, pl_ in zip(("dq", "dk", "dv"), got, want, plain):
      assert bool(jnp.all(jnp.isfinite(gv))), f"{name}: NaN reached a gradient it is not in"
      bound = 3 * helpers.max_err(pl_, w) if low else helpers.fp32_tol(w)
      assert helpers.max_err(gv, w) <= max(bound, 1e-6), name
    ref_out = np.asarray(dense(True)(q, k, v)[0], np.float32)
    plain_out = np.asarray(dense(False)(q, k, v)[0], np.float32)
    err = np.max(np.abs(out[0][~seeing] - ref_out[0][~seeing]))
    bound = 2 * np.max(np.abs(plain_out[0] - ref_out[0])) if low else helpers.FP32_TOL * max(
        1.0, float(np.max(np.abs(ref_out))))
    assert err <= bound, err
    # The rows that see it: their gradients are non-finite where they depend on it, and
    # the keys no seeing row sees keep finite gradients.
    dq, dk, dv = (np.asarray(x, np.float32) for x in grads(
        ring, bad["q"], bad["k"], bad["v"], jnp.asarray(seeing)[None, :, :, None]))
    assert np.all(np.any(~np.isfinite(dq[0]), axis=-1)[seeing])
    seen = np.any(sees[np.any(seeing, axis=1)], axis=0)   # [S]: keys some seeing row sees
    assert np.all(np.any(~np.isfinite(dv[0, seen, 0]), axis=-1))
    assert np.all(np.isfinite(dk[0, :, 1:])) and np.all(np.isfinite(dv[0, :, 1:]))
    if where == "q":
      assert np.all(np.isfinite(dk[0, ~seen])) and np.all(np.isfinite(dv[0, ~seen]))

  @pytest.mark.parametrize("ring_size,sinks,causal", [(4, False, True), (4, True, True),
                                                      (1, False, True), (2, False, False)],
                           ids=["P4", "P4-sinks", "P1", "P2-unmasked"])
  def test_scores_below_float32_make_their_row_nan_not_zero(self, ring_size, sinks, causal):
    """Finite inputs whose scores overflow float32: the rows whose every valid score is -inf
    (q = -1e38 against positive keys) have no float32 answer and become NaN, out and lse,
    with non-finite gradients where the loss reads them; they never pass for rows without
    keys (0). With sinks the exact answer is representable (the sink takes all the weight):
    out 0, lse the sink, and every output and gradient equals the oracle's. Other rows are
    exact either way. Causal, each such row meets keys over several ring steps, on tiles
    with and without a mask; not causal (no ids, no window), on tiles without one only."""
    self.require("ring")
    vocab, oracle_vocab = self._nonfinite_vocab(None, sinks)
    case = self.adapt(RingCase("overflow", ring_size, causal=causal))
    q, k, v, dout, _ = self._inputs(case)
    t, p = q.shape[1], case.ring_size
    k = (jnp.abs(k.astype(jnp.float32)) + 0.5).astype(k.dtype)   # q.k < -3.4e38 below
    over = np.arange(t) % 5 == 2
    q_over = jnp.where(jnp.asarray(over)[None, :, None, None], jnp.asarray(-1e38, q.dtype), q)
    mesh = self.mesh(p)

    def ring(a, b_, c):
      return ringflash.ring_attention(a, b_, c, mesh=mesh, **self.options(),
                                      is_causal=causal, return_residual=True,
                                      backend=self.BACKEND, **vocab,
                                      block_sizes=self.block_sizes(t // p, t // p))

    def dense(upcast):
      return lambda a, b_, c: oracle.attention(a, b_, c, causal=causal, upcast=upcast,
                                               **oracle_vocab)

    def with_grads(attn, q_, mask=None):
      def loss(a, b_, c):
        o = attn(a, b_, c)[0].astype(jnp.float32) * dout
        return jnp.sum(o if mask is None else jnp.where(mask, o, 0.0))
      return tuple(jax.jit(attn)(q_, k, v)) + tuple(
          jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q_, k, v))

    low = jnp.dtype(q.dtype) != jnp.float32
    if sinks:
      got = with_grads(ring, q_over)
      out, lse = (np.asarray(x, np.float32) for x in got[:2])
      assert np.all(out[0, over] == 0.0), "the sink takes all the weight: 0"
      np.testing.assert_array_equal(lse[0][:, over],
                                    np.broadcast_to(np.asarray(vocab["sinks"])[:, None],
                                                    (N, int(over.sum()))))
      self.check(got, with_grads(dense(True), q_over), with_grads(dense(False), q_over),
                 low_precision=low)
      return
    out, lse = (np.asarray(x, np.float32) for x in jax.jit(ring)(q_over, k, v))
    assert np.all(np.isnan(out[0, over])), "a row with only scores below float32: NaN, not 0"
    assert np.all(np.isnan(lse[0][:, over]))
    # The other rows, and the gradients with the loss masked to them, against the oracle on
    # inputs without the overflowing rows (their queries never reach another row).
    keep = jnp.asarray(~over)[None, :, None, None]
    got = with_grads(ring, q_over, keep)
    want = with_grads(dense(True), q, keep)
    plain = with_grads(dense(False), q, keep)
    got, want, plain = ([x[0, ~over] for x in r[:1]] + [r[1][0][:, ~over]] + list(r[2:])
                        for r in (got, want, plain))
    got[2], want[2], plain[2] = (x[0, ~over] for x in (got[2], want[2], plain[2]))
    self.check(got, want, plain, low_precision=low)
    # The loss reads them: their query gradients are non-finite.
    dq = np.asarray(with_grads(ring, q_over)[2], np.float32)
    assert np.all(np.any(~np.isfinite(dq[0, over]), axis=-1))

  def _float16_range_gradients(self, name, nan_in_the_middle=False):
    """float16 with small q, k, large values and a large output cotangent (a loss scale),
    causal on a ring of 4: ds = p (dp - D) reaches about 1e6, past float16's 65504, while
    every true gradient is below 2200. nan_in_the_middle: the values of key T / 2 + 3 are NaN
    and the loss reads only the rows before it. Returns the backend's gradients of q, k, v, the fp32
    oracle's on clean inputs, both cut to the rows the loss reads."""
    self.require("ring")
    case = self.adapt(RingCase(name, 4, causal=True))
    q, k, v, dout, _ = self._inputs(case)
    q, k, v, dout = ((x.astype(jnp.float32) * f).astype(jnp.float16)
                     for x, f in ((q, 0.01), (k, 0.01), (v, 3000.0), (dout, 30.0)))
    p, t = case.ring_size, q.shape[1]
    rows = t // 2 + 3 if nan_in_the_middle else t
    keep = (jnp.arange(t) < rows)[None, :, None, None]
    mesh = self.mesh(p)

    def grads(attn, v_):
      def loss(a, b_, c):
        return jnp.sum(jnp.where(keep, attn(a, b_, c).astype(jnp.float32)
                                 * dout.astype(jnp.float32), 0.0))
      return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v_)

    got = grads(lambda a, b_, c: ringflash.ring_attention(
        a, b_, c, mesh=mesh, **self.options(), is_causal=True, backend=self.BACKEND,
        block_sizes=self.block_sizes(t // p, t // p)),
                v.at[:, rows].set(jnp.nan) if nan_in_the_middle else v)
    want = grads(lambda a, b_, c: oracle.attention(a, b_, c, causal=True)[0], v)
    cut = lambda xs: [np.asarray(x, np.float32)[:, :rows] for x in xs]
    return cut(got), cut(want)

  @staticmethod
  def _check_float16_range(got, want, message):
    """Finite, and within 4 float16 epsilons (2^-10) of the largest gradient of each."""
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
      assert np.all(np.isfinite(g)), f"{name}: {message}"
      scale = float(np.max(np.abs(w)))
      assert np.max(np.abs(g - w)) <= 4 * 2.0 ** -10 * scale, (name, np.max(np.abs(g - w)))

  def test_float16_gradients_keep_the_range_of_float16(self):
    """The float16 range case (_float16_range_gradients): the gradients are finite and
    within 4 float16 epsilons of their largest, against the fp32 oracle (plain float16 dense
    attention is non-finite here, so FlashAttention's criterion has nothing to compare
    with)."""
    got, want = self._float16_range_gradients("float16-range")
    self._check_float16_range(got, want, "float16 overflowed")

  def test_float16_gradient_range_beside_a_nan_it_does_not_see(self):
    """The float16 range case with NaN in the values of one key in the middle (causal): the
    rows before it do not see it, and their gradients (the loss reads only them) stay finite
    and within 4 float16 epsilons of their largest against the fp32 oracle on clean inputs.
    A backend that scales ds into float16's range must not let the NaN decide the scale."""
    got, want = self._float16_range_gradients("float16-range-nan", nan_in_the_middle=True)
    self._check_float16_range(got, want, "NaN or overflow reached rows that do not see it")

  def test_lse_cotangent_flows(self):
    """With return_residual, gradients through lse are exact too."""
    self.require("ring")
    case = self.adapt(RingCase("lse", 4, causal=True, kv_heads=1))
    q, k, v, _, _ = self._inputs(case)
    p = case.ring_size
    mesh = self.mesh(p)

    def loss(attn):
      def f(q, k, v):
        out, lse = attn(q, k, v)
        return (jnp.sum(out.astype(jnp.float32) ** 2)
                + jnp.sum(jnp.where(jnp.isfinite(lse), jnp.sin(lse), 0.0)))
      return f

    got = jax.jit(jax.grad(loss(lambda q, k, v: ringflash.ring_attention(
        q, k, v, mesh=mesh, **self.options(), is_causal=True, return_residual=True,
        backend=self.BACKEND,
        block_sizes=self.block_sizes(q.shape[1] // p, k.shape[1] // p))),
        argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: oracle.attention(q, k, v, causal=True)),
                    argnums=(0, 1, 2))(q, k, v)
    plain = jax.grad(loss(lambda q, k, v: oracle.attention(q, k, v, causal=True,
                                                           upcast=False)),
                     argnums=(0, 1, 2))(q, k, v)
    for g, w, p in zip(got, want, plain):
      if jnp.dtype(self.DTYPE) == jnp.float32:
        assert helpers.max_err(g, w) <= helpers.fp32_tol(w)
      else:
        assert helpers.max_err(g, w) <= 3 * helpers.max_err(p, w)

  @pytest.mark.parametrize("layout,window", [("contiguous", None), ("zigzag", (40, 0)),
                                             ("striped", None)])
  def test_sharded_entry_at_local_lengths_no_tile_divides(self, layout, window):
    """ring_attention_sharded takes the local shards as they are: at a local length that
    no tile of the backend divides (1.5 UNIT + 4 rows a device: 28 or 388, zigzag chunks of
    14 or 194), causal, the kernels pad inside (pallas_gpu: rows up to whole tiles whose ids
    see nothing) or tile it as it is, and out, lse and the gradients meet the oracle on
    natural order; a NaN key reaches the rows that see it and no other. The ring of 4 (as
    many GPUs as there are on the GPU)."""
    self.require("ring", "layouts", *(("window",) if window else ()))
    case = self.adapt(RingCase("odd", 4))
    p = case.ring_size
    local_len = self.UNIT + self.UNIT // 2 + 4
    n_tok = local_len * p
    q, k, v, dout = helpers.inputs(11 + p, 1, n_tok, n_tok, N, 2, self.HEAD_DIM, self.DTYPE)
    mesh = self.mesh(p)
    unit = local_len // 2 if layout == "zigzag" else local_len     # what tiles must divide

    def local(q, k, v):
      return ringflash.ring_attention_sharded(
          q, k, v, axis_name="sp", is_causal=True, return_residual=True,
          backend=self.BACKEND, layout=layout, local_window_size=window,
          block_sizes=self.block_sizes(unit, unit))

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                       out_specs=(P(None, "sp"), P(None, None, "sp")),
                       check_vma=self.SHARD_MAP_CHECK_VMA)

    def to(x):
      return ringflash.to_layout(x, layout, p)

    @jax.jit
    def ours(q, k, v, dout):
      (out, lse), vjp = jax.vjp(fn, to(q), to(k), to(v))
      grads = vjp((to(dout).astype(out.dtype), jnp.zeros_like(lse)))
      back = functools.partial(ringflash.from_layout, layout=layout, ring_size=p)
      return (back(out), back(lse, axis=-1)) + tuple(back(g) for g in grads)

    def dense(upcast):
      @jax.jit
      def run(q, k, v, dout):
        (out, lse), vjp = jax.vjp(lambda *a: oracle.attention(
            *a, causal=True, window=window, upcast=upcast), q, k, v)
        return (out, lse) + vjp((dout.astype(out.dtype), jnp.zeros_like(lse)))
      return run(q, k, v, dout)

    got = ours(q, k, v, dout)
    assert got[0].shape == (1, n_tok, N, self.HEAD_DIM) and got[1].shape == (1, N, n_tok)
    self.check(got, dense(True), dense(False))
    # A NaN key at natural position local_len - 1 (device 0's last row, beside its padding
    # where the layout is contiguous): the rows that see it (causal, within the window) come
    # out NaN; the others, out and dq, as without it.
    j = local_len - 1
    out_n, _, dq_n, _, _ = ours(q, k.at[:, j].set(jnp.nan), v, dout)
    rows = np.arange(n_tok)
    sees = (rows >= j) & (rows - j <= (window[0] if window else n_tok))
    assert np.all(np.isnan(np.asarray(out_n, np.float32)[0, sees])), "a seen NaN was lost"
    for name, g, clean in (("out", out_n, got[0]), ("dq", dq_n, got[2])):
      g, clean = (np.asarray(x, np.float32)[0, ~sees] for x in (g, clean))
      assert np.all(np.isfinite(g)), f"{name}: NaN reached rows that do not see it"
      np.testing.assert_allclose(g, clean, rtol=1e-5, atol=1e-5, err_msg=name)

  @pytest.mark.parametrize("extra", ["segments", "segments-sinks-lengths", "query-lengths"])
  def test_sharded_entry_inside_callers_shard_map(self, extra):
    """ring_attention_sharded in the caller's own shard_map (check_vma as the backend
    needs, SHARD_MAP_CHECK_VMA), against the oracle (forward and gradients); sinks and
    sequence lengths replicated (the sinks' gradient summed over the devices), query
    lengths alone (key ids that vary over no mesh axis)."""
    sinks_lengths, segments = "sinks" in extra, "segments" in extra
    self.require("ring", *(("segments",) if segments else ()),
                 *(("sinks",) if sinks_lengths else ()),
                 *(("lengths",) if "lengths" in extra else ()))
    case = self.adapt(RingCase("sharded", 4, causal=True,
                               segments="packed" if segments else None))
    q, k, v, dout, seg = self._inputs(case)
    mesh = self.mesh(case.ring_size)
    rng = np.random.default_rng(7)
    b, t = q.shape[0], q.shape[1]
    sinks = jnp.asarray(rng.normal(size=N) * 2, jnp.float32) if sinks_lengths else None
    q_len = (jnp.asarray(rng.integers(t // 2, t, b), jnp.int32) if "lengths" in extra
             else None)
    kv_len = jnp.asarray(rng.integers(t // 3, t, b), jnp.int32) if sinks_lengths else None

    def local(q, k, v, seg, sinks):
      return ringflash.ring_attention_sharded(
          q, k, v, axis_name="sp", is_causal=True, segment_ids=seg, return_residual=True,
          backend=self.BACKEND, block_sizes=self.block_sizes(q.shape[1], k.shape[1]),
          sinks=sinks, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)

    fn = jax.shard_map(local, mesh=mesh,
                       in_specs=(P(None, "sp"),) * 3 + (P(None, "sp") if segments else P(), P()),
                       out_specs=(P(None, "sp"), P(None, None, "sp")),
                       check_vma=self.SHARD_MAP_CHECK_VMA)

    def grads(attn):
      @jax.jit
      def run(q, k, v, dout, sinks):
        (out, lse), vjp = jax.vjp(attn, q, k, v, sinks)
        return (out, lse) + vjp((dout.astype(out.dtype), jnp.zeros_like(lse)))
      return run(q, k, v, dout, sinks)

    def dense(upcast):
      return lambda q, k, v, sinks: oracle.attention(
          q, k, v, causal=True, q_seg=seg, kv_seg=seg, sinks=sinks, q_lengths=q_len,
          kv_lengths=kv_len, upcast=upcast)

    got = grads(lambda q, k, v, sinks: fn(q, k, v, seg, sinks))
    ref, plain = grads(dense(True)), grads(dense(False))
    self.check(got[:5], ref[:5], plain[:5],
               low_precision=jnp.dtype(q.dtype) != jnp.float32)
    if sinks_lengths:
      g, r, pl_ = (np.asarray(x[5], np.float32) for x in (got, ref, plain))
      tol = (3 * float(np.max(np.abs(pl_ - r))) if jnp.dtype(q.dtype) != jnp.float32
             else helpers.fp32_tol(r))
      assert np.max(np.abs(g - r)) <= max(tol, 1e-6), ("dsinks", g, r)
