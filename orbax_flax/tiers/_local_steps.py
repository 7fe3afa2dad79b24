"""The local tier's steps on this process's own disk: one directory per step, a sealed record.

``<local_directory>/run-<digest>/process_<i>/<step>/`` holds this process's
blob (:data:`OWN`), the peers' replicas it keeps (``replica-<q>.blob``) and,
written last, :data:`COMMITTED`, a sealed :class:`StepRecord`: a step without a
valid record does not exist. :class:`StepDirectory` lists, commits, prunes and
discards the steps of one run in one process's directory, and sweeps away what
a failed save left uncommitted; :class:`Sink` writes a
replica as it arrives. Which steps to save and how processes agree is
:mod:`orbax_flax.tiers.local`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Sequence

import numpy as np

from orbax_flax.core import _location
from orbax_flax.format import _manifest
from orbax_flax.core import _progress
from orbax_flax import errors
from orbax_flax.tiers import _blob
from orbax_flax.tiers.placement import Holdings

OWN = "own.blob"
COMMITTED = "COMMITTED"
TMP = ".ofx-tmp-local"     # in the name of a step directory still being written
_RECORD_MAGIC = b"orbax_flax local step v1"


def run_identity(run: str) -> str:
  """What identifies the run whose persistent directory is ``run`` in the local tier.

  A local directory (an absolute path, as the manager spells it) is identified by its real
  path, symbolic links resolved: a restart through another spelling of the same workdir
  (``/home/u/exp`` linked to ``/mnt/disk/exp``, ``pwd -L`` and ``pwd -P``) finds the steps
  it saved. A path without links is its own real path, so its identity (and the digest of
  :func:`run_dir`) is the path as spelled. An object-store URL or a spec is taken as given.

  Example:
    >>> run_identity("s3://bucket/exp1/checkpoints")
    's3://bucket/exp1/checkpoints'
  """
  return os.path.realpath(run) if os.path.isabs(run) else run


def run_dir(run: str) -> str:
  """The subdirectory of the local directory that holds the steps of ``run``.

  A digest of the run's persistent directory (its :func:`run_identity`): two jobs that
  share a ``local_directory`` (``/dev/shm/ckpt`` on one host) but save to different
  places never see nor delete each other's local steps.

  Example:
    >>> run_dir("/tmp/exp1/checkpoints") != run_dir("/tmp/exp2/checkpoints")
    True
    >>> run_dir("/tmp/exp1/checkpoints")   # sha256 of the path: /tmp holds no link
    'run-c948a8532e42830d'
  """
  return "run-" + hashlib.sha256(run_identity(run).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """What a local step's ``COMMITTED`` file records (sealed with a SHA-256)."""
  step: int
  run: str               # the persistent directory of the run that saved it
  timeline: str          # the manager's timeline when it was saved (see CheckpointManager.timeline)
  seq: int               # commit order in this directory: retention keeps the newest commits
  process_count: int
  save_id: str = ""      # agreed by the processes; the persistent save of the same step by the
                         # same callback records it too ("local_copy"), else the copy is stale
  base: int | None = None  # the newest persistent step the job had saved (or was saving) then:
                           # a persistent step between it and this one is another run's
                           # (None: not known, a record of an older version)

  def encode(self) -> bytes:
    return _manifest.seal(_RECORD_MAGIC, json.dumps(dataclasses.asdict(self)).encode())

  @classmethod
  def decode(cls, data: bytes, where: str) -> "StepRecord":
    body = _manifest.unseal(_RECORD_MAGIC, data, where)
    try:
      d = json.loads(body)
      base = d.get("base")
      return cls(int(d["step"]), str(d["run"]), str(d["timeline"]), int(d["seq"]),
                 int(d["process_count"]), str(d.get("save_id", "")),
                 None if base is None else int(base))
    except (ValueError, KeyError, TypeError) as e:
      raise errors.CheckpointCorruptedError(f"{where}: not a local step record ({e})") from None


class StepDirectory:
  """The committed local steps of run ``run`` in one process's directory ``root``."""

  def __init__(self, root: str, run: str):
    self.root, self.run = root, run

  def dir(self, step: int) -> str:
    return os.path.join(self.root, str(step))

  def records(self) -> tuple[dict[int, StepRecord], list[str]]:
    """The committed steps here (this run's, by their records), and the damaged ones, why."""
    out, damaged = {}, []
    for name in os.listdir(self.root) if os.path.isdir(self.root) else []:
      path = os.path.join(self.root, name, COMMITTED)
      if not name.isdigit() or not os.path.exists(path):
        continue
      try:
        with _location.open_plain(path, self.root) as f:
          record = StepRecord.decode(f.read(1 << 16), path)
      except (OSError, errors.CheckpointCorruptedError) as e:
        damaged.append(f"step {name}: {e}")
        continue
      if record.run != self.run or record.step != int(name):
        damaged.append(f"step {name}: its record names run {record.run!r} step {record.step}")
        continue
      out[record.step] = record
    return out, damaged

  def commit(self, step: int, timeline: str, process_count: int, save_id: str,
             base: int | None = None) -> None:
    """Makes the step written in ``dir(step) + TMP`` committed here, the newest commit.

    The directory is renamed into place (replacing a step of the same number: one of a
    timeline a rollback abandoned), then its record is written atomically, so that a
    step has a whole record or none. Pruning older steps is the caller's, once every
    process has committed.

    Raises:
      OSError: the step is not committed here (:meth:`discard` removes what is left).
    """
    records, _ = self.records()
    seq = 1 + max((r.seq for r in records.values()), default=0)
    final = self.dir(step)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(final + TMP, final)
    write(os.path.join(final, COMMITTED),
          StepRecord(step, self.run, timeline, seq, process_count, save_id, base).encode())
    _location.fsync_dir(self.root)  # the rename

  def discard(self, step: int) -> None:
    """Removes ``step`` here, committed or not, and its directory still being written; its
    record goes first, so that a removal cut short leaves no committed step."""
    d = self.dir(step)
    with contextlib.suppress(FileNotFoundError):
      os.unlink(os.path.join(d, COMMITTED))
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(d + TMP, ignore_errors=True)

  def sweep(self) -> None:
    """Removes what a save left uncommitted (a step directory without a record, one still
    being written): it holds disk space that the next save needs. Best effort."""
    try:
      names = os.listdir(self.root)
    except OSError:  # no directory yet, or an unreadable one (holdings() says so)
      return
    for name in names:
      path = os.path.join(self.root, name)
      if TMP in name or (name.isdigit() and not os.path.lexists(os.path.join(path, COMMITTED))):
        shutil.rmtree(path, ignore_errors=True)

  def prune(self, max_to_keep: int) -> None:
    """Keeps the ``max_to_keep`` newest commits (not the highest step numbers: after a
    rollback the new timeline's steps are the lower ones) and removes everything else."""
    records, _ = self.records()
    keep = {r.step for r in sorted(records.values(), key=lambda r: r.seq)[-max_to_keep:]}
    for name in os.listdir(self.root):
      if (name.isdigit() and int(name) not in keep) or TMP in name:
        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

  def holdings(self, timeline: str | None, process_count: int,
               persistent: tuple[int, str] | None = None,
               persistent_steps: Sequence[int] = ()) -> Holdings:
    """Committed local steps here (of ``timeline``, if given), and the peers' replicas held
    here; the steps left out, and why, are logged.

    ``persistent`` is ``(step, local_copy)`` of the persistent tier's newest step: a local
    step of that number counts only if it is the copy that save recorded (the same
    ``save_id``); otherwise another save replaced the step there since (a forced re-save by
    another manager, ``convert``), and the persistent tier holds what the step now is.
    ``persistent_steps`` are the persistent tier's committed steps: a local step saved when
    the job's newest persistent step was ``base`` is another lineage's if the persistent tier
    now holds a step after ``base`` and before it (a run without this local tier went on from
    ``base``; the local step is what an earlier run did after it, which that run replaced).
    """
    own, replicas, ids = [], {}, {}
    records, ignored = self.records()
    for step, record in sorted(records.items()):
      if timeline is not None and record.timeline != timeline:
        ignored.append(f"step {step}: of timeline {record.timeline or '(the first)'!r}, which"
                       f" a rollback abandoned; this run continues timeline"
                       f" {timeline or '(the first)'!r}")
        continue
      if record.process_count != process_count:
        ignored.append(f"step {step}: saved by a job of {record.process_count} process(es),"
                       f" this one has {process_count} (a local step is tied to the process"
                       " layout)")
        continue
      if (persistent is not None and step == persistent[0]
          and not (record.save_id and record.save_id == persistent[1])):
        ignored.append(f"step {step}: the persistent tier holds another save of step {step}"
                       f" (a forced re-save, a convert), which is read there")
        continue
      later = [s for s in persistent_steps
               if record.base is not None and record.base < s < step]
      if later:
        ignored.append(f"step {step}: saved when the persistent tier's newest step was"
                       f" {record.base if record.base >= 0 else 'none'}; it holds step(s)"
                       f" {', '.join(map(str, later[:5]))} since, of a run that went on from"
                       " there without this local step")
        continue
      d = self.dir(step)
      ids[step] = record.save_id
      if os.path.exists(os.path.join(d, OWN)):
        own.append(step)
      for f in os.listdir(d):
        if f.startswith("replica-") and f.endswith(".blob") and f[8:-5].isdigit():
          replicas.setdefault(int(f[len("replica-"):-len(".blob")]), []).append(step)
    if ignored:
      _progress.say("local tier (%s): ignoring %s", self.root, "; ".join(ignored))
    return Holdings(sorted(own), {k: sorted(v) for k, v in replicas.items()}, process_count,
                    ids)  # (a step of another process count was passed over above)


class Sink:
  """Writes a replica to ``path`` as its rounds arrive; a failure is kept, not raised, so
  that this process still takes part in the rest of the exchange."""

  def __init__(self, path: str | None):
    self.error: OSError | None = None
    self.fd = None
    if path is not None:
      try:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask
      except OSError as e:
        self.error = e

  def __call__(self, offset: int, chunk: np.ndarray) -> None:
    if self.fd is None or self.error:
      return
    try:  # parallel pwrites, as for the own copy
      _blob.parallel(lambda lo: _blob.pwrite(self.fd, chunk[lo:lo + _blob.SEGMENT], offset + lo),
                     list(range(0, chunk.size, _blob.SEGMENT)))
    except OSError as e:
      self.error = e

  def close(self) -> OSError | None:
    """Fsyncs and closes; returns what failed (None: nothing, or nothing was to be written)."""
    if self.fd is not None:
      try:
        if not self.error:
          os.fsync(self.fd)
      except OSError as e:
        self.error = e
      finally:
        os.close(self.fd)
    return self.error


def write(path: str, data: bytes) -> None:
  """Writes ``data`` to ``path`` atomically and durably: a reader finds all of it or nothing.

  Written and fsynced beside ``path`` first, renamed over it, then its directory fsynced
  (the rename, and the directory's own, made durable).
  """
  tmp = path + TMP
  try:
    with open(tmp, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except OSError:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise
  _location.fsync_dir(os.path.dirname(path))
