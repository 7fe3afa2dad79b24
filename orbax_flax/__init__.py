"""orbax_flax: distributed, asynchronous, atomic checkpoints for JAX on tensorstore.

Example:
  >>> import numpy as np, orbax_flax as ofx, tempfile, os
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
  >>> ofx.save(path, {"state": {"w": np.arange(3)}})
  >>> ofx.restore(path)["state"]["w"]
  array([0, 1, 2])
"""

from orbax_flax.callbacks import Callback
from orbax_flax.callbacks import LogProgress
from orbax_flax.callbacks import Trainer
from orbax_flax.checkpoint_callback import CheckpointCallback
from orbax_flax.checkpointer import Checkpointer
from orbax_flax.config import CheckpointPolicy
from orbax_flax.errors import CheckpointCorruptedError
from orbax_flax.errors import CheckpointError
from orbax_flax.errors import CheckpointExistsError
from orbax_flax.errors import CheckpointFormatError
from orbax_flax.errors import CheckpointNotFoundError
from orbax_flax.errors import SaveCancelledError
from orbax_flax.errors import StorageError
from orbax_flax.errors import TreeMismatchError
from orbax_flax.errors import UnsupportedLeafError
from orbax_flax.manager import CheckpointManager
from orbax_flax.describe import ArrayMetadata
from orbax_flax.describe import CheckpointMetadata
from orbax_flax.describe import ItemMetadata
from orbax_flax.describe import metadata
from orbax_flax.checkpointer import restore
from orbax_flax.saving import AsyncSave
from orbax_flax._planning import LIBRARY_VERSION as __version__
from orbax_flax.checkpointer import save
from orbax_flax.checkpointer import save_async
from orbax_flax.targets import abstract
from orbax_flax.tensorboard import TensorBoardWriter
from orbax_flax.verifying import verify
from orbax_flax.evaluation import checkpoints_iterator
from orbax_flax.formats import transforms
from orbax_flax.formats.convert import convert
from orbax_flax.formats.safetensors_io import export_safetensors

__all__ = [
    "ArrayMetadata", "AsyncSave", "Callback", "CheckpointCallback", "CheckpointCorruptedError",
    "CheckpointError", "CheckpointManager", "Checkpointer", "CheckpointPolicy", "LogProgress", "Trainer",
    "CheckpointExistsError", "CheckpointFormatError", "CheckpointMetadata", "CheckpointNotFoundError",
    "ItemMetadata", "SaveCancelledError", "StorageError", "TreeMismatchError", "UnsupportedLeafError",
    "TensorBoardWriter", "abstract", "checkpoints_iterator", "convert", "export_safetensors", "metadata", "restore", "save",
    "save_async", "transforms", "verify",
    "__version__",
]
