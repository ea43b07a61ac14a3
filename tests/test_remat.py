"""ring_attention under jax.checkpoint (rematerialization), as large models call it.

A rematerialized layer runs its forward again in the backward to rebuild what the backward
reads. For attention that is every hop and kernel of the ring (or the gathers and the
kernel), unless the policy saves the strategy's output and lse: they carry the names
ringflash.RESIDUAL_NAMES for that. Gradients must be exact under every policy; with the
names saved, the backward must hold no more collectives than the plain one, and with
nothing saved, more (the forward's, run again).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import partial_eval as pe   # jax's jaxpr DCE, which jit runs
from jax.sharding import Mesh

import helpers
import oracle
import ringflash

T, D, N, K, H = 32, 16, 4, 2, 8
NAMES = jax.checkpoint_policies.save_only_these_names(*ringflash.RESIDUAL_NAMES)
_COLLECTIVE = re.compile(r"ppermute|all_gather|all_to_all|reduce_scatter|psum\w*")
# A kernel launch: pallas_call (Pallas TPU, Triton), or the mpmd_map that Mosaic GPU's
# plgpu.kernel traces to (inside a custom_vmap_call; jax 0.11.2 and 0.12).
_KERNEL = re.compile(r"pallas_call|mpmd_map")


def _count(jaxpr, primitives: re.Pattern) -> int:
  """The equations of `jaxpr` whose primitive's name fullmatches `primitives`, nested
  jaxprs included, each as often as the equation holding it. Counted in the jaxpr, what JAX
  asks XLA to run: XLA may merge a rematerialized forward's collectives with the first
  forward's where their inputs agree, and keep its values alive instead. Walked, not read
  from the printed jaxpr: printing names a sub-jaxpr that two equations share once (call=
  jaxpr1), so a forward kernel run again under a policy prints once (seen with plgpu.kernel)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)               # a ClosedJaxpr's Jaxpr
  total = 0
  for eqn in jaxpr.eqns:
    if primitives.fullmatch(eqn.primitive.name):
      total += 1
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
          total += _count(sub, primitives)
  return total


def _step_count(loss, args, primitives: re.Pattern) -> int:
  """`primitives`' equations (_count) in one training step of `loss`, jax.value_and_grad:
  the loss is read, so the first forward is live under every policy, and a forward run
  again is one more. Dead equations are removed first, as jit removes them before lowering:
  jax 0.11.2 leaves a forward that nothing reads in the jaxpr of save_only_these_names."""
  closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))(*args)
  live, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  return _count(live, primitives)


def _mesh(strategy):
  if strategy == "hybrid":
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("r", "u")), ("r", "u")
  return helpers.mesh_of(4), "sp"


def _project(x, wq, wk, wv):
  b = x.shape[0]
  return ((x @ wq).reshape(b, T, N, H), (x @ wk).reshape(b, T, K, H),
          (x @ wv).reshape(b, T, K, H))


@pytest.mark.parametrize("strategy,backend,with_sinks", [
    ("ring", "xla", True), ("allgather", "xla", True), ("ulysses", "xla", True),
    ("ulysses", "xla", False),
    pytest.param("hybrid", "xla", True, marks=pytest.mark.slow),
    pytest.param("ring", "pallas_tpu", True, marks=pytest.mark.slow),
    pytest.param("ulysses", "pallas_tpu", True, marks=pytest.mark.slow),
    pytest.param("ring", "xla", False, marks=pytest.mark.slow)])
def test_remat_is_exact_and_the_names_spare_the_forward(strategy, backend, with_sinks):
  """A layer x [B, T, D] -> tanh(attention(x wq, x wk, x wv)) [B, T, N * H] (projections, dots
  that a policy may save or recompute, around ring_attention: causal, zigzag, GQA, with or
  without sinks) under jax.checkpoint with no policy, nothing saved, and RESIDUAL_NAMES
  saved: the gradients of x, the weights (and sinks) against the oracle's, and the
  backward's collectives."""
  mesh, axis_name = _mesh(strategy)
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((2, T, D)), jnp.float32)
  weights = tuple(jnp.asarray(rng.standard_normal((D, m * H)) / np.sqrt(D), jnp.float32)
                  for m in (N, K, K))
  sinks = (jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32),) if with_sinks else ()
  dy = jnp.asarray(rng.standard_normal((2, T, N * H)), jnp.float32)
  args = (x, *weights, *sinks)
  pos = ringflash.to_layout(np.arange(T), "zigzag", 4, axis=0)

  def layer(x, wq, wk, wv, sinks=None):
    out = ringflash.ring_attention(*_project(x, wq, wk, wv), mesh=mesh, axis_name=axis_name,
                                   is_causal=True, layout="zigzag", strategy=strategy,
                                   backend=backend, sinks=sinks)
    return jnp.tanh(out.reshape(x.shape[0], T, N * H))

  def reference(x, wq, wk, wv, sinks=None):
    out = oracle.attention(*_project(x, wq, wk, wv), causal=True, q_pos=pos, kv_pos=pos,
                           sinks=sinks)[0]
    return jnp.tanh(out.reshape(x.shape[0], T, N * H))

  def loss_of(f):
    return lambda *a: jnp.sum(f(*a) * dy)

  def grads_of(f):
    return jax.jit(jax.grad(loss_of(f), argnums=tuple(range(len(args)))))

  want = grads_of(reference)(*args)
  counts = {}
  for name, policy in [("plain", None), ("nothing", jax.checkpoint_policies.nothing_saveable),
                       ("names", NAMES)]:
    f = layer if policy is None else jax.checkpoint(layer, policy=policy)
    grads = grads_of(f)
    for g, w, what in zip(grads(*args), want, ("x", "wq", "wk", "wv", "sinks")):
      assert helpers.max_err(g, w) <= helpers.fp32_tol(w), (name, what)
    counts[name] = _step_count(loss_of(f), args, _COLLECTIVE)
  assert counts["names"] == counts["plain"], counts
  assert counts["nothing"] > counts["plain"], counts


@pytest.mark.parametrize("backend,dtype", [
    pytest.param("pallas_tpu", jnp.float32, marks=pytest.mark.skipif(
        jax.devices()[0].platform != "cpu", reason="interpreted on CPU devices")),
    pytest.param("pallas_gpu", jnp.bfloat16, marks=pytest.mark.skipif(
        not helpers.hopper_devices(), reason="needs a GPU of compute capability >= 9.0"))])
def test_the_names_spare_the_kernels_forward_on_one_device(backend, dtype):
  """On one device there is no collective to count: the kernels are. tanh(attention(q, k, v))
  (causal, GQA, sinks, the backend's dtype) on a ring of one: with the names saved the
  backward launches as many kernels as the plain one, with nothing saved more (the forward
  kernel again). The gradients under every policy, none included, meet the oracle's (fp32_tol;
  bf16: 3x a dense bf16 implementation's error). Not closer to the plain ones than that: a
  policy moves the elementwise work around the kernels (tanh's derivative, giving the
  cotangent of out) into other fusions, whose float32 roundings flip bf16 roundings of the
  cotangent and of the gradients (seen on an H100: dq off by 2^-7 at a value in [1, 2), dsinks
  by 0.3%)."""
  t, h = 256, 64
  devices = helpers.hopper_devices() if backend == "pallas_gpu" else jax.devices()
  mesh = Mesh(np.array(devices[:1]), ("sp",))
  rng = np.random.default_rng(6)
  q, k, v = (jnp.asarray(rng.standard_normal((2, t, m, h)), dtype) for m in (N, K, K))
  sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)
  dy = jnp.asarray(rng.standard_normal((2, t, N, h)), jnp.float32)
  args = (q, k, v, sinks)

  def layer(q, k, v, sinks):
    return jnp.tanh(ringflash.ring_attention(q, k, v, mesh=mesh, axis_name="sp",
                                             is_causal=True, backend=backend,
                                             sinks=sinks).astype(jnp.float32))

  def reference(q, k, v, sinks):
    return jnp.tanh(oracle.attention(q, k, v, causal=True, sinks=sinks)[0])

  def loss_of(f):
    return lambda *a: jnp.sum(f(*a) * dy)

  def grads_of(f, a):
    return jax.jit(jax.grad(loss_of(f), argnums=(0, 1, 2, 3)))(*a)

  want = grads_of(reference, tuple(x.astype(jnp.float32) for x in args))
  # a plain dense implementation in the inputs' dtype: the bound of the low-precision check
  dense = grads_of(lambda q, k, v, sinks: jnp.tanh(oracle.attention(
      q, k, v, causal=True, sinks=sinks, upcast=False)[0].astype(jnp.float32)), args)
  grads, kernels = {}, {}
  for name, policy in [("plain", None), ("nothing", jax.checkpoint_policies.nothing_saveable),
                       ("names", NAMES)]:
    f = layer if policy is None else jax.checkpoint(layer, policy=policy)
    grads[name] = grads_of(f, args)
    kernels[name] = _step_count(loss_of(f), args, _KERNEL)
  for i, what in enumerate(("q", "k", "v", "sinks")):
    bound = (helpers.fp32_tol(want[i]) if dtype == jnp.float32
             else 3 * helpers.max_err(dense[i], want[i]))
    for name, got in grads.items():
      assert helpers.max_err(got[i], want[i]) <= bound, (name, what)
  assert kernels["plain"] >= 2, kernels
  assert kernels["names"] == kernels["plain"], kernels
  assert kernels["nothing"] > kernels["plain"], kernels
