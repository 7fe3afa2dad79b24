"""With ``differential`` off, no code of ``orbax_flax/differential/`` runs in a save or a restore.

Differential saves plug into interfaces the engine and the manager own (the
save's :class:`orbax_flax.engine.saving.SaveHooks`, the registry's
:class:`orbax_flax.manager.registry.Retention`); a plain run uses their plain
defaults, and a restore of a checkpoint that references no other step finds
its databases in the engine. Checked in a fresh process with a profiler that records every Python
call into a file of ``orbax_flax/differential/``, phase by phase: saves through
the callback and the manager (with deletions by the keep rules), and resumes and
restores. A plain manager looks, when it becomes the writer, whether its directory
holds differential data already (a run that had it on), whose references its
deletions must then keep (``registry.holds_references``, no differential code).
"""

import os
import subprocess
import sys
import textwrap

import numpy as np

import orbax_flax as ofx

SCRIPT = textwrap.dedent("""
    import collections, os, sys, tempfile, threading
    import numpy as np
    import orbax_flax as ofx
    ofx.CheckpointCallback, ofx.CheckpointManager, ofx.CheckpointPolicy  # imported before the probe

    root = os.path.dirname(os.path.abspath(ofx.__file__))
    differential = os.path.join(root, "differential") + os.sep
    phase = ["none"]
    entered = collections.defaultdict(set)

    def probe(frame, event, arg):
      if event == "call" and frame.f_code.co_filename.startswith(differential):
        entered[phase[0]].add(os.path.relpath(frame.f_code.co_filename, root))

    def run(work, on):
      policy = {"save_interval_steps": 1, "max_to_keep": 2, "differential": on}
      state = {"w": np.arange(4096, dtype=np.float32), "b": np.zeros(8, np.float32)}
      with ofx.CheckpointCallback(work, policy) as ckpt:
        phase[0] = "restore"
        state = ckpt.restore_or_init(state)
        phase[0] = "save"
        for step in range(1, 5):
          state = {"w": state["w"] + (step == 3), "b": state["b"]}
          ckpt.on_step_end(step, state, {"loss": 1.0 / step})
        ckpt.manager.wait()
        phase[0] = "none"
      with ofx.CheckpointCallback(work, policy) as ckpt:
        phase[0] = "restore"
        restored = ckpt.restore_or_init(state)
        phase[0] = "none"
        assert ckpt.restored_step == 4, ckpt.restored_step
        assert ckpt.manager.all_steps() == [3, 4], ckpt.manager.all_steps()
        np.testing.assert_array_equal(restored["w"], state["w"])
      with ofx.CheckpointManager(work, ofx.CheckpointPolicy(max_to_keep=2, differential=on)) as m:
        phase[0] = "save"
        m.save(5, {"state": state}, force=True)
        m.save(6, {"state": state}, force=True)
        m.wait()
        phase[0] = "restore"
        m.restore(6)
        phase[0] = "none"
        assert m.all_steps() == [5, 6], m.all_steps()

    sys.setprofile(probe)
    threading.setprofile(probe)
    for on in (False, True):
      entered.clear()
      with tempfile.TemporaryDirectory() as d:
        run(d, on)
      for p in ("save", "restore"):
        print("ON" if on else "OFF", p, " ".join(sorted(entered[p])) or "-")
    sys.setprofile(None)
    threading.setprofile(None)
""")


def test_a_plain_run_enters_no_differential_module(tmp_path):
  env = dict(os.environ, TMPDIR=str(tmp_path), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-4000:]
  seen = {tuple(line.split(" ")[:2]): set(line.split(" ")[2:]) - {"-"}
          for line in out.stdout.splitlines() if line.startswith(("OFF ", "ON "))}
  assert seen[("OFF", "save")] == set(), f"differential off, a save entered {seen[('OFF', 'save')]}"
  assert seen[("OFF", "restore")] == set(), (
      f"differential off, a restore entered {seen[('OFF', 'restore')]}")
  # The probe sees differential code when it runs: the same run with it on enters it.
  assert {"differential/differ.py", "differential/retention.py"} <= seen[("ON", "save")], seen
  assert "differential/refs.py" in seen[("ON", "restore")], seen


def test_a_plain_manager_keeps_what_earlier_differential_steps_reference(tmp_path):
  """A run that turns differential saves off over a directory that holds differential steps:
  its keep rules still retire, never delete, a step a kept step borrows from."""
  root = str(tmp_path / "ckpt")
  big = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(differential=True)) as m:
    for step in range(3):  # steps 1 and 2 borrow the big array from step 0
      m.save(step, {"s": {"big": big, "step": step}}, force=True)
    m.wait()
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(max_to_keep=2)) as m:
    m.save(3, {"s": {"big": big + 1, "step": 3}}, force=True)
    m.wait()
    assert m.all_steps() == [2, 3]
    assert os.path.exists(os.path.join(root, "0", "_RETIRED"))  # step 2 borrows from it
    assert m.restore(2)["s"]["big"].tobytes() == big.tobytes()
