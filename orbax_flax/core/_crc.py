"""CRC-32C (Castagnoli), the checksum of zarr3's ``crc32c`` codec, at hardware speed.

``google-crc32c`` wraps Google's C library, which uses the CPU's CRC32
instruction. Its Python functions hold the GIL for anything but ``bytes``, so
reading threads would take turns; called through ctypes, the same C function
releases the GIL and checksums run in parallel with the reads. Where the
bundled library cannot be found, the Python functions are used.

Example:
  >>> import numpy as np
  >>> value(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283
  True
  >>> extend(value(np.frombuffer(b"1234", np.uint8)), np.frombuffer(b"56789", np.uint8)) == 0xE3069283
  True
"""

from __future__ import annotations

import ctypes
import glob
import os

import google_crc32c
import numpy as np


def _load():
  base = os.path.dirname(os.path.dirname(os.path.abspath(google_crc32c.__file__)))
  for pattern in ("google_crc32c.libs/libcrc32c*", "google_crc32c/.dylibs/libcrc32c*"):
    for path in sorted(glob.glob(os.path.join(base, pattern))):
      try:
        lib = ctypes.CDLL(path)
        fn = lib.crc32c_extend
      except (OSError, AttributeError):
        continue
      fn.restype = ctypes.c_uint32
      fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
      return fn
  return None


_EXTEND = _load()


def extend(crc: int, data: np.ndarray) -> int:
  """The CRC-32C of everything so far (``crc``) followed by ``data`` (contiguous)."""
  if _EXTEND is not None and data.flags.c_contiguous:
    return int(_EXTEND(crc, data.ctypes.data, data.nbytes))
  return google_crc32c.extend(crc, np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def value(data: np.ndarray) -> int:
  """The CRC-32C of ``data``."""
  return extend(0, data)
