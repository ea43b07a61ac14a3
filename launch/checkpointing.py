"""Checkpoints of a training run: orbax CheckpointManager, asynchronous saves, verified restore.

A checkpoint of step s holds the state *after* s steps: parameters, optimizer state, the step,
the RNG key, and (as JSON) the data stream position and a fingerprint of every array. Saves
are asynchronous: `save` returns once the arrays are copied off the devices, and the write
proceeds in the background. Orbax writes each step into a temporary directory
(`<step>.orbax-checkpoint-tmp-*`) and renames it to `<step>` only once complete, so a run
killed mid-save leaves a temporary directory and the previous step intact.

Restore walks the steps from the newest down and takes the first one that is complete and
verified:
  * temporary (partial) directories are never loaded; each one is reported by step;
  * a `<step>` directory whose metadata the caller refuses (another run configuration), that
    fails to load, whose arrays do not match the fingerprints saved with them (a corrupted
    file), or whose contents the caller refuses once loaded (the state of another step, in a
    folder copied under the wrong name), is skipped with a message naming the step;
and restores the arrays directly into the target shardings (the caller's abstract state),
which may belong to a different mesh than the one that saved them. When complete steps exist
but none of them restores, restore raises NoUsableCheckpointError naming each step and why.

Orbax saves only steps after the newest complete one it sees, so complete steps newer than
the restored one (skipped: unusable) would make every later save of the resumed run a silent
no-op. `move_aside` renames them to `<step>.unusable` (which neither orbax nor
`partial_steps` reads as a step), kept for inspection.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

_PARTIAL = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")
_STEP = re.compile(r"^(\d+)$")
UNUSABLE_SUFFIX = ".unusable"
# What loading a damaged or foreign step raises (besides orbax's plain Exception).
_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError)


def finalized_steps(directory: str) -> list[int]:
  """Steps with a finalized `<step>` folder in `directory` (as orbax names a complete save;
  not verified), newest first; [] when the directory does not exist. Reads the file system
  only: no orbax manager, no device."""
  if not os.path.isdir(directory):
    return []
  return sorted((int(name) for name in os.listdir(directory)
                 if _STEP.match(name) and os.path.isdir(os.path.join(directory, name))),
                reverse=True)


def fingerprint(tree) -> dict[str, int]:
  """Per-leaf fingerprint of the bits: the sum of the leaf's words, modulo 2**32.

  A word is one element's bit pattern read as an unsigned integer of the element's own width
  (a bfloat16 0.5 is the word 0x3F00 = 16128, not the value 0), zero-extended to 32 bits; an
  8-byte element counts as its two 32-bit halves. Two arrays whose bits differ in one element
  have different fingerprints. An integer sum is associative, so the value is exact and
  independent of the sharding the leaf has, on any mesh.

  Returns:
    {leaf path: int}.

  Raises:
    ValueError: a leaf whose elements are not 1, 2, 4 or 8 bytes wide (int4, complex).
  """
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  for path, leaf in leaves:
    dtype = jnp.dtype(leaf.dtype if hasattr(leaf, "dtype") else jnp.asarray(leaf).dtype)
    if dtype != jnp.bool_ and (dtype.itemsize not in _WORDS or dtype.kind == "c"):
      raise ValueError(f"fingerprint of {jax.tree_util.keystr(path)}: dtype {dtype} is not "
                       f"supported (elements of 1, 2, 4 or 8 bytes, not complex)")
  sums = _word_sums([leaf for _, leaf in leaves])
  return {jax.tree_util.keystr(path): int(s) for (path, _), s in zip(leaves, sums)}


# element width in bytes -> the unsigned type its bits are read as (8 bytes: two uint32 halves)
_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


@jax.jit
def _word_sums(leaves):
  def words(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
      return x.astype(jnp.uint32)               # False/True: the bytes 0 and 1
    # A bitcast, not astype: astype converts the value (bfloat16 0.5 and 0.25 both become 0).
    # 8 bytes -> uint32 adds a trailing axis of the two halves.
    bits = jax.lax.bitcast_convert_type(x, _WORDS[x.dtype.itemsize])
    return bits.astype(jnp.uint32)              # zero-extends the unsigned word
  return [jnp.sum(words(x), dtype=jnp.uint32) for x in leaves]


class NoUsableCheckpointError(Exception):
  """Complete checkpoints exist, but none of them restores. The message names each step and
  why; what that means for the run (train refuses to start at step 0 over them) is the
  caller's to add.

  Attributes:
    directory: the checkpoint directory.
    tried: (step, why it was skipped), newest first.
  """

  def __init__(self, directory: str, tried: list[tuple[int, str]]):
    self.directory = directory
    self.tried = tried
    reasons = "; ".join(f"step {step}: {why}" for step, why in tried)
    super().__init__(f"none of the {len(tried)} complete checkpoint(s) in {directory} "
                     f"restores ({reasons})")


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restored checkpoint: the state pytree (in the target shardings) and its JSON metadata.

  Attributes:
    skipped: the complete steps newer than `step` that were tried and refused, newest first
      (see Checkpoints.move_aside).
  """

  step: int
  state: Any
  meta: dict
  skipped: tuple[int, ...] = ()


class Checkpoints:
  """Saves every `save_every` steps, keeps the newest `keep`, restores the newest good one.

  Args:
    directory: where step directories live (created if missing).
    save_every: save when step % save_every == 0.
    keep: how many complete checkpoints to keep.
    async_save: write in the background (default); False blocks in `save`.
    log: where messages go (skipped steps), default print.
  """

  def __init__(self, directory: str, *, save_every: int, keep: int, async_save: bool = True,
               log: Callable[[str], None] = print):
    if save_every < 1 or keep < 1:
      raise ValueError(f"save_every and keep must be >= 1, got {save_every=}, {keep=}")
    self.directory = os.path.abspath(directory)
    self._log = log
    self.save_every = save_every
    # The interval is applied here (orbax would also save the first step it sees).
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=1, max_to_keep=keep,
        enable_async_checkpointing=async_save, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
    """Starts saving `state` (a pytree of arrays) and `meta` (JSON) as step `step`.

    Does nothing unless step is a multiple of save_every or `force` (a save on a preemption
    notice). The fingerprints of the arrays are computed now and stored in the metadata
    under "fingerprint".

    Returns:
      True if a save was started. False also when the step is due (or forced) but orbax
      refuses it: it saves only steps after the newest one it holds (latest_step).
    """
    if step % self.save_every and not force:
      return False
    meta = dict(meta, fingerprint=fingerprint(state))
    return self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def wait(self) -> None:
    """Blocks until the save in flight (if any) is complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def latest_step(self) -> int | None:
    """The newest step orbax holds (complete, or being saved by this manager), or None."""
    return self._manager.latest_step()

  def complete_steps(self) -> list[int]:
    """Steps with a finalized directory, newest first (not yet verified)."""
    self._manager.reload()
    return sorted(self._manager.all_steps(), reverse=True)

  def partial_steps(self) -> list[int]:
    """Steps whose directory is a leftover temporary (an interrupted save), newest first."""
    if not os.path.isdir(self.directory):
      return []
    found = {int(m.group(1)) for name in os.listdir(self.directory)
             if (m := _PARTIAL.match(name))}
    return sorted(found, reverse=True)

  def move_aside(self, steps) -> list[tuple[int, str]]:
    """Renames the complete step folders `steps` to `<step>.unusable` (`-2`, `-3`, ... added
    when that name exists), so that orbax's newest step is the one restored and the resumed
    run's saves start; then reloads orbax. Each move is logged with where the folder went.

    In a job of several processes only process 0 renames; every process must call this at
    the same point (it ends with a barrier, after which all of them see the new folders).

    Returns:
      (step, new path) of each folder moved (on process 0; [] elsewhere).
    """
    moved = []
    if jax.process_index() == 0:
      for step in steps:
        source = os.path.join(self.directory, str(step))
        target = source + UNUSABLE_SUFFIX
        n = 1
        while os.path.exists(target):
          n += 1
          target = f"{source}{UNUSABLE_SUFFIX}-{n}"
        os.rename(source, target)
        moved.append((step, target))
        self._log(f"checkpoint: moved unusable step {step} aside, to {target} (newer than "
                  f"the step restored, it would stop every later save)")
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("ringflash_checkpoints_moved_aside")
    self._manager.reload()
    return moved

  def restore_latest(self, abstract_state,
                     check_meta: Callable[[dict], str | None] | None = None,
                     check_restored: Callable[[int, Any, dict], str | None] | None = None,
                     ) -> Restored | None:
    """The newest complete, verified checkpoint, restored into `abstract_state`'s shardings.

    Args:
      abstract_state: pytree of jax.ShapeDtypeStruct with `sharding` set (the target layout),
        same structure as the saved state.
      check_meta: called with a step's JSON metadata before its arrays are read; returns why
        the step cannot be resumed (e.g. saved by another run configuration), or None.
      check_restored: called with (the folder's step, the restored and verified state, the
        metadata); returns why the step cannot be resumed (e.g. the folder holds the state of
        another step), or None.

    Returns:
      Restored, or None when there is no complete checkpoint (partial ones are reported).

    Raises:
      NoUsableCheckpointError: complete checkpoints exist but none restores; every one
        tried is named with the reason.
    """
    complete = set(self.complete_steps())
    for step in self.partial_steps():
      if step not in complete:
        self._log(f"checkpoint: skipping step {step}: partial save "
                  f"(temporary directory of an interrupted write) in {self.directory}")
    tried = []
    for step in sorted(complete, reverse=True):
      restored, problem = self._try_restore(step, abstract_state, check_meta, check_restored)
      if restored is not None:
        return dataclasses.replace(restored, skipped=tuple(s for s, _ in tried))
      self._log(f"checkpoint: skipping step {step}: {problem}")
      tried.append((step, problem))
    if tried:
      raise NoUsableCheckpointError(self.directory, tried)
    return None

  def _try_restore(self, step: int, abstract_state, check_meta,
                   check_restored) -> tuple[Restored | None, str]:
    step_dir = os.path.join(self.directory, str(step))
    meta_file = os.path.join(step_dir, "meta", "metadata")
    try:
      with open(meta_file) as f:
        meta = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
      return None, f"unreadable metadata {meta_file}: {err}"
    expected = meta.get("fingerprint") if isinstance(meta, dict) else None
    if not isinstance(expected, dict):
      return None, f"metadata {meta_file} has no array fingerprints"
    problem = check_meta(meta) if check_meta is not None else None
    if problem:
      return None, problem
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))
    except Exception as err:  # pylint: disable=broad-except
      # orbax wraps TensorStore's read errors (a damaged data file) in a plain Exception:
      # those and the errors of reading files skip the step; anything else is a bug, raised.
      if type(err) is not Exception and not isinstance(err, _LOAD_ERRORS):
        raise
      first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
      return None, f"cannot be loaded ({type(err).__name__}: {first[:300]})"
    state = out["state"]
    got = fingerprint(state)
    bad = sorted(k for k in set(expected) | set(got) if expected.get(k) != got.get(k))
    if bad:
      return None, (f"arrays differ from the fingerprints saved with them (corrupted): "
                    f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")
    problem = check_restored(step, state, meta) if check_restored is not None else None
    if problem:
      return None, problem
    return Restored(step=step, state=state, meta=meta), ""

