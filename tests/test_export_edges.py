"""Edges of ``export_orbax`` and ``export_safetensors``, read back by the real readers.

Each export here is read back by the package it is written for: orbax-checkpoint 0.12's
``StandardCheckpointer`` / ``CheckpointManager`` (what ``docs/interop.md`` promises restores
an ``export_orbax`` onto any mesh) and the ``safetensors`` package.
"""

import io
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file

import orbax_flax as ofx
from orbax_flax import cli


def _convert_to_orbax(src, dst, capsys):
  code = cli.main(["convert", src, dst, "--format", "orbax"], io.StringIO())
  return code, capsys.readouterr().err


def test_export_orbax_refuses_a_string_leaf_standard_checkpointer_cannot_restore(tmp_path,
                                                                                 capsys):
  """A string leaf was written (``_strings.json``) into an item labelled
  StandardCheckpointHandler, which can neither save nor restore strings: orbax's
  StandardCheckpointer then failed for every target ("Unsupported type: <class 'str'>" with
  the string, "tree structures do not match" without). It is refused before anything is
  written, naming each string leaf and the way around (leave it out with select=)."""
  state = {"params": {"w": np.arange(4, dtype=np.float32)}, "step": 7,
           "model_name": "lm-small", "cfg": {"act": "gelu"}}
  for step in (None, 7):
    with pytest.raises(ValueError, match=r"(?s)cfg/act: a string.*model_name: a string.*select="):
      ofx.export_orbax(str(tmp_path / "out"), state, step=step)
  assert not os.listdir(tmp_path)
  # convert --format orbax of a checkpoint holding a string: bad input (exit 2), naming it.
  src = str(tmp_path / "ckpt")
  ofx.save(src, {"state": state})
  code, err = _convert_to_orbax(src, str(tmp_path / "conv"), capsys)
  assert code == cli.EXIT_MISSING and "model_name: a string" in err, err
  assert "selector" in err and "StorageError" not in err, err
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]
  # The way around the message names; what is written restores with a target, as promised.
  item = ofx.export_orbax(str(tmp_path / "item"), state, select="params,step")
  run = str(tmp_path / "run")
  ofx.export_orbax(run, state, select="params,step", step=7)
  on = NamedSharding(jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]), P("x"))
  target = {"params": {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=on)}, "step": 0}
  with ocp.StandardCheckpointer() as c:
    got = c.restore(item, target)
  assert got["params"]["w"].tobytes() == state["params"]["w"].tobytes() and got["step"] == 7
  with ocp.CheckpointManager(run) as mgr:
    got = mgr.restore(7, args=ocp.args.StandardRestore(target))
  assert got["params"]["w"].tobytes() == state["params"]["w"].tobytes() and got["step"] == 7


def test_export_orbax_refuses_a_python_int_beyond_64_bits_naming_it_before_writing(tmp_path,
                                                                                   capsys):
  """``tokens_seen = 2**64 + 1`` (ofx.save keeps it) became a numpy object array, which failed
  in tensorstore as a StorageError after the temporary directory was made, naming neither the
  leaf nor the fix. It is a ValueError naming the leaf, before anything is written; ints that
  fit int64 or uint64 are written and restore through orbax as the same numbers."""
  for big in (2**64 + 1, -2**63 - 1):
    tree = {"params": {"w": np.ones(2, np.float32)}, "tokens_seen": big}
    with pytest.raises(ValueError, match=r"tokens_seen: the int .* 64 bits.*select="):
      ofx.export_orbax(str(tmp_path / "out"), tree)
    assert not os.listdir(tmp_path)
  src = str(tmp_path / "ckpt")
  ofx.save(src, {"state": {"params": {"w": np.ones(2, np.float32)}, "tokens_seen": 2**64 + 1}})
  code, err = _convert_to_orbax(src, str(tmp_path / "conv"), capsys)
  assert code == cli.EXIT_MISSING and "tokens_seen: the int" in err, err
  assert "StorageError" not in err and "failed (layout)" not in err, err
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]
  edges = {"w": np.ones(2, np.float32), "hi": 2**64 - 1, "lo": -2**63}
  path = ofx.export_orbax(str(tmp_path / "edges"), edges)
  with ocp.StandardCheckpointer() as c:
    got = c.restore(path, edges)
  assert got["hi"] == 2**64 - 1 and got["lo"] == -2**63


def _chunks(path, name):
  zarr = json.load(open(os.path.join(path, name, "zarr.json"), encoding="utf-8"))
  files = [f for _, _, fs in os.walk(os.path.join(path, name, "c")) for f in fs]
  return zarr["chunk_grid"]["configuration"]["chunk_shape"], len(files)


def _one_writer_each(x, chunk):
  """Every chunk of ``x`` lies inside one shard written (replica 0): no two writers share one."""
  owners = [[(s.start or 0, x.shape[d] if s.stop is None else s.stop)
             for d, s in enumerate(shard.index)] for shard in x.addressable_shards
            if shard.replica_id == 0]
  for origin in itertools.product(*(range(0, n, c) for n, c in zip(x.shape, chunk))):
    box = [(o, min(o + c, n)) for o, c, n in zip(origin, chunk, x.shape)]
    inside = [b for b in owners if all(lo <= a and z <= hi for (a, z), (lo, hi) in zip(box, b))]
    assert len(inside) == 1, (box, inside)


def test_export_orbax_cuts_a_prime_row_count_into_few_chunks_one_writer_each(tmp_path):
  """A dimension with a prime length, held whole by each shard (a numpy array, an unsharded
  dimension), was cut into chunks of one row, since a chunk's length had to divide it: a
  (32003, 1024) float32 array became 32,007 files. Along such a dimension a chunk is as long
  as the size limit allows, the last one partial (one shard holds it, so one writer); a
  dimension split across shards is still cut at its divisors. orbax restores both bitwise."""
  host = np.arange(1009 * 16, dtype=np.float32).reshape(1009, 16)  # 1009 is prime
  path = ofx.export_orbax(str(tmp_path / "host"), {"x": host}, max_chunk_bytes=4096)
  chunk, files = _chunks(path, "x")
  assert chunk == [64, 16] and files == -(-1009 // 64) == 16, (chunk, files)
  with ocp.StandardCheckpointer() as c:
    assert c.restore(path)["x"].tobytes() == host.tobytes()
  # Rows held whole by every shard, columns split over 8 devices: rows by the limit, columns
  # at the shard's edges.
  mesh = jax.make_mesh((8,), ("all",))
  x = jax.device_put(jnp.arange(101 * 64, dtype=jnp.float32).reshape(101, 64),
                     NamedSharding(mesh, P(None, "all")))  # shards of (101, 8)
  path = ofx.export_orbax(str(tmp_path / "sharded"), {"x": x}, max_chunk_bytes=320)
  chunk, files = _chunks(path, "x")
  assert chunk == [10, 8] and files == 11 * 8, (chunk, files)
  _one_writer_each(x, chunk)
  other = NamedSharding(jax.make_mesh((4,), ("all",), devices=jax.devices()[4:]), P(None, "all"))
  with ocp.StandardCheckpointer() as c:
    got = c.restore(path, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other)})
  assert got["x"].sharding == other and np.asarray(got["x"]).tobytes() == np.asarray(x).tobytes()
  # A dimension split over shards keeps chunks that divide the shard: 32 rows per shard.
  y = jax.device_put(jnp.ones((64, 12), jnp.float32), NamedSharding(
      jax.make_mesh((2, 4), ("data", "model")), P("data", None)))
  chunk, _ = _chunks(ofx.export_orbax(str(tmp_path / "split"), {"y": y}, max_chunk_bytes=480),
                     "y")
  assert chunk == [8, 12], chunk
  # Split into shards of a prime length (13 rows): no divisor but 1, so not one-row chunks
  # (104 files) but the shard's 13 rows and the columns cut by the limit, each chunk in one
  # shard.
  z = jax.device_put(jnp.arange(104 * 64, dtype=jnp.float32).reshape(104, 64),
                     NamedSharding(mesh, P("all", None)))
  path = ofx.export_orbax(str(tmp_path / "prime"), {"z": z}, max_chunk_bytes=1024)
  chunk, files = _chunks(path, "z")
  assert chunk == [13, 19] and files == 8 * 4, (chunk, files)
  _one_writer_each(z, chunk)
  with ocp.StandardCheckpointer() as c:
    got = c.restore(path, {"z": jax.ShapeDtypeStruct(z.shape, z.dtype, sharding=other)})
  assert np.asarray(got["z"]).tobytes() == np.asarray(z).tobytes()


def test_export_safetensors_writes_big_endian_numpy_arrays_in_little_endian(tmp_path):
  """A '>f4' or '>i8' numpy array (what FITS, netCDF and HDF5 readers hand back) was refused
  ("safetensors cannot store >f4"), advising dtype=, which does nothing for integers. It is
  written as the little-endian dtype safetensors names (F32, I64), its bytes swapped."""
  tree = {"w": (np.arange(6, dtype=">f4") / 7).reshape(2, 3), "ids": np.arange(3, dtype=">i8"),
          "h": np.array([1.5, -2.0], dtype=">f2"), "flags": np.array([True, False])}
  d = str(tmp_path / "st")
  ofx.export_safetensors(d, tree)
  file = os.path.join(d, "model.safetensors")
  back = load_file(file)
  for k, v in tree.items():
    assert back[k].dtype == v.dtype.newbyteorder("<") and back[k].tobytes() == v.astype(
        v.dtype.newbyteorder("<")).tobytes(), k
    np.testing.assert_array_equal(back[k], v)
  with safe_open(file, framework="numpy") as f:
    assert f.get_slice("ids").get_dtype() == "I64" and f.get_slice("w").get_dtype() == "F32"
  np.testing.assert_array_equal(ofx.restore(d)["params"]["ids"], tree["ids"])
  # One dtype for the tree converts the floating ones, from big-endian too.
  ofx.export_safetensors(str(tmp_path / "bf16"), tree, dtype="bfloat16")
  back = load_file(str(tmp_path / "bf16" / "model.safetensors"))
  assert back["w"].dtype == jnp.bfloat16 and back["ids"].dtype == np.int64
  np.testing.assert_array_equal(back["w"], tree["w"].astype(jnp.bfloat16))


def test_convert_streams_arrays_in_slabs_of_rows_and_writes_every_row_once(tmp_path, monkeypatch):
  """convert reads, casts and writes an array a slab of rows at a time (``SLAB_BYTES``): with
  slabs of 4 KiB, row counts that no slab divides (a remainder slab), a row larger than a
  slab (one row a slab), a 0-d and an empty array come back equal in safetensors and through
  orbax-checkpoint, cast to bfloat16."""
  from orbax_flax.engine import converting  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(converting, "SLAB_BYTES", 4096)
  rng = np.random.default_rng(0)
  state = {"rem": rng.standard_normal((1031, 7), dtype=np.float32),  # 146 rows a slab, 7 slabs
           "wide": rng.standard_normal((3, 2000), dtype=np.float32),  # 8000-byte rows
           "ints": np.arange(5000, dtype=np.int64).reshape(1000, 5),  # not cast
           "scalar": np.array(3.5, np.float32), "empty": np.zeros((0, 4), np.float32)}
  src = str(tmp_path / "ck")
  ofx.save(src, {"s": state})
  want = {k: (np.asarray(v).astype(jnp.bfloat16) if np.asarray(v).dtype.kind == "f"
              else np.asarray(v)) for k, v in state.items()}
  st = ofx.convert(src, str(tmp_path / "st"), format="safetensors", dtype="bfloat16")
  assert "safetensors" in st
  got = {}
  for f in os.listdir(tmp_path / "st"):
    if f.endswith(".safetensors"):
      with safe_open(str(tmp_path / "st" / f), framework="numpy") as fh:
        got.update({k: np.asarray(fh.get_tensor(k)) for k in fh.keys()})
  for k, v in want.items():
    assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
    np.testing.assert_array_equal(got[k], v)
  ofx.convert(src, str(tmp_path / "ob"), format="orbax", dtype="bfloat16")
  back = ocp.StandardCheckpointer().restore(str(tmp_path / "ob"))
  for k, v in want.items():
    assert np.asarray(back[k]).dtype == v.dtype, k
    np.testing.assert_array_equal(np.asarray(back[k]), v)
