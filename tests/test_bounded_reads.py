"""A damaged or crafted checkpoint fails its read in bounded time and memory, from its own files.

Regression tests of issue 26 (promises 4, 5, 6 and 7 of ``docs/guarantees.md``),
each through the public API (``ofx.restore``, ``ofx.verify``, the CLI):

* a restore of a damaged checkpoint raises ``CheckpointCorruptedError`` at once,
  never waits forever for temporary memory a failed read kept;
* sizes a manifest states are checked against the stored chunks before anything
  is allocated (a 1 KB manifest claiming 4 TiB), and a manifest claiming a million
  missing chunks is refused without reading them one by one;
* a symbolic link inside a checkpoint is never followed;
* a database moved between items, or copied from another checkpoint, is an error;
* a tensorstore failure is reported as what it is, not as a checksum mismatch.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_flax as ofx
from orbax_flax.engine import _reading
from orbax_flax.engine import restoring

# A wait guard, not a timing: a read that has not ended by then hangs.
_HANG_S = 120


def _manifest(path):
  _, line, body = open(os.path.join(path, "_CHECKPOINT"), "rb").read().split(b"\n", 2)
  return json.loads(line), json.loads(body)


def _manifest_bytes(summary, body):
  """A manifest with its digests redone (a crafted one: its hashes are no signature)."""
  s = json.dumps(summary, sort_keys=True, separators=(",", ":")).encode()
  b = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
  sha = lambda x: hashlib.sha256(x).hexdigest()  # noqa: E731
  return (f"orbax_flax checkpoint v1 summary_sha256={sha(s)} sha256={sha(b)}"
          f" summary_bytes={len(s)}".encode() + b"\n" + s + b"\n" + b)


def _write_manifest(path, summary, body):
  with open(os.path.join(path, "_CHECKPOINT"), "wb") as f:
    f.write(_manifest_bytes(summary, body))


def _data_files(path, item="state"):
  return sorted(glob.glob(os.path.join(path, item, "p0-*", "d", "*")), key=os.path.getsize)


def _in_thread(fn):
  """Runs ``fn`` in a thread; returns its exception (None if it returned) or fails if it hangs."""
  out = {}

  def run():
    try:
      fn()
      out["error"] = None
    except BaseException as e:  # pylint: disable=broad-except
      out["error"] = e
  t = threading.Thread(target=run, daemon=True)
  t.start()
  t.join(_HANG_S)
  assert not t.is_alive(), f"still running after {_HANG_S} s: hangs"
  return out["error"]


# ---------------------------------------------------------------------------
# Damaged data: an error, never a hang


@pytest.fixture
def mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return jax.make_mesh((8,), ("x",))


def _chunk_only_files(db: str) -> list[str]:
  """The data files of OCDBT database ``db`` that hold chunk values and no node of its index."""
  store = ts.KvStore.open({"driver": "file", "path": db + "/"}).result()
  values, nodes = set(), set()
  root = ts.ocdbt.dump(store).result()["versions"][-1]["root"].get("location")
  stack = [root] if root else []
  while stack:
    nodes.add(stack[-1].split("::", 1)[1].rsplit(":", 2)[0])
    for entry in ts.ocdbt.dump(store, stack.pop()).result().get("entries", []):
      child = entry.get("node") or entry.get("location")
      if isinstance(child, str) and child.startswith("btreenode::"):
        stack.append(child)
      elif "indirect_value" in entry:
        values.add(str(entry["indirect_value"]).split("::", 1)[1].rsplit(":", 2)[0])
  return sorted(os.path.join(db, f) for f in values - nodes)


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_damaged_checkpoint_fails_a_resharding_restore_instead_of_hanging(tmp_path, mesh, damage):
  """Saved by rows, restored by columns within a 1 MiB budget: every chunk goes through a
  temporary buffer. Before the fix, each failed read kept its buffer and the others waited
  for the budget forever."""
  rows, cols = NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, "x"))
  state = {f"w{i}": jax.device_put(jnp.full((2048, 1024), i, jnp.float32), rows) for i in range(4)}
  path = str(tmp_path / "ckpt")
  ckptr = ofx.Checkpointer(max_host_bytes=4 << 20)  # written in batches: data files apart
  ckptr.save(path, {"state": state})
  ckptr.close()
  (db,) = glob.glob(os.path.join(path, "state", "p0-*"))
  damaged = _chunk_only_files(db)
  assert damaged, "every data file holds index nodes: nothing to damage apart from the index"
  for f in damaged:
    os.remove(f) if damage == "delete" else os.truncate(f, os.path.getsize(f) // 8)
  target = {"state": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=cols)
                      for k, v in state.items()}}
  error = _in_thread(lambda: ofx.restore(path, target, max_host_bytes=1 << 20))
  assert isinstance(error, ofx.errors.CheckpointCorruptedError), error
  assert "data file" in str(error) and ("missing" in str(error) or "truncated" in str(error))


def test_a_read_that_fails_returns_its_temporary_buffer_and_stops_the_others(tmp_path, mesh):
  """The reader's own error path: data files deleted after the index was read (as by a
  concurrent delete), so every read fails in ``preadv``. The error comes back, and no
  temporary memory stays out for the next read of the same reader."""
  rows = NamedSharding(mesh, P("x"))
  state = {f"w{i}": jax.device_put(jnp.full((512, 1024), i, jnp.float32), rows) for i in range(4)}
  path = str(tmp_path / "ckpt")
  ofx.save(path, {"state": state})
  loc, manifest = restoring.open_manifest(path)
  reader = restoring.reader_for(loc, manifest, max_host_bytes=1 << 20)
  recs = manifest.items["state"].leaves
  fills = [_reading.Fill("state", r, ((0, 512), (k * 128, k * 128 + 128)),
                         np.empty((512, 128), np.float32)) for r in recs for k in range(8)]
  reader.index.load([("state", 0)])
  for f in _data_files(path)[-2:]:
    os.remove(f)
  error = _in_thread(lambda: reader.read(fills))
  assert isinstance(error, ofx.errors.CheckpointCorruptedError), error
  assert "is missing" in str(error)
  assert reader.temps.out == 0


# ---------------------------------------------------------------------------
# Allocation bombs: sizes checked against the stored chunks first


def _bomb(tmp_path, name, shape, chunk, owners):
  path = str(tmp_path / name)
  ofx.save(path, {"state": {"big": np.arange(1 << 20, dtype=np.float32)}})
  summary, body = _manifest(path)
  leaf = body["items"]["state"]["leaves"][0]
  leaf.update(shape=[shape], chunk_shape=[chunk], nbytes=shape * 4, owners=[0] * owners)
  summary["item_bytes"]["state"] = shape * 4
  _write_manifest(path, summary, body)
  return path


@pytest.mark.parametrize("shape,chunk,owners", [(2**40, 2**40, 1), (2**32, 2**32, 1),
                                                (2**40, 2**20, 2**20)],
                         ids=["4TiB_one_chunk", "16GiB_one_chunk", "4TiB_1M_missing_chunks"])
def test_a_manifest_claiming_more_than_is_stored_is_refused_before_allocating(
    tmp_path, shape, chunk, owners):
  path = _bomb(tmp_path, "bomb", shape, chunk, owners)
  for read in (lambda: ofx.restore(path), lambda: ofx.verify(path)):
    error = _in_thread(read)
    assert isinstance(error, ofx.errors.CheckpointCorruptedError), repr(error)
    assert "array big" in str(error) and "p0-" in str(error)
    assert "chunk" in str(error)


@pytest.mark.parametrize("shape,chunk,owners", [(2**40, 2**40, 1), (2**40, 2**20, 2**20)],
                         ids=["4TiB_one_chunk", "4TiB_1M_missing_chunks"])
def test_an_allocation_bomb_on_an_object_store_is_refused_before_allocating(
    s3_server, shape, chunk, owners):
  """On S3 the stored lengths come from the databases' OCDBT index, read before allocating."""
  bucket = s3_server.new_bucket()
  url = s3_server.url(bucket, "bomb")
  ofx.save(url, {"state": {"big": np.arange(1 << 20, dtype=np.float32)}})
  _, line, body = s3_server.get(bucket, "bomb/_CHECKPOINT").split(b"\n", 2)
  summary, body = json.loads(line), json.loads(body)
  body["items"]["state"]["leaves"][0].update(shape=[shape], chunk_shape=[chunk],
                                             nbytes=shape * 4, owners=[0] * owners)
  summary["item_bytes"]["state"] = shape * 4
  s3_server.put(bucket, "bomb/_CHECKPOINT", _manifest_bytes(summary, body))
  for read in (lambda: ofx.restore(url), lambda: ofx.verify(url)):
    error = _in_thread(read)
    assert isinstance(error, ofx.errors.CheckpointCorruptedError), repr(error)
    assert "array big" in str(error) and "chunk" in str(error)


def test_verify_cli_reports_an_allocation_bomb(tmp_path):
  path = _bomb(tmp_path, "bomb", 2**40, 2**20, 2**20)
  r = subprocess.run([sys.executable, "-m", "orbax_flax", "verify", path], capture_output=True,
                     text=True, timeout=_HANG_S, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode != 0 and "1048576 chunk(s)" in r.stdout + r.stderr, r


def test_a_manifest_over_the_size_cap_is_not_read(tmp_path):
  path = str(tmp_path / "ckpt")
  ofx.save(path, {"state": {"w": np.arange(4, dtype=np.float32)}})
  file = os.path.join(path, "_CHECKPOINT")
  with open(file, "ab") as f:  # a sparse file: 300 MiB claimed, nothing written
    f.truncate(300 << 20)
  with pytest.raises(ofx.errors.CheckpointFormatError, match="larger than 256 MiB"):
    ofx.restore(path)


# ---------------------------------------------------------------------------
# Links are never followed


@pytest.fixture
def victim(tmp_path):
  path = str(tmp_path / "victim" / "private")
  value = np.arange(1 << 20, dtype=np.float32) * 7
  ofx.save(path, {"state": {"w": value}})
  return path, value


def test_an_item_directory_linked_outside_is_refused(tmp_path, victim):
  secret, _ = victim
  evil = str(tmp_path / "downloaded")
  os.makedirs(evil)
  shutil.copy(os.path.join(secret, "_CHECKPOINT"), evil)
  os.symlink(os.path.join(secret, "state"), os.path.join(evil, "state"))
  for read in (lambda: ofx.restore(evil), lambda: ofx.verify(evil)):
    with pytest.raises(ofx.errors.CheckpointFormatError, match="symbolic link") as e:
      read()
    assert os.path.join(evil, "state") in str(e.value)


@pytest.mark.parametrize("inside", [False, True], ids=["to_outside", "to_inside"])
def test_a_data_file_link_is_refused(tmp_path, victim, inside):
  secret, _ = victim
  evil = str(tmp_path / "downloaded")
  shutil.copytree(secret, evil)
  (f,) = _data_files(evil)[-1:]
  os.remove(f)
  source = f + ".moved" if inside else os.path.join(secret, os.path.relpath(f, evil))
  if inside:
    shutil.copy(os.path.join(secret, os.path.relpath(f, evil)), source)
  os.symlink(source, f)
  with pytest.raises(ofx.errors.CheckpointFormatError, match="symbolic link") as e:
    ofx.restore(evil)
  assert f in str(e.value)


def test_a_manifest_link_is_refused(tmp_path, victim):
  secret, _ = victim
  evil = str(tmp_path / "downloaded")
  shutil.copytree(secret, evil)
  os.remove(os.path.join(evil, "_CHECKPOINT"))
  os.symlink(os.path.join(secret, "_CHECKPOINT"), os.path.join(evil, "_CHECKPOINT"))
  with pytest.raises(ofx.errors.CheckpointFormatError, match="_CHECKPOINT is a symbolic link"):
    ofx.restore(evil)


def _bounded(read, limit=_HANG_S):
  """What ``read()`` raised (None: it returned), or "hung" if it had not ended in ``limit`` s."""
  out = []

  def run():
    try:
      read()
      out.append(None)
    except Exception as e:  # pylint: disable=broad-except
      out.append(e)

  t = threading.Thread(target=run, daemon=True)
  t.start()
  t.join(limit)
  return out[0] if out else "hung"


def _release_fifo(path):
  """Ends a read blocked on the FIFO ``path`` (a writer opens and closes it: end of file)."""
  try:
    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
  except OSError:
    pass  # no reader is blocked on it


@pytest.mark.parametrize("where", ["manifest", "data file"])
def test_a_fifo_inside_a_checkpoint_is_refused_not_read_forever(tmp_path, where):
  """A FIFO in place of a step's _CHECKPOINT, or of a data file: restore, metadata, verify
  and a manager's keep rules (which read step metadata) blocked forever in open(), where a
  symbolic link at the same place is refused at once."""
  d = str(tmp_path / "run")
  with ofx.CheckpointManager(d) as m:
    m.save(1, {"state": {"w": np.ones(1000, np.float32)}}, force=True)
  step = os.path.join(d, "5")
  shutil.copytree(os.path.join(d, "1"), step)
  fifo = (os.path.join(step, "_CHECKPOINT") if where == "manifest"
          else _data_files(step)[-1])
  os.remove(fifo)
  os.mkfifo(fifo)

  def keep_best_save():
    with ofx.CheckpointManager(d, ofx.CheckpointPolicy(best_metric="loss", keep_best=1)) as mm:
      mm.save(9, {"state": {"w": np.zeros(1000, np.float32)}}, force=True,
              metrics={"loss": 0.0})

  reads = {"restore": lambda: ofx.restore(step), "verify": lambda: ofx.verify(step)}
  if where == "manifest":
    reads.update(metadata=lambda: ofx.metadata(step), keep_best_save=keep_best_save)
  try:
    for name, read in reads.items():
      got = _bounded(read, limit=30)  # a FIFO's read ends at once or never
      if name == "keep_best_save":  # the damaged step counts as having no metrics
        assert got is None, got
      else:
        assert isinstance(got, ofx.errors.CheckpointFormatError), (name, got)
        assert f"{fifo} is a FIFO" in str(got), (name, got)
  finally:
    _release_fifo(fifo)


# ---------------------------------------------------------------------------
# A database belongs to one item, process and checkpoint


def _two_items(path, a_value):
  b_value = np.arange(1 << 20, dtype=np.float32) * -1
  ofx.save(path, {"a": {"w": a_value}, "b": {"w": b_value}})
  return _manifest(path)[0]["generation"]


def test_databases_swapped_between_items_are_detected_by_restore_and_verify(tmp_path):
  path = str(tmp_path / "c")
  gen = _two_items(path, np.arange(1 << 20, dtype=np.float32))
  a, b = f"{path}/a/p0-{gen}", f"{path}/b/p0-{gen}"
  os.rename(a, f"{path}/tmp")
  os.rename(b, a)
  os.rename(f"{path}/tmp", b)
  with pytest.raises(ofx.errors.CheckpointCorruptedError, match=f"names itself 'b/p0-{gen}'"):
    ofx.restore(path)
  r = subprocess.run([sys.executable, "-m", "orbax_flax", "verify", path], capture_output=True,
                     text=True, timeout=_HANG_S, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode != 0 and "names itself" in r.stdout + r.stderr, r


def test_another_checkpoints_database_renamed_in_is_detected(tmp_path):
  value = np.arange(1 << 20, dtype=np.float32)
  other, mine = str(tmp_path / "other"), str(tmp_path / "mine")
  g_other = _two_items(other, value + 1)
  g_mine = _two_items(mine, value)
  shutil.rmtree(f"{mine}/a/p0-{g_mine}")
  shutil.copytree(f"{other}/a/p0-{g_other}", f"{mine}/a/p0-{g_mine}")
  for read in (lambda: ofx.restore(mine), lambda: ofx.verify(mine)):
    with pytest.raises(ofx.errors.CheckpointCorruptedError, match=f"names itself 'a/p0-{g_other}'"):
      read()


def _drop_identity(path, item, gen):
  kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file",
                                                    "path": f"{path}/{item}/p0-{gen}/"}}).result()
  kv.delete_range(ts.KvStore.KeyRange("ofx_database", "ofx_database\0")).result()


def test_a_checkpoint_written_before_database_identities_still_restores(tmp_path):
  """The identity is required only where the manifest says every database holds one."""
  path = str(tmp_path / "c")
  value = np.arange(1 << 20, dtype=np.float32)
  gen = _two_items(path, value)
  for item in ("a", "b"):
    _drop_identity(path, item, gen)
  with pytest.raises(ofx.errors.CheckpointCorruptedError, match="does not name itself"):
    ofx.restore(path)
  summary, body = _manifest(path)
  del summary["database_identity"]
  _write_manifest(path, summary, body)
  np.testing.assert_array_equal(ofx.restore(path)["a"]["w"], value)
  assert ofx.verify(path) == 2 * value.nbytes


# ---------------------------------------------------------------------------
# Messages name what failed


def test_a_tensorstore_failure_is_not_called_a_checksum_mismatch(tmp_path):
  """An int4 array is read through tensorstore; its stored zarr metadata is made to disagree
  with the manifest. Before the fix this was reported as 'the stored checksum does not match'."""
  path = str(tmp_path / "c")
  value = (np.arange(1 << 21) % 8).astype(jnp.int4)
  ofx.save(path, {"state": {"w": value}})
  gen = _manifest(path)[0]["generation"]
  kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file",
                                                    "path": f"{path}/state/p0-{gen}/"}}).result()
  meta = json.loads(kv.read("a0/zarr.json").result().value)
  meta["shape"] = [meta["shape"][0] + 1]
  kv.write("a0/zarr.json", json.dumps(meta).encode()).result()
  with pytest.raises(ofx.errors.CheckpointCorruptedError) as e:
    ofx.restore(path)
  assert "checksum" not in str(e.value)
  assert "metadata does not match the manifest" in str(e.value)



def _value_at(db: str, key: bytes) -> tuple[str, int, int]:
  """(data file, offset, length) of ``key`` in OCDBT database ``db`` (a value not inline)."""
  store = ts.KvStore.open({"driver": "file", "path": db + "/"}).result()
  stack = [ts.ocdbt.dump(store).result()["versions"][-1]["root"]["location"]]
  while stack:
    for entry in ts.ocdbt.dump(store, stack.pop()).result().get("entries", []):
      child = entry.get("node") or entry.get("location")
      if isinstance(child, str) and child.startswith("btreenode::"):
        stack.append(child)
      elif entry.get("key") == key and "indirect_value" in entry:
        file, offset, length = str(entry["indirect_value"]).split("::", 1)[1].rsplit(":", 2)
        return os.path.join(db, file), int(offset), int(length)
  raise KeyError(key)


@pytest.mark.parametrize("n, key, says", [
    (1 << 20, b"a0/c/0", "not the bytes the manifest recorded"),
    # Small arrays, packed into one buffer per item and process: verify compared the recorded
    # content hashes of chunked arrays only, not of packed pieces.
    (1024, b"packed/c/0", "item 'a', the packed small arrays .* not the bytes the manifest")])
def test_verify_checks_a_differential_saves_content_hashes(tmp_path, n, key, says):
  """Another chunk's bytes (CRC-32C and all) written over a chunk of the same size: its
  checksum passes and its database is the right one, but a differential save recorded each
  chunk's content hash, and verify compares it."""
  path = str(tmp_path / "c")
  a, b = np.arange(n, dtype=np.float32), np.arange(n, dtype=np.float32) * -1
  ckptr = ofx.Checkpointer(differential=True)
  ckptr.save(path, {"a": {"w": a}, "b": {"w": b}})
  ckptr.close()
  assert ofx.verify(path) == 2 * a.nbytes
  gen = _manifest(path)[0]["generation"]
  src = _value_at(f"{path}/b/p0-{gen}", key)
  dst = _value_at(f"{path}/a/p0-{gen}", key)
  assert src[2] == dst[2]
  with open(src[0], "rb") as f:
    f.seek(src[1])
    data = f.read(src[2])
  with open(dst[0], "r+b") as f:
    f.seek(dst[1])
    f.write(data)
  with pytest.raises(ofx.errors.CheckpointCorruptedError, match=says):
    ofx.verify(path)


def test_verify_lists_every_item_whose_database_is_not_its_own(tmp_path):
  """Three items, two databases swapped and the third intact: verify names both, not only
  the first it meets."""
  path = str(tmp_path / "c")
  value = np.arange(1 << 20, dtype=np.float32)
  ofx.save(path, {"a": {"w": value}, "b": {"w": -value}, "c": {"w": value + 1}})
  gen = _manifest(path)[0]["generation"]
  os.rename(f"{path}/a/p0-{gen}", f"{path}/tmp")
  os.rename(f"{path}/b/p0-{gen}", f"{path}/a/p0-{gen}")
  os.rename(f"{path}/tmp", f"{path}/b/p0-{gen}")
  with pytest.raises(ofx.errors.CheckpointCorruptedError) as e:
    ofx.verify(path)
  assert f"names itself 'b/p0-{gen}'" in str(e.value)
  assert f"names itself 'a/p0-{gen}'" in str(e.value)
  assert "item 'c'" not in str(e.value)
