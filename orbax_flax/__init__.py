"""orbax_flax: distributed, asynchronous, atomic checkpoints for JAX on tensorstore.

Example:
  >>> import numpy as np, orbax_flax as ofx, tempfile, os
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
  >>> ofx.save(path, {"state": {"w": np.arange(3)}})
  >>> ofx.restore(path)["state"]["w"]
  array([0, 1, 2])

The public names below are imported on first use, so that importing the
package (and ``python -m orbax_flax --help``) does not import JAX or
tensorstore; ``from orbax_flax import save`` and ``ofx.save`` work as usual.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# Public name -> the module that defines it (and its name there, where it differs).
_EXPORTS = {
    "Callback": "orbax_flax.training.callbacks",
    "LogProgress": "orbax_flax.training.callbacks",
    "Trainer": "orbax_flax.training.callbacks",
    "CheckpointCallback": "orbax_flax.training.checkpoint_callback",
    "Checkpointer": "orbax_flax.engine.checkpointer",
    "CheckpointPolicy": "orbax_flax.manager.config",
    "CheckpointCorruptedError": "orbax_flax.errors",
    "CheckpointError": "orbax_flax.errors",
    "CheckpointExistsError": "orbax_flax.errors",
    "CheckpointFormatError": "orbax_flax.errors",
    "CheckpointNotFoundError": "orbax_flax.errors",
    "SaveCancelledError": "orbax_flax.errors",
    "WriterConflictError": "orbax_flax.errors",
    "StorageError": "orbax_flax.errors",
    "TreeMismatchError": "orbax_flax.errors",
    "UnsupportedLeafError": "orbax_flax.errors",
    "CheckpointManager": "orbax_flax.manager.manager",
    "SaveEvent": "orbax_flax.manager.manager",
    # The pure policy pieces CheckpointPolicy is built from, to compose by hand.
    "EveryNSteps": "orbax_flax.manager.policy",
    "EveryNSeconds": "orbax_flax.manager.policy",
    "OnSteps": "orbax_flax.manager.policy",
    "FirstStep": "orbax_flax.manager.policy",
    "YoungDaly": "orbax_flax.manager.policy",
    "any_of": "orbax_flax.manager.policy",
    "KeepLast": "orbax_flax.manager.policy",
    "KeepEvery": "orbax_flax.manager.policy",
    "KeepBest": "orbax_flax.manager.policy",
    "KeepOnePer": "orbax_flax.manager.policy",
    "to_delete": "orbax_flax.manager.policy",
    "ArrayMetadata": "orbax_flax.engine.describe",
    "CheckpointMetadata": "orbax_flax.engine.describe",
    "ItemMetadata": "orbax_flax.engine.describe",
    "metadata": "orbax_flax.engine.describe",
    "restore": "orbax_flax.engine.checkpointer",
    "AsyncSave": "orbax_flax.engine.saving",
    "__version__": ("orbax_flax.engine._planning", "LIBRARY_VERSION"),
    "save": "orbax_flax.engine.checkpointer",
    "save_async": "orbax_flax.engine.checkpointer",
    "abstract": "orbax_flax.engine.targets",
    "TensorBoardWriter": "orbax_flax.training.tensorboard",
    "verify": "orbax_flax.engine.verifying",
    "checkpoints_iterator": "orbax_flax.manager.evaluation",
    "transforms": ("orbax_flax.engine.transforms", None),  # the module itself
    "data": ("orbax_flax.data", None),  # the subpackage: ofx.data.ElasticIterator (needs grain)
    "convert": "orbax_flax.engine.converting",
    "export_safetensors": "orbax_flax.formats.safetensors_export",
    "export_orbax": "orbax_flax.formats.orbax_export",
    "Prefetched": "orbax_flax.training.prefetching",
    "PREEMPTED_EXIT_CODE": "orbax_flax.launch",
}

__all__ = [
    "ArrayMetadata", "AsyncSave", "Callback", "CheckpointCallback", "CheckpointCorruptedError",
    "CheckpointError", "CheckpointManager", "Checkpointer", "CheckpointPolicy", "LogProgress", "Trainer",
    "CheckpointExistsError", "CheckpointFormatError", "CheckpointMetadata", "CheckpointNotFoundError",
    "ItemMetadata", "SaveCancelledError", "WriterConflictError", "StorageError", "TreeMismatchError", "UnsupportedLeafError",
    "TensorBoardWriter", "abstract", "checkpoints_iterator", "convert", "export_orbax", "export_safetensors", "Prefetched", "metadata", "restore", "save",
    "save_async", "transforms", "verify", "data",
    "SaveEvent", "EveryNSteps", "EveryNSeconds", "OnSteps", "FirstStep", "YoungDaly", "any_of",
    "KeepLast",
    "KeepEvery", "KeepBest", "KeepOnePer", "to_delete",
    "PREEMPTED_EXIT_CODE", "__version__",
]


# Modules of the flat layout before the layer packages, each an alias of the module that
# holds its code now (``orbax_flax.registry`` is ``orbax_flax.manager.registry``), so that
# imports of the old module paths keep working; importing one warns (DeprecationWarning).
# The paths resolve, not every private name: a helper may have moved to the module that
# uses it (``describe_sharding`` to planning) or been folded into its new module's API.
_MOVED = {
    **{m: f"core.{m}" for m in ("_crc", "_location", "_multihost", "_progress", "_staging",
                                "_tree")},
    **{m: f"format.{m}" for m in ("_layout", "_manifest", "_tsio", "step_dir")},
    "_records": "format._manifest", "_records_decode": "format._manifest",
    "_chunk_index": "format._tsio",
    **{m: f"engine.{m}" for m in ("_planning", "_reading", "_selecting", "checkpointer",
                                  "converting", "describe", "restoring", "saving", "targets",
                                  "transforms", "verifying")},
    "_matching": "engine.targets", "_planner": "engine._planning",
    "_committing": "engine.saving", "_save_run": "engine.saving",
    "_read_buffers": "engine._reading", "_read_once": "engine.restoring",
    **{m: f"manager.{m}" for m in ("components", "config", "evaluation", "leases", "policy",
                                   "registry", "schedule")},  # (orbax_flax.manager: the package)
    "events": "manager.manager", "inflight": "manager.manager", "rollback": "manager.registry",
    **{m: f"training.{m}" for m in ("callbacks", "checkpoint_callback", "init_from",
                                    "preemption", "prefetching", "resume",
                                    "state_items", "tensorboard")},
    "workdir": "training.resume", "restart": "training.resume",
    "interruptions": "training.checkpoint_callback",
    # Modules of the layer packages since folded into another of the same package.
    "format._records": "format._manifest", "format._records_decode": "format._manifest",
    "training.restart": "training.resume", "training.workdir": "training.resume",
    "engine._save_run": "engine.saving", "engine._matching": "engine.targets",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds ``orbax_flax.<old name>`` (see ``_MOVED``): the module that holds its code now."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    prefix, _, name = fullname.partition(".")
    if prefix != __name__ or name not in _MOVED:
      return None
    return importlib.util.spec_from_loader(fullname, self)

  def create_module(self, spec):
    new = f"{__name__}.{_MOVED[spec.name.partition('.')[2]]}"
    warnings.warn(f"{spec.name} moved to {new}; import it from there.", DeprecationWarning,
                  stacklevel=2)
    module = importlib.import_module(new)
    spec.loader_state = module.__spec__  # put back once the import system set the alias's
    return module

  def exec_module(self, module):
    module.__spec__ = module.__spec__.loader_state


sys.meta_path.append(_OldPaths())


def __getattr__(name: str):
  """Imports a public name (or a submodule, e.g. ``orbax_flax.errors``) on first use."""
  where = _EXPORTS.get(name)
  if where is not None:
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = importlib.import_module(module)
    if attr is not None:
      value = getattr(value, attr)
    globals()[name] = value
    return value
  if name in _MOVED:
    return importlib.import_module(f"{__name__}.{name}")
  if not name.startswith("__"):
    try:
      return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"{__name__}.{name}":
        raise
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__))
