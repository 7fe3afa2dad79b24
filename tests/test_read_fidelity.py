"""A restore returns the saved values or raises: what the read path's mutation review found untested.

Each test here failed to fail on a mutant of the read path that returned wrong values (or a
wrong shape, or a lossy cast) without an error, while the rest of the suite passed:
a chunk's checksum not compared (read in place, or streamed for packed small arrays), a
target of another shape with as many elements, a lossy cast between 16-bit floats,
overlapping packed arrays in a manifest, and chunks of a column-sharded array placed by the
wrong box. Real files, real tensorstore; the damage is done to the bytes on disk.
"""

import hashlib
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_flax as ofx
from disks import flip_a_bit_in_the_largest_data_file


@pytest.mark.parametrize("how", ["one array read in place", "packed small arrays"])
def test_a_flipped_bit_in_a_chunk_fails_the_restore(tmp_path, how):
  """The chunk's CRC-32C is compared on both read paths: an array's chunk read straight into
  the result, and the streamed buffer of packed small arrays."""
  path = str(tmp_path / "c")
  if how == "one array read in place":
    state = {"params": {"w": np.arange(1 << 20, dtype=np.float32)}}
  else:
    state = {"params": {f"b{i}": np.arange(1000, dtype=np.float32) + i for i in range(64)}}
  ofx.save(path, state)
  flip_a_bit_in_the_largest_data_file(path, mask=0xFF)
  target = {"params": {k: np.zeros_like(v) for k, v in state["params"].items()}}
  with pytest.raises(ofx.CheckpointCorruptedError):
    ofx.restore(path, target)


def test_a_target_of_another_shape_with_as_many_elements_is_refused(tmp_path):
  path = str(tmp_path / "c")
  ofx.save(path, {"s": {"x": np.arange(512 * 256, dtype=np.float32).reshape(512, 256)}})
  with pytest.raises(ofx.TreeMismatchError, match=r"shape"):
    ofx.restore(path, {"s": {"x": np.zeros((256, 512), np.float32)}})


def test_a_lossy_cast_between_16_bit_floats_is_refused_unless_allowed(tmp_path):
  """bfloat16 -> float16 loses the range (1e30 overflows, 7e-39 underflows): refused without
  allow_lossy_casts, as any lossy cast."""
  path = str(tmp_path / "c")
  saved = np.array([1e30, 3.0, 7e-39], ml_dtypes.bfloat16)
  ofx.save(path, {"s": {"x": saved}})
  with pytest.raises(ofx.TreeMismatchError):
    ofx.restore(path, {"s": {"x": np.zeros(3, np.float16)}})
  got = ofx.restore(path, {"s": {"x": np.zeros(3, np.float16)}}, allow_lossy_casts=True)
  assert got["s"]["x"].dtype == np.float16 and got["s"]["x"][1] == 3.0


def test_overlapping_packed_arrays_in_a_manifest_are_refused(tmp_path):
  """A crafted manifest (its hashes made again) pointing one packed array into another's bytes
  and shrinking the buffer to match: refused, never one array's bytes under another's name."""
  path = str(tmp_path / "c")
  names = "abcdef"
  ofx.save(path, {"s": {n: np.full(1 << 18, i, np.float32) for i, n in enumerate(names)}})
  file = os.path.join(path, "_CHECKPOINT")
  with open(file, "rb") as f:
    _, line, body = f.read().split(b"\n", 2)
  summary, body = json.loads(line), json.loads(body)
  item = body["items"]["s"]
  by_offset = {rec["packed_offset"]: rec for rec in item["leaves"]
               if rec and "packed_offset" in rec}
  mib = 1 << 20
  assert sorted(by_offset) == [i * mib for i in range(6)], sorted(by_offset)
  by_offset[4 * mib]["packed_offset"] = 3 * mib  # e over d
  by_offset[5 * mib]["packed_offset"] = 4 * mib
  item["packed"] = {k: 5 * mib for k in item["packed"]}
  dump = lambda d: json.dumps(d, sort_keys=True, separators=(",", ":"),  # noqa: E731
                              allow_nan=True).encode()
  line2, body2 = dump(summary), dump(body)
  with open(file, "wb") as f:
    f.write(b"orbax_flax checkpoint v1 " + (
        f"summary_sha256={hashlib.sha256(line2).hexdigest()}"
        f" sha256={hashlib.sha256(body2).hexdigest()}").encode() + b"\n" + line2 + b"\n" + body2)
  with pytest.raises(ofx.CheckpointFormatError):
    ofx.restore(path)


def test_an_array_sharded_by_columns_restores_onto_any_layout(tmp_path):
  """2 MiB, over the packing limit, so its chunks (column slabs) are read and scattered as
  chunks; the resharding test's arrays are small enough to be packed and never took this
  path."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  w = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)
  path = str(tmp_path / "c")
  ofx.save(path, {"params": {"w": jax.device_put(w, NamedSharding(mesh, P(None, "x")))}})
  two = Mesh(np.array(jax.devices()[:2]), ("y",))
  for name, target in [
      ("numpy", np.zeros_like(w)),
      ("one device", jax.device_put(np.zeros_like(w), jax.devices()[0])),
      ("rows", jax.device_put(np.zeros_like(w), NamedSharding(mesh, P("x", None)))),
      ("rows of 2", jax.device_put(np.zeros_like(w), NamedSharding(two, P("y", None)))),
  ]:
    got = np.asarray(ofx.restore(path, {"params": {"w": target}})["params"]["w"])
    assert np.array_equal(got, w), (name, int((got != w).sum()))
