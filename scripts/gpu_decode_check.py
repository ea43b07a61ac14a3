"""decode attention on the GPUs of this machine against a dense float32 reference (bf16 inputs).

Checks ringflash.decode_attention (strategies reduce, allgather, ring) and KVCache.attention
on a cache of 65536 tokens sharded over all local GPUs (rows of lengths 100 and 40000, so
most shards of the first row are empty), t = 1 and 2 new tokens, with and without a window of
1000: the pallas_gpu kernel with its query rows padded to 128 and split-KV runs. Criterion:
error against the float32 reference <= 2x the error of a plain bf16 dense computation
(+1e-3). Run on the GPU machine after `python3 -m pip install --no-deps --no-build-isolation .`:

  python3 scripts/gpu_decode_check.py
"""

import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ringflash
mesh = Mesh(np.array(jax.devices()), ("sp",)); seq = NamedSharding(mesh, P(None, "sp"))
B, S, N, K, H = 2, 65536, 16, 4, 128
ks = jax.random.split(jax.random.key(0), 3)
k = jax.random.normal(ks[1], (B, S, K, H), jnp.bfloat16)
v = jax.random.normal(ks[2], (B, S, K, H), jnp.bfloat16)
L = np.array([100, 40000])
def ref(q, w, up):
  outs = []
  for b in range(B):
    kk, vv, qq = jnp.repeat(k[b], N // K, 1), jnp.repeat(v[b], N // K, 1), q[b]
    if up:
      qq, kk, vv = (x.astype(jnp.float32) for x in (qq, kk, vv))
    t = q.shape[1]; qp = np.arange(L[b] - t, L[b]); kp = np.arange(S)
    s = jnp.einsum("tnh,snh->nts", qq, kk, precision="highest").astype(jnp.float32) / np.sqrt(H)
    m = (kp[None] <= qp[:, None]) & ((kp[None] >= qp[:, None] - w) if w else True)
    p = jax.nn.softmax(jnp.where(m[None], s, -jnp.inf), -1)
    outs.append(jnp.einsum("nts,snh->tnh", p.astype(vv.dtype), vv, precision="highest"))
  return jnp.stack(outs).astype(jnp.float32)
ksh, vsh = jax.device_put(k, seq), jax.device_put(v, seq)
cache = ringflash.KVCache.create(B, S, K, H, mesh=mesh).prefill(ksh, vsh)
for t in (1, 2):
  q = jax.random.normal(ks[0], (B, t, N, H), jnp.bfloat16)
  for w in (None, 1000):
    r32 = ref(q, w, True); base = float(jnp.max(jnp.abs(ref(q, w, False) - r32)))
    outs = {st: ringflash.decode_attention(q, ksh, vsh, cache_lengths=jnp.array(L), mesh=mesh,
                                           local_window_size=w, strategy=st)
            for st in ("reduce", "allgather", "ring")}
    if t == 1:
      outs["cache"] = cache.attention(q, local_window_size=w)
    for st, o in outs.items():
      e = float(jnp.max(jnp.abs(o.astype(jnp.float32) - r32)))
      print(f"t={t} w={w} {st}: err {e:.2e} plain-bf16 {base:.2e}", "ok" if e <= 2 * base + 1e-3 else "BAD")
