"""The local tier: each process's own shards on its own fast disk, replicated to peers.

Layout (``docs/format.md``), per run and process, never read by another run or process:

```
<directory>/run-<digest of the run's persistent directory>/process_<i>/
  <step>/
    own.blob             this process's shards (:mod:`orbax_flax.tiers._blob`): a
                         header, the sealed (SHA-256) index, the bytes (CRC-32C each 16 MiB)
    replica-<q>.blob     the same blob of process q (received with a JAX collective)
    COMMITTED            a sealed record (run, timeline, commit order), written (atomically)
                         once every process reported its part durable; older steps are
                         removed once every process reported its record written
```

A step counts only once ``COMMITTED`` exists: every process (and its replicas)
wrote its part, agreed through the coordination service, so a restore never
mixes steps. A step belongs to a run (the persistent directory) and to a
timeline (:attr:`orbax_flax.CheckpointManager.timeline`): a resume never takes
one of another run or of a timeline a rollback abandoned. A local step is tied
to the process layout that wrote it (the same process count, the same devices
per process, the same shardings): a job passes over the local steps of another
process count (each step records it), and reads the persistent tier where the
local tier holds no step of its own layout.

Restore: every process reports what it holds; each computes, from the same
reports, the newest step every process can get (its own blob, else a peer's
replica of it), and the processes whose own copy is missing receive it from a
replica holder with the same collective. Every process learns every other's
verdict, so a damaged copy anywhere sends all to the replica, then to an older
local step, then to the persistent tier, together. Where copies go and which to read:
:mod:`orbax_flax.tiers.placement`.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import shutil
import socket
import struct
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from orbax_flax.core import _multihost
from orbax_flax.core import _progress
from orbax_flax import errors
from orbax_flax.tiers import _blob
from orbax_flax.tiers import _exchange
from orbax_flax.tiers import placement
from orbax_flax.tiers._local_steps import (COMMITTED, OWN, TMP, Sink, StepDirectory, run_dir,
                                           run_identity)
from orbax_flax.tiers.placement import Holdings
from orbax_flax.tiers.placement import RestorePlan

__all__ = ["COMMITTED", "OWN", "LocalTier", "run_dir", "run_identity"]

log = logging.getLogger("orbax_flax")

_DAMAGED = "damaged own copy: "
_DAMAGED_REPLICA = "damaged replica: "
_MISMATCH = "target mismatch: "
# What reading a damaged local file can raise: it becomes this process's verdict, which every
# process learns, so that all fall back together instead of one raising and the rest waiting.
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, IndexError, OverflowError, MemoryError,
               struct.error)


class LocalTier:
  """Saves and restores this process's shards in ``directory/run-<digest>/process_<i>``.

  Args:
    directory: a fast local directory (e.g. ``/dev/shm/ckpt``), which jobs
      may share: each run uses its own ``run-<digest>`` below it
      (:func:`run_dir`), each process its own ``process_<i>`` below that.
      ``~`` is the home directory, and a relative path is made absolute here,
      once: a later ``os.chdir`` does not move the tier.
    run: what identifies the run, the persistent tier's directory (the
      callback passes its manager's): a local step of another run is never
      read, listed or deleted. A local directory is identified by its real
      path (:func:`run_identity`): any spelling of it finds the same steps.
    replicas: how many other processes hold a copy of each process's shards
      (losing any ``replicas`` local directories loses no local step).
    max_to_keep: committed local steps kept (the newest commits).
    coordination_timeout_seconds: how long a process waits for the others (every wait of
      the tier names the processes it waits for when it times out).
    host: the host this process runs on, which replica placement spreads over
      (:func:`~orbax_flax.tiers.placement.replica_ring`); default: the
      ``ORBAX_FLAX_HOST`` environment variable, else ``socket.gethostname()``. The first save or restore
      gathers every process's host and warns when the topology cannot keep
      each process's replicas on other hosts.
    max_host_bytes: a budget for the host buffers of a replica exchange (0:
      rounds of 64 MiB); a received replica is written as it arrives.
  """

  def __init__(self, directory: str, *, run: str, replicas: int = 1, max_to_keep: int = 1,
               coordination_timeout_seconds: float = _multihost.DEFAULT_TIMEOUT_S,
               host: str | None = None, max_host_bytes: int = 0):
    n = jax.process_count()
    if replicas < 0:
      raise ValueError(f"replicas={replicas}: must be >= 0")
    if n > 1 and replicas > n - 1:
      raise ValueError(f"replicas={replicas} with {n} processes: at most {n - 1} other processes"
                       " can hold a copy; lower replicas")
    if max_to_keep < 1:
      raise ValueError(f"local_max_to_keep={max_to_keep}: keep at least 1 local step")
    self.run = run_identity(run)  # what this process's records and blobs name
    self.directory = os.path.abspath(os.path.expanduser(directory))
    self.root = os.path.join(self.directory, run_dir(run), f"process_{jax.process_index()}")
    self.steps = StepDirectory(self.root, self.run)
    self.replicas = replicas if n > 1 else 0
    self.max_to_keep = max_to_keep
    self.timeout = coordination_timeout_seconds
    # As every process spells the run (a real path may differ between hosts).
    self._key = _multihost.namespace("local_tier", run, coordination_timeout_seconds)
    self._calls = 0
    self.host = host if host is not None else (os.environ.get(placement.HOST_ENV)
                                               or socket.gethostname())
    self.max_host_bytes = max_host_bytes
    self._ring: tuple[int, ...] | None = None

  def ring(self) -> tuple[int, ...]:
    """The replica ring (:func:`~orbax_flax.tiers.placement.replica_ring`) of this job's
    hosts; collective on its first call."""
    if self._ring is None:
      n = jax.process_count()
      hosts = (_multihost.all_gather(f"{self._key}/hosts", self.host, self.timeout,
                                     what="report its host") if n > 1 else [self.host])
      self._ring, warning = placement.replica_ring(hosts, self.replicas)
      if warning:
        log.warning("local tier: %s", warning)
    return self._ring

  def _next_key(self, what: str) -> str:
    """A coordination key unique to this call: every process makes the same calls in order."""
    self._calls += 1
    return f"{self._key}/{self._calls}-{what}"

  def save(self, step: int, items: Mapping[str, Any], *, timeline: str = "",
           base: int | None = None) -> str:
    """Saves ``step`` of ``timeline`` to the local tier on every process; returns its save id.

    Collective: every process calls it with the same step. Raises if any
    process failed: then nobody marks the step committed and every process
    removes what it wrote of it, so that a transient failure (a disk full for
    a moment) costs this save only. The save id, the
    same on every process and new at every save, is recorded with the step: a
    persistent save of the same state that records it too
    (:meth:`orbax_flax.CheckpointManager.save`'s ``local_copy``) is what this
    copy stands for, and a resume takes the copy only while that save is the
    persistent tier's step (see :meth:`restore`). ``base`` is the newest persistent step the
    job has committed or is saving (-1: none), recorded with the step (see :meth:`restore`).
    """
    me, n = jax.process_index(), jax.process_count()
    key = self._next_key(f"save{step}")
    self.steps.sweep()  # what a failed save left would take the room this one needs
    tmp = self.steps.dir(step) + TMP
    error: Exception | None = None  # this process's failure
    blob = None
    try:
      blob = _blob.encode(step, items, run=self.run, timeline=timeline)
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(tmp)
      _blob.write(os.path.join(tmp, OWN), blob, self.max_host_bytes)
    except (OSError, ValueError, TypeError) as e:
      error = e
    ring = self.ring() if self.replicas else ()
    for k in range(1, self.replicas + 1):  # every process takes part, even after a failure
      source = ring[(ring.index(me) - k) % n]
      sink = Sink(None if error else os.path.join(tmp, f"replica-{source}.blob"))
      reader = None
      try:  # the own copy is sent from its file (in RAM), one round at a time
        reader = None if error else _blob.FileReader(os.path.join(tmp, OWN))
      except OSError as e:
        error = e
      try:  # a timeout here (another process gave up) raises on every process alike
        _exchange.shift_parts(reader or [], k, f"{key}/x{k}", self.timeout, order=ring,
                              sink=sink, max_round_bytes=_exchange.round_bytes(self.max_host_bytes))
      finally:
        if reader is not None:
          reader.close()
        sink_error = sink.close()
      error = error or sink_error
    # Every process offers a save id with its verdict; process 0's is the step's.
    verdicts = [json.loads(v) for v in _multihost.all_gather(
        f"{key}/done", json.dumps([*self._verdict(error, tmp, blob), uuid.uuid4().hex[:16]]),
        self.timeout, what=f"finish local step {step}")]
    save_id = verdicts[0][3]
    if any(v[0] for v in verdicts):  # every process removes what it wrote: it costs this save only
      shutil.rmtree(tmp, ignore_errors=True)  # a committed step of the same number stays
      raise self._failed(step, "failed", verdicts)
    # Every part is durable. Each process commits its own, and all learn that every process
    # did before any removes an older step: a step one process could not commit counts
    # nowhere, and the older ones are then what a restore reads.
    error = None
    try:
      self.steps.commit(step, timeline, n, save_id, base)
    except OSError as e:
      error = e
    verdicts = [json.loads(v) for v in _multihost.all_gather(
        f"{key}/committed", json.dumps(self._verdict(error, self.steps.dir(step), blob)),
        self.timeout, what=f"commit local step {step}")]
    if any(v[0] for v in verdicts):
      self.steps.discard(step)
      raise self._failed(step, "failed: not every process could commit it", verdicts)
    try:
      self.steps.prune(self.max_to_keep)
    except OSError as e:  # the step is committed everywhere; an older one stays a while
      log.warning("local tier: cannot remove older local steps in %s (%s: %s); the next save"
                  " tries again", self.root, type(e).__name__, e)
    return save_id

  def _verdict(self, error: Exception | None, where: str,
               blob: _blob.Blob | None) -> tuple[str, bool, float]:
    """This process's part of a save's verdict: what failed, where ("" if nothing); whether
    its disk is full; the MiB a local step takes here (its shards and the replicas)."""
    mib = (blob.nbytes if blob is not None else 0) * (1 + self.replicas) / 2**20
    if error is None:
      return "", False, mib
    if not isinstance(error, OSError):  # the state itself (an unsupported leaf), not the disk
      return f"{type(error).__name__}: {error}", False, mib
    return (f"{where}: {type(error).__name__}: {error}",
            error.errno in (errno.ENOSPC, errno.EDQUOT), mib)

  def _failed(self, step: int, what: str, verdicts: list) -> errors.StorageError:
    """The error every process raises for a failed save, made from every process's verdict."""
    message = (f"local save of step {step} {what}; it does not count:\n  "
               + "\n  ".join(f"process {p}: {v[0]}" for p, v in enumerate(verdicts) if v[0]))
    full = [f"{v[2]:.1f} MiB on process {p}" for p, v in enumerate(verdicts) if v[1]]
    if full:
      held = "a process's shards" + (f" and the replicas of {self.replicas} peer(s)"
                                     if self.replicas else "")
      fix = ("lower local_max_to_keep, or use" if self.max_to_keep > 1 else "use")
      message += (
          f"\nA local disk is full: each process's part of local_directory {self.directory!r}"
          f" needs room for local_max_to_keep + 1 = {self.max_to_keep + 1} local steps (those"
          f" kept and the one being written; a step ({held}) takes about {', '.join(full)})."
          f" Fix: {fix} another local_directory with that much room.")
    return errors.StorageError(message)

  def holdings(self, timeline: str | None = None,
               persistent: tuple[int, str] | None = None,
               persistent_steps: Sequence[int] = ()) -> Holdings:
    """Committed local steps here (of ``timeline``, if given, not replaced by the
    ``persistent`` tier's step and not of another lineage than ``persistent_steps``, as for
    :meth:`restore`), and the peers' replicas held here; the steps left out, and why, are
    logged."""
    return self.steps.holdings(timeline, jax.process_count(), persistent, persistent_steps)

  def restore(self, target: Mapping[str, Any], newer_than: int | None = None, *,
              timeline: str | None = None, persistent: tuple[int, str] | None = None,
              partial: bool = False, allow_lossy_casts: bool = False,
              casts: list | None = None,
              optional: tuple[str, ...] = (),
              persistent_steps: Sequence[int] = ()) -> tuple[int, dict[str, Any], str] | None:
    """The newest local step of ``timeline`` every process can assemble, if newer than
    ``newer_than``.

    Collective. Returns ``(step, items, source)`` (``source`` says where this
    process's shards came from), or None when the local tier has nothing newer,
    was written by another layout, or has no step left whose copies are intact
    (a step with a damaged copy gives way to the peer's replica of it, then to
    the next older step; the log names every damaged copy); every process gets
    the same answer. ``persistent`` is ``(step, local_copy)`` of the
    persistent tier's newest step (``local_copy``: the save id its save recorded,
    else ""): a local step of that number is taken only if it is that copy, since
    another save may have replaced the step there (a forced re-save by another
    manager, ``convert``). The target is checked as the persistent tier
    checks it (``partial``, ``allow_lossy_casts``, ``casts`` as for
    :func:`orbax_flax.restore`); items named in ``optional`` are left out
    where the step does not hold them. ``persistent_steps``: the persistent tier's
    committed steps; a local step saved when the job's newest persistent step was
    ``b`` is not taken while one of them lies between ``b`` and it (another run, without
    this local tier, went on from ``b``).

    Raises:
      TreeMismatchError: on every process, when the target does not match the
        step (the persistent tier would refuse it too).
    """
    n = jax.process_count()
    key = self._next_key("restore")
    self.steps.sweep()  # what a save that died left uncommitted
    if self.replicas:
      self.ring()  # at start-up: a topology that cannot keep replicas on other hosts is named
    try:
      mine = self.holdings(timeline, persistent, persistent_steps)
    except OSError as e:  # an unreadable local directory holds nothing: the others go on
      _progress.say("local tier: cannot list %s (%s); this process holds no local step",
                    self.root, e)
      mine = Holdings([], {}, n)
    reports = _multihost.all_gather(f"{key}/holdings", mine.to_json(), self.timeout,
                                    what="report its local steps")
    holdings = [Holdings.from_json(r) for r in reports]
    options = dict(partial=partial, allow_lossy_casts=allow_lossy_casts, optional=optional)
    damaged: list[str] = []  # the copies this restore found damaged, for the log
    for attempt in itertools.count():  # each round that goes on removes a copy: it ends
      plan = placement.plan_restore(holdings, newer_than)
      if attempt == 0 and placement.mixed_steps(holdings, plan):
        log.warning("local tier: step(s) %s are held as copies of different saves (runs that"
                    " died while committing them); a restore never mixes saves, so they are not"
                    " used", placement.mixed_steps(holdings, plan))
      if plan is None:
        if newer_than is not None:  # the persistent tier's step is resumed: those above are dead
          self._discard_above(newer_than, timeline)
        newer = "" if newer_than is None else f" newer than step {newer_than}"
        if damaged:
          log.warning("local tier: no intact step that every process can get%s (damaged: %s);"
                      " the local tier gives up and the persistent tier is used", newer,
                      "; ".join(damaged))
        else:
          held = sorted({s for h in holdings for s in h.own})
          _progress.say("local tier: no step that every process can get (own copy or a peer's"
                        " replica)%s; steps held: %s", newer, held or "none")
        return None
      found: list = []
      got, verdicts = self._assemble(plan, target, options, found, f"{key}/{attempt}")
      mismatch = next((v for v in verdicts if v.startswith(_MISMATCH)), None)
      if mismatch is not None:  # every process raises, as the persistent tier would
        if casts is not None:
          casts.extend(found)
        kind, _, message = mismatch.removeprefix(_MISMATCH).partition(": ")
        if kind != "TreeMismatchError":  # a target sharding that cannot hold its array
          raise ValueError(message)
        lines = message.splitlines()  # a diagnosis, the differences (indented), the advice
        raise errors.TreeMismatchError(message, [l.strip() for l in lines[1:] if l.startswith(" ")],
                                       summary="\n".join(l for l in lines if not l.startswith("Fix:")))
      copies = [p for p, v in enumerate(verdicts) if v.startswith((_DAMAGED, _DAMAGED_REPLICA))]
      bad = [f"process {p}: {v}" for p, v in enumerate(verdicts) if v]
      if not bad:
        if casts is not None:
          casts.extend(found)
        self._discard_above(plan.step, timeline)
        return got
      if len(copies) == len(bad):  # damaged copies: read the others, else an older step
        log.warning("local tier: step %d: %s; trying the peers' replicas, then older local steps",
                    plan.step, "; ".join(bad))
        damaged.append(f"step {plan.step}: " + ", ".join(
            f"process {p}'s own copy" if plan.source[p] == p
            else f"process {plan.source[p]}'s replica of process {p}" for p in copies))
        for p in copies:  # every process drops the same copies, so all plan the same next step
          holder = holdings[plan.source[p]]
          if plan.source[p] == p:
            holder.own = [s for s in holder.own if s != plan.step]
          else:
            holder.replicas[p] = [s for s in holder.replicas.get(p, []) if s != plan.step]
        continue
      log.warning("local tier: step %d cannot be used (%s); the persistent tier is used",
                  plan.step, "; ".join(bad))
      return None
    return None  # not reached: the loop ends by a return

  def _discard_above(self, step: int, timeline: str | None) -> None:
    """Removes the local steps of ``timeline`` above ``step``, which a restore found that
    no process set can assemble (else it would have taken one).

    They are what a run that died left (a step some processes committed, copies of
    different saves, damaged copies) and hold disk room that the next saves need: a local
    directory has room for ``local_max_to_keep + 1`` steps. Steps of other timelines are
    left to retention. Best effort.
    """
    try:
      above = [s for s, r in self.steps.records()[0].items()
               if s > step and (timeline is None or r.timeline == timeline)]
      for s in above:
        self.steps.discard(s)
    except OSError as e:
      log.warning("local tier: cannot remove local steps above step %d in %s (%s: %s)", step,
                  self.root, type(e).__name__, e)
      return
    if above:
      _progress.say("local tier: removed local steps %s of %s, which no restore can take",
                    sorted(above), self.root)

  def _assemble(self, plan: RestorePlan, target: Mapping[str, Any], options: dict[str, Any],
                casts: list, key: str) -> tuple[tuple[int, dict[str, Any], str] | None, list[str]]:
    """Every process gets its blob of ``plan.step`` and builds it; collective.

    Returns this process's result and every process's verdict ("" when it
    succeeded; prefixed with ``_DAMAGED`` when its own copy is damaged, with
    ``_DAMAGED_REPLICA`` when the replica it received is (or never came), with
    ``_MISMATCH`` when the target does not match).
    """
    me, n = jax.process_index(), jax.process_count()
    blob, decoded, where, error = None, None, "nowhere", ""
    what = f"local step {plan.step} of process {me}"
    if plan.source[me] == me:
      try:
        decoded = _blob.read_blob(os.path.join(self.steps.dir(plan.step), OWN), what)
      except _UNREADABLE as e:  # the others still exchange
        error = f"{_DAMAGED}{type(e).__name__}: {e}"
      where = "its own local copy"
    # Replica holders send to the processes that lost their copy, one shift along the ring
    # at a time.
    ring = self.ring() if any(s != p for p, s in enumerate(plan.source)) else ()
    pos = {p: i for i, p in enumerate(ring)}
    for shift in sorted({(pos[p] - pos[s]) % n for p, s in enumerate(plan.source) if s != p}):
      send: Any = []
      target_p = ring[(pos[me] + shift) % n]
      if plan.source[target_p] == me and target_p != me:
        path = os.path.join(self.steps.dir(plan.step), f"replica-{target_p}.blob")
        try:  # sent from its file, one round at a time
          send = _blob.FileReader(path)
        except _UNREADABLE as e:  # the receiver gets nothing: its verdict names the replica
          log.warning("local tier: cannot send %s to process %d (%s: %s)", path, target_p,
                      type(e).__name__, e)
      try:
        got = _exchange.shift_parts(send, shift, f"{key}/x{shift}", self.timeout, order=ring,
                                    max_round_bytes=_exchange.round_bytes(self.max_host_bytes))
      finally:
        if not isinstance(send, list):
          send.close()
      source = ring[(pos[me] - shift) % n]
      if plan.source[me] == source and source != me:
        blob = got
        where = f"the replica held by process {source}"
    items = None
    if not error:
      try:
        index, payload = decoded if decoded is not None else _blob.decode(blob, what)
      except _UNREADABLE as e:  # only a received replica is decoded here
        error = f"{_DAMAGED_REPLICA}{type(e).__name__}: {e}"
    if not error:
      try:
        optional = options["optional"]
        m = _blob.match(index, {k: v for k, v in target.items()
                                if k not in optional or k in index.items},
                        casts=casts, source=f"local step {plan.step} ({self.root})",
                        partial=options["partial"], allow_lossy_casts=options["allow_lossy_casts"])
      except (errors.TreeMismatchError, ValueError) as e:
        error = f"{_MISMATCH}{type(e).__name__}: {e}"
    if not error:
      try:
        items = _blob.build(m, index, payload)
      except _UNREADABLE as e:  # damaged, or another layout: every process learns it
        error = f"{type(e).__name__}: {e}"
    verdicts = _multihost.all_gather(f"{key}/ok", error, self.timeout,
                                     what="assemble the local step")
    return (plan.step, items, where) if not any(verdicts) else None, verdicts
