"""A quick screen of the Pallas GPU kernels before a benchmark: forward and gradients of
ring_attention (backend pallas_gpu, one-GPU mesh) against an fp32 dense reference, next to
a peer implementation's error against the same reference, bf16, causal and not, MHA, GQA
and MQA:
  - at H = 128, T = 1024-4096: the reference of `ringflash demo` (ringflash/reference.py),
    the peer cuDNN;
  - a soft-capped case (cap 30, H = 128) and an MLA case (H = 192, Hv = 128), which that
    reference and jax.nn's cuDNN path do not compute: the reference is the dense attention
    below, written from the definition in fp32 at HIGHEST precision, and the peer is the
    same dense attention computed in bf16 (the "plain bf16 implementation" of
    FlashAttention's criterion, as the tests use).

Passes when, in every case and for each of o, dq, dk and dv, our max abs error is at most
3x the peer's (floored at 1e-3). It compiles in seconds, so a kernel variant can be screened
and then benchmarked in one device call (scripts/gpu_variants.sh); the conformance tests
(tests/test_pallas_gpu.py) remain the standard. Run from the repository root on a Hopper
GPU: `python3 scripts/gpu_screen.py`; exit status 0 when it passes.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import ringflash
from ringflash import reference

# T, N, K, causal, H, Hv, soft-cap
CASES = [(2048, 4, 4, False, 128, 128, None), (2048, 4, 4, True, 128, 128, None),
         (4096, 8, 2, True, 128, 128, None), (1024, 4, 1, False, 128, 128, None),
         (2048, 4, 2, True, 128, 128, 30.0),          # soft-cap: fused Mosaic backward
         (2048, 4, 1, True, 192, 128, None)]          # MLA: Triton backward, 128 + 64 / 128
LIMIT = 3.0


def _with_grads(f, q, k, v, do):
  def g(q, k, v):
    out, vjp = jax.vjp(f, q, k, v)
    return (out,) + vjp(do.astype(out.dtype))
  return [np.asarray(x, np.float32) for x in jax.jit(g)(q, k, v)]


def _dense(q, k, v, causal, softcap, upcast):
  """Dense attention from the definition, with a soft-cap and Hv != H: q [B, T, N, H],
  k [B, S, K, H], v [B, S, K, Hv]; fp32 at HIGHEST precision (upcast) or in bf16."""
  if upcast:
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  n, kh, h = q.shape[2], k.shape[2], q.shape[3]
  k, v = jnp.repeat(k, n // kh, axis=2), jnp.repeat(v, n // kh, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * jnp.asarray(h ** -0.5,
                                                                             q.dtype)
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  if causal:
    t, sk = s.shape[-2], s.shape[-1]
    s = jnp.where(jnp.arange(sk)[None, :] <= jnp.arange(t)[:, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", p.astype(v.dtype), v, precision="highest")


def main():
  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  worst = 0.0
  for t, n, kh, causal, h, hv, softcap in CASES:
    seed = t + n + kh + causal + (h - 128) + (softcap is not None)   # H = 128: as before
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (1, t, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, t, kh, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, t, kh, hv), jnp.bfloat16)
    do = jax.random.normal(keys[3], (1, t, n, hv), jnp.bfloat16)
    ours = _with_grads(lambda q, k, v: ringflash.ring_attention(
        q, k, v, mesh=mesh, is_causal=causal, backend="pallas_gpu", logits_soft_cap=softcap),
                       q, k, v, do)
    if softcap is None and hv == h:
      peer_name = "cuDNN"
      peer = _with_grads(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn"), q, k, v, do)
      ref = _with_grads(lambda q, k, v: reference.dense_attention(q, k, v, causal, chunk=t),
                        q, k, v, do)
    else:
      peer_name = "dense bf16"
      peer = _with_grads(lambda q, k, v: _dense(q, k, v, causal, softcap, upcast=False),
                         q, k, v, do)
      ref = _with_grads(lambda q, k, v: _dense(q, k, v, causal, softcap, upcast=True),
                        q, k, v, do)
    err_ours = [float(np.max(np.abs(a - r))) for a, r in zip(ours, ref)]
    err_peer = [float(np.max(np.abs(a - r))) for a, r in zip(peer, ref)]
    ratio = max(e / max(c, 1e-3) for e, c in zip(err_ours, err_peer))
    worst = max(worst, ratio)
    print(f"T={t} N={n} K={kh} causal={causal} H={h} Hv={hv} softcap={softcap}: max abs "
          "error (o, dq, dk, dv) ours " + " ".join(f"{e:.2e}" for e in err_ours)
          + f" | {peer_name} " + " ".join(f"{e:.2e}" for e in err_peer)
          + f" | ours/{peer_name} {ratio:.2f}", flush=True)
  print("SCREEN", "PASS" if worst <= LIMIT else "FAIL", f"worst ratio {worst:.2f}")
  return 0 if worst <= LIMIT else 1


if __name__ == "__main__":
  sys.exit(main())
