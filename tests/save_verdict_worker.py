"""One process of a 2-process save whose verdict tests/test_save_verdicts.py checks.

--scenario, each a shim installed on one process before the save:
  cancel_while_waiting: process 1 syncs its written part only once process 0, which has written
    and reported its own part and waits for process 1, has cancelled its save (save_async).
  commit_fails: process 0's local commit (``saving._commit_local``) raises OSError.
  commit_slow: process 0's local commit starts only once process 1 says that its save returned,
    or after --hold seconds; process 1 restores the checkpoint right after its save returns.
  write_fails: process 1's writing raises OSError after its first batch was issued.
  parent_fsync_fails: on process 0, the fsync of the checkpoint's parent directory after the
    rename into place raises OSError (EIO): the checkpoint is in place, its new name maybe not
    durable.

Every process prints ``P<i> RESULT ok`` or ``P<i> RESULT <error type>: <message>``; with
commit_slow, process 1 also prints ``P1 RESTORED bitwise`` (or what it got instead).
"""

import argparse
import errno
import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs


def value():
  """The saved array (2 MiB: chunked, not packed): the same on every process."""
  return np.random.default_rng(11).standard_normal((4, 1 << 17), dtype=np.float32)


def install(scenario, me, hold_s, leading, path):
  """The scenario's shim on this process (``leading``: set when process 0 waits for the others)."""
  from orbax_flax.core import _multihost  # pylint: disable=g-import-not-at-top
  from orbax_flax.engine import saving  # pylint: disable=g-import-not-at-top
  from orbax_flax.format import _tsio  # pylint: disable=g-import-not-at-top
  if scenario == "cancel_while_waiting":
    if me == 0:
      real_lead = saving.SaveRun._lead

      def lead(self, error):
        leading.set()
        return real_lead(self, error)
      saving.SaveRun._lead = lead
    else:
      real_sync = saving.SaveRun._sync

      def sync(self):
        _multihost.fetch("verdicts/cancelled", 60)
        return real_sync(self)
      saving.SaveRun._sync = sync
  elif scenario == "commit_fails" and me == 0:
    def commit_local(*args, **kw):
      raise OSError(errno.EIO, "injected: the commit failed")
    saving._commit_local = commit_local
  elif scenario == "commit_slow" and me == 0:
    real_commit = saving._commit_local

    def commit_local(*args, **kw):
      try:
        _multihost.fetch("verdicts/p1_returned", hold_s)
      except _multihost.CoordinationTimeoutError:
        pass  # process 1 still waits for this commit, as it should
      return real_commit(*args, **kw)
    saving._commit_local = commit_local
  elif scenario == "parent_fsync_fails" and me == 0:
    from orbax_flax.core import _location  # pylint: disable=g-import-not-at-top
    real_fsync_dir = _location.fsync_dir
    parent = os.path.dirname(os.path.realpath(path))

    def fsync_dir(d):
      if os.path.realpath(d) == parent and os.path.exists(os.path.join(path, "_CHECKPOINT")):
        raise OSError(errno.EIO, "injected: fsync of the parent directory failed")
      return real_fsync_dir(d)
    _location.fsync_dir = fsync_dir
  elif scenario == "write_fails" and me == 1:
    real_flush = _tsio.DatabaseWriter.flush

    def flush(self, depth=2):
      real_flush(self, depth)
      raise OSError(errno.EIO, "injected: the disk went away")
    _tsio.DatabaseWriter.flush = flush


def main():
  import threading  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser()
  p.add_argument("--path")
  p.add_argument("--scenario", choices=["cancel_while_waiting", "commit_fails", "commit_slow",
                                        "write_fails", "parent_fsync_fails"])
  p.add_argument("--hold", type=float, default=1.5)
  a = jobs.join(p)
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  from orbax_flax.core import _multihost  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  v = value()
  x = jax.make_array_from_callback(v.shape, NamedSharding(mesh, P("x")), lambda i: v[i])
  leading = threading.Event()
  install(a.scenario, me, a.hold, leading, a.path)
  with ofx.Checkpointer(coordination_timeout_seconds=60) as ckptr:
    try:
      if a.scenario == "cancel_while_waiting":
        handle = ckptr.save_async(a.path, {"s": {"x": x}})
        if me == 0:
          assert leading.wait(60), "process 0 never waited for the others"
          handle.cancel()
          _multihost.publish("verdicts/cancelled", "1", timeout_s=60)
        handle.wait()
      else:
        ckptr.save(a.path, {"s": {"x": x}})
      print(f"P{me} RESULT ok", flush=True)
    except Exception as e:  # pylint: disable=broad-except  # what the test checks
      print(f"P{me} RESULT {type(e).__name__}: {e}", flush=True)
    if a.scenario == "commit_slow" and me == 1:
      try:  # at once: the save returned, so the checkpoint is there
        got = np.asarray(ofx.restore(a.path)["s"]["x"])
        print(f"P1 RESTORED {'bitwise' if got.tobytes() == v.tobytes() else 'other bytes'}",
              flush=True)
      except Exception as e:  # pylint: disable=broad-except
        print(f"P1 RESTORED {type(e).__name__}: {e}", flush=True)
      _multihost.publish("verdicts/p1_returned", "1", timeout_s=60)
  jobs.exit_together(60)


if __name__ == "__main__":
  main()
