"""Storage that fails: a disk that fills up, an object store that dies mid-save and mid-restore."""

import os
import threading
import time

import numpy as np
import pytest

import orbax_flax as ofx
from disks import small_disk


def _state(mb, value=1.0):
  n = mb * (1 << 20) // 4 // 1024
  return {"w": np.full((n, 1024), value, np.float32), "b": np.full(16, value, np.float32)}


# ---------------------------------------------------------------------- disk full


def test_a_full_disk_fails_the_save_clearly_and_keeps_earlier_steps(tmp_path):
  with small_disk(str(tmp_path / "disk"), "12m") as disk:
    with ofx.CheckpointManager(disk, ofx.CheckpointPolicy(max_to_keep=5)) as m:
      m.save(1, {"s": _state(4, 1.0)}, force=True)
      m.wait()
      m.save(2, {"s": _state(16, 2.0)}, force=True)  # does not fit
      with pytest.raises(ofx.StorageError, match="the store is full") as e:
        m.wait()
      assert "max_to_keep" in str(e.value) or "free space" in str(e.value)
      assert m.all_steps() == [1]
    assert sorted(os.listdir(disk)) == ["1"]  # nothing partial left, step 1 intact
    np.testing.assert_array_equal(ofx.restore(os.path.join(disk, "1"))["s"]["w"], _state(4, 1.0)["w"])


@pytest.mark.parametrize("on_save_error", ["raise", "warn"])
def test_training_stops_or_goes_on_when_the_disk_fills(tmp_path, on_save_error, caplog):
  with small_disk(str(tmp_path / "disk"), "10m") as disk:
    cfg = {"save_interval_steps": 1, "max_to_keep": 1, "save_final_step": False,
           "on_save_error": on_save_error, "directory": disk}
    cb = ofx.CheckpointCallback("/unused", cfg)
    state = cb.restore_or_init(_state(2, 0.0))
    sizes = {1: 2, 2: 2, 3: 12, 4: 12, 5: 2}  # steps 3 and 4 cannot fit
    reached = 0
    try:
      for step in range(1, 6):
        state = _state(sizes[step], float(step))
        cb.on_step_end(step, state, {})
        cb.manager.wait_for_save()
        reached = step
      cb.close()
    except ofx.StorageError as e:
      assert on_save_error == "raise" and "the store is full" in str(e)
      cb.on_exception(reached, state, e)
    if on_save_error == "raise":
      assert reached < 5
      steps = ofx.CheckpointManager(disk).all_steps()
      assert steps and max(steps) <= 2  # the last good step survives
    else:
      assert reached == 5 and "CHECKPOINT SAVE FAILED, training goes on" in caplog.text
      assert ofx.CheckpointManager(disk).all_steps() == [5]  # saving works again once it fits


# ---------------------------------------------------------------------- object store dies


@pytest.fixture
def own_s3_server():
  """A SeaweedFS server of this test alone (it gets killed)."""
  import s3server  # pylint: disable=g-import-not-at-top
  try:
    server = s3server.S3Server()
  except RuntimeError as e:
    pytest.skip(f"needs a local SeaweedFS server, which could not start: {e}")
  yield from server.serve()


def test_object_store_killed_mid_save_and_mid_restore(own_s3_server):
  server = own_s3_server
  bucket = server.new_bucket()

  def url(step):  # a spec dict: its context shortens the retries to a few seconds
    return {"driver": "s3", "bucket": bucket, "path": f"run/{step}", "endpoint": server.endpoint,
            "aws_region": "us-east-1",
            "context": {"s3_request_retries": {"max_retries": 2, "initial_delay": "0.2s",
                                               "max_delay": "1s"}}}

  ofx.save(url(1), {"s": _state(8, 1.0)})

  # Mid-save: the server dies while a 128 MiB save writes.
  handle = ofx.save_async(url(2), {"s": _state(128, 2.0)})
  time.sleep(0.3)
  server.kill()
  start = time.monotonic()
  with pytest.raises(ofx.StorageError) as e:
    handle.wait()
  failed_after = time.monotonic() - start
  assert bucket in str(e.value) and "127.0.0.1" in str(e.value), e.value  # names the store
  assert failed_after < 30, failed_after

  # After a restart: nothing partial was committed, and the next save and restores work.
  server.start()
  with pytest.raises(ofx.CheckpointNotFoundError):
    ofx.metadata(url(2))
  ofx.save(url(3), {"s": _state(128, 3.0)})
  np.testing.assert_array_equal(ofx.restore(url(3))["s"]["w"], _state(128, 3.0)["w"])
  np.testing.assert_array_equal(ofx.restore(url(1))["s"]["w"], _state(8, 1.0)["w"])

  # Mid-restore: the server dies during a read.
  result = {}

  def restore():
    try:
      result["value"] = ofx.restore(url(3))
    except BaseException as e:  # pylint: disable=broad-except
      result["error"] = e

  t = threading.Thread(target=restore)
  t.start()
  time.sleep(0.2)
  server.kill()
  start = time.monotonic()
  t.join(60)
  assert not t.is_alive() and time.monotonic() - start < 30
  if "error" in result:  # the kill landed during the read
    assert isinstance(result["error"], ofx.StorageError), repr(result["error"])
    assert bucket in str(result["error"]), result["error"]
  else:  # it finished first: whatever came back is right
    np.testing.assert_array_equal(result["value"]["s"]["w"], _state(128, 3.0)["w"])
