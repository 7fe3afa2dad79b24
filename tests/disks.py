"""A real, small file system that fills up: a tmpfs mounted for one test (needs root)."""

import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_disk(path, size="4m"):
  """A real tmpfs of ``size`` mounted at ``path``; skips the test where mounting is refused."""
  os.makedirs(path, exist_ok=True)
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                     capture_output=True, text=True, check=False)
  if r.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs to fill a disk (needs root): {r.stderr.strip()}")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", path], check=False)
