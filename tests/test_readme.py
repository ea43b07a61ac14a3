"""The README's Python examples run as written, on 8 CPU devices, and give the oracle's answer.

Only their sizes change (65536 tokens become 256, bfloat16 zeros become random float32, so
that a wrong answer shows); the names they take from the surrounding text (sinks, lengths,
x, layer, the caches) are made here. Each statement that computes attention is checked.
"""

from __future__ import annotations

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import helpers
import oracle

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def blocks() -> list[str]:
  return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def statements(block: str) -> list[str]:
  """The block cut before each line that assigns `out` (comments stay with what follows)."""
  parts, current = [], []
  for line in block.splitlines():
    if line.startswith("out =") and any(not l.startswith("#") for l in current):
      parts.append("\n".join(current))
      current = []
    current.append(line)
  return parts + ["\n".join(current)]


def changed(text: str, old: str, new: str) -> str:
  assert old in text, f"the README's example no longer has {old!r}: update this test"
  return text.replace(old, new)


def close(got, want):
  assert helpers.max_err(got, want) <= helpers.fp32_tol(want)


def test_readme_examples_run_and_match_the_oracle():
  examples = blocks()
  assert len(examples) == 7, "a README example was added or removed: run it here"
  rng = np.random.default_rng(0)

  def normal(shape, dtype="float32"):
    return jnp.asarray(rng.normal(size=shape), dtype)

  # 1. the quick start: ring_attention, its residual and its gradients
  ns = {"normal": normal}
  first = changed(examples[0], "65536", "256")
  first = changed(first, "jax.numpy.zeros(", "normal(")
  first = changed(first, '"bfloat16"', '"float32"')
  exec(first, ns)  # pylint: disable=exec-used
  q, k, v, mesh, seq = (ns[name] for name in ("q", "k", "v", "mesh", "seq"))
  want, want_lse = oracle.attention(q, k, v, causal=True)
  close(ns["out"], want)
  close(ns["lse"], want_lse)
  want_grads = jax.grad(lambda *a: oracle.attention(*a)[0].sum(), argnums=(0, 1, 2))(q, k, v)
  for name, ref in zip(("dq", "dk", "dv"), want_grads):
    close(ns[name], ref)

  # 2. the vocabulary of real models, statement by statement
  B, T, N, K = (ns[name] for name in ("B", "T", "N", "K"))
  lengths = jnp.asarray([200], jnp.int32)
  sinks = normal((N,))
  q_192, k_192, v_128 = (jax.device_put(normal(shape), seq) for shape in (
      (B, T, N, 192), (B, T, K, 192), (B, T, K, 128)))
  ns.update(sinks=sinks, lengths=lengths, q_192=q_192, k_192=k_192, v_128=v_128)
  short = 250    # divides by no ring of 8 (nor by 2P)
  vocabulary = changed(examples[1], ":1000]", f":{short}]")
  expected = [
      oracle.attention(q, k, v, causal=True, sinks=sinks)[0],
      oracle.attention(q, k, v, causal=True, softcap=50.0)[0],
      oracle.attention(q_192, k_192, v_128, causal=True)[0],
      oracle.attention(q, k, v, q_lengths=lengths, kv_lengths=lengths)[0],
      oracle.attention(q, k, v)[0][0],
      oracle.attention(q[:, :short], k[:, :short], v[:, :short])[0],
  ]
  parts = statements(vocabulary)
  assert len(parts) == len(expected), "the vocabulary example changed: update this test"
  for part, ref in zip(parts, expected):
    exec(part, ns)  # pylint: disable=exec-used
    assert ns["out"].shape == ref.shape, part
    close(ns["out"], ref)

  # 3. Flax: the module with ring attention against the same module with its own
  from flax import nnx  # pylint: disable=g-import-not-at-top
  x = jax.device_put(normal((2, 64, 2048)), seq)
  ns.update(nnx=nnx, x=x)
  exec(examples[2].replace("from flax import nnx\n", ""), ns)  # pylint: disable=exec-used
  plain = nnx.MultiHeadAttention(num_heads=16, in_features=2048, decode=False,
                                 rngs=nnx.Rngs(0))
  close(ns["y"], plain(jax.device_get(x), mask=nnx.make_causal_mask(jnp.ones((2, 64)))))

  # 4. rematerialization with the residual names: gradients as without it
  def layer(q, k, v):
    return ns["ringflash"].ring_attention(q, k, v, mesh=mesh, is_causal=True)

  ns["layer"] = layer
  exec(examples[3], ns)  # pylint: disable=exec-used
  grads = jax.grad(lambda *a: ns["layer"](*a).sum(), argnums=(0, 1, 2))(q, k, v)
  refs = jax.grad(lambda *a: oracle.attention(*a, causal=True)[0].sum(), argnums=(0, 1, 2))(
      q, k, v)
  for got, ref in zip(grads, refs):
    close(got, ref)

  # 5. the zigzag layout, there and back
  exec(examples[4], ns)  # pylint: disable=exec-used
  close(ns["out"], want)

  # 6. decode_attention over a sequence-sharded cache
  replicated = NamedSharding(mesh, P())
  q1 = jax.device_put(normal((B, 1, N, ns["H"])), replicated)
  ns.update(q=q1, key_cache=k, value_cache=v, lengths=lengths)
  exec(examples[5], ns)  # pylint: disable=exec-used
  close(ns["out"], oracle.attention(q1, k, v, kv_lengths=lengths)[0])

  # 7. a KVCache: prefill, then one jitted step that appends a token and attends
  k1, v1 = (jax.device_put(normal((B, 1, K, ns["H"])), replicated) for _ in range(2))
  ns.update(jnp=jnp, functools=functools, max_len=128 * mesh.size, k=k, v=v)
  exec(changed(examples[6], "jnp.bfloat16", "jnp.float32"), ns)  # pylint: disable=exec-used
  _, got = ns["step"](ns["cache"], k1, v1, q1)
  close(got, oracle.attention(q1, jnp.concatenate([k, k1], 1), jnp.concatenate([v, v1], 1))[0])
