"""Re-reading a whole checkpoint to check every checksum.

Restores check the chunks they read; :func:`verify` reads them all, one array
at a time (so memory stays bounded by the largest array), and reports every
damaged array, not just the first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from orbax_flax import _tree
from orbax_flax import errors
from orbax_flax import restoring
from orbax_flax import saving
from orbax_flax._location import Location


def verify(path: Any) -> int:
  """Reads every chunk of a checkpoint and checks its checksum.

  Args:
    path: the checkpoint.

  Returns:
    The number of array bytes verified.

  Raises:
    CheckpointNotFoundError: no committed checkpoint at ``path``.
    CheckpointCorruptedError: listing every array whose bytes are damaged.

  Example:
    >>> import numpy as np, orbax_flax as ofx, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> ofx.save(path, {"state": {"w": np.ones((4, 4), np.float32)}})
    >>> ofx.verify(path)
    64
  """
  loc = Location.parse(path)
  saving.wait_for_inflight_save(loc)
  manifest = restoring.read_manifest(loc)  # checks the manifest's own hashes
  problems: list[str] = []
  verified = 0
  for item, saved in manifest["items"].items():
    batches: list[list[restoring._Want]] = []  # pylint: disable=protected-access
    packed: list[restoring._Want] = []  # pylint: disable=protected-access
    for rec in saved["leaves"]:
      if rec["kind"] == "value" or not rec["owners"]:
        continue
      shape = tuple(rec["shape"])
      want = restoring._Want(item, rec, np.dtype(_tree.dtype_from_name(rec["dtype"])), None,  # pylint: disable=protected-access
                             shape, None, {tuple((0, s) for s in shape): []})
      if "packed_offset" in rec:
        packed.append(want)      # small arrays: read together
      else:
        batches.append([want])   # one large array at a time
    if packed:
      batches.insert(0, packed)
    for batch in batches:
      try:
        restoring._read(loc, manifest, batch)  # pylint: disable=protected-access
        verified += sum(w.rec["nbytes"] for w in batch)
      except errors.CheckpointCorruptedError as e:
        problems.append(str(e))
  if problems:
    raise errors.CheckpointCorruptedError(
        f"{len(problems)} damaged array group(s) in {loc}:\n  " + "\n  ".join(problems))
  return verified
