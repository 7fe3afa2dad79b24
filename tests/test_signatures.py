"""One signature per verb: restore and save take the same arguments at every layer.

Checked on the signatures themselves (names, kinds, defaults, annotations),
with the first positional argument (the path, or the manager's step) left out;
and on meanings: what a default of None means, and that an option the policy
hands the checkpointer has one name, one default and one documented meaning.
"""

import dataclasses
import inspect

import pytest

import orbax_flax as ofx
from orbax_flax.engine import checkpointer
from orbax_flax.engine import restoring
from orbax_flax.manager import components

# The agreed keyword arguments, in order.
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


# What a restore's max_host_bytes=None means, at every layer: the budget of what is called
# (a module function has none; a Checkpointer its own; a manager's checkpointer the policy's).
NONE_MEANS = "``max_host_bytes=None``: the budget of what is called"


@pytest.mark.parametrize("fn", [ofx.restore, checkpointer.Checkpointer.restore,
                                ofx.CheckpointManager.restore],
                         ids=["orbax_flax.restore", "Checkpointer.restore", "manager.restore"])
def test_max_host_bytes_none_means_one_thing_at_every_layer(fn):
  assert inspect.signature(fn).parameters["max_host_bytes"].default is None
  assert NONE_MEANS in " ".join(inspect.getdoc(fn).split()), (
      f"{fn.__qualname__}'s docstring must say what max_host_bytes=None means: {NONE_MEANS!r}")


def _documented(doc, name):
  """The text of ``name``'s entry in a Google-style Args:/Attributes: section, one line."""
  lines, out = inspect.cleandoc(doc).splitlines(), []
  for i, line in enumerate(lines):
    if line.strip().startswith(f"{name}:"):
      indent = len(line) - len(line.lstrip())
      out.append(line.strip())
      for more in lines[i + 1:]:
        if not more.strip() or len(more) - len(more.lstrip()) <= indent:
          break
        out.append(more.strip())
      break
  return " ".join(out)


def test_the_policy_and_the_checkpointer_mean_the_same_by_each_option(tmp_path):
  """Every option a policy hands the manager's Checkpointer has one name, one default and one
  meaning (the same values documented), and reaches the checkpointer as set."""
  params = inspect.signature(checkpointer.Checkpointer).parameters
  fields = {f.name: f.default for f in dataclasses.fields(ofx.CheckpointPolicy)}
  shared = [n for n in params if n in fields]
  assert set(shared) == {"max_host_bytes", "keep_staging_memory", "host_transfer",
                         "coordination_timeout_seconds", "watchdog_seconds", "differential"}
  for name in shared:
    assert params[name].default == fields[name], name
  # The values whose meaning both docstrings spell out, spelled out alike.
  for name, words in {"max_host_bytes": ["0: none"], "watchdog_seconds": ["0: off"],
                      "host_transfer": ['"memcpy"', '"pinned_host"', '"auto"']}.items():
    for doc in (ofx.CheckpointPolicy.__doc__, checkpointer.Checkpointer.__doc__):
      entry = _documented(doc, name)
      assert entry and all(w in entry for w in words), (name, entry)
  policy = ofx.CheckpointPolicy(max_host_bytes=1 << 20, keep_staging_memory=False,
                                host_transfer="memcpy", coordination_timeout_seconds=30.0,
                                watchdog_seconds=5.0, differential=True)
  options = components.build(policy, str(tmp_path)).checkpointer
  assert {n: options[n] for n in shared} == {n: getattr(policy, n) for n in shared}
