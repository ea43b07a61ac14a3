"""Synthetic long-range key -> value retrieval, generated deterministically from (seed, step).

A sequence of length T has two halves:

  store   [0, T/2):  random filler tokens, and *pair* tokens at random positions: one token id
                     stands for (key k, value v). A sequence stores `num_pairs` pairs with
                     distinct keys and values drawn at random per sequence, each pair at
                     `num_copies` random positions.
  queries [T/2, T):  fillers, and `num_queries` query tokens at random positions: the query
                     token of key k (one id per stored key asked, drawn with replacement). The
                     target of a query position is the value token of v, the answer.

Worked example, T = 4096, num_values = 8: the store holds the pair token of (key 5, value 3)
at positions 611 and 1730 (two copies); position 3377 holds the query token of key 5, and its
target is the value token of 3. Value tokens never appear as inputs and the values are random
per sequence, so nothing after the store reveals the answer: the query must attend more than
1600 tokens back to a pair token with its key. One attention layer suffices (the query token's
projection matches the key half of the pair tokens; the value half is copied to the output),
so learning starts early, while the distance from a query to its pairs is thousands of tokens.

Loss and accuracy are taken at query positions only (weights 1 there, 0 elsewhere): fillers
are random and carry no signal. Chance accuracy is 1 / num_values; a model that attends to
the pairs without matching their keys can reach about 1 / num_pairs at best.

Vocabulary, in this order (F fillers, K keys, V values):
  fillers [0, F),  pairs [F, F + K*V) with id F + k*V + v,  queries [F + K*V, F + K*V + K),
  values [F + K*V + K, F + K*V + K + V).

Every batch is a pure function of (seed, step): restoring the step restores the stream, and
any process can build any part of the global batch (`batch(rows=...)`); the training job
builds the whole batch on every process and places each process's rows from it.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Shape of the retrieval task.

  Attributes:
    seq_len: tokens per sequence (T), even.
    num_keys: distinct keys (K); there are K query ids and K * V pair ids.
    num_values: distinct values (V); chance accuracy is 1 / V.
    num_pairs: pairs stored per sequence (distinct keys), at most num_keys.
    num_copies: positions each pair is stored at; num_pairs * num_copies <= T / 2. Copies
      make the first matches easier to find (a query has several targets to attend to)
      without shortening the distance from the queries to the store.
    num_queries: query tokens per sequence, at most T / 2.
    num_fillers: distinct filler token ids.
  """

  seq_len: int = 4096
  num_keys: int = 16
  num_values: int = 8
  num_pairs: int = 16
  num_copies: int = 8
  num_queries: int = 64
  num_fillers: int = 16

  def __post_init__(self):
    for name in ("seq_len", "num_keys", "num_values", "num_pairs", "num_copies",
                 "num_queries", "num_fillers"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.seq_len % 2:
      raise ValueError(f"seq_len must be even, got {self.seq_len}")
    half = self.seq_len // 2
    if self.num_pairs > self.num_keys:
      raise ValueError(f"num_pairs={self.num_pairs} must be <= num_keys={self.num_keys} "
                       f"(the keys of a sequence are distinct)")
    if self.num_pairs * self.num_copies > half:
      raise ValueError(f"num_pairs={self.num_pairs} x num_copies={self.num_copies} = "
                       f"{self.num_pairs * self.num_copies} must be <= seq_len / 2 = {half} "
                       f"(the store)")
    if self.num_queries > half:
      raise ValueError(f"num_queries={self.num_queries} must be <= seq_len / 2 = {half}")
    if self.vocab_size > MAX_VOCAB:
      # The embedding and its optimizer state grow with it: a mistyped size asked for
      # hundreds of GiB, and the job waited for an allocation that never came back.
      big = max(("num_fillers", "num_keys", "num_values"), key=lambda n: getattr(self, n))
      raise ValueError(f"{big}={getattr(self, big)} makes the vocabulary (num_fillers + "
                       f"num_keys x (num_values + 1) + num_values) {self.vocab_size} token "
                       f"ids; it must be at most 2**20 = {MAX_VOCAB}")

  @property
  def pair_base(self) -> int:
    return self.num_fillers

  @property
  def query_base(self) -> int:
    return self.pair_base + self.num_keys * self.num_values

  @property
  def value_base(self) -> int:
    return self.query_base + self.num_keys

  @property
  def vocab_size(self) -> int:
    return self.value_base + self.num_values

  @property
  def chance(self) -> float:
    return 1.0 / self.num_values

  def pair_token(self, key, value):
    """Token id of the pair (key, value); works elementwise on arrays."""
    return self.pair_base + key * self.num_values + value


MAX_VOCAB = 2**20


@dataclasses.dataclass(frozen=True)
class Batch:
  """One global batch, numpy, each [B, T]."""

  tokens: np.ndarray      # int32 inputs
  positions: np.ndarray   # int32 global token indices 0..T-1
  targets: np.ndarray     # int32 value token at query positions, 0 elsewhere
  weights: np.ndarray     # float32 1 at query positions, 0 elsewhere


def _sequence(task: TaskConfig, rng: np.random.Generator):
  t, half = task.seq_len, task.seq_len // 2
  tokens = rng.integers(0, task.num_fillers, size=t, dtype=np.int64)
  keys = rng.choice(task.num_keys, size=task.num_pairs, replace=False)
  values = rng.integers(0, task.num_values, size=task.num_pairs)
  store_pos = rng.choice(half, size=task.num_pairs * task.num_copies, replace=False)
  tokens[store_pos] = np.tile(task.pair_token(keys, values), task.num_copies)
  query_pos = half + rng.choice(t - half, size=task.num_queries, replace=False)
  asked = rng.integers(0, task.num_pairs, size=task.num_queries)
  tokens[query_pos] = task.query_base + keys[asked]
  targets = np.zeros(t, np.int64)
  targets[query_pos] = task.value_base + values[asked]
  weights = np.zeros(t, np.float32)
  weights[query_pos] = 1.0
  return tokens, targets, weights


def batch(task: TaskConfig, seed: int, step: int, batch_size: int,
          rows: slice | None = None) -> Batch:
  """The global batch of training step `step`, or some of its rows.

  Row r of step s is generated from its own stream (seed, s, r), so a process that holds
  rows 2..3 builds exactly those rows, identical to what one process would build.

  Args:
    task: the task's shape.
    seed: data seed of the run.
    step: training step (0-based); part of the checkpoint.
    batch_size: global batch size B.
    rows: which rows to build (default all).

  Returns:
    Batch with arrays [len(rows), T].
  """
  if step < 0:
    raise ValueError(f"step must be >= 0, got {step}")
  indices = range(batch_size)[rows if rows is not None else slice(None)]
  out = [_sequence(task, np.random.default_rng([seed, step, r])) for r in indices]
  tokens = np.stack([o[0] for o in out]).astype(np.int32)
  targets = np.stack([o[1] for o in out]).astype(np.int32)
  weights = np.stack([o[2] for o in out])
  positions = np.broadcast_to(np.arange(task.seq_len, dtype=np.int32), tokens.shape).copy()
  return Batch(tokens=tokens, positions=positions, targets=targets, weights=weights)
