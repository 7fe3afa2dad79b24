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

An NNX model saved whole (``nnx.state(model)``, as the Flax Gemma example's
``model`` item is) holds more than params: its BatchNorm statistics are taken
too when ``load`` is given them as ``variables``, and its RNG state (an
``nnx.Rngs`` stream's ``key`` and ``count``) is left out: the target need not
hold it, and the new run keeps its own fresh RNGs.

Dtypes convert as in a resume: a conversion that loses information (float32
saved, a bfloat16 model) only with the policy's ``allow_lossy_casts``, and
every change made is logged. The part taken is compared strictly (a leaf of it
the target lacks is a difference, RNG state apart); what lies outside it is left out. A target
that does not match raises ``TreeMismatchError`` listing every difference, the
checkpoint's items with their top-level keys and example key paths of the
chosen item, and an ``init_from`` to write (never the one refused).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import jax

from orbax_flax.engine import _selecting
from orbax_flax.core import _tree
from orbax_flax.engine import checkpointer
from orbax_flax import errors
from orbax_flax.engine import restoring
from orbax_flax.engine import targets as targets_lib
from orbax_flax.format import _manifest
from orbax_flax.format import step_dir
from orbax_flax.core._location import Location
from orbax_flax.format._manifest import Manifest
from orbax_flax.formats import orbax_checkpoint
from orbax_flax.manager import registry


def source_of(text: str) -> Location:
  """The checkpoint ``init_from=text`` points at: a run's or a directory's latest step
  resolved to that step (what :func:`load` reads, unless it is given another ``source``).

  Raises:
    CheckpointNotFoundError: nothing committed where ``text`` points.
  """
  return _checkpoint_in(_selecting.split(text)[0], text)


def params_part(text: str, source: Location) -> str | None:
  """For a run whose state is a plain pytree with a ``params`` key and an ``init_from``
  naming no part: the ``init_from`` that takes only the params (``dst=src``), not the whole
  state with its optimizer state and step counter; None where the checkpoint holds no
  params part to take (an orbax-checkpoint, a state without ``params``).

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "10")
    >>> ofx.save(path, {"state": {"params": {"w": np.ones(2)}, "step": 10}})
    >>> params_part(path, Location.parse(path)).endswith(":state/params=state/params")
    True
  """
  path, selector = _selecting.split(text)
  if selector:
    return None
  _, manifest = restoring.open_manifest(source)
  if manifest.format != _manifest.FORMAT:
    return None
  for item in ("params", "state"):
    saved = manifest.items.get(item)
    if saved is None:
      continue
    if item == "params":
      return f"{path}:state/params=params"
    if any(r.path[:1] == ("params",) and len(r.path) > 1 for r in saved.leaves):
      return f"{path}:state/params=state/params"
  return None


def load(text: str, name: str, target: Any, ckptr: checkpointer.Checkpointer, *,
         allow_lossy_casts: bool = False, casts: list | None = None,
         variables: Any = None, source: Location | None = None) -> tuple[Any, Any, Location]:
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
    variables: an NNX model's variables that are neither params nor RNG state
      (its ``train_state`` item: BatchNorm statistics), as a restore target.
      When the part taken holds any of them (``nnx.state(model)`` saved whole),
      it must hold them all, and they are restored too.
    source: the checkpoint to read (:func:`source_of`, resolved once for every process
      of a job: a run's latest step may change between two processes' looks); None:
      resolved here.

  Returns:
    ``(params, variables, step)``: ``target`` restored; ``variables`` restored,
    or None when the part holds none of them (they stay as they are); the
    checkpoint it came from.

  Raises:
    CheckpointNotFoundError: nothing committed where ``text`` points.
    TreeMismatchError: the named item or subtree is missing, or does not match
      ``target``; the message lists what the checkpoint holds.
  """
  path, selector = _selecting.split(text)
  source = _checkpoint_in(path, text) if source is None else source
  _, manifest = restoring.open_manifest(source)
  cast = _Casts(allow_lossy_casts, casts)
  if selector:
    return *_take(text, source, manifest, selector, target, ckptr, cast, variables,
                  name), source
  if manifest.format == "orbax-checkpoint":
    return *_from_orbax_checkpoint(text, source, manifest, name, target, ckptr, cast,
                                   variables), source
  return *_take(text, source, manifest, name, target, ckptr, cast, variables, name), source


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
               allow_lossy_casts: bool = False, casts: list | None = None,
               source: Location | None = None
               ) -> tuple[dict[tuple[str, ...], Any], Location]:
  """Several parts of a checkpoint (``"<ckpt>:params,train_state/batch_stats"``), each restored
  into the same part of this run's state; ``dst=src`` takes ``src`` into ``dst``
  (``"<ckpt>:params=default/params,train_state/batch_stats=default/batch_stats"``).

  Args:
    text: the policy's ``init_from``.
    targets: this run's items as restore targets.
    ckptr: the checkpointer that restores them.
    allow_lossy_casts, casts, source: as :func:`load`.

  Returns:
    ``({destination key path: restored subtree}, the step it came from)``.

  Raises:
    CheckpointNotFoundError, TreeMismatchError: as :func:`load`; ValueError: a
    destination that is not part of this run's state (naming what is).
  """
  path, selector = _selecting.split(text)
  source = _checkpoint_in(path, text) if source is None else source
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
                     _Casts(allow_lossy_casts, casts))[0]
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
                        target: Any, item: str | None = None, under: tuple[str, ...] = (),
                        diffs: list[str] | None = None,
                        name: str | None = None) -> errors.TreeMismatchError:
  other = _another_part(text, manifest, target, "/".join((item,) + under) if item else "")
  into = _into_the_same_place(text, manifest, target, item, under, name) if not other else None
  if not other and not into and name and not under:
    into = _fitting_parts(text, manifest, target, item or name, name)
  if other:
    advice = (f"Name the item and subtree that hold the model with"
              f" init_from='<checkpoint>:<item>/<sub/tree>', e.g. {other!r}.")
  elif into:
    advice = (f"To take what fits into the same place of this run's state (the rest starting"
              f" fresh, e.g. a new head), write it as dst=src: {into!r}.")
  else:
    advice = ("No other item or params subtree of it holds this run's key paths with their"
              " shapes: make this run's model the checkpoint's (the differences above), take"
              " the parts that fit with init_from='<checkpoint>:<dst>=<src>' (each a key path"
              " as `python -m orbax_flax show` prints it), or point init_from at another"
              " checkpoint.")
  return errors.TreeMismatchError(
      f"init_from={text!r}: {problem}.\n{source} holds {_holdings(manifest, item, under)}.\n"
      + advice, diffs or [])


def _another_part(text: str, manifest: Manifest, target: Any, refused: str) -> str | None:
  """An ``init_from`` for the error to suggest: an item or ``<item>/params`` subtree that
  holds every one of ``target``'s key paths with its shape (one that would be refused again
  is no advice), never the part just ``refused`` (nor the one ``text`` names); None when
  there is none."""
  path, selector = _selecting.split(text)
  for name, saved in sorted(manifest.items.items()):
    for under in (("params",), ()):
      part = "/".join((name,) + under)
      if part in (refused, selector.strip("/")):
        continue
      if _fits(saved.leaves, under, target):
        return f"{path}:{part}"
  return None


def _into_the_same_place(text: str, manifest: Manifest, target: Any, item: str | None,
                         under: tuple[str, ...], name: str | None) -> str | None:
  """For a selector ``item/under`` that names a part of the checkpoint fitting the same part
  of this run's ``name`` item (the trunk, without a head of another size): the ``dst=src``
  ``init_from`` that takes it there; else None."""
  if not (item in manifest.items and under and name):
    return None
  part = target
  for k in under:
    if not isinstance(part, dict) or k not in part:
      return None
    part = part[k]
  if not _fits(manifest.items[item].leaves, under, part):
    return None
  path = _selecting.split(text)[0]
  src = "/".join((item,) + under)
  return f"{path}:{'/'.join((name,) + under)}={src}"


def _fitting_parts(text: str, manifest: Manifest, target: Any, item: str,
                   name: str) -> str | None:
  """The ``dst=src`` ``init_from`` taking every largest subtree of ``target`` (this run's
  ``name`` item) that ``item`` of the checkpoint holds at the same key path with the same
  shapes (the trunk of a model whose head changed), or None where none fits."""
  if item not in manifest.items or not isinstance(target, dict):
    return None
  leaves, found = manifest.items[item].leaves, []
  def walk(tree, under):
    if not isinstance(tree, dict) or len(under) > 4:
      return
    for k, sub in sorted(tree.items()):
      if _fits(leaves, under + (k,), sub):
        found.append(under + (k,))
      else:
        walk(sub, under + (k,))
  walk(target, ())
  if not found:
    return None
  path = _selecting.split(text)[0]
  return f"{path}:" + ",".join(f"{'/'.join((name,) + p)}={'/'.join((item,) + p)}" for p in found)


def _fits(leaves: list, under: tuple[str, ...], target: Any) -> bool:
  """Whether the records ``leaves`` hold below ``under`` exactly ``target``'s key paths (the
  part taken is compared strictly), each with the target's shape."""
  def bare(path):  # a box's value may be recorded below the box's path
    return path[:-1] if path[-1:] == ("value",) else path
  records = {bare(r.path[len(under):]): r for r in leaves
             if r.path[:len(under)] == under and len(r.path) > len(under)}
  wanted = {bare(p): leaf for p, leaf in _tree.flatten(target)}
  if not wanted or set(records) != set(wanted):
    return False
  return all(getattr(leaf, "shape", None) is None
             or tuple(getattr(records[p], "shape", ())) == tuple(leaf.shape)
             for p, leaf in wanted.items())


def _take(text: str, source: Location, manifest: Manifest, selector: str, target: Any,
          ckptr: checkpointer.Checkpointer, cast: _Casts,
          variables: Any = None, name: str | None = None) -> tuple[Any, Any]:
  """``init_from`` with a selector: the named item's subtree, restored into ``target`` (and
  into ``variables`` where the subtree holds them, else None: see :func:`load`)."""
  item, _, sub = selector.partition("/")
  under = tuple(k for k in sub.split("/") if k)
  names = sorted(manifest.items)
  if item not in manifest.items:
    if manifest.any_item and len(names) == 1:
      item = names[0]  # one unnamed item (an orbax item directory, safetensors): any name reads it
    else:
      raise _init_from_mismatch(text, source, manifest, f"no item {item!r} in {source}",
                                target)
  leaves = manifest.items[item].leaves
  if under and not any(r.path[:len(under)] == under for r in leaves):
    raise _init_from_mismatch(text, source, manifest,
                              f"item {item!r} has no subtree {_tree.path_str(under)!r}", target,
                              item)
  inside = [r for r in leaves if r.path[:len(under)] == under]
  held = {r.path[len(under):] for r in inside}
  both = variables is not None and any(p in held for p, _ in _tree.flatten(variables))
  # A whole NNX model state: its params and other variables, taken as one tree.
  wanted = _selecting.nested(_tree.flatten(target) + _tree.flatten(variables)) if both else target
  left_out = _rng_state(inside, under) - {p for p, _ in _tree.flatten(wanted)}
  for k in reversed(under):
    wanted = {k: wanted}
  try:
    _check_selected(source, manifest, item, under, wanted, cast, left_out)
    out = ckptr.restore(source, {item: wanted}, partial=True,
                        allow_lossy_casts=cast.allow_lossy, casts=cast.made)[item]
  except errors.TreeMismatchError as e:
    raise _init_from_mismatch(text, source, manifest,
                              f"this run's state does not match {'/'.join((item,) + under)} of"
                              f" the checkpoint: {_shown(e)}", target, item, under,
                              e.differences, name) from None
  for k in under:
    out = out[k]
  if not both:
    return out, None
  return _like(target, out), _like(variables, out)


def _like(tree: Any, restored: Any) -> Any:
  """``tree``'s structure holding the leaves of ``restored`` at the same key paths."""
  found = dict(_tree.flatten(restored))
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree),
                                      [found[p] for p, _ in _tree.flatten(tree)])


def _rng_state(records: list, under: tuple[str, ...]) -> set[tuple[str, ...]]:
  """The key paths (below ``under``) of RNG state among ``records``: every PRNG key, and the
  ``count`` an NNX ``Rngs`` stream keeps beside its ``key`` (``<stream>/key/value``,
  ``<stream>/count/value``)."""
  paths = {r.path[len(under):] for r in records}
  keys = {r.path[len(under):] for r in records if getattr(r, "key_impl", None)}
  counts = {p[:i] + ("count",) + p[i + 1:] for p in keys
            for i in range(len(p)) if p[i] == "key" and p[i + 1:] in ((), ("value",))}
  return keys | (counts & paths)


def _check_selected(source: Location, manifest: Manifest, item: str, under: tuple[str, ...],
                    wanted: Any, cast: _Casts, left_out: set[tuple[str, ...]]) -> None:
  """Compares the selected part (``item``/``under``) with ``wanted`` strictly, reading no
  data: a leaf of the checkpoint under it that the target lacks is a difference too (a model
  configured with fewer layers), where the restore, partial, leaves out what lies outside it.
  The leaves at ``left_out`` (key paths below ``under``: RNG state) are not compared.

  Raises:
    TreeMismatchError: every difference, by key path.
  """
  saved = manifest.items[item]
  inside = dataclasses.replace(saved, leaves=tuple(
      r for r in saved.leaves
      if r.path[:len(under)] == under and r.path[len(under):] not in left_out))
  targets_lib.match_target(dataclasses.replace(manifest, items={item: inside}), {item: wanted},
                           allow_lossy_casts=cast.allow_lossy, source=str(source))


def _shown(e: errors.TreeMismatchError) -> str:
  """A mismatch's diagnosis and differences (one line per kind when many), without its advice."""
  head, *lines = e.summary.splitlines()
  return head.partition(": ")[2] + "".join(f"\n  {l.strip()}" for l in lines)


def _from_orbax_checkpoint(text: str, source: Location, manifest: Manifest, name: str,
                           target: Any, ckptr: checkpointer.Checkpointer, cast: _Casts,
                           variables: Any = None) -> tuple[Any, Any]:
  """``init_from`` an orbax-checkpoint step: the params (or whole state) from its state item.

  The item is the only one, else ``default`` or ``state``; the params are its
  ``params`` subtree when it has one (a saved TrainState), else the item itself.
  """
  names = sorted(manifest.items)
  item = names[0] if len(names) == 1 else next((n for n in ("default", "state") if n in names), None)
  if item is None:
    raise _init_from_mismatch(text, source, manifest, f"an orbax-checkpoint step with items"
                              f" {names}; none is 'default' or 'state', so the one holding the"
                              " model is not known", target)
  paths = [r.path for r in manifest.items[item].leaves]
  nested = name == "params" and any(p and p[0] == "params" for p in paths)
  return _take(text, source, manifest, f"{item}/params" if nested else item, target, ckptr,
               cast, variables)
