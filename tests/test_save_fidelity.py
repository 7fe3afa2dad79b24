"""A save writes the values the caller had, at their places, within its memory budget.

Holes a mutation review of the save path found, each test killing its mutant: shards taken by
their position in the sharding's device order (not by device id); the planner's kept layouts
told apart by sharding; the numpy leaves of an async save copied before it returns, for every
host transfer; a save during a zero-filling preparation of its staging memory; the staging
memory within ``max_host_bytes``; a save still writing when the interpreter exits.

Every value is distinct per element (``arange``) and compared bitwise. Where a race needs a
window, a shim holds the background write on an event (never a bare sleep), so that the test
decides on a loaded host as on an idle one.
"""

import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_flax as ofx
from orbax_flax.core import _staging
from orbax_flax.engine import saving

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ON_CPU = jax.devices()[0].platform == "cpu"
needs_8_cpu_devices = pytest.mark.skipif(
    not _ON_CPU or jax.device_count() != 8, reason="meshes of the 8 simulated CPU devices")


def _arange(shape, dtype, sharding=None, start=0):
  """Distinct values per element (exact in ``dtype``), placed with ``sharding`` if given."""
  x = (np.arange(int(np.prod(shape)), dtype=np.int64) + start).astype(dtype).reshape(shape)
  return x if sharding is None else jax.device_put(x, sharding)


def _assert_tree_equal(got, expected):
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def _hold_background_writes(monkeypatch):
  """Holds every ``SaveRun.write`` made outside the calling thread (the async save's
  background phase) until the returned event is set (at most 30 s): its host data must not
  change meanwhile, whatever the caller does."""
  release = threading.Event()
  caller = threading.get_ident()
  write = saving.SaveRun.write

  def held(self, *args, **kwargs):
    if threading.get_ident() != caller:
      release.wait(30)
    return write(self, *args, **kwargs)
  monkeypatch.setattr(saving.SaveRun, "write", held)
  return release


# ----------------------------------------------------------------------------
# Shards at their places.


@needs_8_cpu_devices
@pytest.mark.parametrize("how", ["save", "save_async:memcpy", "save_async:device_copy"])
def test_a_mesh_whose_devices_are_not_in_id_order_saves_each_shard_at_its_place(tmp_path, how):
  """jax orders an array's shards by its mesh's device order, not by device id: a shard found by
  its position among the sorted devices is another device's, written at this one's place."""
  mesh = Mesh(np.array(jax.devices())[[3, 1, 7, 5, 0, 2, 6, 4]].reshape(4, 2), ("x", "y"))
  assert [d.id for d in mesh.devices.flat] != sorted(d.id for d in mesh.devices.flat)
  state = {
      "big": _arange((1024, 512), np.float32, NamedSharding(mesh, P("x", "y"))),  # chunked
      "rows": _arange((512, 1024), np.int32, NamedSharding(mesh, P("x")), 7),  # chunked, replicas
      "small": _arange((16, 8), np.int32, NamedSharding(mesh, P("x", "y")), 3),  # packed
      "cols": _arange((8, 6), np.float32, NamedSharding(mesh, P(None, "y")), 5),  # packed
  }
  expected = jax.tree.map(np.array, state)
  path = str(tmp_path / "c")
  if how == "save":
    ofx.save(path, {"state": state})
  else:
    with ofx.Checkpointer(host_transfer=how.split(":")[1]) as ckptr:
      handle = ckptr.save_async(path, {"state": state})
      handle.wait()
    assert handle.transfer == how.split(":")[1]
  # Into the same shardings, onto a mesh in id order, and as host arrays.
  same = ofx.restore(path, {"state": ofx.abstract(state)})["state"]
  _assert_tree_equal(same, expected)
  assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(state)))
  plain = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
  target = {"state": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=plain),
                                  state)}
  _assert_tree_equal(ofx.restore(path, target)["state"], expected)
  _assert_tree_equal(ofx.restore(path)["state"], expected)


@needs_8_cpu_devices
@pytest.mark.parametrize("how", ["save", "save_async"])
def test_one_checkpointer_saves_one_shape_under_three_shardings_each_from_its_own_shards(
    tmp_path, how):
  """A checkpointer keeps the layouts it planned, by what a layout depends on: the same shapes
  and dtypes under another sharding are another layout (other shards, other chunks)."""
  mesh = jax.make_mesh((8,), ("x",))
  with ofx.Checkpointer() as ckptr:
    for n, spec in enumerate([P("x"), P(None, "x"), P()]):
      sharding = NamedSharding(mesh, spec)
      state = {"big": _arange((512, 1024), np.float32, sharding, n),   # chunked
               "small": _arange((16, 64), np.int32, sharding, 10 * n)}  # packed
      path = str(tmp_path / f"c{n}")
      if how == "save":
        ckptr.save(path, {"state": state})
      else:
        ckptr.save_async(path, {"state": state}).wait()
      _assert_tree_equal(ckptr.restore(path)["state"], jax.tree.map(np.array, state))
      restored = ckptr.restore(path, {"state": ofx.abstract(state)})["state"]
      _assert_tree_equal(restored, jax.tree.map(np.array, state))
      assert restored["big"].sharding == sharding


# ----------------------------------------------------------------------------
# The snapshot of an async save.


@pytest.mark.parametrize("transfer", ["memcpy", "device_copy", "pinned_host"])
def test_an_async_save_keeps_the_numpy_values_the_caller_had_when_it_returned(
    tmp_path, monkeypatch, transfer):
  """save_async returns once the caller may change its arrays: numpy leaves, packed or chunked,
  are copied before it returns under every host transfer (all three run on CPU), and a
  change made while the background write is held does not reach the checkpoint."""
  release = _hold_background_writes(monkeypatch)
  sharding = NamedSharding(jax.make_mesh((len(jax.devices()),), ("x",)), P("x"))
  state = {"big": _arange((1024, 640), np.float32),  # 2.5 MiB: its own chunked array
           "small": _arange((40, 3), np.int64, None, 11),  # packed
           "w": _arange((256, 64), np.float32, sharding, 13)}
  expected = jax.tree.map(np.array, state)
  path = str(tmp_path / "c")
  with ofx.Checkpointer(host_transfer=transfer) as ckptr:
    handle = ckptr.save_async(path, {"state": state})
    assert handle.transfer == transfer and not handle.done()  # held: nothing written yet
    state["big"][...] = -1  # the caller goes on with its arrays, in place
    state["small"][...] = -1
    state["w"] = jax.jit(lambda x: x * 0 - 1, donate_argnums=0)(state["w"])
    jax.block_until_ready(state["w"])
    release.set()
    handle.wait()
  _assert_tree_equal(ofx.restore(path)["state"], expected)


# ----------------------------------------------------------------------------
# Staging memory.


def _save_during_a_slow_preparation(tmp_path, monkeypatch, state, populate):
  """Prepares the staging memory for ``state`` and saves it while the preparation runs: the
  preparation touches its first MiB, then waits until the save has stopped it and 0.2 s more
  (a slow host) before it touches the rest of its slice; the save writes after that (its
  snapshot is taken by then). Returns the staging stats after the save, and what restores."""
  touching, touched = threading.Event(), threading.Event()
  touch = _staging.touch
  ckptr = ofx.Checkpointer(host_transfer="memcpy")

  def slow_host(address, nbytes, populating):
    assert populating == populate
    first = min(nbytes, 1 << 20)
    ok = touch(address, first, populating)
    touching.set()
    if ok is False:  # the preparation stops there
      touched.set()
      return ok
    deadline = time.monotonic() + 30
    while ckptr.staging_stats().preparing and time.monotonic() < deadline:
      time.sleep(0.001)  # until a save stops the preparation
    time.sleep(0.2)
    ok = touch(address + first, nbytes - first, populating)
    touched.set()
    return ok
  monkeypatch.setattr(_staging, "touch", slow_host)
  write = saving.SaveRun.write

  def after_the_preparation(self, *args, **kwargs):  # its zeros, if any, are there by now
    touched.wait(30)
    return write(self, *args, **kwargs)
  monkeypatch.setattr(saving.SaveRun, "write", after_the_preparation)
  with ckptr:
    assert ckptr.prepare({"state": state}) >= state["w"].nbytes
    assert touching.wait(30)
    ckptr.save_async(str(tmp_path / "c"), {"state": state}).wait()
    stats = ckptr.staging_stats()
  assert touched.is_set()
  return stats, ofx.restore(str(tmp_path / "c"))["state"]


@pytest.mark.skipif(not _ON_CPU, reason="memcpy stages the whole state on CPU only")
def test_a_save_during_a_zero_filling_preparation_waits_for_its_slice_and_keeps_the_snapshot(
    tmp_path, monkeypatch):
  """Without MADV_POPULATE_WRITE (Linux < 5.14) the preparation writes zeros into the staging
  memory: a save that stopped it must wait for its current slice, whose zeros would otherwise
  land on the snapshot copied meanwhile."""
  monkeypatch.setattr(_staging, "_can_populate", lambda address: False)
  sharding = NamedSharding(jax.make_mesh((len(jax.devices()),), ("x",)), P("x"))
  state = {"w": _arange((2048, 2048), np.int32, sharding, 1),  # 16 MiB, staged whole
           "b": _arange((1000,), np.int32, None, 5)}
  expected = jax.tree.map(np.array, state)
  stats, restored = _save_during_a_slow_preparation(tmp_path, monkeypatch, state, populate=False)
  assert stats.mappings == 1  # the save copied into the prepared memory
  _assert_tree_equal(restored, expected)


@pytest.mark.skipif(not _ON_CPU, reason="memcpy stages the whole state on CPU only")
def test_a_preparation_whose_populate_fails_midway_writes_no_zeros_under_a_save(
    tmp_path, monkeypatch):
  """MADV_POPULATE_WRITE can work for the one-page probe and fail later (ENOMEM under a
  cgroup's memory pressure): the preparation then fell back to writing zeros, while a save
  does not wait for a populating preparation, and 44% of the snapshot came back zero. Here
  madvise fails past one page."""
  class FailingPopulate:
    def madvise(self, address, nbytes, advice):
      del address, advice
      return 0 if nbytes <= 4096 else -1
  monkeypatch.setattr(_staging, "_libc", FailingPopulate)
  sharding = NamedSharding(jax.make_mesh((len(jax.devices()),), ("x",)), P("x"))
  state = {"w": _arange((2048, 2048), np.int32, sharding, 1)}  # 16 MiB, staged whole
  expected = jax.tree.map(np.array, state)
  _, restored = _save_during_a_slow_preparation(tmp_path, monkeypatch, state, populate=True)
  _assert_tree_equal(restored, expected)


def test_the_staging_memory_never_exceeds_max_host_bytes_when_a_round_rounds_up_past_it(tmp_path):
  """Staging memory grows in 2 MiB steps; a round just under a budget that is not a multiple of
  2 MiB is held at the budget, never rounded past it (the budget is the user's promise)."""
  budget = 3 * 2**20 + 4096
  state = {"w": _arange(((3 << 20) + 1024) // 4, np.int32, None, 9)}  # one round: 3 MiB + 1 KiB
  for prepared in (True, False):
    path = str(tmp_path / f"c{prepared}")
    with ofx.Checkpointer(max_host_bytes=budget) as ckptr:
      if prepared:
        n = ckptr.prepare({"state": state})
        assert state["w"].nbytes <= n <= budget, n
        assert ckptr.staging_bytes == n
      handle = ckptr.save_async(path, {"state": state})
      handle.wait()
      assert handle.transfer == "memcpy"
      assert state["w"].nbytes <= ckptr.staging_bytes <= budget, (prepared, ckptr.staging_bytes)
      assert ckptr.staging_stats().mappings == 1
    _assert_tree_equal(ofx.restore(path)["state"], state)


# ----------------------------------------------------------------------------
# The interpreter's exit.

_EXIT_WITH_A_SAVE_IN_FLIGHT = """
import sys, time
import jax.numpy as jnp, numpy as np
import orbax_flax as ofx
from orbax_flax.engine import saving

write = saving.SaveRun.write
def slow_write(self, *args, **kwargs):  # storage slower than the exit
  time.sleep(0.5)
  return write(self, *args, **kwargs)
saving.SaveRun.write = slow_write
state = {"w": jnp.arange(1 << 18, dtype=jnp.int32), "n": np.arange(1000, dtype=np.int64) * 3}
handle = ofx.save_async(sys.argv[1], {"state": state})
print("returned while writing:", not handle.done(), flush=True)
# No wait(): the script ends with the save in flight.
"""


def test_a_save_async_still_writing_when_the_interpreter_exits_is_committed(tmp_path):
  """A script whose last line starts a save must not lose it: the exit waits for the save in
  flight to commit (its thread is a daemon, which the exit would otherwise kill)."""
  path = str(tmp_path / "c")
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  done = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXIT_WITH_A_SAVE_IN_FLIGHT), path],
                        capture_output=True, text=True, timeout=300, env=env, check=False)
  assert "returned while writing: True" in done.stdout, (done.stdout, done.stderr[-3000:])
  assert done.returncode == 0, done.stderr[-3000:]
  assert os.listdir(tmp_path) == ["c"], os.listdir(tmp_path)  # committed, no leftover
  restored = ofx.restore(path)["state"]
  np.testing.assert_array_equal(restored["w"], np.arange(1 << 18, dtype=np.int32))
  np.testing.assert_array_equal(restored["n"], np.arange(1000, dtype=np.int64) * 3)


_EXIT_WITH_A_FAILED_SAVE = """
import os, sys, time
import jax.numpy as jnp
import orbax_flax as ofx
from orbax_flax.engine import saving
root, when = sys.argv[1], sys.argv[2]
if when == "at_the_exit":  # storage slower than the exit
  begin = saving.SaveRun.begin
  def slow_begin(self):
    time.sleep(0.5)
    return begin(self)
  saving.SaveRun.begin = slow_begin
open(os.path.join(root, "d"), "w").close()  # a file where the checkpoint's parent should be
handle = ofx.save_async(os.path.join(root, "d", "ckpt"), {"state": {"w": jnp.arange(1000)}})
if when == "before_the_exit":
  while not handle.done():  # failed, and nobody looks
    time.sleep(0.01)
print("done at the end:", handle.done(), flush=True)
"""


@pytest.mark.parametrize("when", ["before_the_exit", "at_the_exit"])
def test_an_async_save_that_failed_unseen_says_so_when_the_program_ends(tmp_path, when):
  """A failed save nobody waited for is said at the exit, whether it failed before (the handle
  still alive: finalized silently) or while the exit joined it. Both ended 0 with no word."""
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXIT_WITH_A_FAILED_SAVE),
                         str(tmp_path), when], capture_output=True, text=True, timeout=300,
                        env=env, check=False)
  assert f"done at the end: {when == 'before_the_exit'}" in done.stdout, (done.stdout,
                                                                         done.stderr[-3000:])
  assert "and nobody waited for it: StorageError" in done.stderr, done.stderr[-3000:]
  assert done.stderr.count("nobody waited for it") == 1, done.stderr[-3000:]
  assert "ckpt" in done.stderr and os.listdir(tmp_path) == ["d"]
