"""Foreign formats: behaviour the readers and exporters promise that no other test pinned.

Written from a mutation-testing pass over ``orbax_flax/formats/`` (mutants F01-F86): each
test below kills one or more mutants that survived the interop, export and hostile-file
tests, and its docstring names them. Foreign files are written by the real peer library
(``safetensors.numpy.save_file``, orbax-checkpoint's own checkpointers) and, where a test
needs a file no writer makes, edited from one the peer wrote; the peer then stays the
reference (what it loads, we read the same; what orbax refuses, we refuse).
"""

from __future__ import annotations

import io
import json
import os
import struct

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import orbax_flax as ofx
from orbax_flax import cli


def _header(path):
  """``(header dict, header length)`` of a safetensors file, as the file stores them."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n)), n


def _rewrite_header(path, header):
  """Replaces the header of ``path`` (keeping the data section), padded to 8 bytes."""
  _, n = _header(path)
  data = open(path, "rb").read()[8 + n:]
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + data)


# ---- safetensors: reading

_EXTREMES = {
    "b": np.array([True, False, True]),
    "u8": np.array([0, 255], np.uint8), "i8": np.array([-128, 127], np.int8),
    "u16": np.array([0, 65535, 40000], np.uint16), "i16": np.array([-32768, 32767, -1], np.int16),
    "u32": np.array([0, 2**32 - 1], np.uint32), "i32": np.array([-2**31, 2**31 - 1], np.int32),
    "u64": np.array([0, 2**64 - 1], np.uint64), "i64": np.array([-2**63, 2**63 - 1], np.int64),
    "f16": np.array([-0.0, 65504, 1e-7], np.float16), "f32": np.array([np.pi, -np.inf], np.float32),
    "f64": np.array([np.e, 1e300], np.float64),
}


def test_safetensors_every_integer_and_float_dtype_reads_as_the_package_wrote_it(tmp_path):
  """Kills F09 (U16 and I16 swapped): each dtype's extreme values, written by the
  safetensors package, come back with its dtype and bits; and what we export the package
  loads with the same dtypes and bits."""
  f = str(tmp_path / "all.safetensors")
  save_file(_EXTREMES, f)
  back = ofx.restore(f)["params"]
  for name, want in _EXTREMES.items():
    got = np.asarray(back[name])
    assert got.dtype == want.dtype, (name, got.dtype)
    assert got.tobytes() == want.tobytes(), name
  d = str(tmp_path / "export")
  ofx.export_safetensors(d, _EXTREMES)
  loaded = load_file(os.path.join(d, "model.safetensors"))
  for name, want in _EXTREMES.items():
    assert loaded[name].dtype == want.dtype and loaded[name].tobytes() == want.tobytes(), name


def test_a_safetensors_header_longer_than_the_package_allows_is_refused_unread(tmp_path):
  """Kills F12 (no 100 MiB cap on the header length, only the file's size): a file whose
  first 8 bytes claim a header of 100 MiB + 1 (inside the file) is refused by its length,
  as the safetensors package refuses it, not read into memory and parsed."""
  f = tmp_path / "big.safetensors"
  n = (100 << 20) + 1
  with open(f, "wb") as fh:
    fh.write(struct.pack("<Q", n) + b"{")
    fh.truncate(8 + n + 8)  # sparse: nothing of it is on disk
  with pytest.raises(ofx.CheckpointFormatError, match=r"header length 104857601"):
    ofx.metadata(str(f))
  with pytest.raises(Exception):  # noqa: B017  (the reference refuses it too)
    load_file(str(f))


def test_a_zero_sized_tensor_listed_after_its_neighbour_reads_as_the_package_reads_it(tmp_path):
  """Kills F19 (the tiling check sorts by start offset only): an empty tensor at the
  offset where a longer one starts, listed after it in the header, is a valid file (the
  safetensors package loads it); we read it too, with the package's values."""
  f = str(tmp_path / "z.safetensors")
  save_file({"a": np.arange(2, dtype=np.float16), "b": np.zeros((0, 3), np.float32)}, f)
  header, _ = _header(f)
  assert header["a"]["data_offsets"][0] == header["b"]["data_offsets"][0] == 0
  _rewrite_header(f, {k: header[k] for k in ("__metadata__", "a", "b") if k in header})
  want = load_file(f)
  got = ofx.restore(f)["params"]
  assert set(got) == set(want) == {"a", "b"}
  for k in want:
    assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
    np.testing.assert_array_equal(got[k], want[k])


def test_an_index_placing_a_tensor_in_the_wrong_shard_is_refused(tmp_path):
  """Kills F20 (the index only checked to name tensors some shard holds): an index that
  places ``a`` in the shard holding ``b`` (and ``b`` in ``a``'s) is refused, as its
  docstring says, though every tensor it names is in some shard: a Hugging Face loader
  opens the shard the index names and would not find the tensor there."""
  d = str(tmp_path / "hf")
  tree = {"a": np.ones(64, np.float32), "b": np.zeros(64, np.float32)}
  names = ofx.export_safetensors(d, tree, max_shard_bytes=256)
  assert len(names) == 2
  index_path = os.path.join(d, "model.safetensors.index.json")
  index = json.load(open(index_path))
  wm = index["weight_map"]
  wm["a"], wm["b"] = wm["b"], wm["a"]
  json.dump(index, open(index_path, "w"))
  with pytest.raises(ofx.CheckpointFormatError, match=r"weight_map places tensors in files whose"
                     r" headers do not hold them: 'a' \(in .*model-00002-of-00002"):
    ofx.restore(d)


def test_a_file_of_another_format_is_no_checkpoint(tmp_path):
  """Kills F23 (any file read as safetensors): a file that is not ``*.safetensors`` (a
  PyTorch ``.bin``) is no checkpoint: CheckpointNotFoundError, as for any other path that
  holds none, not a format error about a safetensors header."""
  f = tmp_path / "pytorch_model.bin"
  f.write_bytes(b"\x80\x02}q\x00." + bytes(64))
  for call in (ofx.restore, ofx.metadata):
    with pytest.raises(ofx.CheckpointNotFoundError):
      call(str(f))


# ---- safetensors: writing

def test_export_safetensors_starts_every_files_data_8_byte_aligned(tmp_path):
  """Kills F26 (the header padded to 4 bytes): the data section starts at a multiple of
  8, as the safetensors package writes it (a loader that maps the file views float64 and
  int64 tensors in place), whatever the names' lengths, in one file and in shards."""
  for k in range(1, 9):
    d = str(tmp_path / f"e{k}")
    tree = {"x" * k: np.arange(3, dtype=np.float64), "y" * (k + 3): np.arange(5, dtype=np.int64)}
    for name in ofx.export_safetensors(d, tree, max_shard_bytes=1 if k % 2 else 1 << 20):
      _, n = _header(os.path.join(d, name))
      assert (8 + n) % 8 == 0, (k, name, n)


def test_export_safetensors_dtype_function_returning_none_keeps_the_dtype(tmp_path):
  """Kills F27 (None from ``dtype=`` casts to np.dtype(None), float64): a function that
  returns None for a leaf keeps that leaf's dtype, as documented."""
  d = str(tmp_path / "st")
  tree = {"kernel": np.ones((2, 2), np.float32), "bias": np.ones(2, np.float32),
          "count": np.arange(3, dtype=np.int32)}
  ofx.export_safetensors(d, tree, dtype=lambda name, dt: "bfloat16" if name == "kernel" else None)
  with safe_open(os.path.join(d, "model.safetensors"), "flax") as f:
    dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
  assert dtypes == {"kernel": ml_dtypes.bfloat16, "bias": np.float32, "count": np.int32}


def test_export_safetensors_metadata_given_wins_over_the_default(tmp_path):
  """Kills F29 (the default ``format: pt`` written over the caller's): ``metadata`` is what
  the header's ``__metadata__`` holds; ``format: pt`` only where it names no format."""
  d = str(tmp_path / "a")
  ofx.export_safetensors(d, {"w": np.ones(2, np.float32)}, metadata={"format": "flax", "k": "v"})
  with safe_open(os.path.join(d, "model.safetensors"), "numpy") as f:
    assert f.metadata() == {"format": "flax", "k": "v"}
  d = str(tmp_path / "b")
  ofx.export_safetensors(d, {"w": np.ones(2, np.float32)}, metadata={"k": "v"})
  with safe_open(os.path.join(d, "model.safetensors"), "numpy") as f:
    assert f.metadata() == {"format": "pt", "k": "v"}


def test_export_safetensors_in_two_shards_writes_the_index_hugging_face_reads(tmp_path):
  """Kills F31 (``total_size`` counting the headers) and F32 (no index for two shards):
  two shards come with ``model.safetensors.index.json`` naming each tensor's shard, and
  ``total_size`` is the tensors' bytes, as transformers writes it."""
  d = str(tmp_path / "st")
  tree = {"a": np.ones((4, 8), np.float32), "b": np.arange(8, dtype=np.int64)}
  names = ofx.export_safetensors(d, tree, max_shard_bytes=128)
  assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
  index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
  assert index["weight_map"] == {"a": names[0], "b": names[1]}
  assert index["metadata"]["total_size"] == 4 * 8 * 4 + 8 * 8


def test_export_safetensors_writes_booleans_as_bytes_0_and_1(tmp_path):
  """Kills F34 (a bool array's bytes written as they are): a bool array viewed from other
  bytes (``np.frombuffer(..., bool)``) is written 0/1, the only bytes a BOOL tensor may
  hold (torch and Rust readers take other bytes as undefined)."""
  d = str(tmp_path / "st")
  mask = np.frombuffer(bytes([0, 1, 2, 255]), np.bool_)
  ofx.export_safetensors(d, {"mask": mask})
  f = os.path.join(d, "model.safetensors")
  header, n = _header(f)
  lo, hi = header["mask"]["data_offsets"]
  assert header["mask"]["dtype"] == "BOOL"
  assert open(f, "rb").read()[8 + n + lo:8 + n + hi] == bytes([0, 1, 1, 1])


def test_export_overwrite_refuses_a_directory_of_links_as_in_the_hub_cache(tmp_path):
  """Kills F36 (a link counted as an earlier export): a Hugging Face cache snapshot is a
  directory of links named like an export's files (``model.safetensors -> blobs/...``);
  even with overwrite=True it is refused and left as it was."""
  blob = tmp_path / "blobs" / "abc123"
  blob.parent.mkdir()
  save_file({"w": np.ones(2, np.float32)}, str(blob))
  snap = tmp_path / "snapshot"
  snap.mkdir()
  os.symlink(blob, snap / "model.safetensors")
  with pytest.raises(ValueError,
                     match=r"not an earlier safetensors export.*holds model.safetensors"):
    ofx.export_safetensors(str(snap), {"w": np.zeros(2, np.float32)}, overwrite=True)
  assert os.path.islink(snap / "model.safetensors")
  np.testing.assert_array_equal(load_file(str(snap / "model.safetensors"))["w"], np.ones(2))


def test_a_column_block_of_a_tensor_over_16_mib_reads_in_several_slabs(tmp_path):
  """Kills F04 (a slab one row longer than its buffer): a restore that splits a matrix by
  columns reads whole rows in slabs of about 16 MiB and copies its columns out; a tensor
  of more rows than one slab holds (4100 rows of 4 KiB) reads exactly, every slab's rows."""
  f = str(tmp_path / "big.safetensors")
  w = np.arange(4100 * 1024, dtype=np.float32).reshape(4100, 1024)
  save_file({"w": w}, f)
  mesh = jax.make_mesh((8,), ("x",))
  target = {"params": {"w": jax.ShapeDtypeStruct(w.shape, w.dtype,
                                                 sharding=NamedSharding(mesh, P(None, "x")))}}
  got = ofx.restore(f, target)["params"]["w"]
  assert got.sharding.spec == P(None, "x")
  np.testing.assert_array_equal(np.asarray(got), w)


# ---- orbax-checkpoint: reading

def _ocp_item(path, tree):
  with ocp.StandardCheckpointer() as saver:
    saver.save(path, tree)
    saver.wait_until_finished()
  return path


def test_orbax_key_type_other_than_1_or_2_is_refused(tmp_path):
  """Kills F42 (any integer key_type accepted): a ``_METADATA`` whose key names a key type
  orbax-checkpoint does not have (3) is refused, naming the leaf, as orbax refuses it,
  instead of being read as a dict key."""
  item = _ocp_item(str(tmp_path / "item"), {"a": np.ones(2, np.float32)})
  meta_path = os.path.join(item, "_METADATA")
  meta = json.load(open(meta_path))
  meta["tree_metadata"]["('a',)"]["key_metadata"][0]["key_type"] = 3
  json.dump(meta, open(meta_path, "w"))
  with pytest.raises(ofx.CheckpointFormatError, match=r"leaf \"\('a',\)\": key_metadata entry"
                     r" .*'key_type': 3.* is not"):
    ofx.metadata(item)
  with pytest.raises(Exception):  # noqa: B017  (orbax-checkpoint refuses it too)
    with ocp.StandardCheckpointer() as reader:
      reader.restore(item)


def test_orbax_empty_namedtuple_written_with_rich_types_reads_as_none(tmp_path):
  """Kills F43 (``NamedTuple`` read as an empty tuple): orbax-checkpoint's rich types
  record an empty namedtuple (``optax.EmptyState()``) as ``NamedTuple``; without them, as
  orbax reads it by default, it comes back None."""
  import optax  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.metadata import (  # pylint: disable=g-import-not-at-top
      pytree_metadata_options as pmo)
  item = str(tmp_path / "item")
  handler = ocp.PyTreeCheckpointHandler(
      pytree_metadata_options=pmo.PyTreeMetadataOptions(support_rich_types=True))
  with ocp.Checkpointer(handler) as saver:
    saver.save(item, args=ocp.args.PyTreeSave({"a": np.ones(2, np.float32),
                                                "s": optax.EmptyState()}))
  meta = json.load(open(os.path.join(item, "_METADATA")))["tree_metadata"]
  assert meta["('s',)"]["value_metadata"]["value_type"] == "NamedTuple"
  with ocp.PyTreeCheckpointer() as reader:
    assert reader.restore(item)["s"] is None
  got = ofx.restore(item)["default"]
  assert got["s"] is None
  np.testing.assert_array_equal(got["a"], np.ones(2, np.float32))


def test_orbax_key_data_of_another_dtype_is_refused(tmp_path):
  """Kills F46 (only the key data's shape checked): an ``array_metadatas`` that names a
  float32[2] array as threefry2x32 keys (whose data is uint32[..., 2]) is refused, naming
  the array, instead of wrapping floats as keys."""
  path = str(tmp_path / "item")
  with ocp.StandardCheckpointer() as saver:
    saver.save(path, {"k": jax.random.key(1), "w": jax.numpy.arange(2.0, dtype=np.float32)})
  file = os.path.join(path, "array_metadatas", "process_0")
  doc = json.load(open(file))
  for entry in doc["array_metadatas"]:
    if entry["array_metadata"]["param_name"] == "w":
      entry["array_metadata"]["ext_metadata"] = {"random_key_impl": "threefry2x32"}
  json.dump(doc, open(file, "w"))
  for read in (ofx.restore, ofx.metadata):
    with pytest.raises(ofx.CheckpointFormatError, match=r"array 'w' holds float32\[2\], not the key"
                       r" data of threefry2x32 keys \(uint32\[..., 2\]\)"):
      read(path)


def _ocp_run(root, tree, step=1):
  with ocp.CheckpointManager(root) as mngr:
    mngr.save(step, args=ocp.args.StandardSave(tree))
    mngr.wait_until_finished()
  return os.path.join(root, str(step))


def test_orbax_step_time_is_its_commit_time_and_a_negative_one_is_refused(tmp_path):
  """Kills F47 (the step's time taken from ``init_timestamp_nsecs``) and F48 (a negative
  timestamp accepted): a step is written when orbax committed it; a negative time is
  damage."""
  step = _ocp_run(str(tmp_path / "run"), {"w": np.arange(3.0)})
  meta_path = os.path.join(step, "_CHECKPOINT_METADATA")
  meta = json.load(open(meta_path))
  assert meta["init_timestamp_nsecs"] != meta["commit_timestamp_nsecs"]
  assert ofx.metadata(step).created == meta["commit_timestamp_nsecs"] / 1e9
  meta["commit_timestamp_nsecs"] = -5
  json.dump(meta, open(meta_path, "w"))
  with pytest.raises(ofx.CheckpointFormatError, match=r"timestamp -5 is not an integer of"
                     r" nanoseconds"):
    ofx.metadata(step)


def test_orbax_run_steps_are_ascii_numbered_directories_with_either_marker(tmp_path):
  """Kills F49 (a directory named with non-ASCII digits taken as a step) and F50 (a step
  with ``_CHECKPOINT_METADATA`` but no ``commit_success.txt``, as older orbax versions
  leave on a local disk, not listed): the run directory's steps are what the error for a
  run passed as a checkpoint names."""
  root = str(tmp_path / "run")
  step = _ocp_run(root, {"w": np.arange(3.0)}, step=5)
  os.remove(os.path.join(step, "commit_success.txt"))
  arabic_seven = os.path.join(root, "\u0667")
  os.makedirs(arabic_seven)
  open(os.path.join(arabic_seven, "commit_success.txt"), "w").close()
  with pytest.raises(ofx.CheckpointNotFoundError) as e:
    ofx.restore(root)
  text = str(e.value)
  assert "orbax-checkpoint run directory holding" in text and os.path.join(root, "5") in text
  assert os.path.join(root, "7") not in text


def test_orbax_items_a_step_holds_but_this_reader_skips_are_named(tmp_path):
  """Kills F58 (the skipped items not recorded): a step item of a handler this reader does
  not read (an ``ArraySave`` item) is named in the metadata's ``items_not_read``, the only
  trace that the step holds more than what is restored."""
  root = str(tmp_path / "run")
  with ocp.CheckpointManager(root, item_names=("state", "extra")) as mngr:
    mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.arange(3.0)}),
                                         extra=ocp.args.ArraySave(np.arange(4))))
    mngr.wait_until_finished()
  meta = ofx.metadata(os.path.join(root, "1"))
  assert set(meta.items) == {"state"}
  assert list(meta.custom["items_not_read"]) == ["extra"]
  assert meta.custom["items_not_read"]["extra"].endswith("ArrayCheckpointHandler")


def test_orbax_aggregate_file_missing_a_list_element_is_refused(tmp_path):
  """Kills F59 (a list index beyond the aggregate's list read): a leaf that ``_METADATA``
  puts in the legacy aggregate file (``skip_deserialize``) at an index its list does not
  have is refused as a format error, not an IndexError."""
  from flax import serialization  # pylint: disable=g-import-not-at-top
  path = tmp_path / "item"
  tree = {"layers": [np.arange(2.0), np.arange(3.0)]}
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(str(path), args=ocp.args.PyTreeSave(tree))
  meta = json.loads((path / "_METADATA").read_text())
  for leaf in meta["tree_metadata"].values():
    leaf["value_metadata"]["skip_deserialize"] = True
  (path / "_METADATA").write_text(json.dumps(meta))
  (path / "checkpoint").write_bytes(serialization.msgpack_serialize({"layers": [np.arange(2.0)]}))
  with pytest.raises(ofx.CheckpointFormatError, match=r"leaf layers.1 is marked as aggregated but"
                     r" is not in 'checkpoint'"):
    ofx.restore(str(path))


def test_orbax_string_leaf_holding_another_json_value_is_refused(tmp_path):
  """Kills F61 (any JSON value of ``_strings.json`` read for a string leaf): orbax
  records a string leaf in ``_strings.json``; a number there is damage, refused naming
  the leaf, not restored as a number where the checkpoint says a string."""
  path = tmp_path / "item"
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(
      str(path), args=ocp.args.PyTreeSave({"tag": "run-7", "w": np.arange(2.0)}))
  assert json.loads((path / "_strings.json").read_text()) == {"tag": "run-7"}
  assert ofx.restore(str(path))["default"]["tag"] == "run-7"
  (path / "_strings.json").write_text(json.dumps({"tag": 5}))
  with pytest.raises(ofx.CheckpointFormatError, match=r"string leaf 'tag' is 5, not a string"):
    ofx.restore(str(path))


def test_orbax_scalar_leaf_whose_array_is_empty_is_refused(tmp_path):
  """Kills F55 (only scalars of more than one element refused): a leaf ``_METADATA`` calls
  a scalar whose stored array has no element (shape [0]) is a format error naming it, not
  a ValueError from reading an item out of an empty array."""
  path = tmp_path / "item"  # (orbax-checkpoint refuses to save an empty array; we write one)
  ofx.export_orbax(str(path), {"a": np.zeros((0,), np.float32), "b": 1})
  meta = json.loads((path / "_METADATA").read_text())
  meta["tree_metadata"]["('a',)"]["value_metadata"]["value_type"] = "scalar"
  (path / "_METADATA").write_text(json.dumps(meta))
  for read in (ofx.metadata, ofx.restore):
    with pytest.raises(ofx.CheckpointFormatError, match=r"leaf 'a' is a scalar, but its array has"
                       r" shape \[0\]"):
      read(str(path))


def test_orbax_array_of_a_dtype_orbax_flax_does_not_read_is_refused(tmp_path):
  """Kills F56 (any stored dtype accepted): an item whose zarr array holds raw bytes
  (``|V4``, which tensorstore's zarr driver stores and orbax never writes) is refused when
  opened, naming the array and the dtype, not described as a ``void`` array of 0 bytes."""
  import shutil  # pylint: disable=g-import-not-at-top
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / "item")
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(
      path, args=ocp.args.PyTreeSave({"a": np.ones(2, np.float32)}))
  shutil.rmtree(os.path.join(path, "a"))
  ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(path, "a")},
           "metadata": {"shape": [2], "chunks": [2], "dtype": "|V4"}}, create=True).result()
  for read in (ofx.metadata, ofx.restore):
    with pytest.raises(ofx.CheckpointFormatError,
                       match=r"array 'a' has dtype \|V0, which orbax_flax cannot read"):
      read(path)


def test_orbax_step_item_name_with_a_nul_is_refused_as_a_format_error(tmp_path):
  """Kills F82 (NUL allowed in a plain name): a step's ``_CHECKPOINT_METADATA`` naming an
  item ``de\\0fault``, or a safetensors index naming a shard ``model\\0.safetensors``, is
  a crafted name, refused as such (CheckpointFormatError), not passed to the file system
  (a raw ValueError: embedded null byte) or reported as a lost shard."""
  step = _ocp_run(str(tmp_path / "run"), {"w": np.arange(3.0)})
  meta_path = os.path.join(step, "_CHECKPOINT_METADATA")
  meta = json.load(open(meta_path))
  meta["item_handlers"] = {"de\0fault": meta["item_handlers"]["default"]}
  json.dump(meta, open(meta_path, "w"))
  with pytest.raises(ofx.CheckpointFormatError, match=r"item name is 'de\\x00fault', not a plain"
                     r" name"):
    ofx.metadata(step)
  d = tmp_path / "hf"
  d.mkdir()
  save_file({"a": np.ones(2, np.float32)}, str(d / "model.safetensors"))
  (d / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"a": "model\0.safetensors"}}))
  with pytest.raises(ofx.CheckpointFormatError, match=r"weight_map\['a'\] is 'model\\x00"
                     r"\.safetensors', not a plain name"):
    ofx.metadata(str(d))


def test_flax_legacy_run_continues_from_its_newest_committed_checkpoint(tmp_path):
  """Kills F51 (``checkpoint_<N>`` matched as a prefix): a flax legacy directory holding
  ``checkpoint_10`` and an interrupted save's ``checkpoint_20.orbax-checkpoint-tmp-...``
  (complete enough to have its ``_METADATA``) continues from step 10, never the
  uncommitted temporary."""
  workdir = tmp_path / "work"
  for name, value in (("checkpoint_10", 1.0),
                      ("checkpoint_20.orbax-checkpoint-tmp-1700000000", 2.0)):
    _ocp_item(str(workdir / name), {"w": np.full(3, value, np.float32)})
  with ofx.CheckpointCallback(str(workdir), {}) as ckpt:
    state = ckpt.restore_or_init({"w": np.zeros(3, np.float32)})
    assert ckpt.restored_step == 10
  np.testing.assert_array_equal(np.asarray(state["w"]), np.ones(3, np.float32))


# ---- orbax-checkpoint: writing

def test_export_orbax_chunks_never_exceed_max_chunk_bytes(tmp_path):
  """Kills F67 (an array up to twice ``max_chunk_bytes`` left in one chunk): every chunk
  holds at most ``max_chunk_bytes``, also for an array just over it, and orbax restores it."""
  d = str(tmp_path / "exported")
  w = np.arange(24 * 16, dtype=np.float32).reshape(24, 16)  # 1536 bytes
  ofx.export_orbax(d, {"w": w}, max_chunk_bytes=1024)
  zarr = json.load(open(os.path.join(d, "w", "zarr.json")))
  chunk = zarr["chunk_grid"]["configuration"]["chunk_shape"]
  assert int(np.prod(chunk)) * 4 <= 1024, chunk
  with ocp.StandardCheckpointer() as reader:
    np.testing.assert_array_equal(reader.restore(d)["w"], w)


def test_export_orbax_refuses_a_negative_step_a_nested_item_and_one_name_twice(tmp_path):
  """Kills F73 (a negative step written as ``<path>/-1``), F74 (an item name with ``/``
  written as nested directories) and F75 (two leaves stored under one name, ``a.b``): each
  is a ValueError naming it, raised before anything is written."""
  d = str(tmp_path / "run")
  tree = {"w": np.ones(2, np.float32)}
  with pytest.raises(ValueError, match=r"step=-1; give a step number >= 0"):
    ofx.export_orbax(d, tree, step=-1)
  with pytest.raises(ValueError, match=r"item='a/b'; give a plain directory name"):
    ofx.export_orbax(d, tree, step=1, item="a/b")
  with pytest.raises(ValueError, match=r"stored as 'a.b', as .* is"):
    ofx.export_orbax(d, {"a.b": np.ones(2, np.float32), "a": {"b": np.zeros(2, np.float32)}})
  assert not os.path.exists(d) or not os.listdir(d)


def test_export_orbax_step_names_its_item_for_both_readers(tmp_path):
  """Kills F77 (the step's ``_CHECKPOINT_METADATA`` naming one handler, not its items): a
  step exported with ``item="params"`` names that item and its handler, so that orbax's
  CheckpointManager and our reader find it."""
  run = str(tmp_path / "run")
  w = np.arange(6, dtype=np.float32).reshape(2, 3)
  step = ofx.export_orbax(run, {"w": w}, step=7, item="params")
  handlers = json.load(open(os.path.join(step, "_CHECKPOINT_METADATA")))["item_handlers"]
  assert list(handlers) == ["params"] and handlers["params"].endswith("StandardCheckpointHandler")
  np.testing.assert_array_equal(ofx.restore(step)["params"]["w"], w)
  with ocp.CheckpointManager(run, item_names=("params",)) as mngr:
    got = mngr.restore(7, args=ocp.args.Composite(params=ocp.args.StandardRestore({"w": w})))
  np.testing.assert_array_equal(got["params"]["w"], w)


def test_export_orbax_refuses_a_device_array_of_a_dtype_zarr3_lacks_before_writing(tmp_path):
  """Kills F79 (the zarr3 dtype check skipped for jax.Arrays): a jax.Array of uint4 is a
  ValueError naming the leaf and the cast, raised before anything is written, not a
  StorageError from tensorstore halfway through the export."""
  d = str(tmp_path / "exported")
  tree = {"params": {"q": jax.numpy.array([1, 2, 3], jax.numpy.uint4), "w": jax.numpy.ones(2)}}
  with pytest.raises(ValueError, match=r"params/q: dtype uint4 cannot be stored in a zarr3 array"):
    ofx.export_orbax(d, tree)
  assert not os.path.exists(d)


# ---- defects found by the review, fixed

@pytest.mark.parametrize("nsecs", [10**30, 3 * 10**21])
def test_orbax_step_with_a_timestamp_beyond_any_date_is_reported_not_crashed_on(tmp_path, nsecs):
  """A crafted or damaged ``_CHECKPOINT_METADATA`` whose ``commit_timestamp_nsecs`` is past
  any date was accepted (only negative ones were refused); ``python -m orbax_flax show``
  and ``list`` then died with a traceback (OverflowError: timestamp out of range for
  platform time_t; ValueError: year 97036 is out of range) where a crafted file gives a
  clean report (EXIT_CORRUPT for ``show``, as for every crafted safetensors header)."""
  root = str(tmp_path / "run")
  step = _ocp_run(root, {"w": np.arange(3.0)})
  meta_path = os.path.join(step, "_CHECKPOINT_METADATA")
  meta = json.load(open(meta_path))
  meta["commit_timestamp_nsecs"] = nsecs
  json.dump(meta, open(meta_path, "w"))
  assert cli.main(["show", step], out=io.StringIO()) == cli.EXIT_CORRUPT
  assert isinstance(cli.main(["list", root], out=io.StringIO()), int)
