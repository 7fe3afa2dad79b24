"""SIGKILL at random instants: nothing committed is lost, nothing half-written is listed.

Each kill point starts a real job (``fault_worker.py``), waits for its first
commit, kills it with SIGKILL at a random instant (while it saves, deletes
old steps, overwrites or sweeps leftovers), then checks the directory from a
fresh process's point of view: every listed step restores bitwise, the
newest step the job reported committed is still there (or a newer one), and a
restarted job resumes, commits, and leaves no leftovers.

CI runs a few kill points per scenario; ``ORBAX_FLAX_FAULTS=long`` runs at
least 200 in all (the counts go to docs/guarantees.md).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

import jobs
import orbax_flax as ofx
from orbax_flax import launch
from orbax_flax.format import step_dir
from orbax_flax.core._location import Location

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fault_worker  # noqa: E402  pylint: disable=wrong-import-position

LONG = os.environ.get("ORBAX_FLAX_FAULTS") == "long"
COUNTS = {"manager": 90, "overwrite": 50, "sweep": 30, "mp": 30, "delete": 40} if LONG else \
         {"manager": 2, "overwrite": 2, "sweep": 2, "mp": 1, "delete": 3}
TALLY = os.environ.get("ORBAX_FLAX_FAULTS_TALLY")  # a JSON file the long run appends to


def _tally(scenario, kills, steps_checked):
  if not TALLY:
    return
  data = json.load(open(TALLY)) if os.path.exists(TALLY) else {}
  entry = data.setdefault(scenario, {"kill_points": 0, "steps_checked": 0, "lost": 0})
  entry["kill_points"] += kills
  entry["steps_checked"] += steps_checked
  json.dump(data, open(TALLY, "w"), indent=1)


def _start(mode, d, extra=(), n=1, devices=8):
  if n == 1:
    return [subprocess.Popen([sys.executable, os.path.join(HERE, "fault_worker.py"), mode, str(d), *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=jobs.env_for(devices))]
  coordinator = launch.coordinator_address()
  return [subprocess.Popen([sys.executable, os.path.join(HERE, "fault_worker.py"), mode, str(d),
                            f"--coordinator={coordinator}", f"--num_processes={n}",
                            f"--process_id={i}", *extra],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=jobs.env_for(devices)) for i in range(n)]


def _read_until_commit(proc, timeout=120):
  """Lines until the first COMMITTED line (the job is then well under way)."""
  return jobs.read_until(proc, r"^COMMITTED", timeout)


def _committed(lines):
  return [int(l.split()[1]) for l in lines if l.startswith("COMMITTED")]


def _unlisted_step_dirs(d):
  """Directories named like a step without a manifest: never listed, so never restored nor
  deleted, and in the way of a later save of that number (a deletion must uncommit first)."""
  return [n for n in os.listdir(d)
          if n.isdigit() and not os.path.exists(os.path.join(d, n, "_CHECKPOINT"))]


def _check_directory(d):
  """Every committed step restores bitwise, and no step-named directory lacks its manifest;
  returns the steps."""
  import jax  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  assert not _unlisted_step_dirs(d), _unlisted_step_dirs(d)
  steps, _ = step_dir.list_steps(Location.parse(str(d)))
  for step in steps:
    restored = ofx.restore(os.path.join(d, str(step)), {"state": fault_worker.target(mesh)})["state"]
    fault_worker.check(restored, step)
  return steps


def _kill_at_random(rng, procs, lines_of):
  time.sleep(rng.uniform(0.0, 1.2))
  for p in procs:
    p.send_signal(signal.SIGKILL)
  outs = []
  for p, lines in zip(procs, lines_of):
    rest, _ = p.communicate()
    outs.append(lines + rest.splitlines(keepends=True))
  return outs


@pytest.mark.timeout(3600 if LONG else 600)  # the long run's kill points take minutes each under load
def test_kill_during_async_saves_with_retention(tmp_path):
  rng = random.Random(1)
  checked = 0
  for trial in range(COUNTS["manager"]):
    d = tmp_path / f"t{trial}"
    (proc,) = _start("manager", d)
    lines = _read_until_commit(proc)
    (out,) = _kill_at_random(rng, [proc], [lines])
    reported = max(_committed(out))
    steps = _check_directory(d)
    checked += len(steps)
    assert steps and max(steps) >= reported, (steps, reported)  # nothing committed is lost
    # A restarted job resumes from the newest step, commits, and removes the debris.
    res = subprocess.run([sys.executable, os.path.join(HERE, "fault_worker.py"), "manager", str(d),
                          f"--steps={max(steps) + 2}"], capture_output=True, text=True,
                         env=jobs.env_for(8), timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"RESUMED {max(steps)}" in res.stdout, res.stdout[-2000:]
    assert "LEFTOVERS []" in res.stdout, res.stdout[-2000:]
    assert not [n for n in os.listdir(d) if ".ofx-tmp-" in n], os.listdir(d)
    _check_directory(d)
  _tally("async saves with retention", COUNTS["manager"], checked)


_DELETING_WORKER = r"""
import sys, numpy as np, orbax_flax as ofx
m = ofx.CheckpointManager(sys.argv[1], ofx.CheckpointPolicy(max_to_keep=1, async_save=False))
for step in range(1, 10000):  # each commit deletes the step before: 200 items of files
  m.save(step, {f"i{k}": {"w": np.full(1024, step, np.float32)} for k in range(200)}, force=True)
  print("COMMITTED", step, flush=True)
"""


@pytest.mark.timeout(3600 if LONG else 600)
def test_kill_during_keep_rule_deletions(tmp_path):
  """Killed while a keep rule deletes a step of many files: a deletion uncommits first (one
  rename), so what is left is the whole step or debris the next manager sweeps; never a
  listed step with files missing, nor a step-named directory without its manifest (a
  deletion of the files in place failed 7 of 12 such kills: mutation review)."""
  rng = random.Random(4)
  checked = 0
  for trial in range(COUNTS["delete"]):
    d = tmp_path / f"t{trial}"
    proc = subprocess.Popen([sys.executable, "-c", _DELETING_WORKER, str(d)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=jobs.env_for(1))
    lines = jobs.read_until(proc, r"^COMMITTED 3", 120)
    time.sleep(rng.uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    rest, _ = proc.communicate()
    reported = max(_committed(lines + rest.splitlines()))
    assert not _unlisted_step_dirs(d), _unlisted_step_dirs(d)
    with ofx.CheckpointManager(str(d)) as m:
      steps = m.all_steps()
      assert steps and max(steps) >= reported, (steps, reported)
      for step in steps:
        got = m.restore(step)
        assert all(float(got[f"i{k}"]["w"][0]) == step for k in range(200)), step
      checked += len(steps)
  _tally("keep-rule deletions", COUNTS["delete"], checked)


@pytest.mark.timeout(3600 if LONG else 600)  # the long run's kill points take minutes each under load
def test_kill_during_overwrite_loop(tmp_path):
  rng = random.Random(2)
  checked = 0
  for trial in range(COUNTS["overwrite"]):
    d = tmp_path / f"t{trial}"
    (proc,) = _start("overwrite", d)
    lines = _read_until_commit(proc)
    (out,) = _kill_at_random(rng, [proc], [lines])
    reported = max(_committed(out))
    restored = ofx.restore(os.path.join(d, "c"))["state"]
    step = int(restored["step"])
    assert step in (reported, reported + 1), (step, reported)  # the old or the new, whole
    for name in fault_worker.SHAPES:
      assert (restored[name] == fault_worker.value(name, step)).all(), name
    checked += 1
  _tally("overwrite loop", COUNTS["overwrite"], checked)


@pytest.mark.timeout(3600 if LONG else 600)  # the long run's kill points take minutes each under load
def test_kill_during_leftover_sweeps(tmp_path):
  rng = random.Random(3)
  for trial in range(COUNTS["sweep"]):
    d = tmp_path / f"t{trial}"
    (proc,) = _start("sweep", d)
    lines = _read_until_commit(proc)
    _kill_at_random(rng, [proc], [lines])
    assert _check_directory(d) == [5]
    ofx.CheckpointManager(str(d)).close()  # the next start finishes the sweep
    assert sorted(os.listdir(d)) == ["5"], os.listdir(d)
  _tally("leftover sweeps", COUNTS["sweep"], COUNTS["sweep"])


@pytest.mark.timeout(3600 if LONG else 600)  # the long run's kill points take minutes each under load
def test_kill_one_process_of_two(tmp_path):
  """The survivor stops within the coordination timeout with an error naming the lost process."""
  rng = random.Random(4)
  checked = 0
  for trial in range(COUNTS["mp"]):
    d = tmp_path / f"t{trial}"
    p0, p1 = _start("mp", d, n=2, devices=4)
    lines0, lines1 = _read_until_commit(p0), _read_until_commit(p1)
    time.sleep(rng.uniform(0.0, 1.2))
    p1.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    p1.communicate()
    out0, _ = p0.communicate(timeout=120)
    stopped_after = time.monotonic() - killed_at
    assert p0.returncode != 0, out0[-3000:]
    # Our own rendezvous names process 1 within the 4 s coordination timeout (JAX's
    # heartbeat, 30 s here, would abort the survivor much later).
    assert "ERROR" in out0 and "1" in out0.split("ERROR", 1)[1], out0[-3000:]
    assert stopped_after < 20, (stopped_after, out0[-3000:])
    reported = max(_committed(lines0 + out0.splitlines(keepends=True)))
    steps = _check_directory(d)
    checked += len(steps)
    assert steps and max(steps) >= reported, (steps, reported)
  _tally("one process of two", COUNTS["mp"], checked)
