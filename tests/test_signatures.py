"""One signature per verb: restore and save take the same arguments at every layer.

Checked on the signatures themselves (names, kinds, defaults, annotations),
with the first positional argument (the path, or the manager's step) left out.
"""

import inspect

import pytest

import orbax_flax as ofx
from orbax_flax.engine import checkpointer
from orbax_flax.engine import restoring

# The agreed keyword arguments (issue 17), in order.
RESTORE = ["target", "partial", "allow_lossy_casts", "transforms", "read_once", "max_host_bytes",
           "progress", "casts"]
SAVE = ["items", "overwrite", "custom_metadata", "dtype"]

RESTORE_LAYERS = {
    "orbax_flax.restore": ofx.restore,
    "Checkpointer.restore": checkpointer.Checkpointer.restore,
    "restoring.restore": restoring.restore,
}
SAVE_LAYERS = {"orbax_flax.save": ofx.save, "Checkpointer.save": checkpointer.Checkpointer.save}
SAVE_ASYNC_LAYERS = {"orbax_flax.save_async": ofx.save_async,
                     "Checkpointer.save_async": checkpointer.Checkpointer.save_async}


def _after_first(fn):
  """The parameters after the path (and ``self``), as comparable tuples."""
  params = list(inspect.signature(fn).parameters.values())
  if params[0].name == "self":
    params = params[1:]
  return [(p.name, p.kind, p.default, p.annotation) for p in params[1:]]


@pytest.mark.parametrize("layers, names", [
    (RESTORE_LAYERS, RESTORE), (SAVE_LAYERS, SAVE), (SAVE_ASYNC_LAYERS, SAVE + ["cancellable"])],
    ids=["restore", "save", "save_async"])
def test_every_layer_takes_the_same_arguments(layers, names):
  sigs = {name: _after_first(fn) for name, fn in layers.items()}
  first = next(iter(sigs))
  for name, sig in sigs.items():
    assert [p[0] for p in sig] == names, name
    assert sig == sigs[first], f"{name} differs from {first}:\n  {sig}\n  {sigs[first]}"


def test_the_manager_restores_and_saves_with_the_same_arguments():
  # Its first argument is the step; its read_once=None means "the policy's read_once_restore".
  manager = _after_first(ofx.CheckpointManager.restore)
  engine = _after_first(checkpointer.Checkpointer.restore)
  assert [p[0] for p in manager] == RESTORE
  assert [p for p in manager if p[0] != "read_once"] == [p for p in engine if p[0] != "read_once"]
  save = [p[0] for p in _after_first(ofx.CheckpointManager.save)]
  assert save[:1] == ["items"] and set(SAVE[1:]) - {"overwrite"} <= set(save), save


def test_save_async_is_save_plus_cancellable():
  save, save_async = _after_first(ofx.save), _after_first(ofx.save_async)
  assert save_async[:-1] == save
  assert save_async[-1][:3] == ("cancellable", inspect.Parameter.KEYWORD_ONLY, False)


def test_one_spelling_of_the_coordination_timeout():
  from orbax_flax.tiers import local  # pylint: disable=g-import-not-at-top
  for fn in (checkpointer.Checkpointer, ofx.export_safetensors, local.LocalTier):
    params = inspect.signature(fn).parameters
    assert "coordination_timeout_seconds" in params, fn
    assert not [p for p in params if "timeout" in p and p != "coordination_timeout_seconds"], fn
