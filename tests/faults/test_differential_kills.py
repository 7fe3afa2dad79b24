"""Differential saves under SIGKILL, with retention deleting the bases newer steps borrow from.

One directory lives through every kill point: a job resumes (its latest step
checked bitwise), saves differentially with ``max_to_keep=2``, and is killed
at a random instant (while it hashes, writes, commits, retires a base, or
sweeps retired data). After each kill, from a fresh process: every listed step
restores bitwise and the newest step the job reported committed is there. At
the end a job runs to completion: nothing leaks (no leftover, and every
retired directory is referenced by a kept step). CI runs 1 kill point;
``ORBAX_FLAX_FAULTS=long`` runs 110.
"""

import json
import os
import random
import re
import subprocess
import sys

import pytest

import jobs
import orbax_flax as ofx
from orbax_flax.format import step_dir
from orbax_flax.core._location import Location

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import diff_kill_worker  # noqa: E402  pylint: disable=wrong-import-position
import test_kills  # noqa: E402  pylint: disable=wrong-import-position

LONG = os.environ.get("ORBAX_FLAX_FAULTS") == "long"
KILLS = 110 if LONG else 1


def _start(d, *extra):
  return subprocess.Popen([sys.executable, os.path.join(HERE, "diff_kill_worker.py"), d, *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=jobs.env_for(8))


def _check_directory(d):
  import jax  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  steps, _ = step_dir.list_steps(Location.parse(d))
  for step in steps:
    got = ofx.restore(os.path.join(d, str(step)), {"state": diff_kill_worker.target(mesh)})
    diff_kill_worker.check(got["state"], step)
  return steps


def _bases(path, key="_CHECKPOINT", own=False):
  """The generations a step borrows from (its manifest's summary line), or its own."""
  with open(os.path.join(path, key), "rb") as f:
    summary = json.loads(f.read().split(b"\n")[1])
  return summary["generation"] if own else {b["generation"] for b in summary.get("bases", [])}


@pytest.mark.timeout(3600 if LONG else 600)  # the long run: about 8 s per kill point here
def test_sigkill_during_differential_saves_with_retention(tmp_path):
  rng = random.Random(19)
  d = str(tmp_path / "ckpt")
  checked, last = 0, 0
  for _ in range(KILLS):
    proc = _start(d)
    lines = jobs.read_until(proc, r"^COMMITTED", 240)
    (out,) = test_kills._kill_at_random(rng, [proc], [lines])  # pylint: disable=protected-access
    text = "".join(out)
    assert "Traceback" not in text, text[-3000:]
    resumed = re.findall(r"^RESUMED (\d+)", text, re.M)
    if last:  # what the previous job reported committed is still there, or newer
      assert resumed and int(resumed[0]) >= last, (resumed, last, text[-2000:])
    committed = [int(s) for s in re.findall(r"^COMMITTED (\d+)", text, re.M)]
    last = max(committed) if committed else last
    steps = _check_directory(d)
    assert steps and max(steps) >= last, (steps, last)
    checked += len(steps)
  # A job that finishes: retention and the sweep leave only what kept steps reference.
  res = subprocess.run([sys.executable, os.path.join(HERE, "diff_kill_worker.py"), d,
                        f"--steps={last + 7}"], capture_output=True, text=True,
                       env=jobs.env_for(8), timeout=300)
  assert res.returncode == 0 and "DONE" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
  steps = _check_directory(d)
  assert steps == [last + 6, last + 7], steps
  names = [n for n in os.listdir(d) if not n.startswith(".")]  # .readers: evaluator leases
  assert not [n for n in names if ".ofx-tmp-" in n], names
  referenced = set()
  for step in steps:
    referenced |= _bases(os.path.join(d, str(step)))
  retired = [n for n in names if ".ofx-base-" in n or not n.isdigit() or int(n) not in steps]
  for n in retired:  # retired in place (<step>/_RETIRED) or moved aside (<step>.ofx-base-<gen>)
    gen = (n.rsplit("-", 1)[1] if ".ofx-base-" in n
           else _bases(os.path.join(d, n), "_RETIRED", own=True))
    assert gen in referenced, (n, gen, referenced)
  assert len(names) == len(steps) + len(retired) and len(retired) <= 2, names
  test_kills._tally(  # pylint: disable=protected-access
      "differential saves with retention", KILLS, checked)
