"""``init_from``: which checkpoint, item and subtree a fine-tuning run starts from.

``CheckpointPolicy.init_from`` is read when a run has nothing to resume. It
names a checkpoint or a run (its latest step) in any format ``restore`` reads:
ours (``<workdir>``, ``<workdir>/checkpoints``, ``.../checkpoints/<step>``), an
orbax-checkpoint ``CheckpointManager`` directory or step or an item directory,
a directory of flax's legacy ``checkpoint_<N>`` checkpoints (its newest), or
safetensors. ``"<checkpoint>:<item>/<sub/tree>"`` names the item to take and
optionally the subtree inside it (keys joined by ``/``, as ``python -m
orbax_flax show`` prints them), e.g. ``"/runs/gemma/checkpoints:model"`` for the
Flax Gemma example's ``model`` item. Without a selector: our ``params`` item;
for orbax-checkpoint, its only item, else ``default`` or ``state``, and that
item's ``params`` subtree when it has one.

Dtypes convert as in a resume: a conversion that loses information (float32
saved, a bfloat16 model) only with the policy's ``allow_lossy_casts``, and
every change made is logged. The part taken is compared strictly (a leaf of it
the target lacks is a difference); what lies outside it is left out. A target
that does not match raises ``TreeMismatchError`` listing every difference, the
checkpoint's items with their top-level keys and example key paths of the
chosen item, and the ``init_from`` to write.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

from orbax_flax.engine import _selecting
from orbax_flax.core import _tree
from orbax_flax.engine import checkpointer
from orbax_flax import errors
from orbax_flax.engine import restoring
from orbax_flax.engine import targets as targets_lib
from orbax_flax.format import step_dir
from orbax_flax.core._location import Location
from orbax_flax.format._manifest import Manifest
from orbax_flax.formats import orbax_checkpoint
from orbax_flax.manager import registry


def load(text: str, name: str, target: Any, ckptr: checkpointer.Checkpointer, *,
         allow_lossy_casts: bool = False, casts: list | None = None) -> tuple[Any, Location]:
  """What ``init_from=text`` names, restored into ``target``; and the step it came from.

  Args:
    text: the policy's ``init_from``.
    name: the part of the state the target is (``params``, or ``state`` for a
      plain pytree), the item taken when ``text`` names none.
    target: the restore target (shapes, dtypes, shardings of this run).
    ckptr: the checkpointer that restores it (the run's, with its watchdog,
      progress output and host-memory budget).
    allow_lossy_casts: the policy's: converting to a dtype that loses
      information (float32 saved, a bfloat16 model) is allowed.
    casts: a list that receives every dtype change made (as
      :func:`orbax_flax.restore`'s ``casts``), for the log.

  Raises:
    CheckpointNotFoundError: nothing committed where ``text`` points.
    TreeMismatchError: the named item or subtree is missing, or does not match
      ``target``; the message lists what the checkpoint holds.
  """
  path, selector = _selecting.split(text)
  source = _checkpoint_in(path, text)
  _, manifest = restoring.open_manifest(source)
  cast = _Casts(allow_lossy_casts, casts)
  if selector:
    return _take(text, source, manifest, selector, target, ckptr, cast), source
  if manifest.format == "orbax-checkpoint":
    return _from_orbax_checkpoint(text, source, manifest, name, target, ckptr, cast), source
  return _take(text, source, manifest, name, target, ckptr, cast), source


class _Casts(NamedTuple):
  """What a restore of ``init_from`` may convert (the policy's flag) and where it lists what it
  converted."""
  allow_lossy: bool = False
  made: list | None = None


def several(text: str) -> bool:
  """True when ``init_from`` names several parts, or puts one elsewhere (``dst=src``).

  Example:
    >>> several("/runs/a:params"), several("/runs/a:params,train_state/batch_stats")
    (False, True)
  """
  selector = _selecting.split(text)[1]
  return "," in selector or "=" in selector


def load_parts(text: str, targets: dict[str, Any], ckptr: checkpointer.Checkpointer, *,
               allow_lossy_casts: bool = False, casts: list | None = None
               ) -> tuple[dict[tuple[str, ...], Any], Location]:
  """Several parts of a checkpoint (``"<ckpt>:params,train_state/batch_stats"``), each restored
  into the same part of this run's state; ``dst=src`` takes ``src`` into ``dst``
  (``"<ckpt>:params=default/params,train_state/batch_stats=default/batch_stats"``).

  Args:
    text: the policy's ``init_from``.
    targets: this run's items as restore targets.
    ckptr: the checkpointer that restores them.
    allow_lossy_casts, casts: as :func:`load`.

  Returns:
    ``({destination key path: restored subtree}, the step it came from)``.

  Raises:
    CheckpointNotFoundError, TreeMismatchError: as :func:`load`; ValueError: a
    destination that is not part of this run's state (naming what is).
  """
  path, selector = _selecting.split(text)
  source = _checkpoint_in(path, text)
  _, manifest = restoring.open_manifest(source)
  out = {}
  for dst, src in _selecting.selections(selector):
    try:
      target = _selecting.pick(targets, "/".join(dst))
    except ValueError as e:
      raise ValueError(f"init_from={text!r}: {'/'.join(dst)!r} is not a part of this run's state"
                       f" ({e}); name a destination among its items {sorted(targets)}, as"
                       " dst=<item>/<sub/tree>") from None
    out[dst] = _take(text, source, manifest, "/".join(src), target, ckptr,
                     _Casts(allow_lossy_casts, casts))
  return out, source


def _checkpoint_in(source: str, text: str) -> Location:
  """``init_from``: a checkpoint (any format ``restore`` reads), or a run's step directory or
  workdir (its latest step), ours or orbax-checkpoint's."""
  loc = Location.parse(source)
  for candidate in (loc, loc.join("checkpoints")):
    try:
      restoring.open_manifest(candidate)
      return candidate
    except errors.CheckpointNotFoundError:
      pass
    ocp_steps = orbax_checkpoint.steps(candidate)
    if ocp_steps:
      return candidate.join(str(ocp_steps[-1]))
    legacy = orbax_checkpoint.legacy_steps(candidate)  # flax's checkpoint_<N>
    if legacy and orbax_checkpoint.detect(candidate.join(legacy[-1][1])):
      return candidate.join(legacy[-1][1])
    try:
      steps = registry.visible_steps(candidate, step_dir.list_steps(candidate)[0])
    except NotADirectoryError:
      break
    if steps:
      return candidate.join(str(steps[-1]))
  raise errors.CheckpointNotFoundError(
      f"init_from={text!r}: no committed checkpoint at {source}, nor a step directory (or a run"
      " with a checkpoints/ directory) holding one; point it at a checkpoint such as"
      " <workdir>/checkpoints/<step>, at the run's workdir, at an orbax-checkpoint run"
      " directory or step, or at a directory of flax's checkpoint_<N> (add :<item>/<sub/tree>"
      " to name what to take from it).")


def _holdings(manifest: Manifest, item: str | None = None,
              under: tuple[str, ...] = ()) -> str:
  """What a checkpoint holds, for an error: its items and their top-level keys, and
  example key paths of ``item``/``under``."""
  def keys(leaves, prefix):
    found = sorted({_tree.path_str((r.path[len(prefix)],)) for r in leaves
                    if len(r.path) > len(prefix) and r.path[:len(prefix)] == prefix})
    return ", ".join(found[:8]) + (f", ... ({len(found)} keys)" if len(found) > 8 else "")
  parts = []
  for name, saved in sorted(manifest.items.items()):
    top = keys(saved.leaves, ())
    parts.append(f"{name} ({top})" if top else f"{name} (a value)")
  text = "items " + "; ".join(parts)
  if item in manifest.items:
    paths = [r.path for r in manifest.items[item].leaves if r.path[:len(under)] == under]
    if paths:
      shown = ", ".join(_tree.path_str(p) for p in paths[:6])
      text += f"; key paths in {item} include {shown}"
  return text


def _init_from_mismatch(text: str, source: Location, manifest: Manifest, problem: str,
                        item: str | None = None, under: tuple[str, ...] = (),
                        diffs: list[str] | None = None) -> errors.TreeMismatchError:
  example = next(iter(sorted(manifest.items)), "<item>")
  return errors.TreeMismatchError(
      f"init_from={text!r}: {problem}.\n{source} holds {_holdings(manifest, item, under)}.\n"
      f"Name the item and subtree that hold the model with"
      f" init_from='<checkpoint>:<item>/<sub/tree>', e.g."
      f" {_selecting.split(text)[0] + ':' + example!r}.", diffs or [])


def _take(text: str, source: Location, manifest: Manifest, selector: str, target: Any,
          ckptr: checkpointer.Checkpointer, cast: _Casts) -> Any:
  """``init_from`` with a selector: the named item's subtree, restored into ``target``."""
  item, _, sub = selector.partition("/")
  under = tuple(k for k in sub.split("/") if k)
  names = sorted(manifest.items)
  if item not in manifest.items:
    if manifest.any_item and len(names) == 1:
      item = names[0]  # one unnamed item (an orbax item directory, safetensors): any name reads it
    else:
      raise _init_from_mismatch(text, source, manifest, f"no item {item!r} in {source}")
  leaves = manifest.items[item].leaves
  if under and not any(r.path[:len(under)] == under for r in leaves):
    raise _init_from_mismatch(text, source, manifest,
                              f"item {item!r} has no subtree {_tree.path_str(under)!r}", item)
  wanted = target
  for k in reversed(under):
    wanted = {k: wanted}
  try:
    _check_selected(source, manifest, item, under, wanted, cast)
    out = ckptr.restore(source, {item: wanted}, partial=True,
                        allow_lossy_casts=cast.allow_lossy, casts=cast.made)[item]
  except errors.TreeMismatchError as e:
    raise _init_from_mismatch(text, source, manifest,
                              f"this run's state does not match {'/'.join((item,) + under)} of"
                              f" the checkpoint: {_shown(e)}", item, under,
                              e.differences) from None
  for k in under:
    out = out[k]
  return out


def _check_selected(source: Location, manifest: Manifest, item: str, under: tuple[str, ...],
                    wanted: Any, cast: _Casts) -> None:
  """Compares the selected part (``item``/``under``) with ``wanted`` strictly, reading no
  data: a leaf of the checkpoint under it that the target lacks is a difference too (a model
  configured with fewer layers), where the restore, partial, leaves out what lies outside it.

  Raises:
    TreeMismatchError: every difference, by key path.
  """
  saved = manifest.items[item]
  inside = dataclasses.replace(saved, leaves=tuple(
      r for r in saved.leaves if r.path[:len(under)] == under))
  targets_lib.match_target(dataclasses.replace(manifest, items={item: inside}), {item: wanted},
                           allow_lossy_casts=cast.allow_lossy, source=str(source))


def _shown(e: errors.TreeMismatchError) -> str:
  """A mismatch's diagnosis and differences (one line per kind when many), without its advice."""
  head, *lines = e.summary.splitlines()
  return head.partition(": ")[2] + "".join(f"\n  {l.strip()}" for l in lines)


def _from_orbax_checkpoint(text: str, source: Location, manifest: Manifest, name: str,
                           target: Any, ckptr: checkpointer.Checkpointer, cast: _Casts) -> Any:
  """``init_from`` an orbax-checkpoint step: the params (or whole state) from its state item.

  The item is the only one, else ``default`` or ``state``; the params are its
  ``params`` subtree when it has one (a saved TrainState), else the item itself.
  """
  names = sorted(manifest.items)
  item = names[0] if len(names) == 1 else next((n for n in ("default", "state") if n in names), None)
  if item is None:
    raise _init_from_mismatch(text, source, manifest, f"an orbax-checkpoint step with items"
                              f" {names}; none is 'default' or 'state', so the one holding the"
                              " model is not known")
  paths = [r.path for r in manifest.items[item].leaves]
  nested = name == "params" and any(p and p[0] == "params" for p in paths)
  return _take(text, source, manifest, f"{item}/params" if nested else item, target, ckptr,
               cast)
