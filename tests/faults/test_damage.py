"""Every file of a checkpoint damaged every way; crafted manifests; names that try to escape.

A damaged checkpoint gives CheckpointCorruptedError or CheckpointNotFoundError
naming what is wrong: never wrong values, never another exception type.
"""

import base64
import json
import os
import random
import re
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_flax as ofx
from orbax_flax.format import _manifest

LONG = os.environ.get("ORBAX_FLAX_FAULTS") == "long"


def _state():
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(0)
  big = rng.standard_normal((1024, 2048), dtype=np.float32)  # 8 MiB: chunked, several chunks
  return {"params": {"big": jax.device_put(big, NamedSharding(mesh, P("data", "model"))),
                     "small": rng.standard_normal((64, 64), dtype=np.float32),  # packed
                     "step": 7},
          "opt": {"mu": np.arange(1000, dtype=np.int64)}}


def _expected():
  s = _state()
  return {"params": {"big": np.asarray(s["params"]["big"]), "small": s["params"]["small"], "step": 7},
          "opt": {"mu": s["opt"]["mu"]}}


def _files(path):
  return sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs)


def _damage(file, how, rng):
  size = os.path.getsize(file)
  if how == "delete":
    os.remove(file)
  elif how == "truncate":
    with open(file, "r+b") as f:
      f.truncate(size // 2)
  elif how == "zero":
    with open(file, "r+b") as f:
      f.write(b"\0" * size)
  elif how == "flip":
    with open(file, "r+b") as f:
      pos = rng.randrange(size)
      f.seek(pos)
      b = f.read(1)
      f.seek(pos)
      f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))


def _outcome(path):
  """'ok' (and the values are right), or the error type; anything else fails the test."""
  try:
    got = ofx.restore(path)
  except (ofx.CheckpointCorruptedError, ofx.CheckpointNotFoundError) as e:
    assert len(str(e)) > 40, str(e)  # it says what is wrong
    return type(e).__name__
  exp = _expected()
  np.testing.assert_array_equal(got["params"]["big"], exp["params"]["big"])
  np.testing.assert_array_equal(got["params"]["small"], exp["params"]["small"])
  np.testing.assert_array_equal(got["opt"]["mu"], exp["opt"]["mu"])
  assert got["params"]["step"] == 7
  return "ok"


@pytest.mark.parametrize("how", ["delete", "truncate", "zero", "flip"])
def test_every_file_damaged_every_way(tmp_path, how):
  pristine = str(tmp_path / "pristine")
  ofx.save(pristine, _state())
  rng = random.Random(how)
  outcomes = {}
  for rel in _files(pristine):
    for trial in range(3 if how == "flip" and LONG else 1):
      path = str(tmp_path / "c")
      shutil.rmtree(path, ignore_errors=True)
      shutil.copytree(pristine, path)
      _damage(os.path.join(path, rel), how, rng)
      outcomes[(rel, trial)] = _outcome(path)
  # Array data and the manifest are always caught; only bytes no reader needs (a zarr.json
  # that the direct reader does not open) may be damaged harmlessly, and then the values are right.
  for (rel, _), outcome in outcomes.items():
    if rel == "_CHECKPOINT" or rel.endswith("manifest.ocdbt"):
      assert outcome != "ok", (rel, outcome)
  assert any(o != "ok" for o in outcomes.values())


def test_verify_names_every_damaged_array(tmp_path):
  path = str(tmp_path / "c")
  ofx.save(path, _state())
  data = max((os.path.join(path, f) for f in _files(path) if "/d/" in f), key=os.path.getsize)
  _damage(data, "flip", random.Random(0))
  with pytest.raises(ofx.CheckpointCorruptedError, match=r"params|opt"):
    ofx.verify(path)


def _rewrite_manifest(path, edit):
  """Applies ``edit`` to the manifest and re-signs it: what a crafted checkpoint looks like."""
  m = os.path.join(path, "_CHECKPOINT")
  _manifest.decode(open(m, "rb").read(), m)  # intact, before the edit
  _, summary, body = open(m, "rb").read().split(b"\n", 2)
  manifest = dict(json.loads(summary), items=json.loads(body)["items"])
  edit(manifest)
  body = _manifest._dumps({"format": _manifest.FORMAT, "version": manifest.pop("version_override", 1),  # pylint: disable=protected-access
                            "items": manifest["items"]})
  summary = _manifest._dumps({k: v for k, v in manifest.items() if k != "items"})  # pylint: disable=protected-access
  header = _manifest._MAGIC + (f"summary_sha256={_manifest._sha(summary)} sha256={_manifest._sha(body)}").encode()  # pylint: disable=protected-access
  open(m, "wb").write(header + b"\n" + summary + b"\n" + body)


def test_a_manifest_of_a_future_format_version_names_both_versions(tmp_path):
  path = str(tmp_path / "c")
  ofx.save(path, {"s": {"x": np.arange(3)}})
  _rewrite_manifest(path, lambda m: m.update(version_override=4))
  with pytest.raises(ofx.CheckpointCorruptedError, match=r"format version 4 \(by a newer orbax_flax\);"
                                                         r" this orbax_flax reads format versions 1, 2, 3"):
    ofx.restore(path)
  with pytest.raises(ofx.CheckpointCorruptedError, match="Upgrade orbax_flax"):
    ofx.metadata(path)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m["items"].__setitem__("../../escape", m["items"].pop("s")), "item name"),
    (lambda m: m.__setitem__("generation", "../../../etc"), "generation"),
    (lambda m: m["items"]["s"]["leaves"][0].__setitem__("name", "../../x"), "array name"),
    (lambda m: m["items"]["s"]["leaves"][0].__setitem__("dtype", "object"), "dtype"),
    (lambda m: m["items"]["s"]["leaves"][0].__setitem__("owners", [5]), "owners"),
    (lambda m: m["items"]["s"]["leaves"][1].__setitem__(
        "value", {"t": "np", "dtype": "object", "b64": base64.b64encode(b"x" * 8).decode()}), "dtype"),
    (lambda m: m["items"]["s"]["leaves"][1].__setitem__("value", {"t": "pickle", "v": "..."}), "unknown type"),
    # (a time datetime cannot hold: `show` died with a raw OverflowError printing it)
    (lambda m: m.__setitem__("created", 1e30), "created"),
])
def test_crafted_manifests_are_refused_before_anything_is_read(tmp_path, edit, match):
  """Intact hashes do not make a manifest trusted: names become paths, dtypes become buffers."""
  path = str(tmp_path / "c")
  ofx.save(path, {"s": {"a": np.arange(1 << 18, dtype=np.float32), "v": 3}})
  _rewrite_manifest(path, edit)
  with pytest.raises(ofx.CheckpointCorruptedError, match=match):
    ofx.restore(path)


def test_nothing_from_a_checkpoint_is_executed():
  """No pickle, marshal, eval or exec anywhere in the library; structure decodes to plain data."""
  root = os.path.dirname(ofx.__file__)
  for dirpath, _, files in os.walk(root):
    for f in files:
      if f.endswith(".py"):
        text = open(os.path.join(dirpath, f)).read()
        for word in ("import pickle", "pickle.load", "marshal", "__import__"):
          assert word not in text, (f, word)
        # bare eval/exec (ast.literal_eval only parses literals: allowed)
        assert not re.search(r"(?<![\w.])(eval|exec)\(", text), f
  from orbax_flax.core import _tree  # pylint: disable=g-import-not-at-top
  tree = _tree.decode_structure({"t": "node", "type": "os.system", "k": ["a"], "c": [{"t": "leaf", "i": 0}]},
                                ["rm -rf /"])
  assert tree == {"a": "rm -rf /"}  # a node type is a name, never looked up


def test_keys_and_item_names_cannot_escape_or_collide(tmp_path):
  path = str(tmp_path / "c")
  tricky = {"../x": np.ones(3), "/abs/path": np.ones(2), "_CHECKPOINT": np.zeros(4), "a/b": 1,
            "..": "dots"}
  ofx.save(path, {"s": tricky})
  assert sorted(os.listdir(tmp_path)) == ["c"]  # nothing written beside it
  assert os.path.getsize(os.path.join(path, "_CHECKPOINT")) > 0
  got = ofx.restore(path)["s"]
  assert sorted(got) == sorted(tricky)
  np.testing.assert_array_equal(got["_CHECKPOINT"], np.zeros(4))
  for bad in ("../x", "/abs", "_CHECKPOINT", "a/b", ".hidden", ""):
    with pytest.raises(ValueError, match="invalid item name"):
      ofx.save(str(tmp_path / "d"), {bad: {"x": 1}})
  assert not os.path.exists(tmp_path / "d")
