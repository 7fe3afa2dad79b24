"""Every file-system call of a manager's life failing once: nothing a user saved is lost.

The kill points (test_kills.py) stop a process at each step of a save; this sweeps the other
kind of failure, a call that returns an error (EIO) and a process that goes on. One fixed run
of ordinary operations (saves, a forced re-save, a rollback and the save after it, retention,
a restart, differential saves on and off) is recorded once, fault-free, with the call site of
every file-system call our code makes under its directory (``os.rename``, ``replace``,
``unlink``, ``rmdir``, ``mkdir``, ``open``, ``fsync``, ``listdir``, ``scandir`` and the atomic
exchange). Then, for each call site, the run again with that site's first call failing.

After each run a fresh manager, fault-free, must find:

* every step the fault-free run keeps, whose saves in this run all returned, restorable bitwise
  to its last save (a failure may keep more steps, never fewer: a failed save or deletion
  only delays retention and rollbacks);
* every step it lists restorable to one of the saves made under that number (the last one
  that returned, or a later one whose failure came after its commit);
* every error the operations raised one of ours (``ofx.CheckpointError``), naming the failure.

CI runs the first call of every site, differential saves on and off (async); ``ORBAX_FLAX_FAULTS=long``
also the second and the last call of each site, and blocking saves. The same run in a job of
two processes (``error_points_worker.py``), one process's call failing, must also leave no
process waiting out the coordination timeout. Its first run found three
sites where a raw ``OSError`` reached the caller (reading a manifest, listing reader leases,
listing another library's steps): each is a ``StorageError`` with its fix now.
"""

import collections
import contextlib
import errno
import fnmatch
import json
import os
import sys
import threading
import traceback

import numpy as np
import pytest

import jobs
import orbax_flax as ofx
from orbax_flax.core import _location

LONG = os.environ.get("ORBAX_FLAX_FAULTS") == "long"
_PKG = os.path.dirname(os.path.abspath(ofx.__file__))
_FROZEN = np.random.default_rng(0).standard_normal((3, 320, 1024)).astype(np.float32)


def _items(tag: int) -> dict:
  """Three 1.25 MiB arrays (chunked: a packed array is never borrowed), one of which changes
  with ``tag`` (a differential save borrows the other two)."""
  return {"state": {"a": _FROZEN[0] + tag, "b": _FROZEN[1], "c": _FROZEN[2],
                    "tag": np.full(4, tag, np.int64)}}


class _Faults:
  """Spies on the file-system calls our code makes under ``root``: records each call's site (the
  innermost orbax_flax frame) and fails the ``nth`` call of site ``target`` with EIO."""

  _OS = ("rename", "replace", "unlink", "remove", "rmdir", "mkdir", "open", "fsync", "listdir",
         "scandir")

  def __init__(self, root: str, target: tuple[str, str] | None = None, nth: int = 0):
    self.root = os.path.realpath(root)
    self.target, self.nth = target, nth
    self.calls: list[tuple[str, str]] = []  # (function, site), in order
    self.failed: tuple[str, str] | None = None
    self._lock = threading.Lock()
    self._seen = collections.Counter()
    self.paused = False  # (the test's own checks: neither counted nor failed)

  def _path(self, name, args, kwargs) -> str | None:
    if name == "fsync":
      try:
        return os.readlink(f"/proc/self/fd/{args[0]}")
      except OSError:
        return None
    if not args:
      return None
    p = args[0]
    if isinstance(p, int):
      try:
        return os.readlink(f"/proc/self/fd/{p}")
      except OSError:
        return None
    p = os.fsdecode(p)
    d = kwargs.get("dir_fd")
    if d is not None and not os.path.isabs(p):
      try:
        p = os.path.join(os.readlink(f"/proc/self/fd/{d}"), p)
      except OSError:
        return None
    return os.path.realpath(os.path.abspath(p)) if os.path.isabs(p) or d is None else p

  def _site(self) -> str | None:
    """The innermost three orbax_flax frames (a helper's line alone, such as fsync_dir's, is
    shared by every caller of the helper)."""
    f, frames = sys._getframe(2), []  # pylint: disable=protected-access
    while f is not None and len(frames) < 3:
      if f.f_code.co_filename.startswith(_PKG):
        frames.append(f"{os.path.relpath(f.f_code.co_filename, _PKG)}:{f.f_lineno}")
      f = f.f_back
    return " < ".join(frames) or None

  def _aimed(self, name: str, site: str) -> bool:
    """Whether the call is the target's: its function, and its site or a site the target's
    matches as a glob (``"format/step_dir.py:*"``: any call whose innermost frame is in that
    file; ``"a.py:* < b.py:*"``: from b.py into a.py; ``nth`` counts per site)."""
    if self.target is None or name != self.target[0]:
      return False
    return fnmatch.fnmatchcase(site, self.target[1])

  def wrap(self, name, real):
    def spy(*args, **kwargs):
      path = None if self.paused else self._path(name, args, kwargs)
      if path is not None and path.startswith(self.root):
        site = self._site()
        if site is not None:
          with self._lock:
            self.calls.append((name, site))
            k = self._seen[(name, site)]
            self._seen[(name, site)] += 1
            fail = self.failed is None and self._aimed(name, site) and k == self.nth
            if fail:
              self.failed = (name, site)
          if fail:
            raise OSError(errno.EIO, f"injected: {name} at {site} failed", path)
      return real(*args, **kwargs)
    return spy

  @contextlib.contextmanager
  def installed(self, monkeypatch):
    with monkeypatch.context() as m:
      for name in self._OS:
        m.setattr(os, name, self.wrap(name, getattr(os, name)))
      m.setattr(_location, "exchange", self.wrap("exchange", _location.exchange))
      yield self


def _run(directory: str, differential: bool, async_save: bool, items=_items,
         **policy_fields) -> tuple[dict, list]:
  """The fixed run, saving ``items(tag)``. Returns {step: [(tag, returned)] in save order} and
  the errors raised."""
  saves: dict[int, list[tuple[int, bool]]] = collections.defaultdict(list)
  raised: list[BaseException] = []
  policy = ofx.CheckpointPolicy(max_to_keep=3, differential=differential, async_save=async_save,
                                **policy_fields)
  tag = [0]

  def attempt(fn):
    try:
      fn()
      return True
    except Exception as e:  # pylint: disable=broad-except  # judged below
      raised.append(e)
      return False

  def save(m, step):
    tag[0] += 1
    t = tag[0]
    ok = attempt(lambda: (m.save(step, items(t), force=True), m.wait()))
    saves[step].append((t, ok))

  m = None
  for opened in range(2):
    try:
      m = ofx.CheckpointManager(directory, policy)
    except Exception as e:  # pylint: disable=broad-except
      raised.append(e)
      continue
    try:
      if opened == 0:
        for step in (1, 2, 3):
          save(m, step)
        save(m, 3)  # a forced re-save of the head
        attempt(lambda: m.restore(2))  # a rollback to 2 ...
        save(m, 3)  # ... and the run from there: abandons the re-saved 3
        for step in (4, 5):  # retention: keeps 3
          save(m, step)
      else:
        attempt(lambda: m.restore())
        save(m, 6)
    finally:
      attempt(m.close)
  return saves, raised


def _foreign(raised: list) -> list[str]:
  """The errors among ``raised`` that are not ours, each with the orbax_flax lines it came by."""
  problems = []
  for e in raised:
    if not isinstance(e, ofx.CheckpointError):
      where = traceback.extract_tb(e.__traceback__)
      calls = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(where)
                          if f.filename.startswith(_PKG))
      problems.append(f"raised {type(e).__name__} (not an orbax_flax error): {e} [{calls}]")
  return problems


def _check(directory: str, saves: dict, raised: list, reference_kept: dict) -> list[str]:
  return _foreign(raised) + _judge_steps(directory, saves, reference_kept)


def _judge_steps(directory: str, saves: dict, reference_kept: dict) -> list[str]:
  """What a fresh manager finds wrong in ``directory`` after :func:`_run` made ``saves``."""
  problems = []
  with ofx.CheckpointManager(directory) as m:
    listed = m.all_steps()
    for step in listed:
      made = saves.get(step, [])
      last_ok = max((i for i, (_, ok) in enumerate(made) if ok), default=-1)
      allowed = {t for i, (t, _) in enumerate(made) if i >= last_ok}
      try:
        got = int(np.asarray(m.restore(step)["state"]["tag"])[0])
      except Exception as e:  # pylint: disable=broad-except
        problems.append(f"step {step} is listed but does not restore: {type(e).__name__}: {e}")
        continue
      if got not in allowed:
        problems.append(f"step {step} restores save {got}, not one of {sorted(allowed)}")
    for step, t in reference_kept.items():
      made = saves.get(step, [])
      if made and all(ok for _, ok in made) and made[-1][0] == t and step not in listed:
        problems.append(f"step {step} (save {t} returned) is lost; listed: {listed}")
  return problems


def _sites(tmp_path, monkeypatch, differential, async_save):
  d = str(tmp_path / "reference")
  faults = _Faults(d)
  with faults.installed(monkeypatch):
    saves, raised = _run(d, differential, async_save)
  assert not raised, raised
  with ofx.CheckpointManager(d) as m:
    kept = {s: int(np.asarray(m.restore(s)["state"]["tag"])[0]) for s in m.all_steps()}
  assert kept == {4: 6, 5: 7, 6: 8}, kept  # max_to_keep=3
  counts = collections.Counter(faults.calls)
  return kept, counts


_CASES = [(True, True), (False, True)] + ([(True, False), (False, False)] if LONG else [])


@pytest.mark.parametrize("differential,async_save", _CASES)
def test_every_file_system_call_failing_once_loses_no_step(tmp_path, monkeypatch, differential,
                                                           async_save):
  kept, counts = _sites(tmp_path, monkeypatch, differential, async_save)
  points = [(site, 0) for site in counts]
  if LONG:
    points += [(site, 1) for site, n in counts.items() if n > 1]
    points += [(site, n - 1) for site, n in counts.items() if n > 2]
  problems = []
  for i, (site, nth) in enumerate(points):
    d = str(tmp_path / f"run{i}")
    faults = _Faults(d, site, nth)
    with faults.installed(monkeypatch):
      saves, raised = _run(d, differential, async_save)
    found = _check(d, saves, raised, kept)
    if found:
      problems.append(f"{site[0]} at {site[1]} (call {nth}) failing: " + "; ".join(found))
  print(f"{len(points)} error points over {len(counts)} call sites")
  assert not problems, "\n".join(problems)


def _judge(directory: str, saves: dict) -> list[str]:
  """What is wrong with the checkpoints of :func:`_overwrites` now: each must restore to its
  last save that returned, or to a later one (whose failure came after its commit)."""
  found = []
  for name, made in saves.items():
    last_ok = max((k for k, (_, ok) in enumerate(made) if ok), default=None)
    if last_ok is None:
      continue
    allowed = {t for k, (t, _) in enumerate(made) if k >= last_ok}
    try:
      got = int(np.asarray(ofx.restore(os.path.join(directory, name))["state"]["tag"])[0])
    except Exception as e:  # pylint: disable=broad-except
      found.append(f"{name} does not restore: {type(e).__name__}: {e}")
      continue
    if got not in allowed:
      found.append(f"{name} restores save {got}, not one of {sorted(allowed)}")
  return found


def _overwrites(directory: str, faults: _Faults) -> tuple[dict, list, list]:
  """Checkpoints a, then b borrowing from a, then each overwritten (differential saves): the
  commit's exchange path, where the replaced checkpoint is retired while another borrows it.
  Every checkpoint is judged after each save (a later overwrite can hide an earlier loss).
  Returns {name: [(tag, returned)]}, the errors raised and what was found wrong."""
  saves: dict[str, list[tuple[int, bool]]] = collections.defaultdict(list)
  raised: list[BaseException] = []
  found: list[str] = []
  with ofx.Checkpointer(differential=True) as ck:
    for tag, name in enumerate(["a", "b", "a", "b", "a"], start=1):
      try:
        ck.save(os.path.join(directory, name), _items(tag), overwrite=tag > 2)
        saves[name].append((tag, True))
      except Exception as e:  # pylint: disable=broad-except  # judged below
        raised.append(e)
        saves[name].append((tag, False))
      faults.paused = True
      found += [f"after save {tag}: {f}" for f in _judge(directory, saves)]
      faults.paused = False
  return saves, raised, found


def test_every_file_system_call_of_differential_overwrites_failing_once_loses_no_checkpoint(
    tmp_path, monkeypatch):
  """Overwrites of checkpoints that borrow from each other, each file-system call failing once:
  each checkpoint restores to its last save that returned (or a later one that committed
  before its failure). A failure after an overwrite's exchange deleted the replaced
  checkpoint that another one borrowed: neither restored."""
  d = str(tmp_path / "reference")
  faults = _Faults(d)
  with faults.installed(monkeypatch):
    _, raised, found = _overwrites(d, faults)
  assert not raised and not found, (raised, found)
  counts = collections.Counter(faults.calls)
  points = [(site, 0) for site in counts]
  if LONG:
    points += [(site, n - 1) for site, n in counts.items() if n > 1]
  problems = []
  for i, (site, nth) in enumerate(points):
    d = str(tmp_path / f"run{i}")
    os.makedirs(d)
    faults = _Faults(d, site, nth)
    with faults.installed(monkeypatch):
      _, raised, found = _overwrites(d, faults)
    found += [f"raised {type(e).__name__} (not an orbax_flax error): {e}" for e in raised
              if not isinstance(e, ofx.CheckpointError)]
    if found:
      problems.append(f"{site[0]} at {site[1]} (call {nth}) failing: " + "; ".join(found))
  print(f"{len(points)} error points over {len(counts)} call sites")
  assert not problems, "\n".join(problems)


# -------------------------------------------------------------------- a job of two processes

_JOB_TIMEOUT_S = 20  # the job's coordination_timeout_seconds: no point may wait it out


def _job_lines(result, me: int, word: str) -> list[list[str]]:
  return [line.split()[2:] for line in result.outputs[me].splitlines()
          if line.startswith(f"P{me} {word} ")]


@pytest.mark.parametrize("site,opens,first", [
    ("listdir:format/step_dir.py:*", 1, 1),    # the manager lists the directory's steps
    ("mkdir:manager/leases.py:*", 0, 0)])      # the first save takes the writer lease
def test_what_fails_on_process_0_alone_fails_on_every_process_and_the_job_goes_on(
    tmp_path, site, opens, first):
  """Process 0's storage fails once (EIO) where it works alone: opening the manager, or taking
  the writer lease for the first save. The manager's creation, or that save, fails on both
  processes at once, and the loop's saves after it commit (``on_save_error="warn"``).

  Before, the other process went on alone: into the first save, whose collectives it paired
  with process 0's next save, and every later save of the job failed ("process 0 saves '2' and
  process 1 saves '1'"): no step was saved again. Or it created its manager, which waited for
  process 0 at each call until the coordination timeout, and the job's next manager of the
  directory paired with that one."""
  res = jobs.run("faults/error_points_worker.py",
                 [f"--dir={tmp_path}", f"--out={tmp_path}/out", f"--fail={site}", "--faulty=0",
                  "--differential=0", f"--timeout={_JOB_TIMEOUT_S}"], 2, 2, timeout=240).check()
  assert _job_lines(res, 0, "FAILED") == [["True"]], "the fault was not injected"
  for me in (0, 1):
    assert len(_job_lines(res, me, "OPEN")) == opens, (me, res.outputs[me][-3000:])
    saved = {int(s): int(started) for s, started in _job_lines(res, me, "SAVED")}
    assert saved == {1: first, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1}, (me, saved, res.outputs[me][-3000:])
    (kept, seconds), = _job_lines(res, me, "KEPT")
    # (process 1 may list step 5 still: process 0, which deletes, may not have finished yet)
    assert json.loads(kept)[-1:] == [6], (me, kept, res.outputs[me][-3000:])
    assert float(seconds) < _JOB_TIMEOUT_S, f"process {me} waited the timeout: {seconds} s"


def test_every_file_system_call_of_a_two_process_job_failing_once_loses_no_step(tmp_path):
  """The fixed manager run (:func:`_run`) in a job of two processes, each file-system call
  site of one process failing once (the other's calls all succeed): besides what
  :func:`_judge_steps` checks, no process waits out the coordination timeout (a failure one
  process has alone reaches the others at once) and every error is ours.

  Recorded once, fault-free, on both processes; CI sweeps every site of process 1 and the
  sites of process 0 in the manager's own files (the writer lease, the registry, retention,
  opening), the long run every site of both, and the second and last calls. It found the
  writer lease and the manager's opening failing on process 0 alone (see the test above)."""
  rec = jobs.run("faults/error_points_worker.py",
                 [f"--dir={tmp_path}/record", f"--out={tmp_path}/record",
                  f"--timeout={_JOB_TIMEOUT_S}"], 2, 2, timeout=240).check()
  del rec
  with ofx.CheckpointManager(f"{tmp_path}/record/reference") as m:
    kept = {s: int(np.asarray(m.restore(s)["state"]["tag"])[0]) for s in m.all_steps()}
  assert kept == {4: 6, 5: 7, 6: 8}, kept  # max_to_keep=3
  problems, swept = [], 0
  for faulty in (0, 1):
    with open(f"{tmp_path}/record.{faulty}") as f:
      counts = json.load(f)["counts"]
    points = [[n, site, 0] for n, site, _ in counts
              if LONG or faulty == 1 or "manager/" in site]
    if LONG:
      points += [[n, site, 1] for n, site, c in counts if c > 1]
      points += [[n, site, c - 1] for n, site, c in counts if c > 2]
    with open(f"{tmp_path}/points{faulty}.json", "w") as f:
      json.dump(points, f)
    res = jobs.run("faults/error_points_worker.py",
                   [f"--dir={tmp_path}/p{faulty}", f"--out={tmp_path}/out{faulty}",
                    f"--points={tmp_path}/points{faulty}.json", f"--faulty={faulty}",
                    f"--timeout={_JOB_TIMEOUT_S}"], 2, 2, timeout=1500 if LONG else 400).check()
    lines = []
    for me in (0, 1):
      with open(f"{tmp_path}/out{faulty}.{me}") as f:
        lines.append([json.loads(line) for line in f])
      assert len(lines[me]) == len(points), (faulty, me, res.outputs[me][-3000:])
    for i, (name, site, nth) in enumerate(points):
      mine, other = lines[faulty][i], lines[1 - faulty][i]
      if not mine["failed"]:
        continue  # (the site is not reached in this run: a path that depends on timing)
      swept += 1
      saves = {}
      for step, made in mine["saves"].items():  # a save returned if it did on any process
        theirs = other["saves"].get(step, [])
        saves[int(step)] = [(t, ok or (k < len(theirs) and theirs[k][1]))
                            for k, (t, ok) in enumerate(made)]
      found = _judge_steps(f"{tmp_path}/p{faulty}/run{i}", saves, kept)
      found += mine["foreign"] + other["foreign"]
      found += [f"process {p} took {line['seconds']} s: it waited out the coordination timeout"
                for p, line in ((faulty, mine), (1 - faulty, other))
                if line["seconds"] >= _JOB_TIMEOUT_S]
      if found:
        problems.append(f"process {faulty}: {name} at {site} (call {nth}) failing: "
                        + "; ".join(found))
  print(f"{swept} error points of a two-process job")
  assert swept >= 25, swept
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name,site", [
    # restore_or_init lists the workdir for another library's run
    ("listdir", "formats/orbax_checkpoint.py:* < training/resume.py:*"),
    # the first save's writer looks for steps that borrow bytes (differential saves off)
    ("listdir", "format/step_dir.py:* < engine/restoring.py:* < manager/registry.py:*")])
def test_a_training_run_whose_process_0_fails_alone_stops_at_once_on_every_process(
    tmp_path, name, site):
  """The training callback with the local tier (every step local, every third persistent,
  ``on_save_error="warn"``), process 0's storage failing once where it reads alone, then a
  restart: every process stops (or saves on) together, none waits out the coordination
  timeout, and the restart resumes the same step bitwise on both. Before, process 0 raised
  from restore_or_init alone (process 1 waited the timeout at each collective, 20 s, then
  100 s more), and a writer's look for borrowing steps failing on process 0 alone left
  process 1 saving into a save process 0 never began."""
  with open(f"{tmp_path}/points.json", "w") as f:
    json.dump([[name, site, 0]], f)
  jobs.run("faults/error_points_worker.py",
           [f"--dir={tmp_path}", f"--out={tmp_path}/out", f"--points={tmp_path}/points.json",
            "--faulty=0", "--tier=1"], 2, 2, timeout=240).check()
  lines = []
  for me in (0, 1):
    with open(f"{tmp_path}/out.{me}") as f:
      (line,) = [json.loads(x) for x in f]
    lines.append(line)
    assert line["exact"] and not line["foreign"], (me, line)
    assert line["seconds"] < _JOB_TIMEOUT_S, (me, line)
  assert lines[0]["failed"], "the fault was not injected"
  assert lines[0]["step"] == lines[1]["step"], lines


@pytest.mark.skipif(not LONG, reason="ORBAX_FLAX_FAULTS=long: ~90 points, a minute or two")
def test_every_file_system_call_of_a_local_tier_job_failing_once_resumes_one_step_bitwise(
    tmp_path):
  """The training callback with the local tier in a job of two processes (the worker's
  ``tier_run``), each file-system call site of either process failing once (persistent and
  local directories alike), then a restart: both processes resume the same step, bitwise,
  every error is ours, and no process waits out the coordination timeout. (The two cases
  above are the sites it found; CI runs those.)"""
  jobs.run("faults/error_points_worker.py",
           [f"--dir={tmp_path}/record", f"--out={tmp_path}/record", "--tier=1"], 2, 2,
           timeout=240).check()
  problems, swept = [], 0
  for faulty in (0, 1):
    with open(f"{tmp_path}/record.{faulty}") as f:
      points = [[n, site, 0] for n, site, _ in json.load(f)["counts"]]
    with open(f"{tmp_path}/points{faulty}.json", "w") as f:
      json.dump(points, f)
    jobs.run("faults/error_points_worker.py",
             [f"--dir={tmp_path}/p{faulty}", f"--out={tmp_path}/out{faulty}",
              f"--points={tmp_path}/points{faulty}.json", f"--faulty={faulty}", "--tier=1"],
             2, 2, timeout=1500).check()
    lines = []
    for me in (0, 1):
      with open(f"{tmp_path}/out{faulty}.{me}") as f:
        lines.append([json.loads(x) for x in f])
      assert len(lines[me]) == len(points), (faulty, me)
    for i, (name, site, _) in enumerate(points):
      mine, other = lines[faulty][i], lines[1 - faulty][i]
      swept += mine["failed"]
      found = mine["foreign"] + other["foreign"]
      found += [f"process {p} restored step {line['step']} not bitwise"
                for p, line in ((faulty, mine), (1 - faulty, other)) if not line["exact"]]
      if mine["step"] != other["step"]:
        found.append(f"the processes resumed steps {mine['step']} and {other['step']}")
      found += [f"process {p} took {line['seconds']} s: it waited out the coordination timeout"
                for p, line in ((faulty, mine), (1 - faulty, other))
                if line["seconds"] >= _JOB_TIMEOUT_S]
      if found:
        problems.append(f"process {faulty}: {name} at {site} failing: " + "; ".join(found))
  print(f"{swept} error points of a local-tier job")
  assert swept >= 60, swept
  assert not problems, "\n".join(problems)
