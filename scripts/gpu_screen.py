"""A quick screen of the Pallas GPU kernels before a benchmark: forward and gradients of
ring_attention (backend pallas_gpu, one-GPU mesh) and of cuDNN, each against the fp32 dense
reference of `ringflash demo` (ringflash/reference.py), at T = 1024-4096, H = 128, bf16,
causal and not, MHA, GQA and MQA.

Passes when, in every case and for each of o, dq, dk and dv, our max abs error is at most
3x cuDNN's (floored at 1e-3). It compiles in seconds, so a kernel variant can be screened
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

CASES = [(2048, 4, 4, False), (2048, 4, 4, True), (4096, 8, 2, True), (1024, 4, 1, False)]
LIMIT = 3.0


def _with_grads(f, q, k, v, do):
  def g(q, k, v):
    out, vjp = jax.vjp(f, q, k, v)
    return (out,) + vjp(do.astype(out.dtype))
  return [np.asarray(x, np.float32) for x in jax.jit(g)(q, k, v)]


def main():
  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  worst = 0.0
  for t, n, kh, causal in CASES:
    keys = jax.random.split(jax.random.key(t + n + kh + causal), 4)
    q = jax.random.normal(keys[0], (1, t, n, 128), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, t, kh, 128), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, t, kh, 128), jnp.bfloat16)
    do = jax.random.normal(keys[3], (1, t, n, 128), jnp.bfloat16)
    ours = _with_grads(lambda q, k, v: ringflash.ring_attention(
        q, k, v, mesh=mesh, is_causal=causal, backend="pallas_gpu"), q, k, v, do)
    cudnn = _with_grads(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"), q, k, v, do)
    ref = _with_grads(lambda q, k, v: reference.dense_attention(q, k, v, causal, chunk=t),
                      q, k, v, do)
    err_ours = [float(np.max(np.abs(a - r))) for a, r in zip(ours, ref)]
    err_cudnn = [float(np.max(np.abs(a - r))) for a, r in zip(cudnn, ref)]
    ratio = max(e / max(c, 1e-3) for e, c in zip(err_ours, err_cudnn))
    worst = max(worst, ratio)
    print(f"T={t} N={n} K={kh} causal={causal}: max abs error (o, dq, dk, dv) ours "
          + " ".join(f"{e:.2e}" for e in err_ours) + " | cuDNN "
          + " ".join(f"{e:.2e}" for e in err_cudnn) + f" | ours/cuDNN {ratio:.2f}", flush=True)
  print("SCREEN", "PASS" if worst <= LIMIT else "FAIL", f"worst ratio {worst:.2f}")
  return 0 if worst <= LIMIT else 1


if __name__ == "__main__":
  sys.exit(main())
