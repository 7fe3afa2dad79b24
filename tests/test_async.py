"""save_async: a real snapshot, errors never lost, memory back to baseline."""

import gc
import os
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engine_worker
import orbax_flax as ofx
from disks import small_disk


# On CPU device buffers are host memory, so an async save with the memcpy transfer copies the
# whole state into staging memory (the default for states over 256 MiB; a smaller one is copied
# by XLA, "device_copy", and only its packed small arrays are staged). On an accelerator each
# shard's device-to-host copy is private already: only the packed small arrays are staged (at
# most one 2 MiB unit here), and with max_host_bytes nothing (the pinned transfer). The staging
# tests below check the side of that their platform is on.
_ON_CPU = jax.devices()[0].platform == "cpu"


def _state(mb=64, seed=0, committed_count=False):
  """A state on a mesh of every device there is: 8 CPU devices here ((2, 4)), one TPU chip on
  an accelerator (``JAX_PLATFORMS=tpu pytest -W ignore::UserWarning tests/test_async.py -k
  "donated or private"``). ``count`` is uncommitted, as ``jnp.int32(5)`` is, unless
  ``committed_count`` places it on the mesh."""
  mesh = engine_worker.make_mesh()
  rng = np.random.default_rng(seed)
  n = mb * (1 << 20) // 4 // 2048
  return {"w": jax.device_put(rng.standard_normal((n, 2048), dtype=np.float32),
                              NamedSharding(mesh, P("data", "model"))),
          "b": jax.device_put(rng.standard_normal((2048,), dtype=np.float32), NamedSharding(mesh, P())),
          "count": (jax.device_put(np.int32(5), NamedSharding(mesh, P())) if committed_count
                    else jnp.int32(5))}


def test_arrays_can_be_donated_and_deleted_once_save_async_returns(ckpt_dir):
  state = _state()
  expected = jax.tree.map(np.array, state)
  handle = ofx.save_async(ckpt_dir, {"state": state})
  # The caller owns its buffers again: donate them to a step that overwrites
  # them in place, and delete the rest.
  step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)
  new = step(state)
  jax.block_until_ready(new)
  assert all(x.is_deleted() for x in jax.tree.leaves(state))
  handle.wait()
  assert handle.done() and handle.blocking_s <= handle.total_s
  restored = ofx.restore(ckpt_dir)["state"]
  jax.tree.map(np.testing.assert_array_equal, restored, expected)


def test_snapshot_does_not_alias_device_buffers(ckpt_dir):
  from orbax_flax.engine import _planning  # pylint: disable=g-import-not-at-top
  from orbax_flax.core import _staging
  from orbax_flax.engine import saving
  from orbax_flax.core._location import Location  # pylint: disable=g-import-not-at-top
  state = _state(8)
  plan = _planning.Planner().plan(Location.parse(ckpt_dir), {"state": state})
  saving.snapshot(plan.pieces, _staging.Staging())
  views = [np.asarray(s.data) for s in state["w"].addressable_shards]
  assert plan.pieces
  for piece in plan.pieces:
    assert not any(np.shares_memory(piece.data, v) for v in views)


def test_only_one_save_in_flight_per_checkpointer(tmp_path):
  with ofx.Checkpointer() as ckptr:
    first = ckptr.save_async(str(tmp_path / "a"), {"state": _state(32)})
    second = ckptr.save_async(str(tmp_path / "b"), {"state": _state(8)})
    assert first.done()  # the second call waited for the first
    second.wait()
  assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_module_functions_share_no_checkpointer(tmp_path):
  """Each module-function call makes what it needs: no hidden global links two calls."""
  from orbax_flax.engine import checkpointer  # pylint: disable=g-import-not-at-top
  assert not [n for n, v in vars(checkpointer).items() if isinstance(v, (list, dict, set))
              and not n.startswith("__")]
  first = ofx.save_async(str(tmp_path / "a"), {"state": _state(8)})
  second = ofx.save_async(str(tmp_path / "b"), {"state": {"x": np.arange(3)}})
  second.wait()  # its own save; it did not need the first one's checkpointer
  first.wait()
  assert sorted(os.listdir(tmp_path)) == ["a", "b"]
  np.testing.assert_array_equal(ofx.restore(str(tmp_path / "b"))["state"]["x"], np.arange(3))


def test_cancelled_save_never_commits_and_keeps_the_old_checkpoint(tmp_path):
  path = str(tmp_path / "ckpt")
  ofx.save(path, {"state": {"x": np.arange(3)}})
  handle = ofx.save_async(path, {"state": _state(64)}, overwrite=True)
  handle.cancel()
  with pytest.raises(ofx.SaveCancelledError, match="cancelled on process 0"):
    handle.wait()
  np.testing.assert_array_equal(ofx.restore(path)["state"]["x"], np.arange(3))
  assert os.listdir(tmp_path) == ["ckpt"]  # no temporary leftover either
  handle = ofx.save_async(path, {"state": _state(64)}, overwrite=True)
  handle.cancel()  # nobody waits: the next save does not raise what cancel() asked for
  ofx.save(path, {"state": {"x": np.arange(4)}}, overwrite=True)
  np.testing.assert_array_equal(ofx.restore(path)["state"]["x"], np.arange(4))


def test_a_save_cancelled_while_batches_are_being_written_leaves_nothing(tmp_path,
                                                                         monkeypatch):
  """A cancellable save writes in batches, two in flight. A cancellation noticed between
  batches removed the save's temporary directory while the batch before was still being
  committed by tensorstore, which then wrote its files back there: a leftover the size of a
  batch beside the checkpoint, after wait() had said nothing was committed."""
  from orbax_flax.engine import saving
  from orbax_flax.format import _tsio
  path = str(tmp_path / "ckpt")
  ofx.save(path, {"state": {"x": np.arange(3)}})
  batch = 128 << 20  # long enough a commit for the cleanup to run while it writes
  monkeypatch.setattr(saving, "_FIRST_BATCH_BYTES", batch)
  monkeypatch.setattr(saving, "_MIN_BATCH_BYTES", batch)
  monkeypatch.setattr(saving, "_MAX_BATCH_BYTES", batch)
  handle, flushes = [None], [0]
  flush = _tsio.DatabaseWriter.flush

  def cancel_after_second(self, depth=2):  # batch 2 issued and being committed
    flush(self, depth)
    flushes[0] += 1
    if flushes[0] == 2:
      handle[0].cancel()
  monkeypatch.setattr(_tsio.DatabaseWriter, "flush", cancel_after_second)
  writing = []  # batches still being committed when the cleanup began
  discard = saving.SaveRun._discard

  def checked(self, error):
    writing.append(sum(not c.done() for w in self.writer.databases.values() for c in w._commits))
    discard(self, error)
  monkeypatch.setattr(saving.SaveRun, "_discard", checked)
  w = np.random.default_rng(0).standard_normal(batch, dtype=np.float32)  # 4 batches of bytes
  with ofx.Checkpointer(host_transfer="memcpy") as ckptr:
    handle[0] = ckptr.save_async(path, {"state": {"w": w}}, overwrite=True, cancellable=True)
    with pytest.raises(ofx.SaveCancelledError):
      handle[0].wait()
  assert flushes[0] == 2  # cancelled where it was meant to be
  assert writing == [0]
  time.sleep(1.0)  # (a batch still being written would land meanwhile)
  assert os.listdir(tmp_path) == ["ckpt"]
  np.testing.assert_array_equal(ofx.restore(path)["state"]["x"], np.arange(3))


def test_background_error_raised_on_wait_and_on_next_save(tmp_path):
  with small_disk(str(tmp_path / "disk")) as disk:
    ofx.save(os.path.join(disk, "small"), {"state": {"x": np.arange(10)}})
    handle = ofx.save_async(os.path.join(disk, "big"), {"state": _state(16)})
    with pytest.raises(ofx.StorageError, match="writing array data") as e:
      handle.wait()
    assert "No space left" in str(e.value) or "RESOURCE_EXHAUSTED" in str(e.value) or "ENOSPC" in str(e.value)
    with pytest.raises(ofx.StorageError):  # wait() again still reports it
      handle.wait()
    # The failed save left nothing behind and the earlier checkpoint is intact.
    assert sorted(os.listdir(disk)) == ["small"]
    np.testing.assert_array_equal(ofx.restore(os.path.join(disk, "small"))["state"]["x"], np.arange(10))

    # Nobody waits: the checkpointer's next save raises the error instead of losing it.
    with ofx.Checkpointer() as ckptr:
      ckptr.save_async(os.path.join(disk, "big2"), {"state": _state(16)})
      with pytest.raises(ofx.StorageError) as e:
        ckptr.save_async(str(tmp_path / "elsewhere"), {"state": {"x": np.arange(3)}})
      assert any("nobody waited" in n for n in getattr(e.value, "__notes__", []))
      assert not os.path.exists(tmp_path / "elsewhere")
      # Once reported, it is not raised again.
      ckptr.save(str(tmp_path / "elsewhere"), {"state": {"x": np.arange(3)}})


def test_a_dropped_module_save_async_logs_its_error(tmp_path, caplog):
  """A module-function handle has no next call to raise on: dropped unwaited, it logs."""
  with small_disk(str(tmp_path / "disk")) as disk:
    handle = ofx.save_async(os.path.join(disk, "big"), {"state": _state(16)})
    handle.join()
    assert handle.unreported_error() is not None
    with caplog.at_level("ERROR", logger="orbax_flax"):
      del handle
      gc.collect()
  assert any("nobody waited" in r.getMessage() and "big" in r.getMessage() for r in caplog.records)
  ofx.save(str(tmp_path / "next"), {"state": {"x": np.arange(3)}})  # the next call is unaffected


def test_module_save_async_keeps_no_memory_between_saves(tmp_path):
  """The module functions use fresh staging memory per save: RSS returns to the baseline."""
  state = _state(64)
  proc = psutil.Process()
  rss = []
  for i in range(24):
    handle = ofx.save_async(str(tmp_path / f"c{i}"), {"state": state})
    handle.wait()
    gc.collect()
    rss.append(proc.memory_info().rss)
  # A leaked host copy would add 64 MB a save: 700 MB between the medians below. In a
  # process of its own the allocator's pools grow over the first ~8 saves, then stay within
  # 290-510 MB (60 saves measured), with single saves up to ~170 MB above the floor; so the
  # baseline comes after them and the bounds allow that noise (one state's size, and three).
  early, late = sorted(rss[8:13])[2], sorted(rss[-5:])[2]
  assert late - early < 64 << 20, [r >> 20 for r in rss]
  assert max(rss[8:]) - min(rss[8:]) < 192 << 20, [r >> 20 for r in rss]


def test_staging_needs_one_copy_of_the_state(tmp_path):
  import threading  # pylint: disable=g-import-not-at-top
  state = _state(128)
  proc = psutil.Process()
  ofx.save(str(tmp_path / "warmup"), {"state": state})
  gc.collect()
  base = proc.memory_info().rss
  peak = [base]
  stop = threading.Event()

  def sample():
    while not stop.is_set():
      peak[0] = max(peak[0], proc.memory_info().rss)
      time.sleep(0.001)

  sampler = threading.Thread(target=sample)
  sampler.start()
  ofx.save_async(str(tmp_path / "c"), {"state": state}).wait()
  stop.set()
  sampler.join()
  assert peak[0] - base < (128 << 20) + (48 << 20), (peak[0] - base) >> 20


@pytest.mark.parametrize("transfer", ["auto", "memcpy", "device_copy", "pinned_host"])
def test_donated_state_is_snapshotted(tmp_path, transfer):
  """Every host transfer: the step after save_async donates the state; the checkpoint has the old values."""
  state = _state(32, committed_count=True)
  expected = jax.tree.map(np.array, state)
  with ofx.Checkpointer(host_transfer=transfer) as ckptr:
    handle = ckptr.save_async(str(tmp_path / "c"), {"state": state})
    new = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)(state)
    jax.block_until_ready(new)
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
    handle.wait()
  jax.tree.map(np.testing.assert_array_equal, ofx.restore(str(tmp_path / "c"))["state"], expected)


def test_an_async_snapshot_stages_only_what_is_not_a_private_host_copy(tmp_path):
  """On CPU device buffers are host memory: the snapshot copies the whole state into staging
  memory. On an accelerator each shard's device-to-host copy is private already: only the
  packed small arrays are staged (and prepared), and a donation after the save changes nothing."""
  state = _state(32, committed_count=True)
  expected = jax.tree.map(np.array, state)
  big = state["w"].nbytes
  with ofx.Checkpointer(host_transfer="memcpy") as ckptr:
    prepared = ckptr.prepare({"state": state})
    handle = ckptr.save_async(str(tmp_path / "c"), {"state": state})
    new = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)(state)
    jax.block_until_ready(new)
    handle.wait()
    staged = ckptr.staging_bytes
  if jax.devices()[0].platform == "cpu":
    assert prepared >= big and staged >= big, (prepared, staged, big)
  else:
    assert prepared <= (2 << 20) and staged <= (2 << 20), (prepared, staged, big)
  jax.tree.map(np.testing.assert_array_equal, ofx.restore(str(tmp_path / "c"))["state"], expected)


@pytest.mark.skipif(not _ON_CPU, reason="the device_copy rule of 'auto' is the CPU's")
def test_auto_on_cpu_copies_a_small_state_by_xla_and_a_state_of_replicas_into_staging(tmp_path):
  """'auto' on CPU: a state whose copy is small and not mostly replicas is copied by XLA in one
  call (staging holds only its packed small arrays); a state sharded over 'model' only (each
  shard held by the two 'data' devices) would copy every shard twice: it is staged instead.
  Both checkpoints hold the values the caller had before it donated its arrays."""
  mesh = engine_worker.make_mesh()
  sharded = _state(32, committed_count=True)
  rng = np.random.default_rng(1)
  replicas = {"w": jax.device_put(rng.standard_normal((2048, 2048), dtype=np.float32),
                                  NamedSharding(mesh, P(None, "model")))}
  for name, state, staged in (("sharded", sharded, False), ("replicas", replicas, True)):
    expected = jax.tree.map(np.array, state)
    big = state["w"].nbytes
    with ofx.Checkpointer() as ckptr:
      handle = ckptr.save_async(str(tmp_path / name), {"state": state})
      jax.block_until_ready(jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s),
                                    donate_argnums=0)(state))
      handle.wait()
      held = ckptr.staging_bytes
    assert handle.transfer == ("memcpy" if staged else "device_copy"), (name, handle.transfer)
    assert (held >= big) if staged else (held <= 2 << 20), (name, held, big)
    jax.tree.map(np.testing.assert_array_equal, ofx.restore(str(tmp_path / name))["state"],
                 expected)


def test_a_cancellable_device_copy_save_of_many_small_arrays_is_exact(tmp_path, monkeypatch):
  """A preemption save (cancellable: batches of about half a second, two in flight) of an item
  with 80 MiB of small arrays, which are packed into three pieces written in separate batches.
  The batches are made small here, as slow storage makes them. Each batch's packed bytes must
  stay as they were until tensorstore has written them: a later batch never reuses their
  memory."""
  from orbax_flax.engine import saving  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(saving, "_FIRST_BATCH_BYTES", 8 << 20)
  monkeypatch.setattr(saving, "_MIN_BATCH_BYTES", 8 << 20)
  monkeypatch.setattr(saving, "_MAX_BATCH_BYTES", 24 << 20)
  monkeypatch.setattr(saving, "_BATCH_SECONDS", 0.01)
  rng = np.random.default_rng(3)
  state = {f"a{i:03d}": jax.device_put(rng.standard_normal(128 << 10, dtype=np.float32))
           for i in range(160)}  # 160 arrays of 0.5 MiB: packed
  expected = jax.tree.map(np.array, state)
  with ofx.Checkpointer(host_transfer="device_copy") as ckptr:
    ckptr.save_async(str(tmp_path / "c"), {"state": state}, cancellable=True).wait()
  jax.tree.map(np.testing.assert_array_equal, ofx.restore(str(tmp_path / "c"))["state"], expected)


@pytest.mark.skipif(not _ON_CPU, reason="the device_copy rule of 'auto' is the CPU's")
def test_auto_counts_numpy_leaves_in_the_copy_it_would_make(tmp_path):
  """A state of 300 MiB of numpy arrays and one small device array: device_copy would copy the
  numpy arrays on the host too, over 256 MiB; "auto" stages it (memcpy) instead."""
  state = {"np": np.ones((300 << 20) // 4, np.float32), "w": jnp.ones(8)}
  with ofx.Checkpointer() as ckptr:
    handle = ckptr.save_async(str(tmp_path / "c"), {"state": state})
    handle.wait()
  assert handle.transfer == "memcpy", handle.transfer


def test_device_copy_with_a_host_memory_budget_is_refused():
  with pytest.raises(ValueError, match="device_copy.*max_host_bytes"):
    ofx.Checkpointer(host_transfer="device_copy", max_host_bytes=64 << 20)
  with pytest.raises(ValueError, match="device_copy.*max_host_bytes"):
    ofx.CheckpointPolicy(host_transfer="device_copy", max_host_bytes=64 << 20)


def _rss():
  gc.collect()
  return psutil.Process().memory_info().rss


@pytest.mark.parametrize("transfer", ["memcpy", "device_copy"])
def test_rss_flat_over_24_saves_and_one_staging_copy_between_saves(tmp_path, transfer):
  """memcpy keeps one staging copy of the state between saves; device_copy stages only the packed
  small arrays (its copies are XLA's, freed after each save). Neither grows."""
  state = _state(32)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  ckptr = ofx.Checkpointer(host_transfer=transfer)
  rss = []
  for i in range(24):  # a leaked or second staging copy would add 32 MB each save
    path = str(tmp_path / f"c{i}")
    ckptr.save_async(path, {"state": state}).wait()
    if i:
      subprocess.run(["rm", "-rf", str(tmp_path / f"c{i - 1}")], check=True)
    rss.append(_rss())
  # Held between saves: exactly one staging copy (rounded up to 2 MiB), never a second.
  held = nbytes if _ON_CPU and transfer == "memcpy" else 0
  assert held <= ckptr.staging_bytes <= held + (2 << 20), (nbytes, ckptr.staging_bytes)
  # RSS does not grow. memcpy is flat from the first save on (allocator noise is a few MB).
  # device_copy's host copies are XLA's, freed after each save: run first in a process, the
  # allocator keeps three or four of them as free memory it reuses (90-120 MB here, reached
  # by the eighth to fifteenth save), so its bound is that plateau: over the last twelve
  # saves it stays within one state's bytes of the first twelve's peak, where a leak of one
  # copy a save would add 384 MB.
  mib = [r >> 20 for r in rss]
  if transfer == "memcpy":
    assert max(rss[1:]) - rss[0] < 16 << 20, mib
    assert max(rss[12:]) - max(rss[:12]) < 8 << 20, mib
  else:
    assert max(rss) - rss[0] < 5 * nbytes, mib
    assert max(rss[12:]) - max(rss[:12]) < nbytes, mib
  before = _rss()
  ckptr.close()
  assert ckptr.staging_bytes == 0
  assert before - _rss() >= 0.9 * held  # close() handed the staging copy back


def test_keep_staging_memory_false_releases_it_after_every_save(tmp_path):
  state = _state(32)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  # The staging arena is the memcpy transfer's (device_copy stages nothing; its RSS stays flat:
  # test_rss_flat_over_24_saves_and_one_staging_copy_between_saves).
  policy = ofx.CheckpointPolicy(keep_staging_memory=False, host_transfer="memcpy")
  # A first save of the state, by a checkpointer that releases its staging memory too, before
  # the baseline: what stays from it (on an accelerator the host memory of the first transfers)
  # is the process's, not a staging copy held.
  with ofx.Checkpointer(keep_staging_memory=False, host_transfer="memcpy") as first:
    first.save_async(str(tmp_path / "first"), {"state": state}).wait()
  with ofx.CheckpointManager(str(tmp_path / "steps"), policy) as mngr:
    base = _rss()
    for step in range(1, 4):
      mngr.save(step, {"state": state}, force=True)
      mngr.wait()
      assert mngr.staging_bytes == 0
      assert _rss() - base < nbytes / 2, (step, (_rss() - base) >> 20)
  with ofx.Checkpointer(keep_staging_memory=False, host_transfer="memcpy") as ckptr:
    ckptr.save_async(str(tmp_path / "x"), {"state": state}).wait()
    assert ckptr.staging_bytes == 0


def test_prepare_touches_the_staging_memory_the_first_save_copies_into(tmp_path):
  state = _state(32)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  with ofx.Checkpointer(host_transfer="memcpy") as ckptr:
    n = ckptr.prepare({"state": state})
    held = nbytes if _ON_CPU else 0
    assert max(held, 1) <= n <= held + (2 << 20), (n, nbytes)
    assert ckptr.staging_bytes == n  # mapped now: the budget and RSS see it at once
    assert ckptr.wait_prepared(120)
    assert ckptr.staging_stats() == (n, n, 1, False)  # held, all touched, one arena, done
    ckptr.save_async(str(tmp_path / "c"), {"state": state}).wait()
    assert ckptr.staging_stats().mappings == 1 and ckptr.staging_bytes == n  # reused, not remapped
    assert ckptr.prepare({"state": state}) == 0  # held already
  jax.tree.map(np.testing.assert_array_equal, ofx.restore(str(tmp_path / "c"))["state"],
               jax.tree.map(np.asarray, state))


def test_a_save_during_preparation_stops_it_and_copies_into_the_same_memory(tmp_path):
  state = _state(64)
  with ofx.Checkpointer(host_transfer="memcpy") as ckptr:
    n = ckptr.prepare({"state": state})
    ckptr.save_async(str(tmp_path / "c"), {"state": state}).wait()  # at once: mid-preparation
    stats = ckptr.staging_stats()
    assert not stats.preparing and stats.mappings == 1 and stats.nbytes == n, stats
  jax.tree.map(np.testing.assert_array_equal, ofx.restore(str(tmp_path / "c"))["state"],
               jax.tree.map(np.asarray, state))


def test_prepare_never_goes_over_max_host_bytes(tmp_path):
  state = _state(32)  # 8 chunks of 4 MiB (shards of (2048, 512) float32)
  with ofx.Checkpointer(max_host_bytes=8 << 20) as ckptr:
    n = ckptr.prepare({"state": state})
    # The largest staging round, not the state; on an accelerator a budget takes the pinned
    # transfer, which stages nothing.
    assert (0 < n <= 8 << 20) if _ON_CPU else n == 0, n
    assert ckptr.wait_prepared(120)
    ckptr.save_async(str(tmp_path / "c"), {"state": state}).wait()
    assert ckptr.staging_stats().mappings == int(_ON_CPU) and ckptr.staging_bytes == n
  with ofx.Checkpointer(max_host_bytes=1 << 20) as ckptr:  # below one chunk: nothing prepared
    assert ckptr.prepare({"state": state}) == 0 and ckptr.staging_bytes == 0
  with ofx.Checkpointer(keep_staging_memory=False) as ckptr:  # memory-tight: holds none early
    assert ckptr.prepare({"state": state}) == 0 and ckptr.staging_bytes == 0
  with ofx.Checkpointer(host_transfer="pinned_host") as ckptr:  # stages nothing
    assert ckptr.prepare({"state": state}) == 0 and ckptr.staging_bytes == 0


@pytest.mark.parametrize("transfer", ["auto", "memcpy"])
def test_the_callback_and_the_manager_prepare_before_their_first_save(tmp_path, transfer):
  state = _state(32)
  # What the first save stages: the whole state with memcpy on CPU; nothing with "auto" on CPU
  # (device_copy: XLA's copies are new arrays); the packed arrays on an accelerator (> 0).
  if _ON_CPU:
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state)) if transfer == "memcpy" else 0
  else:
    nbytes = 1
  policy = ofx.CheckpointPolicy(save_interval_steps=5, host_transfer=transfer)
  with ofx.CheckpointCallback(str(tmp_path / "cb"), policy) as ckpt:
    state = ckpt.restore_or_init(state)
    assert ckpt.manager.staging_bytes >= nbytes  # at restore_or_init, before any step
    if not nbytes:
      assert ckpt.manager.staging_bytes == 0
  with ofx.CheckpointManager(str(tmp_path / "m"), policy) as mngr:
    assert mngr.staging_bytes == 0
    assert not mngr.save(1, {"state": state})  # not due: the first save's memory is prepared
    assert mngr.staging_bytes >= nbytes
  no_async = ofx.CheckpointPolicy(save_interval_steps=5, async_save=False, host_transfer=transfer)
  with ofx.CheckpointManager(str(tmp_path / "s"), no_async) as mngr:
    assert not mngr.save(1, {"state": state}) and mngr.staging_bytes == 0


class _SlowStateIterator:
  """A data iterator whose get_state() takes 0.2 s."""

  def __init__(self):
    self.i = 0
    self.calls = 0

  def __next__(self):
    self.i += 1
    return self.i

  def get_state(self):
    self.calls += 1
    time.sleep(0.2)
    return {"i": self.i}

  def set_state(self, s):
    self.i = s["i"]


def test_reported_blocking_is_the_whole_wait_of_on_step_end(tmp_path):
  from jobs import RecordingWriter  # pylint: disable=g-import-not-at-top
  state = _state(8)
  writer = RecordingWriter()
  waited = {}
  with ofx.CheckpointCallback(str(tmp_path), ofx.CheckpointPolicy(save_interval_steps=2),
                              writer=writer) as ckpt:
    it = _SlowStateIterator()
    state = ckpt.restore_or_init(state, data_iterator=it)
    for step in range(1, 6):
      next(it)
      calls, start = it.calls, time.perf_counter()
      ckpt.on_step_end(step, state)
      waited[step] = time.perf_counter() - start
      # One get_state() a step: the exception save's position is the one a save takes too.
      assert it.calls == calls + 1, (step, it.calls - calls)
  events = {s: d for s, d in writer.scalars if "checkpoint/blocking_s" in d}
  assert sorted(events) == [2, 4, 5], events
  for step in (2, 4):
    e = events[step]
    # The whole of on_step_end, with its get_state().
    assert 0.2 <= e["checkpoint/blocking_s"] <= waited[step], (e, waited[step])
    assert e["checkpoint/blocking_s"] >= waited[step] - 0.05, (e, waited[step])
    assert e["checkpoint/blocking_data_s"] >= 0.2, e  # get_state() of the save's data item
    parts = sum(e[f"checkpoint/blocking_{p}_s"] for p in ("items", "data", "wait", "ready", "copy"))
    assert parts <= e["checkpoint/blocking_s"] <= e["checkpoint/total_s"], e


def test_a_preemption_save_takes_the_data_position_once(tmp_path):
  state = _state(8)
  policy = ofx.CheckpointPolicy(save_interval_steps=100, preemption_signals=("SIGUSR2",))
  with ofx.CheckpointCallback(str(tmp_path), policy) as ckpt:
    it = _SlowStateIterator()
    state = ckpt.restore_or_init(state, data_iterator=it)
    assert ckpt.on_step_end(1, state) is False
    next(it)
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.05)
    calls = it.calls
    assert ckpt.on_step_end(2, state) is True  # preempted: saved and committed
    assert it.calls == calls + 1, it.calls - calls
  it = _SlowStateIterator()
  ofx.CheckpointCallback(str(tmp_path), {}).restore_or_init(_state(8), data_iterator=it)
  assert it.i == 1  # the position after step 2, as get_state() gave it


def test_reported_blocking_names_the_train_step_still_computing(tmp_path):
  """JAX dispatches a step asynchronously: a save first waits for its result, a part of its own."""
  from jobs import RecordingWriter  # pylint: disable=g-import-not-at-top

  rounds = 30 if _ON_CPU else 30_000  # a TPU v5e ran 30 rounds in under a millisecond

  @jax.jit
  def train_step(state):  # dispatched at once; computed in seconds (the loop on every device)
    busy = jax.lax.fori_loop(0, rounds, lambda i, a: jnp.tanh(a @ a), jnp.full((1024, 1024), 0.01))
    # The loss comes out of the step, as in a training loop: an op of its own on the step's
    # outputs (jnp.sum(state["b"]) here) can wait in its dispatch for the step on CPU, and
    # the save would then find the step computed already.
    return {**state, "count": state["count"] + (busy[0, 0] > 2).astype(jnp.int32)}, busy[0, 0]

  state = _state(8)
  writer = RecordingWriter()
  with ofx.CheckpointCallback(str(tmp_path), ofx.CheckpointPolicy(save_interval_steps=2),
                              writer=writer) as ckpt:
    state = ckpt.restore_or_init(state)
    for step in range(1, 3):
      state, loss = train_step(state)
      ckpt.on_step_end(step, state, {"loss": loss})
  e = next(d for s, d in writer.scalars if s == 2 and "checkpoint/blocking_s" in d)
  assert e["checkpoint/blocking_ready_s"] >= 0.1, e
  parts = sum(e[f"checkpoint/blocking_{p}_s"] for p in ("items", "data", "wait", "ready", "copy"))
  # The parts are the wait: what none of them names is small beside the step's computation.
  assert e["checkpoint/blocking_s"] - parts < e["checkpoint/blocking_ready_s"] / 2, e
  assert e["checkpoint/blocking_copy_s"] < e["checkpoint/blocking_ready_s"], e
  # save_interval="auto" learns what the save cost, not the step's computation.
  cost = e["checkpoint/blocking_s"] - e["checkpoint/blocking_ready_s"]
  assert ckpt.manager.save_cost() == pytest.approx(cost, abs=1e-6), (ckpt.manager.save_cost(), e)
