"""What a Ctrl-C (KeyboardInterrupt) or a fork does to a save in flight: every save ends
committed and whole, or never committed, and none runs where its caller cannot see it.

A Ctrl-C is a real SIGINT sent to the main thread while it waits; the save is held in its
writing (the real write, after a gate) so that the interrupt lands there every time.
"""
import os
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import orbax_flax as ofx
from orbax_flax.engine import saving


def _items(tag, n=1 << 20):
  return {"state": {"w": np.full(n, tag, np.float32), "b": np.arange(8) + tag}}


def _restores_as(path, tag, n=1 << 20):
  got = ofx.restore(path)["state"]
  return np.array_equal(got["w"], np.full(n, tag, np.float32)) and np.array_equal(
      got["b"], np.arange(8) + tag)


def _verify(path):
  return subprocess.run([sys.executable, "-m", "orbax_flax", "verify", path],
                        capture_output=True, text=True, check=False)


def _join_save_threads():
  for t in threading.enumerate():
    if t.name.startswith("orbax_flax-save"):
      t.join(60)
      assert not t.is_alive(), t.name


@pytest.fixture
def held_writing(monkeypatch):
  """Once ``hold()`` is called, holds every save in its writing until ``release()``;
  ``writing`` is set once one is held."""
  armed, gate, writing = threading.Event(), threading.Event(), threading.Event()
  write = saving.SaveRun.write

  def held(self, *args, **kwargs):
    if armed.is_set():
      writing.set()
      assert gate.wait(60), "a save held at the gate for a minute"
    return write(self, *args, **kwargs)
  monkeypatch.setattr(saving.SaveRun, "write", held)
  held.hold, held.writing, held.release = armed.set, writing, gate.set
  yield held
  gate.set()
  _join_save_threads()


def _ctrl_c_soon(delay=0.2):
  """A SIGINT to the main thread in ``delay`` s (as Ctrl-C in a terminal or a notebook)."""
  main = threading.main_thread().ident
  threading.Timer(delay, lambda: signal.pthread_kill(main, signal.SIGINT)).start()


@pytest.fixture
def ctrl_c_as_the_save_thread_starts(monkeypatch):
  """A KeyboardInterrupt as ``Thread.start()`` returns for a save's thread: what a Ctrl-C
  during its wait for the new thread does (about one interrupted save in a hundred)."""
  start = threading.Thread.start

  def interrupted(self):
    start(self)
    if self.name.startswith("orbax_flax-save") and not interrupted.done:
      interrupted.done = True
      raise KeyboardInterrupt
  interrupted.done = False
  monkeypatch.setattr(threading.Thread, "start", interrupted)
  yield
  _join_save_threads()


def test_a_ctrl_c_as_the_save_thread_starts_abandons_that_save(tmp_path,
                                                              ctrl_c_as_the_save_thread_starts):
  """The save ran on untracked: the next save copied into the staging memory it was still
  writing from, and the first committed with the second's bytes (or bytes failing their CRC)."""
  first, second = str(tmp_path / "first"), str(tmp_path / "second")
  with ofx.Checkpointer(host_transfer="memcpy") as ckptr:
    with pytest.raises(KeyboardInterrupt):
      ckptr.save_async(first, _items(1))
    ckptr.save_async(second, _items(2)).wait()  # waits for the first to end
  _join_save_threads()  # (the first, had it run on untracked)
  assert not os.path.exists(first)  # abandoned: never committed
  assert _restores_as(second, 2)
  assert _verify(second).returncode == 0


def test_a_ctrl_c_as_a_manager_save_thread_starts_leaves_no_step_behind(
    tmp_path, ctrl_c_as_the_save_thread_starts):
  """The manager never learned of the save: it committed beside the keep rules (two steps
  with max_to_keep=1), with the next save's bytes where the memory was shared."""
  d = str(tmp_path)
  policy = ofx.CheckpointPolicy(max_to_keep=1, host_transfer="memcpy")
  with ofx.CheckpointManager(d, policy) as m:
    with pytest.raises(KeyboardInterrupt):
      m.save(1, _items(1), force=True)
    m.save(2, _items(2), force=True)  # the notebook cell run again
    m.wait()
    assert m.all_steps() == [2]
  with ofx.CheckpointManager(d) as m:
    assert m.all_steps() == [2]
    assert _restores_as(m.step_path(2), 2)
  assert _verify(os.path.join(d, "2")).returncode == 0


def test_a_ctrl_c_in_close_abandons_the_save_and_holds_the_lease_until_it_ends(
    tmp_path, held_writing):
  """close() interrupted released the writer lease (and the keep rules) while the save still
  wrote: a manager opened next swept the data it wrote, and it committed a gutted step."""
  d = str(tmp_path)
  policy = ofx.CheckpointPolicy(max_to_keep=1)
  m = ofx.CheckpointManager(d, policy)
  m.save(1, _items(1), force=True)
  m.wait()
  held_writing.hold()
  m.save(2, _items(2), force=True)
  assert held_writing.writing.wait(30)
  _ctrl_c_soon(0.2)
  _ctrl_c_soon(0.6)  # again, while close() waits for the abandoned save's writing to stop
  with pytest.raises(KeyboardInterrupt):
    m.close()
  other = ofx.CheckpointManager(d)
  try:  # the save still writes: its manager still holds the directory
    with pytest.raises(ofx.WriterConflictError, match="interrupted close"):
      other.save(3, _items(3), force=True)
  finally:
    other.close()
  held_writing.release()
  _join_save_threads()
  m.close()  # closed already: returns at once
  with ofx.CheckpointManager(d, policy) as m2:  # the cell run again
    assert m2.all_steps() == [1]  # the abandoned save of 2 never committed
    m2.save(3, _items(3), force=True)
    m2.wait()
    assert m2.all_steps() == [3]
  assert _restores_as(os.path.join(d, "3"), 3)
  assert not [n for n in os.listdir(d) if n.startswith("2")]


def test_a_ctrl_c_in_a_checkpointer_close_abandons_the_save(tmp_path, held_writing):
  """Its staging memory, which the save still writes from, is let go only once it ended."""
  path = str(tmp_path / "ckpt")
  ckptr = ofx.Checkpointer(host_transfer="memcpy")
  held_writing.hold()
  handle = ckptr.save_async(path, _items(1))
  assert held_writing.writing.wait(30)
  _ctrl_c_soon()
  with pytest.raises(KeyboardInterrupt):
    ckptr.close()
  held_writing.release()
  with pytest.raises(ofx.SaveCancelledError):
    handle.wait()
  assert not os.path.exists(path)
  ckptr.close()


_FORK_CHILD = r"""
import os, signal, sys, warnings
warnings.simplefilter("ignore", RuntimeWarning)  # JAX's warning about os.fork()
import numpy as np, orbax_flax as ofx
m = ofx.CheckpointManager(sys.argv[1])
m.save(1, {"state": {"w": np.full(32 << 20, 1, np.float32)}}, force=True)  # still writing
pid = os.fork()
if pid == 0:
  signal.alarm(30)  # a hang ends here
  sys.exit(0)  # the child's work is done: it exits as a script does
_, status = os.waitpid(pid, 0)
print("child", "hung" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM
      else "exited", flush=True)
m.close()
"""


def test_a_child_forked_while_a_save_runs_exits_without_waiting_for_it(tmp_path):
  """The child ran the parent's exit hook and waited for ever for a thread only the parent has."""
  proc = subprocess.run([sys.executable, "-c", _FORK_CHILD, str(tmp_path)], capture_output=True,
                        text=True, timeout=120, check=False,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})  # (on a chip: this holds it)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "child exited" in proc.stdout, (proc.stdout, proc.stderr[-2000:])  # (not "hung")
  with ofx.CheckpointManager(str(tmp_path)) as m:
    assert m.all_steps() == [1]


def test_a_ctrl_c_in_a_pending_restores_join_leaves_it_pending(tmp_path):
  """A Ctrl-C in ``restore_or_init_async(...).join()``: on CPython 3.11/3.12 an interrupted
  Thread.join() leaves the thread looking ended while it runs, so the restore said it was
  done, a second restore_or_init was allowed beside it, close() did not wait, and the stale
  restore later moved the data iterator back to the checkpoint's position mid-training."""
  class Data:
    def __init__(self, seek_s=0.0):
      self.i, self.seek_s, self.seeking = 0, seek_s, threading.Event()
    def get_state(self):
      return {"i": self.i}
    def set_state(self, state):
      self.seeking.set()
      threading.Event().wait(self.seek_s)  # a seek into a large dataset
      self.i = state["i"]
  policy = {"save_interval_steps": 1, "save_final_step": False}
  with ofx.CheckpointCallback(str(tmp_path), policy) as ckpt:
    state = ckpt.restore_or_init({"w": np.zeros(4, np.float32)}, data_iterator=Data())
    ckpt.on_step_end(1, state)
  ckpt = ofx.CheckpointCallback(str(tmp_path), policy)
  data = Data(seek_s=2.0)
  data.i = 7  # where the data iterator stands before the restore
  pending = ckpt.restore_or_init_async({"w": np.zeros(4, np.float32)}, data_iterator=data)
  assert data.seeking.wait(30)
  _ctrl_c_soon(0.1)
  with pytest.raises(KeyboardInterrupt):
    pending.join()
  assert not pending.done() and pending.error() is None  # the restore runs on
  with pytest.raises(RuntimeError, match="still pending: join"):
    ckpt.restore_or_init({"w": np.zeros(4, np.float32)}, data_iterator=data)
  ckpt.close()  # waits for the restore, then its join() says the callback closed
  assert pending.done() and data.i == 0  # moved to step 1's position, before close returned
  with pytest.raises(RuntimeError, match="closed while this restore was pending"):
    pending.join()
