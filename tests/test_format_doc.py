"""docs/format.md is enough to read a checkpoint: a reader using only tensorstore and json."""

import base64
import hashlib
import json
import math
import os

import numpy as np
import pytest
import tensorstore as ts

import jobs
import orbax_flax as ofx


def _manifest(path):
  """Lines, hashes and versions exactly as docs/format.md states them."""
  with open(os.path.join(path, "_CHECKPOINT"), "rb") as f:
    header, summary, body = f.read().split(b"\n", 2)
  assert header.startswith(b"orbax_flax checkpoint v1 ")
  fields = dict(x.split("=", 1) for x in header.decode().split()[3:])
  assert fields["summary_sha256"] == hashlib.sha256(summary).hexdigest()
  assert fields["sha256"] == hashlib.sha256(body).hexdigest()
  summary, body = json.loads(summary), json.loads(body)
  assert summary["format"] == body["format"] == "orbax_flax"
  assert summary["version"] == body["version"] == 1
  return summary, body


def _value(v):
  t = v["t"]
  if t == "int":
    return int(v["v"])
  if t == "float":
    return float.fromhex(v["v"])
  if t == "str":
    return v["v"]
  if t == "np":
    return np.frombuffer(base64.b64decode(v["b64"]), dtype=v["dtype"])[0]
  raise AssertionError(t)


def _open(path, item, owner, gen, name):
  kv = {"driver": "ocdbt", "base": f"file://{path}/{item}/p{owner}-{gen}/", "path": f"{name}/"}
  return ts.open({"driver": "zarr3", "kvstore": kv}, open=True, read=True).result()


def _read_array(path, item, gen, leaf, packed_sizes):
  stored = np.dtype(leaf["stored_dtype"])
  shape = tuple(leaf["shape"])
  if "packed_offset" in leaf:
    buf = _open(path, item, leaf["owners"][0], gen, "packed")
    assert buf.shape == (packed_sizes[str(leaf["owners"][0])],)
    lo = leaf["packed_offset"]
    raw = buf[lo:lo + leaf["nbytes"]].read().result()
    return np.frombuffer(raw.tobytes(), stored).reshape(shape)
  out = np.empty(shape, stored)
  chunk = tuple(leaf["chunk_shape"])
  grid = [math.ceil(s / c) for s, c in zip(shape, chunk)]
  stores = {}
  for c, owner in enumerate(leaf["owners"]):
    coords = np.unravel_index(c, grid) if grid else ()
    box = tuple(slice(i * k, min((i + 1) * k, s)) for i, k, s in zip(coords, chunk, shape))
    if owner not in stores:
      stores[owner] = _open(path, item, owner, gen, leaf["name"])
    out[box] = stores[owner][box].read().result()
  return out


def _rebuild(structure, leaves):
  t = structure["t"]
  if t == "leaf":
    return leaves[structure["i"]]
  if t == "none":
    return None
  children = [_rebuild(c, leaves) for c in structure["c"]]
  if t in ("list", "tuple"):
    return children
  return dict(zip(structure["k"], children))


def read_by_the_document(path):
  summary, body = _manifest(path)
  gen = summary["generation"]
  out = {}
  for item, saved in body["items"].items():
    leaves = []
    for leaf in saved["leaves"]:
      if leaf["kind"] == "value":
        leaves.append(_value(leaf["value"]))
      else:
        data = _read_array(path, item, gen, leaf, saved.get("packed", {}))
        if data.dtype.name != leaf["dtype"]:
          data = data.view(ofx.core._tree.dtype_from_name(leaf["dtype"]))  # the same bits
        leaves.append(data)
    out[item] = _rebuild(saved["structure"], leaves)
  return summary, out


def test_a_reader_following_the_document_gets_every_value(tmp_path):
  import ml_dtypes
  state = {"w": np.arange(24, dtype=np.float32).reshape(4, 6),
           "big": np.random.default_rng(0).standard_normal((600, 700)).astype(np.float32),
           "bf": np.arange(8).astype(ml_dtypes.bfloat16), "i4": np.arange(6).astype(ml_dtypes.int4),
           "step": 3, "name": "run", "layers": [np.ones(2, np.int64), np.zeros(3, np.int8)]}
  path = str(tmp_path / "ckpt")
  ofx.save(path, {"state": state, "extra": {"lr": 0.5}})
  summary, got = read_by_the_document(path)
  assert summary["process_count"] == 1
  assert got["extra"] == {"lr": 0.5}
  s = got["state"]
  assert s["step"] == 3 and s["name"] == "run"
  for k in ("w", "big", "bf", "i4"):
    np.testing.assert_array_equal(np.asarray(s[k]).astype(np.float32), state[k].astype(np.float32))
  np.testing.assert_array_equal(s["layers"][1], state["layers"][1])


def test_document_reader_on_a_two_process_checkpoint(tmp_path):
  path = str(tmp_path / "ckpt")
  jobs.run("engine_worker.py", ["--mode=save", f"--path={path}", "--mesh=2,4"], 2, 4).check()
  _, got = read_by_the_document(path)
  restored = ofx.restore(path)
  checked = 0
  for k, v in restored["state"].items():
    if isinstance(v, np.ndarray):
      np.testing.assert_array_equal(np.asarray(got["state"][k]).reshape(-1).view(np.uint8),
                                    np.asarray(v).reshape(-1).view(np.uint8), err_msg=k)
      checked += 1
  assert checked >= 8


def test_newer_format_version_names_both_versions(tmp_path):
  path = str(tmp_path / "ckpt")
  ofx.save(path, {"s": {"x": np.ones(3)}})
  f = os.path.join(path, "_CHECKPOINT")
  header, summary, body = open(f, "rb").read().split(b"\n", 2)
  body = body.replace(b'"version":1', b'"version":4')
  header = (b"orbax_flax checkpoint v1 summary_sha256=" + hashlib.sha256(summary).hexdigest().encode()
            + b" sha256=" + hashlib.sha256(body).hexdigest().encode())
  open(f, "wb").write(header + b"\n" + summary + b"\n" + body)
  with pytest.raises(ofx.errors.CheckpointFormatError, match=r"version 4.*newer.*reads format versions 1, 2, 3"):
    ofx.restore(path)
