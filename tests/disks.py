"""Disks for tests: a real, small file system that fills up (a tmpfs mounted for one test,
needs root), bit rot in a step, and a record of the calls that make writes durable."""

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


def flip_a_bit_in_the_largest_data_file(step_dir, mask=0x01):
  """Bit rot: XORs ``mask`` into the middle byte of the largest data file (``d/``) of a step."""
  files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs
           if f"{os.sep}d{os.sep}" in os.path.join(r, f)]
  victim = max(files, key=os.path.getsize)
  with open(victim, "r+b") as f:
    f.seek(os.path.getsize(victim) // 2)
    b = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([b[0] ^ mask]))


def durability_spies(events):
  """Stand-ins for ``os.fsync``, ``os.rename`` and ``os.replace`` (name -> function) that
  append ``("fsync", path)`` or ``(name, source, destination)`` (real paths) to ``events``,
  then make the real call: install them with ``monkeypatch.setattr(os, name, f)``, or
  ``setattr`` in a worker process."""
  real = {"fsync": os.fsync, "rename": os.rename, "replace": os.replace}

  def fsync(fd):
    n = fd if isinstance(fd, int) else fd.fileno()
    events.append(("fsync", os.readlink(f"/proc/self/fd/{n}")))
    return real["fsync"](fd)

  def moving(name):
    def move(a, b, *args, **kw):
      events.append((name, os.path.realpath(a), os.path.realpath(b)))
      return real[name](a, b, *args, **kw)
    return move
  return {"fsync": fsync, "rename": moving("rename"), "replace": moving("replace")}
