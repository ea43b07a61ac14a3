"""scripts/random_check.py: its cases pass on the xla backend, and it catches wrong results
(a scaled output, a shifted key position, NaN reaching rows that do not see it, a row that
saw NaN made finite) that a backend could give."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import pytest

import helpers
import ringflash
from ringflash.kernels import xla

random_check = helpers.load_script("random_check")

# An api case on a ring of 4 with most features at once, and a kernel hop whose keys lie
# partly after the queries.
API = random_check.Case(
    kind="api", ring_size=4, strategy="ring", layout="zigzag", bidirectional=False, h=16,
    hv=8, t=64, s=64, n=4, kh=2, lead=(2,), dtype="float32", causal=True, window=(12, 0),
    segments=True, lengths=True, sinks=True, softcap=5.0, q_scale=4.0, scale=None,
    poison=None, poison_value=math.nan, seed=7)
HOP = dataclasses.replace(API, kind="hop", ring_size=1, layout="contiguous", t=32, s=128,
                          lengths=False, sinks=False, window=None, seed=11)


def _checker():
  return random_check._Checker("xla")  # pylint: disable=protected-access


def test_cases_pass_on_xla(capsys):
  assert random_check.main(["--backend=xla", "--cases=4", "--seed=1"]) == 0
  assert "4 passed, 0 failed, 0 refused" in capsys.readouterr().out


@pytest.mark.parametrize("case", [API, HOP, dataclasses.replace(API, poison="k"),
                                  dataclasses.replace(API, poison="v", dtype="bfloat16",
                                                      poison_value=math.inf)],
                         ids=["api", "hop", "k-nan", "v-inf-bf16"])
def test_a_right_case_passes(case):
  checker = _checker()
  assert (checker.hop(case) if case.kind == "hop" else checker.api(case)) == []


def _wrapped(monkeypatch, change):
  """ring_attention as the checker calls it, its (out, lse) passed through `change`."""
  real = ringflash.ring_attention
  monkeypatch.setattr(ringflash, "ring_attention",
                      lambda q, k, v, **kw: change(q, k, v, *real(q, k, v, **kw)))


def test_a_scaled_output_fails(monkeypatch):
  _wrapped(monkeypatch, lambda q, k, v, out, lse: (out * 1.001, lse))
  fails = _checker().api(API)
  assert fails and fails[0].startswith("out: error"), fails


def test_a_shifted_key_position_fails(monkeypatch):
  real = xla.forward
  monkeypatch.setattr(xla, "forward", lambda q, k, v, qp, kp, *a: real(q, k, v, qp, kp + 1,
                                                                         *a))
  fails = _checker().hop(dataclasses.replace(HOP, causal=True))
  assert fails and fails[0].startswith("hop"), fails


def test_nan_reaching_rows_that_do_not_see_it_fails(monkeypatch):
  # a NaN anywhere in k reaches every row
  _wrapped(monkeypatch, lambda q, k, v, out, lse: (out + 0 * jnp.sum(k), lse))
  fails = _checker().api(dataclasses.replace(API, poison="k"))
  assert fails and "rows that do not see it" in fails[0], fails


def test_a_row_that_saw_nan_made_finite_fails(monkeypatch):
  _wrapped(monkeypatch, lambda q, k, v, out, lse: (jnp.nan_to_num(out), lse))
  fails = _checker().api(dataclasses.replace(API, poison="v"))
  assert fails and "rows that see it are finite" in fails[0], fails
