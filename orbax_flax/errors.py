"""Errors raised by orbax_flax.

Every error subclasses a builtin so that generic handlers keep working:
``except FileNotFoundError`` still catches a missing checkpoint.
"""

from __future__ import annotations


class CheckpointError(Exception):
  """Base class of orbax_flax's own errors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
  """No committed checkpoint exists at the given path.

  Example:
    >>> import orbax_flax as ofx
    >>> try:
    ...   ofx.metadata("/nonexistent/ckpt")
    ... except FileNotFoundError as e:
    ...   print(type(e).__name__)
    CheckpointNotFoundError
  """


class CheckpointExistsError(CheckpointError, FileExistsError):
  """A committed checkpoint already exists where a save was asked to write."""


class CheckpointCorruptedError(CheckpointError, OSError):
  """Stored bytes do not match the checksums recorded when they were saved."""


class CheckpointFormatError(CheckpointCorruptedError):
  """The checkpoint was written in a format this version cannot read (e.g. a newer one).

  Also raised for a file that breaks its format's rules (a crafted or damaged
  safetensors header, orbax-checkpoint metadata or manifest: an offset outside
  the data, a negative dimension, a path leaving the checkpoint directory); the
  message names the file, the field and the value.

  Example:
    >>> import orbax_flax as ofx, tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> _ = open(f, "wb").write(b"\\x02" + b"\\x00" * 7 + b"[]")
    >>> try:
    ...   ofx.restore(f)
    ... except ofx.CheckpointFormatError as e:
    ...   print(str(e).split(": ", 1)[1])
    the header is a list ([]), not a JSON object
  """


class TreeMismatchError(CheckpointError, ValueError):
  """The restore target and the checkpoint disagree (keys, shapes, kinds).

  Attributes:
    differences: one human-readable line per difference, by key path.
    summary: the message less its advice (a diagnosis, counts, the first paths),
      for a caller that words its own advice.
  """

  def __init__(self, message: str, differences: list[str], summary: str | None = None):
    super().__init__(message)
    self.differences = list(differences)
    self.summary = message if summary is None else summary


class UnsupportedLeafError(CheckpointError, TypeError):
  """A pytree leaf has a type that cannot be saved."""


class SaveCancelledError(CheckpointError):
  """A save was cancelled, on this process or another, before it committed.

  Nothing was committed; the step's data, if any was written, is a leftover.
  Raised when a preemption grace period runs out on some process.
  """


class StorageError(CheckpointError, OSError):
  """The storage backend failed or could not be reached."""


class WriterConflictError(CheckpointError, RuntimeError):
  """Another live job (or manager) writes the directory: a directory of steps has one writer.

  The message names the holder (host, process id, since when). Stop that job,
  or read the directory without writing (``restore``, ``all_steps``,
  :func:`orbax_flax.checkpoints_iterator`): readers need no lease.
  """
