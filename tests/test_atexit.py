"""Saves and restores from an ``atexit`` hook: a job's last checkpoint, written as it exits.

Once the interpreter has begun to exit, ``concurrent.futures`` takes no new work, and the
copies, hashes and reads of a large state ran on thread pools: a save or restore in an
``atexit`` hook failed ("cannot schedule new futures after interpreter shutdown"), and the
job lost its last checkpoint. At exit that work now runs in the calling thread.

The states here are just large enough for each pool: two 4 MiB arrays, which an async save
with ``host_transfer="memcpy"`` (the path a CPU state over 256 MiB takes) copies into its
staging memory on threads (from 4 MiB), a differential save hashes on threads (from 8 MiB),
a restore reads on threads (more than one read), and the local tier writes and reads its
file on threads (more than one piece). The scripts run in real subprocesses, so that their
hooks run at a real interpreter exit.
"""

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from orbax_flax.core import _threads

# The state the two scripts agree on (two leaves of 4 MiB: one jax, one numpy), and what a
# training script makes while it runs: its callback, here saving each step to the local tier.
_STATE = """
import atexit, sys
import jax.numpy as jnp, numpy as np
import orbax_flax as ofx

root = sys.argv[1]
state = {"a": jnp.arange(1 << 20, dtype=jnp.float32), "b": np.arange(1 << 20, dtype=np.float32) * 2}
local = ofx.CheckpointCallback(root + "/work", ofx.CheckpointPolicy(
    local_directory=root + "/local", local_save_interval_steps=1, save_interval_steps=100,
    save_final_step=False))
"""

# The last saves are made in the hook, which then closes what made them (as
# atexit.register(manager.close) does): the callback's, two managers' (async saves: staged
# copies, and hashes for the differential one) and an engine's.
_SAVE = _STATE + """
plain = ofx.CheckpointManager(root + "/plain", ofx.CheckpointPolicy(host_transfer="memcpy"))
diff = ofx.CheckpointManager(root + "/diff", ofx.CheckpointPolicy(host_transfer="memcpy",
                                                                  differential=True))
local.restore_or_init(state)  # (nothing to resume)
def final_save():
  local.on_step_end(7, state)
  local.close()
  for m in (plain, diff):
    assert m.save(7, {"state": state}, force=True)
    m.close()
  with ofx.Checkpointer(host_transfer="memcpy") as c:
    c.save_async(root + "/engine", {"state": state}).wait()
  print("saved at exit", flush=True)
atexit.register(final_save)
"""

# Restores in the hook: through the callback (the local tier), a manager and the engine.
_RESTORE = _STATE + """
plain = ofx.CheckpointManager(root + "/plain")
def restore():
  got = {"local": local.restore_or_init(state),
         "plain": plain.restore(7)["state"],
         "diff": ofx.restore(root + "/diff/7")["state"],
         "engine": ofx.restore(root + "/engine", {"state": ofx.abstract(state)})["state"]}
  for where, tree in got.items():
    for k, v in state.items():
      np.testing.assert_array_equal(np.asarray(tree[k]), np.asarray(v), err_msg=f"{where}/{k}")
  assert local.restored_step == 7, local.restored_step
  local.close()
  print("restored at exit", sorted(got), flush=True)
atexit.register(restore)
"""


def _run(script: str, root) -> subprocess.CompletedProcess:
  # An exception in an atexit hook is printed, and the exit status stays 0: the tests look
  # for the line each hook prints as it ends.
  return subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(root)],
                        capture_output=True, text=True, timeout=300, check=False)


def test_a_state_big_enough_for_the_thread_pools_is_saved_and_restored_in_atexit_hooks(tmp_path):
  saved = _run(_SAVE, tmp_path)
  assert "saved at exit" in saved.stdout, saved.stderr[-3000:]
  assert "Exception ignored" not in saved.stderr, saved.stderr[-3000:]
  for d in ("plain/7", "diff/7", "engine"):
    assert (tmp_path / d / "_CHECKPOINT").exists(), d

  restored = _run(_RESTORE, tmp_path)
  assert "restored at exit ['diff', 'engine', 'local', 'plain']" in restored.stdout, \
      restored.stderr[-3000:]
  assert "Exception ignored" not in restored.stderr, restored.stderr[-3000:]
  assert saved.returncode == 0 and restored.returncode == 0


def test_the_first_failure_of_the_threads_is_raised_and_wakes_the_others():
  """Outside an exit the calls run on threads; the first error is raised, never swallowed,
  and the calls still running are woken (a read waiting for memory would wait for ever)."""
  woken = threading.Event()

  def call(x):
    if x == 0:
      raise ValueError("read 0 failed")
    assert woken.wait(60), "not woken"
    return x

  with pytest.raises(ValueError, match="read 0 failed"):
    _threads.parallel_map(call, [0, 1, 2], 3, wake=woken.set)
  assert woken.is_set()
  assert _threads.parallel_map(lambda x: x * x, range(5), 3) == [0, 1, 4, 9, 16]
