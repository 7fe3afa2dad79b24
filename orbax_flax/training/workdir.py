"""What a run's workdir holds besides the run's own steps, found before a run starts fresh.

A new run with nothing of its own to resume must not start from scratch beside
checkpoints it could have continued (:class:`orbax_flax.training.resume.Resume` asks
here):

* :class:`PreviousRun`: another library's run in the workdir (an
  orbax-checkpoint ``CheckpointManager`` directory, flax's legacy
  ``checkpoint_<N>``), which the resume continues;
* :func:`refuse_checkpoints_dir`: the slip of passing a run's
  ``<workdir>/checkpoints`` as the workdir;
* :func:`refuse_foreign_steps`: an orbax-checkpoint run in the very directory
  this run's steps would go to.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from orbax_flax.core import _location
from orbax_flax.format import _manifest
from orbax_flax import errors
from orbax_flax.format import step_dir
from orbax_flax.core._location import Location
from orbax_flax.formats import orbax_checkpoint


class PreviousRun(NamedTuple):
  """A run of another library found where a new orbax_flax run starts.

  ``kind`` is ``"orbax-checkpoint"`` (a ``CheckpointManager`` directory of
  numbered steps) or ``"flax"`` (``flax.training.checkpoints``' legacy
  ``checkpoint_<N>``: an orbax pytree directory, or a msgpack file that
  orbax_flax does not read).

  Example:
    >>> import tempfile
    >>> PreviousRun.find(tempfile.mkdtemp(), "/nonexistent/checkpoints") is None
    True
  """
  kind: str
  directory: str   # the directory that holds the steps
  steps: tuple[int, ...]
  path: str        # the newest step's checkpoint

  @property
  def step(self) -> int:
    return self.steps[-1]

  @classmethod
  def find(cls, workdir: str, directory: str) -> PreviousRun | None:
    """The other library's run in ``workdir``, ``workdir/checkpoints`` or ``directory``, if any.

    Raises:
      ValueError: ``workdir`` is itself an orbax_flax checkpoints directory (a
        run's ``<workdir>/checkpoints`` passed as the workdir).
    """
    loc = Location.parse(workdir)
    if not loc.is_local:
      refuse_checkpoints_dir(loc, directory)
      return None
    seen = []
    for candidate in (loc.local_path, os.path.join(loc.local_path, "checkpoints"), directory):
      if candidate in seen or not os.path.isdir(candidate):
        continue
      seen.append(candidate)
      ocp = orbax_checkpoint.steps(Location.parse(candidate))
      if ocp:
        return cls("orbax-checkpoint", candidate, tuple(ocp),
                   os.path.join(candidate, str(ocp[-1])))
      legacy = orbax_checkpoint.legacy_steps(Location.parse(candidate))
      if legacy:
        return cls("flax", candidate, tuple(s for s, _ in legacy),
                   os.path.join(candidate, legacy[-1][1]))
    refuse_checkpoints_dir(loc, directory)
    return None

  def description(self) -> str:
    what = ("an orbax-checkpoint run" if self.kind == "orbax-checkpoint"
            else "flax.training.checkpoints checkpoints")
    return (f"{self.directory} holds {what} (step(s) {_steps_text(self.steps)}), and nothing"
            " of orbax_flax's")

  def item(self) -> str:
    """The item of the newest step that holds the training state.

    Raises:
      CheckpointFormatError: a flax msgpack file, which orbax_flax does not read.
      TreeMismatchError: a step of several items, none of them ``default`` or ``state``.
    """
    if os.path.isfile(self.path):
      raise self.refusal("its newest step is a flax msgpack file, which orbax_flax does not"
                         " read; restore it with flax.training.checkpoints.restore_checkpoint"
                         " and save that state with ofx.save(..., {'state': state})",
                         errors.CheckpointFormatError)
    names = sorted(orbax_checkpoint.open_checkpoint(Location.parse(self.path)).items)
    item = names[0] if len(names) == 1 else next(
        (n for n in ("default", "state") if n in names), None)
    if item is None:
      raise self.refusal(f"its steps hold the items {names}, and none is 'default' or 'state',"
                         " so the one holding the training state is not known")
    return item

  def refusal(self, problem: str, kind: type = errors.TreeMismatchError) -> Exception:
    """The error that refuses to continue this run, with the lines to write instead."""
    text = (f"{self.description()}; it cannot be continued as this job's state: {problem}.\n"
            f"Start from its params instead with --config.checkpoint.init_from={self.path}"
            f" (CheckpointPolicy(init_from={self.path!r}); add :<item>/<sub/tree> to name"
            " another part), or move it away to start from scratch.")
    return kind(text, []) if kind is errors.TreeMismatchError else kind(text)


def refuse_checkpoints_dir(workdir: Location, directory: str) -> None:
  """Raises if ``workdir`` itself holds orbax_flax steps: a run's checkpoints directory."""
  if Location.parse(directory) == workdir:
    return
  try:
    steps, _ = step_dir.list_steps(workdir)
  except (NotADirectoryError, errors.StorageError):
    return
  ours = [s for s in steps if _location.read_key(workdir.join(str(s)), _manifest.MANIFEST_KEY,
                                                  max_bytes=1) is not None]
  if ours:
    parent = os.path.dirname(str(workdir).rstrip("/"))
    raise ValueError(
        f"workdir={str(workdir)!r} holds orbax_flax checkpoints itself (step(s)"
        f" {_steps_text(ours)}): it is a run's checkpoints directory, and this run would look for"
        f" its steps in {directory}, find none and start from scratch. Pass the run's workdir,"
        f" {parent!r} (--workdir={parent}), to resume step {ours[-1]}; or, to keep the steps"
        f" where they are, set the policy's directory={str(workdir)!r}"
        f" (--config.checkpoint.directory={workdir}).")


def refuse_foreign_steps(directory: str, steps: list[int]) -> None:
  """Raises if every step listed in ``directory`` is an orbax-checkpoint step, none ours."""
  loc = Location.parse(directory)
  if not steps or not loc.is_local or any(
      _location.read_key(loc.join(str(s)), _manifest.MANIFEST_KEY, max_bytes=1) is not None
      for s in reversed(steps)):
    return  # (one small read when the newest step is ours, as it is at every resume)
  if set(orbax_checkpoint.steps(loc)) != set(steps):
    return
  elsewhere = os.path.join(os.path.dirname(directory.rstrip("/")), "checkpoints_orbax_flax")
  raise errors.CheckpointExistsError(
      f"{directory} holds an orbax-checkpoint run (step(s) {_steps_text(steps)}), and orbax_flax"
      " would write its own steps among that library's. Give this run's checkpoints a directory"
      f" of their own with --config.checkpoint.directory={elsewhere}"
      f" (CheckpointPolicy(directory={elsewhere!r})): the run then continues the orbax-checkpoint"
      f" run from step {steps[-1]} (the whole state), and leaves its steps as they are. To take"
      " only its params instead:"
      f" --config.checkpoint.init_from={os.path.join(directory, str(steps[-1]))}.")


def _steps_text(steps: Any) -> str:
  steps = list(steps)
  return ", ".join(map(str, steps)) if len(steps) <= 6 else (
      f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-2:]))}")
