"""The portable backend: blockwise attention in jnp, lax loops over tiles, fp32 statistics.

Default on CPU, fallback everywhere, and the reference the Pallas kernels are tested against.
Never materializes a [T, S] score array: the largest intermediate is one [B, K, G, bq, bk]
tile. GQA: queries are viewed as [B, T, K, G, H] (G = N // K query heads per kv head) and
contracted against [B, S, K, H] keys directly, so K/V are never repeated in memory.
"""

from __future__ import annotations


import jax.numpy as jnp
from jax import lax

from ringflash.kernels import base
from ringflash.kernels.tiles import XlaBlockSizes

NAME = "xla"
LENGTH_MULTIPLE = 1         # any local length
_DEFAULT_BLOCK = 512
_SMALLEST_DIVISOR = 64


def unsupported(problem: base.Problem) -> str | None:
  """Why this backend cannot compute `problem` (None: it can; it computes everything)."""
  del problem
  return None


def default_block(length: int) -> int:
  """The default tile of a local length: its largest divisor up to 512 where that is the
  length itself or at least 64 rows; otherwise (1031, a prime, has only 1 and 1031) the
  length in ceil(length / 512) near-equal tiles, rounded up to 8 rows, and the kernels pad
  the last one (base.fit_rows): 1031 rows in tiles of 344, 1 row of padding. Tiles of a few
  rows would make the loops run (length / tile)^2 steps of a few scores each."""
  d = base.largest_divisor_at_most(length, _DEFAULT_BLOCK)
  if d == length or d >= _SMALLEST_DIVISOR:
    return d
  return base.round_up(-(-length // -(-length // _DEFAULT_BLOCK)), 8)


def resolve_tiles(given: XlaBlockSizes | None, problem: base.Problem) -> XlaBlockSizes:
  """Every tile size resolved for `problem` (same signature in every backend).

  Raises:
    ValueError: naming block_sizes, when a given size does not divide its length.
  """
  given = XlaBlockSizes() if given is None else given
  sizes = {}
  for name, length in (("block_q", problem.q_len), ("block_k", problem.kv_len),
                       ("block_q_bwd", problem.q_len), ("block_k_bwd", problem.kv_len)):
    value = getattr(given, name)
    if value is None:
      value = sizes.get(name[:7]) or default_block(length)
    elif length % value:
      raise ValueError(f"block_sizes.{name}={value} must divide the local length {length} "
                       f"(backend {NAME!r})")
    sizes[name] = value
  return XlaBlockSizes(**sizes)


def _slice(x, start, size, axis):
  return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _seg_tile(seg, start, size):
  return None if seg is None else _slice(seg, start, size, 1)


def _geometry(q, k, bq: int, bk: int):
  """(B, T, N, H, S, K, G, bq, bk, nq, nk): shapes, group size G = N // K, tiles and counts."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  return b, t, n, h, s, kh, n // kh, bq, bk, t // bq, s // bk


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec):
  """Block-pair forward; see kernels/base.py for the contract.

  A block pair with no valid entry (a dead ring hop: with causal masking and the contiguous
  layout, about half of them) is skipped whole, with one conditional; otherwise empty
  tiles are skipped one by one. Lengths the tiles do not divide (default_block) are padded
  with rows that see nothing (base.fit_rows), cut off after.
  """
  t = q.shape[1]
  refs = (q, k, v, q_pos, k_pos, q_seg, k_seg)
  args, _ = base.fit_rows(spec.tiles.block_q, spec.tiles.block_k, *refs)
  o, lse = _forward(*args, spec)
  if o.shape[1] != t:
    o, lse = o[:, :t], lse[..., :t]
  return o, lse


def _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec):
  b, t, n, h = q.shape
  refs = (q, k, v, q_pos, k_pos, q_seg, k_seg)

  def empty():
    return (base.filled((b, t, n, v.shape[-1]), 0.0, refs),
            base.filled((b, n, t), -jnp.inf, refs))

  return lax.cond(base.block_may_have_work(q_pos, k_pos, spec, q_seg, k_seg),
                  lambda: forward_tiles(q, k, v, q_pos, k_pos, q_seg, k_seg, spec), empty)


def forward_tiles(q, k, v, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec):
  """forward over every tile of the block pair (skipping the empty ones)."""
  b, t, n, h, s, kh, g, bq, bk, nq, nk = _geometry(q, k, spec.tiles.block_q,
                                                    spec.tiles.block_k)
  hv = v.shape[-1]
  prec = base.matmul_precision(q.dtype)
  q5 = q.reshape(b, t, kh, g, h)

  def q_tile(i):
    qt = _slice(q5, i * bq, bq, 1)                      # [B, bq, K, G, H]
    qp = _slice(q_pos, i * bq, bq, 0)                   # [bq]
    qs = _seg_tile(q_seg, i * bq, bq)                   # [B, bq] | None

    def kv_step(j, carry):
      kt = _slice(k, j * bk, bk, 1)                     # [B, bk, K, H]
      vt = _slice(v, j * bk, bk, 1)
      valid = base.mask(qp, _slice(k_pos, j * bk, bk, 0), qs, _seg_tile(k_seg, j * bk, bk),
                        spec)                           # [B|1, bq, bk]

      def compute(carry):
        m, l, acc = carry                               # [B,K,G,bq], [B,K,G,bq], [B,K,G,bq,Hv]
        sc = base.capped(jnp.einsum("bqkgh,bskh->bkgqs", qt, kt, precision=prec,
                                    preferred_element_type=jnp.float32) * spec.scale, spec)
        # Masked pairs get -inf by a `where`: a NaN score of a key this row does not see
        # (kernels/base.py, guard_kv) never reaches it. A valid score below float32's range
        # (-inf) counts as LOWEST there, so a row that met a valid key has m >= LOWEST.
        sc = jnp.where(valid[:, None, None], base.floor_at_lowest(sc), -jnp.inf)
        # One copy of the scores for the max and the exponent: XLA may otherwise recompute the
        # product inside each consumer's fusion, summed in another order, and at scores near
        # 1e9 the two roundings differ by more than exp's range (sc - m > 88: inf, then NaN).
        sc = lax.optimization_barrier(sc)
        m_new = jnp.maximum(m, sc.max(axis=-1))
        # A row with no valid key so far keeps m = -inf; shift it by 0 so that no
        # (-inf) - (-inf) appears: its p and alpha are then exactly 0. A NaN max stays NaN.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(sc - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l_new = alpha * l + p.sum(axis=-1)
        pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), vt, precision=prec,
                        preferred_element_type=jnp.float32)
        return m_new, l_new, alpha[..., None] * acc + pv

      return lax.cond(jnp.any(valid), compute, lambda c: c, carry)

    refs = (q, k, v, q_pos, k_pos, q_seg, k_seg)
    init = (base.filled((b, kh, g, bq), -jnp.inf, refs),
            base.filled((b, kh, g, bq), 0.0, refs),
            base.filled((b, kh, g, bq, hv), 0.0, refs))
    m, l, acc = lax.fori_loop(0, nk, kv_step, init)
    inv, lse = base.finish_rows(m, l)
    # inv = 0: no key, or only scores below float32 (whose acc, weighted 1 each, may be inf).
    o = jnp.where(inv[..., None] == 0, 0.0, acc * inv[..., None])
    return o.transpose(0, 3, 1, 2, 4), lse              # [B, bq, K, G, Hv], [B, K, G, bq]

  o_tiles, lse_tiles = lax.map(q_tile, jnp.arange(nq))  # [nq, B, bq, K, G, Hv], [nq, ...]
  # One pair of dims merged per reshape: under jax.vmap on a mesh with Explicit axes (the
  # batch sharded) JAX refuses a reshape that merges two pairs at once.
  o = o_tiles.transpose(1, 0, 2, 3, 4, 5).reshape(b, t, kh, g, hv).reshape(b, t, n, hv)
  lse = lse_tiles.transpose(1, 2, 3, 0, 4).reshape(b, kh, g, t).reshape(b, n, t)
  return o, lse


def backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
             dlse=None):
  """Block-pair backward; see kernels/base.py for the contract and backward_tiles.

  A block pair with no valid entry is skipped whole (zero gradients), as in forward, and
  lengths the tiles do not divide are padded likewise (rows without keys: lse -inf).
  """
  t, s = q.shape[1], k.shape[1]
  args, pt = base.fit_rows(spec.tiles.block_q_bwd, spec.tiles.block_k_bwd, q, k, v, q_pos,
                           k_pos, q_seg, k_seg)
  out, dout, dlse = base.pad_rows(out, pt), base.pad_rows(dout, pt), base.pad_rows(dlse, pt, 2)
  lse = base.pad_rows(lse, pt, axis=2, value=-jnp.inf)
  dq, dk, dv = _backward(*args[:3], out, lse, dout, *args[3:], spec, dlse)
  if dq.shape[1] != t or dk.shape[1] != s:
    dq, dk, dv = dq[:, :t], dk[:, :s], dv[:, :s]
  return dq, dk, dv


def _backward(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec: base.KernelSpec,
              dlse):
  refs = (q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, dlse)

  def zeros():
    return tuple(base.filled(x.shape, 0.0, refs) for x in (q, k, v))

  return lax.cond(
      base.block_may_have_work(q_pos, k_pos, spec, q_seg, k_seg),
      lambda: backward_tiles(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, spec, dlse),
      zeros)


def backward_tiles(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg,
                   spec: base.KernelSpec, dlse=None):
  """Backward over every tile of the block pair, from the global out and lse.

  With p = exp(s - lse) (final probabilities) and D = rowsum(dout * out) - dlse:
    dv = p^T dout,  dp = dout v^T,  ds = p * (dp - D),  dq = scale ds k,  dk = scale ds^T q,
  where, with a soft-cap, ds is first multiplied by the derivative of the cap (base.capped).
  Outer loop over key tiles (dk, dv of a tile finish in registers of the loop carry), inner
  loop over query tiles accumulating dq into a float32 [B, T, K, G, H] carry.
  """
  b, t, n, h, s, kh, g, bq, bk, nq, nk = _geometry(q, k, spec.tiles.block_q_bwd,
                                                    spec.tiles.block_k_bwd)
  hv = v.shape[-1]
  prec = base.matmul_precision(q.dtype)
  q5 = q.reshape(b, t, kh, g, h)
  do5 = dout.reshape(b, t, kh, g, hv)
  delta = base.softmax_delta(out, dout, dlse).reshape(b, kh, g, t)
  refs = (q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg, dlse)
  lse4 = lse.reshape(b, kh, g, t)
  row_ok = lse4 != -jnp.inf                  # a NaN lse (the row saw a NaN) stays NaN
  lse_safe = jnp.where(row_ok, lse4, 0.0)

  def kv_tile(j, carry):
    dq, dk, dv = carry
    kt = _slice(k, j * bk, bk, 1)                       # [B, bk, K, H]
    vt = _slice(v, j * bk, bk, 1)
    kp = _slice(k_pos, j * bk, bk, 0)
    ks = _seg_tile(k_seg, j * bk, bk)

    def q_step(i, inner):
      dq, dkt, dvt = inner
      qp = _slice(q_pos, i * bq, bq, 0)
      valid = base.mask(qp, kp, _seg_tile(q_seg, i * bq, bq), ks, spec)  # [B|1, bq, bk]

      def compute(inner):
        dq, dkt, dvt = inner
        qt = _slice(q5, i * bq, bq, 1)                  # [B, bq, K, G, H]
        dot = _slice(do5, i * bq, bq, 1)
        lt = _slice(lse_safe, i * bq, bq, 3)            # [B, K, G, bq]
        okt = _slice(row_ok, i * bq, bq, 3)
        dt = _slice(delta, i * bq, bq, 3)
        sc = base.capped(jnp.einsum("bqkgh,bskh->bkgqs", qt, kt, precision=prec,
                                    preferred_element_type=jnp.float32) * spec.scale, spec)
        # The scores as the forward made them (a product of its own, as there): fused into
        # the exponent, XLA sums the product in another order, and at scores near 1e9 the
        # two roundings put s - lse far above 0 (exp: inf, then NaN).
        sc = lax.optimization_barrier(sc)
        keep = valid[:, None, None] & okt[..., None]
        p = jnp.where(keep, jnp.exp(sc - lt[..., None]), 0.0)          # [B, K, G, bq, bk]
        dvt = dvt + jnp.einsum("bkgqs,bqkgh->bskh", p.astype(v.dtype), dot, precision=prec,
                               preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqkgh,bskh->bkgqs", dot, vt, precision=prec,
                        preferred_element_type=jnp.float32)
        ds_type = base.ds_dtype(q.dtype)
        ds = jnp.where(keep, base.capped_grad(p * (dp - dt[..., None]), sc, spec),
                       0.0).astype(ds_type)
        dkt = dkt + spec.scale * jnp.einsum("bkgqs,bqkgh->bskh", ds, qt.astype(ds_type),
                                            precision=prec,
                                            preferred_element_type=jnp.float32)
        dq_t = spec.scale * jnp.einsum("bkgqs,bskh->bqkgh", ds, kt.astype(ds_type),
                                       precision=prec, preferred_element_type=jnp.float32)
        dq = lax.dynamic_update_slice_in_dim(dq, _slice(dq, i * bq, bq, 1) + dq_t, i * bq, 1)
        return dq, dkt, dvt

      return lax.cond(jnp.any(valid), compute, lambda c: c, inner)

    zeros_k = base.filled((b, bk, kh, h), 0.0, refs)
    zeros_v = base.filled((b, bk, kh, hv), 0.0, refs)
    dq, dkt, dvt = lax.fori_loop(0, nq, q_step, (dq, zeros_k, zeros_v))
    dk = lax.dynamic_update_slice_in_dim(dk, dkt, j * bk, 1)
    dv = lax.dynamic_update_slice_in_dim(dv, dvt, j * bk, 1)
    return dq, dk, dv

  init = (base.filled((b, t, kh, g, h), 0.0, refs),
          base.filled((b, s, kh, h), 0.0, refs),
          base.filled((b, s, kh, hv), 0.0, refs))
  dq, dk, dv = lax.fori_loop(0, nk, kv_tile, init)
  return dq.reshape(b, t, n, h), dk, dv
