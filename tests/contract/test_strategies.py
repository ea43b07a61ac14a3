"""Every strategy (all-gather, Ulysses, hybrid) through the contract cases, on the xla
backend: the same cases, oracle and tolerances as tests/contract/base.py. The ring's own
cases are the backends' subclasses (test_xla.py, ...); here a subset of them runs once per
other strategy, so that each strategy meets every mask, layout and piece of vocabulary.

Hybrid runs on 2-D meshes: P devices as (P / 2, 2), the all-to-all over the second axis and
the ring over the first. Ulysses needs the N = 4 query heads to divide over the devices, so
its rings of 8 run on 4 devices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import ringflash

from contract import base
from contract import test_xla

STRATEGY_RING_CASES = [c for c in base.RING_CASES if c.name in (
    "gqa-causal-seg-P8", "mqa-seg-P4", "cross-causal-T<S-P4", "zigzag-causal-P8",
    "striped-causal-seg-P4", "window-spanning-seg-P8", "low-precision-gqa-causal-P4")]
STRATEGY_VOCAB_CASES = [c for c in base.VOCAB_CASES if c.name in (
    "sinks-softcap-window-zigzag-P4", "uneven-seg-P8", "batch-dims-2x2-P2",
    "zigzag-uneven-sinks-seg-P4")]
SLOW_STRATEGY_VOCAB_CASES = [c for c in base.VOCAB_CASES if c.name in (
    "mla-192-128-P2", "everything-P4", "lengths-P4")]


class _Strategy(test_xla.TestXla):
  """The xla contract with another strategy (not collected: the tests below drive it)."""

  __test__ = False

  def __init__(self, strategy: str):
    self.strategy = strategy

  def options(self):
    if self.strategy == "hybrid":
      return {"strategy": "hybrid", "axis_name": ("ring", "ulysses")}
    return {"strategy": self.strategy}

  def mesh(self, ring_size):
    devices = np.array(jax.devices()[:ring_size])
    if self.strategy == "hybrid":
      u = 2 if ring_size % 2 == 0 else 1
      return Mesh(devices.reshape(ring_size // u, u), ("ring", "ulysses"))
    return Mesh(devices, ("sp",))

  def adapt(self, case):
    if self.strategy != "hybrid":     # bidirectional is a schedule of the ring (refused here)
      case = dataclasses.replace(case, bidirectional=False)
    if self.strategy == "ulysses":
      return dataclasses.replace(case, ring_size=min(case.ring_size, base.N))
    return case


STRATEGIES = ["allgather", "ulysses", "hybrid"]


@pytest.mark.parametrize("case", STRATEGY_RING_CASES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ring_cases(strategy, case):
  _Strategy(strategy)._check_case(case)   # pylint: disable=protected-access


@pytest.mark.parametrize("case", STRATEGY_VOCAB_CASES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vocabulary_cases(strategy, case):
  _Strategy(strategy)._check_vocab(case)   # pylint: disable=protected-access


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_STRATEGY_VOCAB_CASES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vocabulary_cases_slow(strategy, case):
  _Strategy(strategy)._check_vocab(case)   # pylint: disable=protected-access


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_error_does_not_grow_with_ring_size(strategy):
  _Strategy(strategy).test_error_does_not_grow_with_ring_size()


@pytest.mark.parametrize("where", ["q", "q-inf-softcap", pytest.param("v", marks=pytest.mark.slow)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nonfinite_rule(strategy, where):
  if where == "q-inf-softcap":     # the strategy's own forward guards the query too
    _Strategy(strategy).test_nonfinite_values_a_row_sees_reach_it("q", 2.0, False, np.inf)
    return
  _Strategy(strategy).test_nonfinite_values_a_row_sees_reach_it(where, None, False, np.nan)
  _Strategy(strategy).test_nonfinite_values_a_row_does_not_see_never_reach_it(where, None, False)


@pytest.mark.parametrize("strategy,options,n,k,mesh_axes,says", [
    ("allgather", dict(bidirectional=True), 4, 2, ("sp",), "bidirectional=True.*'allgather'"),
    ("ulysses", dict(bidirectional=True), 4, 2, ("sp",), "bidirectional=True.*'ulysses'"),
    # 12 striped tokens on 4 devices: an odd local length, but no ring to split it for
    ("allgather", dict(bidirectional=True, layout="striped", t=12), 4, 2, ("sp",),
     "bidirectional=True.*'allgather'"),
    ("ulysses", {}, 6, 2, ("sp",), "N=6 query heads"),
    ("hybrid", {}, 4, 2, ("sp",), "'hybrid' needs axis_name to be a tuple"),
    ("hybrid", {}, 3, 1, ("r", "u"), "'hybrid' shards the N=3 query heads over the 2 devices "
     "of the last axis"),
])
def test_what_a_strategy_cannot_run_is_not_implemented_naming_it(strategy, options, n, k,
                                                                  mesh_axes, says):
  """Refused before anything runs, with the strategy's reason (never another strategy)."""
  mesh = Mesh(np.array(jax.devices()[:4]).reshape((4,) if len(mesh_axes) == 1 else (2, 2)),
              mesh_axes)
  options = dict(options)
  t = options.pop("t", 16)
  q, kv = jnp.zeros((1, t, n, 8)), jnp.zeros((1, t, k, 8))
  axis_name = mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
  with pytest.raises(NotImplementedError, match=says):
    jax.jit(lambda q, kv: ringflash.ring_attention(
        q, kv, kv, mesh=mesh, axis_name=axis_name, strategy=strategy, **options)).lower(q, kv)
