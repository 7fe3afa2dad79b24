"""Bad input fails loudly, before anything is written, read or deleted."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_flax as ofx
from disks import small_disk
from orbax_flax.core import _location
from orbax_flax.engine import saving


def _tree_files(path):
  return sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs)


def test_missing_checkpoint(tmp_path):
  with pytest.raises(ofx.CheckpointNotFoundError, match="does not exist") as e:
    ofx.restore(str(tmp_path / "nope"))
  assert isinstance(e.value, FileNotFoundError)
  os.makedirs(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="no committed"):
    ofx.metadata(str(tmp_path / "empty"))


def test_existing_checkpoint_needs_overwrite(ckpt_dir):
  ofx.save(ckpt_dir, {"s": {"x": np.zeros(3)}})
  with pytest.raises(ofx.CheckpointExistsError, match="overwrite=True"):
    ofx.save(ckpt_dir, {"s": {"x": np.ones(3)}})
  with pytest.raises(FileExistsError):
    ofx.save_async(ckpt_dir, {"s": {"x": np.ones(3)}})
  np.testing.assert_array_equal(ofx.restore(ckpt_dir)["s"]["x"], np.zeros(3))
  ofx.save(ckpt_dir, {"s": {"x": np.ones(3)}, "new": {"y": 1}}, overwrite=True)
  restored = ofx.restore(ckpt_dir)
  np.testing.assert_array_equal(restored["s"]["x"], np.ones(3))
  assert restored["new"] == {"y": 1}
  assert os.listdir(os.path.dirname(ckpt_dir)) == ["ckpt"]  # no leftovers


def test_refuses_foreign_directory_even_with_overwrite(tmp_path):
  d = tmp_path / "mine"
  d.mkdir()
  (d / "notes.txt").write_text("precious")
  with pytest.raises(ofx.CheckpointExistsError, match="not an orbax_flax checkpoint"):
    ofx.save(str(d), {"s": {"x": np.zeros(1)}}, overwrite=True)
  assert (d / "notes.txt").read_text() == "precious"
  (tmp_path / "afile").write_text("x")
  with pytest.raises(ofx.CheckpointExistsError, match="is a file"):
    ofx.save(str(tmp_path / "afile"), {"s": {"x": np.zeros(1)}})


def test_unsupported_leaf_names_key_path_and_writes_nothing(tmp_path, ckpt_dir):
  with pytest.raises(ofx.UnsupportedLeafError, match=r"state/layers/1/act: custom_jvp is not a supported"):
    ofx.save(ckpt_dir, {"state": {"layers": [{"w": np.ones(2)}, {"act": jax.nn.relu}]}})
  with pytest.raises(TypeError, match=r"s/x.*dtype <U1"):
    ofx.save(ckpt_dir, {"s": {"x": np.array(["a"])}})
  with pytest.raises(TypeError, match=r"s/abstract.*ShapeDtypeStruct"):
    ofx.save(ckpt_dir, {"s": {"abstract": jax.ShapeDtypeStruct((2,), jnp.float32)}})
  with pytest.raises(TypeError, match=r"s/x: numpy value of dtype float128"):
    ofx.save(ckpt_dir, {"s": {"x": np.ones((1 << 17,), np.longdouble)}})
  donated = jnp.ones(4)
  jax.jit(lambda x: x + 1, donate_argnums=0)(donated)
  with pytest.raises(ofx.UnsupportedLeafError, match=r"s/w: its jax.Array was deleted"):
    ofx.save(ckpt_dir, {"s": {"w": donated}})
  # A numpy masked array was saved as its values alone: it came back unmasked, silently.
  with pytest.raises(ofx.UnsupportedLeafError, match=r"s/m: a numpy masked array.*getmaskarray"):
    ofx.save(ckpt_dir, {"s": {"m": np.ma.masked_array([1.0, 2.0], mask=[0, 1])}})
  assert os.listdir(tmp_path) == []


def test_a_donated_array_is_named_by_a_manager_save_too(tmp_path):
  """The manager waits for the arrays it saves; a deleted one is still named, not a jax error."""
  donated = jnp.ones(4)
  jax.jit(lambda x: x + 1, donate_argnums=0)(donated)
  with ofx.CheckpointManager(str(tmp_path / "m"), ofx.CheckpointPolicy(save_interval_steps=1)) as m:
    with pytest.raises(ofx.UnsupportedLeafError, match=r"s/w: its jax.Array was deleted"):
      m.save(1, {"s": {"w": donated}}, metrics={"loss": jnp.float32(1.0)})
    assert m.all_steps() == []


def _hold_after_writing(monkeypatch, action):
  """Runs ``action`` after a save wrote its data, before it commits."""
  commit = saving.SaveRun._commit  # pylint: disable=protected-access

  def act_then_commit(run):
    action()
    commit(run)

  monkeypatch.setattr(saving.SaveRun, "_commit", act_then_commit)


def test_what_appears_during_a_save_is_never_replaced(tmp_path, monkeypatch):
  path = str(tmp_path / "ckpt")
  other = str(tmp_path / "other")
  ofx.save(other, {"s": {"who": "someone else"}})
  _hold_after_writing(monkeypatch, lambda: shutil.copytree(other, path))
  with pytest.raises(ofx.CheckpointExistsError, match="appeared at .* during the save"):
    ofx.save(path, {"s": {"who": "me"}})
  assert ofx.restore(path)["s"]["who"] == "someone else"

  monkeypatch.undo()
  foreign = str(tmp_path / "foreign")
  ofx.save(foreign, {"s": {"who": "me"}})
  precious = os.path.join(foreign, "precious.txt")

  def replace_with_foreign_files():
    shutil.rmtree(foreign)
    os.makedirs(foreign)
    open(precious, "w").write("keep me")

  _hold_after_writing(monkeypatch, replace_with_foreign_files)
  with pytest.raises(ofx.CheckpointExistsError, match="created by someone else"):
    ofx.save(foreign, {"s": {"who": "me again"}}, overwrite=True)
  assert open(precious).read() == "keep me"
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "foreign", "other"]  # no temporary left


def test_overwrite_without_atomic_exchange(tmp_path, monkeypatch):
  """Where paths cannot be swapped (NFS), the manifest is: old or new, never neither."""
  path = str(tmp_path / "ckpt")
  monkeypatch.setattr(_location, "exchange", lambda a, b: False)
  ofx.save(path, {"s": {"x": np.arange(4)}, "gone": {"y": np.ones(3)}})
  old_dbs = sorted(os.listdir(os.path.join(path, "s")))

  def crash(*args):
    raise OSError("killed before the manifest was replaced")

  monkeypatch.setattr(os, "replace", crash)  # what the NFS commit swaps with
  with pytest.raises(OSError, match="killed"):
    ofx.save(path, {"s": {"x": np.arange(5)}}, overwrite=True)
  np.testing.assert_array_equal(ofx.restore(path)["s"]["x"], np.arange(4))  # old, intact
  monkeypatch.undo()
  monkeypatch.setattr(_location, "exchange", lambda a, b: False)
  ofx.save(path, {"s": {"x": np.arange(6)}}, overwrite=True)
  np.testing.assert_array_equal(ofx.restore(path)["s"]["x"], np.arange(6))
  assert not set(os.listdir(os.path.join(path, "s"))) & set(old_dbs)  # old generation gone
  assert "gone" not in os.listdir(path) and os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.parametrize("how", ["convert", "save", "checkpointer"])
def test_overwrite_without_atomic_exchange_keeps_what_others_borrow(tmp_path, monkeypatch, how):
  """Where paths cannot be swapped (NFS), an overwrite of step 0, which differential steps 1
  and 2 borrow from (``convert 0 0 --overwrite``, ``save(..., overwrite=True)``), deleted
  every database of the old generation: 1 and 2, still listed, no longer restored. So did a
  Checkpointer's overwrite of ``a`` whose new data borrows from the old ``a`` through ``b``."""
  monkeypatch.setattr(_location, "exchange", lambda a, b: False)
  root = str(tmp_path / "run")
  w = np.random.default_rng(6).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB: chunked
  state = lambda i: {"s": {"w": w, "c": np.full(64, i, np.int32)}}  # noqa: E731
  if how == "checkpointer":
    names = {"a": 2, "b": 1}
    with ofx.Checkpointer(differential=True) as ck:
      ck.save(os.path.join(root, "a"), state(0))
      ck.save(os.path.join(root, "b"), state(1))
      ck.save(os.path.join(root, "a"), state(2), overwrite=True)  # base b: borrows the old a
  else:
    names = {"1": 1, "2": 2}
    with ofx.CheckpointManager(root, ofx.CheckpointPolicy(differential=True,
                                                          async_save=False)) as m:
      for step in range(3):
        m.save(step, state(step), force=True)
    step0 = os.path.join(root, "0")
    if how == "convert":
      ofx.convert(step0, step0, dtype="bfloat16", overwrite=True)
    else:
      ofx.save(step0, state(10), overwrite=True)
    assert ofx.restore(step0)["s"]["c"].tolist() == [10 if how == "save" else 0] * 64
  for name, i in names.items():
    got = ofx.restore(os.path.join(root, name))["s"]
    assert got["w"].tobytes() == w.tobytes() and got["c"].tolist() == [i] * 64, name
  aside = [n for n in os.listdir(root) if ".ofx-" in n]
  assert len(aside) == 1 and ".ofx-base-" in aside[0], aside  # the old data, retired
  assert sorted(os.listdir(os.path.join(root, aside[0]))) == ["_RETIRED", "s"]
  assert all(d.endswith(aside[0][-16:]) for d in os.listdir(os.path.join(root, aside[0], "s")))


def test_a_destination_that_vanishes_while_it_is_checked_is_a_clear_error(tmp_path, monkeypatch):
  """A save's check of its path raised a raw FileNotFoundError when the directory there went
  away mid-check (another process of the job moved it aside)."""
  path = str(tmp_path / "ckpt")
  os.makedirs(path)  # an empty directory: a save may write there
  listdir = os.listdir

  def moved_meanwhile(p="."):
    if os.fspath(p) == path:
      os.rename(path, path + ".elsewhere")
    return listdir(p)

  monkeypatch.setattr(os, "listdir", moved_meanwhile)
  with pytest.raises(ofx.StorageError, match="moved or removed while this save checked it"):
    ofx.save(path, {"s": {"x": np.arange(4)}})
  monkeypatch.undo()
  assert sorted(os.listdir(tmp_path)) == ["ckpt.elsewhere"]  # nothing written


def test_failed_overwrite_keeps_the_old_checkpoint(ckpt_dir):
  ofx.save(ckpt_dir, {"s": {"x": np.arange(4)}})
  before = _tree_files(ckpt_dir)
  with pytest.raises(ofx.UnsupportedLeafError):
    ofx.save(ckpt_dir, {"s": {"x": object()}}, overwrite=True)
  assert _tree_files(ckpt_dir) == before
  np.testing.assert_array_equal(ofx.restore(ckpt_dir)["s"]["x"], np.arange(4))


@pytest.mark.parametrize("items,match", [
    ([np.zeros(2)], "must be a non-empty dict"),
    ({}, "must be a non-empty dict"),
    ({"": np.zeros(2)}, "invalid item name"),
    ({"a/b": np.zeros(2)}, "invalid item name"),
    ({"_private": np.zeros(2)}, "invalid item name"),
])
def test_bad_items(ckpt_dir, items, match):
  with pytest.raises((TypeError, ValueError), match=match):
    ofx.save(ckpt_dir, items)
  assert not os.path.exists(ckpt_dir)


def test_bad_custom_metadata(ckpt_dir):
  with pytest.raises(TypeError, match="JSON"):
    ofx.save(ckpt_dir, {"s": {"x": 1}}, custom_metadata={"a": object()})
  assert not os.path.exists(ckpt_dir)


def test_custom_metadata_too_large_for_a_manifest_is_refused_before_writing(tmp_path):
  """It was refused only at the commit, from wait(), after every array was written."""
  path = str(tmp_path / "c")
  with ofx.Checkpointer() as ckptr:
    with pytest.raises(ValueError, match="custom_metadata is 260 MiB"):
      ckptr.save_async(path, {"s": {"w": np.ones(1 << 20, np.float32)}},
                       custom_metadata={"notes": "x" * (260 << 20)})
  assert os.listdir(tmp_path) == []


def test_tree_mismatch_lists_every_difference_before_reading(ckpt_dir):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  sh = NamedSharding(mesh, P())
  ofx.save(ckpt_dir, {"s": {"a": np.zeros((4, 4)), "b": np.zeros(3), "c": np.zeros(2), "name": "x"}})
  # Remove the array data: a mismatch must be reported without reading any.
  for root, _, files in os.walk(os.path.join(ckpt_dir, "s")):
    for f in files:
      os.remove(os.path.join(root, f))
  target = {"s": {"a": jax.ShapeDtypeStruct((4, 5), jnp.float64, sharding=sh),
                  "b": np.zeros(3), "d": np.zeros(1), "name": np.zeros(2)}}
  with pytest.raises(ofx.TreeMismatchError) as e:
    ofx.restore(ckpt_dir, target)
  msg = str(e.value)
  assert "s/a: shape (4, 4) in checkpoint, (4, 5) in target" in msg
  assert "s/d: in target, not in checkpoint" in msg
  assert "s/c: in checkpoint, not in target" in msg and "partial=True" in msg
  assert "s/name: checkpoint holds a str" in msg
  assert len(e.value.differences) == 4
  with pytest.raises(ofx.TreeMismatchError, match="item 'other': in target, not in checkpoint"):
    ofx.restore(ckpt_dir, {"other": {"a": np.zeros(1)}})


def test_sharding_that_does_not_divide_is_reported_before_reading(ckpt_dir):
  ofx.save(ckpt_dir, {"s": {"w": np.zeros((6, 8), np.float32)}})
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  target = {"s": {"w": jax.ShapeDtypeStruct((6, 8), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))}}
  with pytest.raises(ValueError, match=r"s/w \(shape \(6, 8\)\).*axis 0.*4 times"):
    ofx.restore(ckpt_dir, target)


def test_bad_targets(ckpt_dir):
  ofx.save(ckpt_dir, {"s": {"w": np.zeros(2)}})
  with pytest.raises(ValueError, match="without a sharding"):
    ofx.restore(ckpt_dir, {"s": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}})
  with pytest.raises(TypeError, match="target leaf s/w is a object"):
    ofx.restore(ckpt_dir, {"s": {"w": object()}})
  with pytest.raises(TypeError, match="target must be a dict"):
    ofx.restore(ckpt_dir, [1])


def test_bad_paths():
  with pytest.raises(TypeError, match="checkpoint path"):
    ofx.save(None, {"s": {"x": 1}})
  with pytest.raises(ValueError, match="cannot use checkpoint URL"):
    ofx.save("gs://b/x", {"s": {"x": 1}})
  with pytest.raises(ValueError, match="reserved"):
    ofx.save("/tmp/x.ofx-tmp-123", {"s": {"x": 1}})


# ------------------------------------------------------------------ storage failures
# Every file-system failure of a save is a StorageError that names the user's path
# (never the save's temporary directory) and the likely fix.


def _saves(path):
  """The same small save three ways: save, save_async, a manager."""
  items = {"s": {"w": np.ones(3)}}
  yield "save", lambda: ofx.save(path, items)
  yield "save_async", lambda: ofx.save_async(path, items).wait()

  def manager():
    with ofx.CheckpointManager(path, ofx.CheckpointPolicy(async_save=False)) as m:
      m.save(1, items, force=True)
  yield "manager", manager


@pytest.mark.parametrize("path,fs", [("/proc/ofx-test", "proc"), ("/sys/ofx-test", "sysfs")])
def test_a_special_file_system_is_a_storage_error_naming_the_path(path, fs):
  for how, save in _saves(path):
    with pytest.raises(ofx.StorageError) as e:
      save()
    text = str(e.value)
    assert path in text and f"special file system ({fs}" in text and "Fix:" in text, (how, text)
    assert ".ofx-tmp-" not in text, (how, text)  # never the internal temporary path


def test_a_file_in_the_way_is_a_storage_error_naming_it(tmp_path):
  blocker = tmp_path / "run"
  blocker.write_text("not a directory")
  for how, save in _saves(str(blocker / "ckpt")):
    with pytest.raises(ofx.StorageError) as e:
      save()
    text = str(e.value)
    assert str(blocker / "ckpt") in text, (how, text)
    assert f"{blocker} is a file" in text and "a file is in the way" in text, (how, text)
  assert blocker.read_text() == "not a directory"
  with pytest.raises(ofx.CheckpointExistsError, match="is a file, not a checkpoint"):
    ofx.save(str(blocker), {"s": {"w": np.ones(3)}})  # the file itself is the path


def test_a_read_only_file_system_is_a_storage_error(tmp_path):
  with small_disk(str(tmp_path / "ro"), "1m", read_only=True) as ro:
    for how, save in _saves(os.path.join(ro, "ckpt")):
      with pytest.raises(ofx.StorageError) as e:
        save()
      text = str(e.value)
      assert os.path.join(ro, "ckpt") in text and f"{ro} is mounted read-only" in text, (how, text)
      assert ".ofx-tmp-" not in text, (how, text)


def test_a_full_disk_at_the_commit_is_a_storage_error(tmp_path):
  """No array data to write (tensorstore reports those): the manifest itself does not fit."""
  with small_disk(str(tmp_path / "disk"), "1m") as disk:
    with open(os.path.join(disk, "filler"), "wb") as f:
      f.write(b"\0" * (1 << 20))
    with pytest.raises(ofx.StorageError, match="the store is full") as e:
      ofx.save(os.path.join(disk, "ckpt"), {"s": {"lr": 0.1, "note": "x" * 100_000}})
    assert os.path.join(disk, "ckpt") in str(e.value)
    assert sorted(os.listdir(disk)) == ["filler"]  # the failed save left nothing


def test_an_item_name_longer_than_a_directory_name_is_refused_before_writing(tmp_path):
  """An item is a directory: a 256-character item name failed mid-save with an error that
  blamed PATH_MAX and told to shorten a 30-byte path. Refused before anything is written,
  naming the limit."""
  path = str(tmp_path / "c")
  with pytest.raises(ValueError, match="has 256 characters: an item is a directory"):
    ofx.save(path, {"x" * 256: {"w": np.ones(2)}})
  assert not os.path.exists(path) or not os.listdir(path)
  ofx.save(path, {"x" * 255: {"w": np.ones(2)}})


def test_a_tree_nested_too_deep_for_python_is_refused_with_a_clear_error(tmp_path):
  """A tree nested 500 dicts deep (jax flattens it) raised SystemError from nanobind (a
  RecursionError inside a jax call): refused with a ValueError naming the depth and the fix."""
  tree = np.arange(4)
  for _ in range(500):
    tree = {"n": tree}
  path = str(tmp_path / "c")
  with pytest.raises(ValueError, match="nested more than 200 containers deep"):
    ofx.save(path, {"s": tree})
  assert not os.path.exists(path) or not os.listdir(path)
