"""The manifest as it grows: listing reads the summary only, however long it is."""

import dataclasses
import os

import numpy as np

import orbax_flax as ofx


def _damage_body(path):
  """Flips the manifest's last byte (inside the body, far from the summary)."""
  with open(os.path.join(path, "_CHECKPOINT"), "r+b") as f:
    f.seek(-1, os.SEEK_END)
    last = f.read(1)
    f.seek(-1, os.SEEK_END)
    f.write(bytes([last[0] ^ 0x01]))


def test_a_long_summary_is_read_without_the_rest_of_the_manifest(tmp_path):
  """A summary longer than the first read (a large config in the metadata) costs one read of
  just the summary, not of the whole manifest (millions of chunk owners at 8,192 devices):
  damage in the body is not even seen by listing, and is by a restore."""
  config = {f"field_{i}": "x" * 40 for i in range(2000)}  # ~100 KB of JSON in the summary
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy()) as mngr:
    mngr.save(7, {"state": {"w": np.arange(8.0)}}, metrics={"loss": 0.25}, force=True,
              custom_metadata=config)
  _damage_body(str(tmp_path / "7"))
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy()) as mngr:
    info = mngr.step_info(7)
    assert info.metrics == {"loss": 0.25} and info.reason == "forced", info
    try:
      mngr.restore(7)
    except ofx.CheckpointCorruptedError as e:
      assert "checksum mismatch" in str(e), e
    else:
      raise AssertionError("the damaged body was not noticed by a restore")


def _layout(nproc, chunks, seed=0):
  """A manifest of one array of ``chunks`` chunks, owners spread over ``nproc`` processes."""
  rng = np.random.default_rng(seed)
  rec = {"path": ["w"], "kind": "jax", "name": "a0", "shape": [chunks * 2, 8], "dtype": "float32",
         "stored_dtype": "float32", "nbytes": chunks * 64, "chunk_shape": [2, 8],
         "owners": rng.integers(0, nproc, chunks).tolist(), "sharding": {"type": "host", "text": "-"}}
  small = {"path": ["b"], "kind": "jax", "name": "a1", "shape": [4, 8], "dtype": "float32",
           "stored_dtype": "float32", "nbytes": 128, "chunk_shape": [2, 8], "owners": [0, nproc - 1],
           "sharding": {"type": "host", "text": "-"}}
  return {"format": "orbax_flax", "version": 1, "library_version": "t", "created": 1.0,
          "process_count": nproc, "device_count": 8 * nproc, "all_chunks_stored": True,
          "generation": "0123456789abcdef", "custom": {},
          "items": {"s": {"structure": {"t": "dict", "k": ["b", "w"], "c": [
              {"t": "leaf", "i": 0}, {"t": "leaf", "i": 1}]}, "leaves": [small, rec], "packed": {}}}}


def test_many_chunk_owners_are_stored_compactly_and_decode_to_the_same_manifest():
  from orbax_flax.format import _manifest  # pylint: disable=g-import-not-at-top
  m = _layout(nproc=1024, chunks=8 * _manifest.COMPACT_OWNERS)
  compact = _manifest.encode(m)
  plain = _manifest.encode(m, compact_owners=1 << 62)  # the version 1 encoding of the same
  assert b'"version":2' in compact and b'"owners_z"' in compact and b'"version":1' in plain
  assert len(compact) < 0.7 * len(plain), (len(compact), len(plain))
  assert m["items"]["s"]["leaves"][1]["owners"] and "owners_z" not in m["items"]["s"]["leaves"][1]
  a, b = _manifest.decode(compact, "compact"), _manifest.decode(plain, "plain")
  assert (a.version, b.version) == (2, 1)
  assert dataclasses.replace(a, version=1) == b  # every reader sees the same records
  n = _manifest.COMPACT_OWNERS
  assert b"owners_z" in _manifest.encode(_layout(nproc=4, chunks=n))
  small = _manifest.encode(_layout(nproc=4, chunks=n - 1))  # fewer chunks: version 1, as before
  assert b'"version":1' in small and b"owners_z" not in small


def _rewrite_body(data, edit):
  """The manifest with its body changed by ``edit`` and the hashes made to match again."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  header, summary, body = data.split(b"\n", 2)
  parsed = json.loads(body)
  edit(parsed["items"]["s"]["leaves"][1])
  body = json.dumps(parsed, sort_keys=True, separators=(",", ":")).encode()
  fields = dict(f.split(b"=", 1) for f in header.split()[3:])
  fields[b"sha256"] = hashlib.sha256(body).hexdigest().encode()
  header = b"orbax_flax checkpoint v1 " + b" ".join(k + b"=" + v for k, v in fields.items())
  return header + b"\n" + summary + b"\n" + body


def test_crafted_compact_owners_are_refused():
  import base64  # pylint: disable=g-import-not-at-top
  import zlib  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  from orbax_flax.format import _manifest  # pylint: disable=g-import-not-at-top
  n = _manifest.COMPACT_OWNERS
  data = _manifest.encode(_layout(nproc=1024, chunks=n))

  def z(values, dtype="<u4"):
    return base64.b64encode(zlib.compress(np.asarray(values, dtype).tobytes())).decode()

  cases = {
      "not base64": lambda r: r.update(owners_z="!!!"),
      "not zlib": lambda r: r.update(owners_z=base64.b64encode(b"junk").decode()),
      "too few": lambda r: r.update(owners_z=z([0] * (n - 1))),
      "too many": lambda r: r.update(owners_z=z([0] * (n + 1))),
      "a bomb": lambda r: r.update(owners_z=z(np.zeros(64 * n, np.uint32))),
      "owner past the processes": lambda r: r.update(owners_z=z([1024] * n)),
      "both forms": lambda r: r.update(owners=[0] * n),
      "a huge grid": lambda r: r.update(shape=[1 << 40, 8]),
      "not a string": lambda r: r.update(owners_z=5),
  }
  for what, edit in cases.items():
    with pytest.raises(ofx.CheckpointCorruptedError, match="not written by orbax_flax"):
      _manifest.decode(_rewrite_body(data, edit), what)
