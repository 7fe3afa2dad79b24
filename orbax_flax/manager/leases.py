"""Leases on a directory of steps: its one writer, and the readers that keep a step.

The writer lease (:class:`WriterLease`, the manager's side): a directory of
steps has one writer, the job whose manager saves there. Every decision that
creates, moves, retires or deletes a step is taken by that manager's
:class:`~orbax_flax.manager.registry.StepRegistry` while it holds
``<directory>/.writer``, a small file naming the holder (host, process id,
when it was last refreshed). A second writer is refused with
:class:`~orbax_flax.errors.WriterConflictError` naming the first. The lease
survives kills: a holder whose process is gone (on this host) or that has not
refreshed it for ``WRITER_SECONDS`` is taken over; on another host, whose clock may
differ from this one's, "not refreshed" is what this process saw: the record unchanged for
``WRITER_SECONDS`` while it waited (:meth:`Holder.alive`). A process is known by more
than its pid, which names another process after a reboot, in another pid
namespace (a restarted container is pid 1 again) or once reused: the record
holds the host's boot id, the pid namespace and the process's start time, and a
holder on this host runs only if all of them match (a record without them, from
an earlier version, by its pid alone). A holder with this very process's pid is
alive only while this process refreshes it (another manager here, not closed:
the conflict says so). A holder in another pid namespace of this host cannot be
looked up, so it counts as gone: should it be alive (two containers with one
host name writing one directory), it finds the lease taken at its next refresh
and changes nothing more. The lease is released by ``close()``, and also when
its manager is collected without it (the refresh thread holds the lease weakly)
or at the interpreter's exit. Readers (``ofx.restore``,
:func:`orbax_flax.checkpoints_iterator`, a manager that only restores and
lists) need no lease to read; such a manager takes the writer lease only for
its start-up sweep, when no writer holds it.

Reader leases (the evaluator's side, :func:`orbax_flax.checkpoints_iterator`):
while a reader holds a step it keeps a small file
``<directory>/.readers/<step>-<token>`` fresh. A lease not refreshed for
``LEASE_SECONDS`` is ignored (a reader that died holding one).

The protocol between a deleting manager and a leasing reader. Each side
announces its intent before it reads the other's, so that whatever the
interleaving, at least one of them sees the other (single-key writes and reads
are linearizable on a local file system, on S3 and on GCS):

* The manager (:func:`announce_deletion`, then :func:`leased_steps`): for the
  steps it wants to delete it first writes a *deletion notice*
  ``.readers/deleting-<step>``, then lists the leases. A leased step is kept (its
  notice removed, :func:`withdraw_deletion`) and retried at a later save. An
  unleased step is uncommitted (``step_dir.delete_step``) and only then is its
  notice removed.
* The reader (:func:`orbax_flax.checkpoints_iterator`): it writes its lease
  first (:class:`Lease`), then checks that no deletion notice names the step
  (:func:`deletion_announced`), and only then that the step is still
  committed. A step with a notice, or no longer committed, is skipped with a
  log line (its lease released); otherwise it is yielded.

Why it is safe: if the manager's listing missed the lease, that listing came
before the lease was written, so the notice was written before the reader looks
for it. The reader either sees the notice (and skips), or the notice is gone
already, which happens only after the step was uncommitted (and the reader's
next check, that the step is committed, fails). Both sides seeing each other
is safe too: the step stays, the reader skips it, and the manager deletes it at
a later save.

A reader ignores a notice older than ``LEASE_SECONDS + CLOCK_SKEW_SECONDS`` by its
clock (the notice's time is the writer's): a manager killed after announcing leaves one
behind, and readers skip that step (which its retention had chosen to delete) until the
next deletion of it removes the notice, or for about an hour at most. So that an old notice is never mistaken for a
live one, a manager whose lease listing took longer than a quarter of that
deletes nothing and tries again at a later save. No start-up sweep removes
notices: a second manager on the same directory (an evaluator's) could remove
a live one.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable

from orbax_flax.core import _location
from orbax_flax import errors
from orbax_flax.core._location import Location

log = logging.getLogger("orbax_flax")

READERS = ".readers"
DELETING = "deleting-"  # a deletion notice: .readers/deleting-<step>
LEASE_SECONDS = 3600.0  # leases and notices older than this are ignored
# Hosts whose clocks differ by more than this are out of any time service's reach: a lease
# (a reader's, or another host's writer lease) older than its limit plus this, by this
# host's clock, is a dead process's without watching it (Holder.alive, leased_steps).
CLOCK_SKEW_SECONDS = 600.0


def _lease_dir(loc: Location) -> Location:
  return loc.join(READERS)


def _notice(step: int) -> str:
  return f"{DELETING}{step}"


def _write(loc: Location, key: str, new: bool = False) -> None:
  """Writes (or rewrites) a small key under ``<loc>/.readers``, holding the time.

  ``new``: a key no one else writes (a notice, a new lease): should the write fail (a full
  disk makes the file, then has no room for its bytes), the file is removed again, else its
  age would make it a live lease or notice for an hour. A refresh (``new`` False) never
  removes: a lease whose rewrite failed is still held, and kept by its age.
  """
  data = str(time.time()).encode()
  d = _lease_dir(loc)
  if not loc.is_local:
    _location.write_key(d, key, data)
    return
  path = os.path.join(d.local_path, key)
  # A manager removes an empty .readers directory after its deletions: make it again.
  for attempt in range(5):
    try:
      with open(path, "wb") as f:
        try:
          f.write(data)
          f.flush()
        except OSError:
          if new:
            os.unlink(path)
          raise
      return
    except FileNotFoundError as e:
      if attempt == 4:
        raise _location.storage_error(d, f"writing {key!r}", e) from e
      try:
        os.makedirs(d.local_path, exist_ok=True)
      except OSError as e2:
        raise _location.storage_error(d, f"creating {d}", e2) from e2
    except OSError as e:
      raise _location.storage_error(d, f"writing {key!r}", e) from e


def _written(loc: Location, key: str) -> float | None:
  """When ``<loc>/.readers/<key>`` was last written, by the writer's clock (a file's
  modification time: its file system's); None if it is absent or unreadable."""
  d = _lease_dir(loc)
  if loc.is_local:
    try:
      return os.path.getmtime(os.path.join(d.local_path, key))
    except (FileNotFoundError, NotADirectoryError):
      return None
  data = _location.read_key(d, key)
  try:
    return None if data is None else float(data.decode())
  except (ValueError, UnicodeDecodeError):
    return None


def _reader_keys(loc: Location) -> list[str]:
  """The names under ``<loc>/.readers`` (leases and deletion notices); none if it is absent."""
  if not loc.is_local:
    return _location.list_keys(_lease_dir(loc))
  try:
    return os.listdir(os.path.join(loc.local_path, READERS))
  except (FileNotFoundError, NotADirectoryError):
    return []
  except OSError as e:
    raise _location.storage_error(loc, f"listing the reader leases in {READERS}", e) from e


def leased_steps(loc: Location, seen: dict[str, tuple[float, float]]) -> set[int]:
  """Steps under ``loc`` that a live reader lease protects from deletion.

  Called by the directory's writer as it deletes. A lease's time is its reader's clock (or
  its file system's), which may differ from this host's by minutes, so it is judged by what
  this writer saw, as the writer lease is (:meth:`Holder.alive`): ``seen`` (the writer's
  own, kept between calls) holds each lease's last written time and when this process first
  saw it so. A lease is stale once this process has seen it unchanged for ``LEASE_SECONDS``,
  or when it is older than ``LEASE_SECONDS + CLOCK_SKEW_SECONDS`` by this host's clock (a
  reader killed long ago). A stale lease is removed here, so that one per killed evaluator
  does not stay for the life of the directory, listed (read, on an object store) at every
  deletion. A reader that was only stalled writes it again at its next refresh.
  The removal is best effort: a lease that cannot be removed is stale all the same (it
  protects nothing), so its failure is logged and the deletion goes on."""
  now, watching = time.time(), time.monotonic()
  out: set[int] = set()
  listed = set()
  for name in _reader_keys(loc):
    head, _, rest = name.partition("-")
    if head.isdigit() and rest:
      written = _written(loc, name)
      if written is None:
        continue  # released meanwhile
      listed.add(name)
      if seen.get(name, (None,))[0] != written:
        seen[name] = (written, watching)
      if (watching - seen[name][1] < LEASE_SECONDS
          and now - written < LEASE_SECONDS + CLOCK_SKEW_SECONDS):
        out.add(int(head))
        continue
      try:
        _location.delete_key(_lease_dir(loc), name)
      except errors.StorageError as e:
        log.warning("could not remove the stale reader lease %s (it protects nothing and is"
                    " tried again at the next deletion): %s", name, e)
  for name in set(seen) - listed:  # released, or removed above
    del seen[name]
  return out


def announce_deletion(loc: Location, steps: Iterable[int]) -> None:
  """The manager's first move: a deletion notice for each step, before it reads the leases.

  No notice, no deletion: a reader that could not write its lease reads on without one
  (:func:`orbax_flax.checkpoints_iterator` on a read-only or full disk), protected by the
  notices alone. So on a full disk the deletion fails (tried again at the next), with an
  error that says what little room it needs and the way out.
  """
  for step in steps:
    try:
      _write(loc, _notice(step), new=True)
    except errors.StorageError as e:
      if not disk_full(e):
        raise
      raise errors.StorageError(
          f"deleting step {step} of {loc}, which no keep rule keeps, failed: the disk is full,"
          " and a deletion first writes a small notice for readers (a few KB; an evaluator"
          " may be reading the step without a lease of its own). Nothing was deleted; the"
          " deletion is tried again at the next save. Fix: free a little room there (the"
          " next deletion then gives back the step's), or, if no evaluator reads the"
          f" directory, remove the step by hand (rm -rf {loc.join(str(step))}).") from e


def disk_full(e: BaseException | None) -> bool:
  """Whether ``e``, or what it was raised from, is a disk (or quota) with no room left."""
  while e is not None:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    e = e.__cause__
  return False


def withdraw_deletion(loc: Location, steps: Iterable[int]) -> None:
  """Removes the notices of ``steps`` (deleted by now, or kept for a reader).

  On a local file system the ``.readers`` directory goes too once it is
  empty, so that a directory no evaluator ever read looks as before.
  """
  d = _lease_dir(loc)
  for step in steps:
    _location.delete_key(d, _notice(step))
  if loc.is_local:
    try:
      os.rmdir(d.local_path)  # only if empty: a lease written meanwhile stays
    except OSError:
      pass


def withdraw_stale_notices(loc: Location) -> list[int]:
  """Removes every deletion notice under ``loc``: called by a job that has just become the
  directory's writer (no other writer lives), they are a dead writer's, killed between its
  notice and its withdrawal. Left, one would make evaluators skip a later save of that step
  number (a rollback's new run) for ``LEASE_SECONDS``. Returns the steps they named."""
  names = _reader_keys(loc)
  steps = sorted(int(n[len(DELETING):]) for n in names
                 if n.startswith(DELETING) and n[len(DELETING):].isdigit())
  if steps:
    withdraw_deletion(loc, steps)
  return steps


def deletion_announced(loc: Location, step: int) -> bool:
  """Whether a manager has announced that it deletes ``step``: a notice written less than
  ``LEASE_SECONDS + CLOCK_SKEW_SECONDS`` ago by this reader's clock (the notice's time is
  the writer's clock: a reader whose clock is ahead by up to CLOCK_SKEW_SECONDS still sees
  it live; one behind always does)."""
  written = _written(loc, _notice(step))
  return written is not None and time.time() - written < LEASE_SECONDS + CLOCK_SKEW_SECONDS


class Lease:
  """One reader lease on ``step`` under ``loc``: taken now, kept fresh from a thread, released."""

  def __init__(self, loc: Location, step: int):
    self._loc = loc
    self._dir = _lease_dir(loc)
    self.key = f"{step}-{uuid.uuid4().hex[:12]}"
    _write(loc, self.key, new=True)  # not left behind, empty, if it cannot be written
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._keep_fresh, daemon=True,
                                    name="orbax_flax-reader-lease")
    self._thread.start()

  def refresh(self) -> None:
    _write(self._loc, self.key)

  def _keep_fresh(self) -> None:
    while not self._done.wait(LEASE_SECONDS / 4):
      try:
        self.refresh()
      except errors.StorageError as e:
        log.warning("could not refresh reader lease %s: %s", self.key, e)

  def release(self) -> None:
    self._done.set()
    try:
      _location.delete_key(self._dir, self.key)
    except errors.StorageError as e:  # a stale lease only delays a deletion by LEASE_SECONDS
      log.warning("could not remove reader lease %s: %s", self.key, e)


# ---------------------------------------------------------------------- the writer lease

WRITER = ".writer"        # <directory>/.writer: the one writer's lease
WRITER_SECONDS = 60.0     # a writer lease not refreshed for this long is a dead writer's
_THREAD = "orbax_flax-writer-lease-"  # + the owner token: the refresh thread of a live lease


def _read_proc(path: str) -> str | None:
  try:
    with open(path, encoding="ascii", errors="replace") as f:
      return f.read()
  except OSError:
    return None


def _boot_id() -> str | None:
  """This host's boot id (Linux): it changes at every boot, so a record from another boot is
  a process that has gone."""
  text = _read_proc("/proc/sys/kernel/random/boot_id")
  return text.strip() or None if text else None


def _pid_namespace() -> str | None:
  """This process's pid namespace (``pid:[<inode>]``, Linux): a pid means a process only
  inside its namespace (a restarted container is pid 1 again, in a new one)."""
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return None


def _start_time(pid: int) -> int | None:
  """When process ``pid`` started (clock ticks after boot: field 22 of ``/proc/<pid>/stat``),
  which tells a process from a later one that reuses its pid."""
  text = _read_proc(f"/proc/{pid}/stat")
  try:  # the command name (field 2) may hold spaces and parentheses: fields 3.. follow the last ")"
    return int(text.rpartition(")")[2].split()[19]) if text else None
  except (IndexError, ValueError):
    return None


def _refreshed_here(owner: str) -> bool:
  """Whether this process holds (or is taking) the lease ``owner``: its refresh thread runs."""
  return any(t.name == _THREAD + owner and t.is_alive() for t in threading.enumerate())


@dataclasses.dataclass(frozen=True)
class Holder:
  """Who holds a writer lease, as recorded in ``.writer``.

  A process is known by its host and pid, and, where its host could tell (Linux), by the
  host's boot id, its pid namespace and its start time: a pid alone names another process
  after a reboot, in another container, or once the pid is reused. A record without them
  (an earlier version's) is known by host and pid only.
  """
  owner: str           # a token unique to the lease (one manager)
  host: str
  pid: int
  time: float          # last refreshed (the holder's clock)
  purpose: str         # "writer" (a saving manager) or "sweep" (a start-up sweep, seconds)
  boot: str | None = None   # the host's boot id
  pidns: str | None = None  # the pid namespace, "pid:[<inode>]"
  start: int | None = None  # the process's start time, clock ticks after boot

  def describe(self, now: float) -> str:
    clock = "" if self.here() else " by its host's clock"
    return (f"{'a training job' if self.purpose == 'writer' else 'a manager starting up'} on"
            f" host {self.host!r}, process id {self.pid}, lease refreshed {now - self.time:.0f} s"
            f" ago{clock}")

  def here(self) -> bool:
    """Whether the holder is on this host."""
    return self.host == socket.gethostname()

  def this_process(self) -> bool:
    """Whether the holder is a live lease of this very process (another manager here)."""
    return self.here() and self.pid == os.getpid() and self._runs()

  def alive(self, now: float, unchanged_s: float = 0.0) -> bool:
    """Whether the holder may still be writing (``now``: this host's clock).

    On this host (one clock): refreshed within ``WRITER_SECONDS``, and its process runs.
    Another host's clock may differ from this one's by minutes, so its record's time tells
    little: it is alive until this process has seen its record unchanged for
    ``WRITER_SECONDS`` (``unchanged_s``: how long so far), or unless its time is more than
    ``WRITER_SECONDS + CLOCK_SKEW_SECONDS`` behind this host's clock. A live holder on a
    host whose clock is behind by less than ``CLOCK_SKEW_SECONDS`` is never taken for dead
    (hosts further apart are taken to be out of any time service's reach), and a dead one
    on a host whose clock was ahead is taken over after ``WRITER_SECONDS`` of watching.
    """
    if self.here():
      return now - self.time <= WRITER_SECONDS and self._runs()
    return unchanged_s < WRITER_SECONDS and now - self.time <= WRITER_SECONDS + CLOCK_SKEW_SECONDS

  def record_id(self) -> tuple[str, float]:
    """What changes at each refresh of the record."""
    return self.owner, self.time

  def _runs(self) -> bool:
    """On this host: whether the holder's process runs, every identity it recorded matching
    this one's (another boot or another pid namespace: gone; see the module docstring)."""
    for recorded, ours in ((self.boot, _boot_id()), (self.pidns, _pid_namespace())):
      if recorded is not None and ours is not None and recorded != ours:
        return False
    if self.pid == os.getpid():  # this process: alive only as a lease it refreshes
      return _refreshed_here(self.owner)
    try:
      os.kill(self.pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      pass
    started = _start_time(self.pid) if self.start is not None else None
    return started is None or started == self.start  # else a later process with its pid


def _decode(data: bytes | None) -> Holder | None:
  if not data:
    return None
  try:
    d = json.loads(data.decode())
    optional = lambda k, kind: None if d.get(k) is None else kind(d[k])  # noqa: E731
    return Holder(str(d["owner"]), str(d["host"]), int(d["pid"]), float(d["time"]),
                  str(d.get("purpose", "writer")), optional("boot", str),
                  optional("pidns", str), optional("start", int))
  except (ValueError, KeyError, TypeError, UnicodeDecodeError):
    return None  # a torn or foreign file: nobody's lease


@dataclasses.dataclass(frozen=True)
class _Claim:
  """What a lease writes and removes: everything but the lease object itself, so that what
  runs after the lease is gone (its refresh thread, its finalizer) keeps nothing alive."""
  loc: Location
  owner: str
  purpose: str
  clock: Callable[[], float]
  pid: int = dataclasses.field(default_factory=os.getpid)  # the process that holds it

  def record(self) -> bytes:
    pid = os.getpid()
    return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": pid,
                       "time": self.clock(), "purpose": self.purpose, "boot": _boot_id(),
                       "pidns": _pid_namespace(), "start": _start_time(pid)}).encode()

  def swap(self, take: bool, refresh: bool = False, loc: Location | None = None,
           unchanged: Callable[[Holder], float] = lambda holder: 0.0) -> Holder | None:
    """One atomic look-and-write: writes our record if the lease is free, stale or ours
    (``take``), or removes it if ours (not ``take``). Returns the live other holder, if any;
    with ``refresh`` (a held lease's refresh), any other holder: it took the lease over.
    ``loc``: where to look, if not the lease's own location (it without retries).
    ``unchanged(holder)``: for how long the caller has seen that very record (see
    :meth:`Holder.alive`)."""
    loc = loc or self.loc
    now = self.clock()
    taken = lambda c: (c is not None and c.owner != self.owner  # noqa: E731
                       and (refresh or c.alive(now, unchanged(c))))
    if loc.is_local:
      root = loc.local_path
      try:
        if take:
          os.makedirs(root, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
      except FileNotFoundError:
        if take:
          raise _location.storage_error(loc, "creating the directory of steps",
                                        FileNotFoundError(root)) from None
        return None
      except OSError as e:
        raise _location.storage_error(loc, "creating the directory of steps", e) from e
      try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released with the fd, and by the kernel at a kill
        path = os.path.join(root, WRITER)
        try:
          with _location.open_plain(path, root) as f:
            current = _decode(f.read())
        except FileNotFoundError:
          current = None
        if taken(current):
          return current
        if take:  # in place, under the lock: a kill mid-write leaves a torn file, nobody's lease
          with open(path, "wb") as f:
            f.write(self.record())
            f.flush()
            os.fsync(f.fileno())
        elif current is not None and current.owner == self.owner:
          os.remove(path)
        return None
      except OSError as e:
        raise _location.storage_error(loc, "taking the writer lease", e) from e
      finally:
        os.close(fd)
    try:
      store = _location.open_kvstore(loc)
      got = store.read(WRITER).result()
      current = _decode(got.value if got.state == "value" else None)
      if taken(current):
        return current
      if take or (current is not None and current.owner == self.owner):
        written = store.write(WRITER, self.record() if take else None,
                              if_equal=got.stamp.generation).result()
        if not written.generation and take:  # someone wrote it since we read: look again
          again = store.read(WRITER).result()
          other = _decode(again.value if again.state == "value" else None)
          if other is not None and other.owner != self.owner:
            return other
      return None
    except ValueError as e:
      raise _location.storage_error(loc, "taking the writer lease", e) from e


def _keep_fresh(lease_ref: weakref.ref, claim: _Claim, done: threading.Event,
                held: threading.Event) -> None:
  """The refresh thread of a lease, holding it only weakly: a lease whose manager was
  dropped without close() is collected (its finalizer releases it) and this thread ends."""
  while not done.wait(WRITER_SECONDS / 6):
    if not held.is_set():
      continue  # still being acquired
    lease = lease_ref()  # held during the refresh: released (finalized) before or after it
    if lease is None or done.is_set():
      return
    try:
      other = claim.swap(take=True, refresh=True)
    except errors.StorageError as e:
      log.warning("could not refresh the writer lease of %s: %s", claim.loc, e)
      other = None
    if other is not None:
      lease.lost(other.describe(claim.clock()))
      return
    del lease  # (the last reference, where the manager was dropped: finalized here)


def _release(claim: _Claim, done: threading.Event, held: threading.Event,
             retries: bool = True) -> None:
  """Removes the record if it is still ours (the finalizer of a lease: also when its
  manager was dropped without close(), and at the interpreter's exit). ``retries=False``:
  one attempt per request. Nothing in another process: a child forked from the holder
  inherits this finalizer, and its exit must leave its parent's lease alone."""
  if os.getpid() != claim.pid:
    return
  done.set()
  if not held.is_set():
    return
  held.clear()
  try:
    claim.swap(take=False, loc=None if retries else _location.without_retries(claim.loc))
  except errors.StorageError as e:  # an unreleased lease only delays the next writer
    log.warning("could not release the writer lease of %s: %s", claim.loc, e)


class WriterLease:
  """The lease that makes this process the one writer of ``loc`` (see the module docstring).

  :meth:`acquire` takes it (or raises :class:`~orbax_flax.errors.WriterConflictError`);
  while held, a daemon thread refreshes it every ``WRITER_SECONDS / 6`` s;
  :meth:`release` removes it, and so does the lease's collection (a manager dropped without
  ``close()``) or the interpreter's exit. A lease lost meanwhile (another job took it over
  because this one stopped refreshing, e.g. while the process was stopped, or because it
  took this one for gone) makes :meth:`check` raise before this process changes anything
  more.

  Example:
    >>> import tempfile, orbax_flax as ofx
    >>> from orbax_flax.core._location import Location
    >>> loc = Location.parse(tempfile.mkdtemp())
    >>> lease = WriterLease(loc)
    >>> lease.acquire()
    >>> WriterLease(loc).acquire(wait_s=0)
    Traceback (most recent call last):
    ...
    orbax_flax.errors.WriterConflictError: ...
    >>> lease.release()
  """

  def __init__(self, loc: Location, *, purpose: str = "writer",
               clock=time.time):
    self._claim = _Claim(loc, uuid.uuid4().hex, purpose, clock)
    self._loc = loc
    self.owner = self._claim.owner
    self._held = threading.Event()
    self._lost: str | None = None
    self._done = threading.Event()
    self._thread: threading.Thread | None = None
    self._finalizer: weakref.finalize | None = None

  @property
  def held(self) -> bool:
    return self._held.is_set()

  def acquire(self, wait_s: float | None = None) -> None:
    """Takes the lease, waiting up to ``wait_s`` s (default ``WRITER_SECONDS + 5``) for a
    holder that may be gone.

    A holder on this host whose process runs and that is a saving manager is
    alive for sure: refused at once. A start-up sweep (seconds) and a holder on
    another host (alive or not: a crashed job's lease is taken over once this process has
    seen it unchanged for ``WRITER_SECONDS``, :meth:`Holder.alive`) are waited for.

    Raises:
      WriterConflictError: another live writer holds the directory.
    """
    if self.held:
      return
    # The refresh thread runs from before the record is written: it is what tells another
    # manager of this process that the record with this pid is a live lease.
    self._done, self._lost = threading.Event(), None
    self._thread = threading.Thread(
        target=_keep_fresh, args=(weakref.ref(self), self._claim, self._done, self._held),
        daemon=True, name=_THREAD + self.owner)
    self._thread.start()
    try:
      self._wait_for(wait_s)
    except BaseException:
      self._done.set()
      raise
    self._held.set()
    self._finalizer = weakref.finalize(self, _release, self._claim, self._done, self._held)

  def _wait_for(self, wait_s: float | None) -> None:
    deadline = time.monotonic() + (WRITER_SECONDS + 5 if wait_s is None else wait_s)
    warned = False
    seen: dict[tuple[str, float], float] = {}  # a record -> when this process first saw it
    unchanged = lambda c: time.monotonic() - seen.get(c.record_id(), time.monotonic())  # noqa: E731
    while True:
      other = self._claim.swap(take=True, unchanged=unchanged)
      if other is None:
        return
      seen.setdefault(other.record_id(), time.monotonic())
      now = self._claim.clock()
      if other.this_process():
        raise errors.WriterConflictError(
            f"{self._loc} has a writer already: another CheckpointManager of this very process"
            f" ({other.describe(now)}), still open, or closed by an interrupted close() while the"
            " save it abandoned still stops (it lets go once that save has ended). A directory"
            " of steps has one writer: close() that earlier manager (or use it instead of a new"
            " one); a manager dropped without"
            " close() lets go of the directory once collected and its save in flight has ended"
            " (`del` it and gc.collect(), e.g. after re-running a notebook cell), or restart the"
            " kernel.")
      certain = other.purpose == "writer" and other.here()
      if certain or time.monotonic() >= deadline:
        raise errors.WriterConflictError(
            f"{self._loc} has a writer already: {other.describe(now)}. A directory of steps has"
            " one writer. Stop that job (or close its CheckpointManager) before saving here, or"
            " give this job another directory; to only read the steps, restore and list"
            " without saving (or use orbax_flax.checkpoints_iterator). A writer that died"
            " leaves a lease behind: on this host it is taken over once its process is gone;"
            " from another host once a save here has seen it unchanged for"
            f" {WRITER_SECONDS:.0f} s (it waits that long).")
      if not warned and other.purpose == "writer":
        log.warning("%s: waiting up to %.0f s for the writer lease of %s (a job that died"
                    " leaves one behind until it expires)", self._loc,
                    deadline - time.monotonic(), other.describe(now))
        warned = True
      time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))

  def lost(self, holder: str) -> None:
    """The refresh found the lease taken over by ``holder``: this process writes no more."""
    self._lost = holder
    log.error("%s: the writer lease was taken over by %s; this manager changes nothing"
              " more there", self._loc, holder)

  def check(self) -> None:
    """Raises if the lease was lost (another writer took over)."""
    if self._lost is not None:
      raise errors.WriterConflictError(
          f"{self._loc}: this job's writer lease was taken over by {self._lost} (this process"
          f" did not refresh it for {WRITER_SECONDS:.0f} s: stopped or cut off; or the other"
          " job took this one for gone: on the same host but in another pid namespace, e.g."
          " another container). Two jobs now write the directory: stop one of them.")

  def release(self, *, retries: bool = True) -> None:
    """Gives the lease up (nothing if not held).

    ``retries=False``: one attempt per request, after the store stopped answering (the
    caller's last call at it ran through its retries); a lease left behind only makes the
    next writer wait for it to expire (``WRITER_SECONDS``).
    """
    self._done.set()
    thread, self._thread = self._thread, None
    if thread is not None and thread is not threading.current_thread():
      thread.join(5)
    if self._finalizer is not None:
      self._finalizer.detach()
      self._finalizer = None
    if self._lost is None:
      _release(self._claim, self._done, self._held, retries)
    self._held.clear()
