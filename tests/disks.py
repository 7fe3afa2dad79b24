"""A real, small file system that fills up: a tmpfs mounted for one test (needs root)."""

import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_disk(path, size="4m", read_only=False):
  """A real tmpfs of ``size`` mounted at ``path``; skips the test where mounting is refused.

  ``read_only``: mounted read-only (chmod would not stop root, who runs the tests).
  """
  os.makedirs(path, exist_ok=True)
  options = ("ro," if read_only else "") + f"size={size}"
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                     capture_output=True, text=True, check=False)
  if r.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.strip()}")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", path], check=False)
