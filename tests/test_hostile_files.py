"""Hostile and foreign files: a crafted file gives a clean error or exactly what was saved.

Every file a reader takes from a checkpoint (a safetensors header and index,
orbax-checkpoint's ``_METADATA``, ``_sharding`` and ``_CHECKPOINT_METADATA``,
our own manifest) names offsets, shapes and paths that a bug or an attacker
chose. The regression tests below turn each reported crafted file into a
check through the public API; the property tests (hypothesis) mutate valid
files, field by field and byte by byte, and assert for every mutation:

* the readers (``restore``, ``metadata``) either raise an orbax_flax error
  (a ``CheckpointError``) or return exactly the saved values: never other
  values, never a raw ``ValueError``/``OSError``/``KeyError``/...;
* nothing outside the checkpoint directory is read: a sentinel checkpoint
  next to it holds the value ``SENTINEL``, which must never come back, and a
  Python audit hook records every file opened under its directory (tensorstore
  opens files in C++, unseen by the hook: the sentinel values cover those).

For safetensors the safetensors package is the reference: when it loads a
mutated file, our values must be its values. Sizes (shapes, chunk shapes,
owner counts up to a million chunks, stated consistently) are refused before
anything is allocated; a symbolic link anywhere in a checkpoint is refused.

A few hundred examples per reader by default; ``ORBAX_FLAX_FAULTS=long`` runs
thousands.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import orbax_flax as ofx
from orbax_flax import cli

LONG = os.environ.get("ORBAX_FLAX_FAULTS") == "long"
SENTINEL = 1234.5  # the value every array outside the checkpoint holds
_SETTINGS = settings(max_examples=3000 if LONG else 200, deadline=None, derandomize=True,
                     database=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.function_scoped_fixture])


class _Opens:
  """Records the files Python opens under ``root`` while ``active`` (an audit hook).

  Audit hooks cannot be removed: after its module the hook stays, inactive.
  """

  def __init__(self, root: str):
    self.root = os.path.realpath(root) + os.sep
    self.active = False
    self.seen: list[str] = []

  def __call__(self, event: str, args: tuple) -> None:
    if self.active and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
      path = os.fsdecode(args[0])
      if os.path.realpath(path).startswith(self.root):
        self.seen.append(path)


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
  """A directory beside the checkpoints, holding sentinel files in every format."""
  root = tmp_path_factory.mktemp("outside")
  value = np.full(4, SENTINEL, np.float32)
  save_file({"w": value, "secret": value}, str(root / "s.safetensors"))
  ck = ocp.StandardCheckpointer()
  ck.save(str(root / "victim"), {"weights_matrix": np.full((2, 3), SENTINEL, np.float32),
                                 "bias_vector": np.full(3, SENTINEL, np.float32)})
  ck.wait_until_finished()
  ofx.save(str(root / "ours"), {"state": {"weights_matrix": value}})
  opens = _Opens(str(root))
  sys.addaudithook(opens)
  yield str(root), opens
  opens.active = False


def _leaves(tree: Any) -> dict[str, Any]:
  """``{"a/b": leaf}`` for every leaf of a restored tree (dicts, lists, tuples)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    out["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = leaf
  return out


def _same_leaf(a: Any, b: Any) -> bool:
  if isinstance(a, (np.ndarray, np.generic, jax.Array)) or isinstance(b, (np.ndarray, np.generic, jax.Array)):
    if _is_key(a) != _is_key(b) or (_is_key(a) and a.dtype != b.dtype):
      return False
    a, b = _host(a), _host(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
  return type(a) is type(b) and a == b


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host(x: Any) -> np.ndarray:
  """A host copy (a PRNG key array as its key data)."""
  return np.asarray(jax.random.key_data(x) if _is_key(x) else x)


def _no_sentinel(tree: Any) -> None:
  for path, leaf in _leaves(tree).items():
    if isinstance(leaf, (np.ndarray, np.generic, jax.Array)):
      arr = _host(leaf)
      if arr.dtype.kind == "f":
        assert not np.any(arr == SENTINEL), f"{path} holds the sentinel: read from outside"


def _outcome(read: Callable[[], Any], opens: _Opens) -> Any:
  """``read()``'s value, or None if it raised an orbax_flax error; any other exception fails."""
  opens.active, opens.seen = True, []
  try:
    got = read()
    event("read back")
    return got
  except ofx.CheckpointError as e:
    event(f"refused: {type(e).__name__}")
    return None
  finally:
    opens.active = False
    assert not opens.seen, f"opened files outside the checkpoint: {opens.seen}"


def check_file_mutation(file: str, data: bytes, read: Callable[[], Any], expected: Any,
                        opens: _Opens, subset: bool = False, exact: bool = True) -> None:
  """Writes ``data`` into ``file``, reads, restores the file; asserts the property above.

  Args:
    expected: the tree read from the unmutated checkpoint.
    subset: the reader may return fewer leaves (a format without a checksum
      over its list of leaves); those it returns must still be exact.
    exact: False where the mutation may change what the file legitimately
      says (only: a clean error or a value, nothing outside).
  """
  original = open(file, "rb").read()
  try:
    with open(file, "wb") as f:
      f.write(data)
    got = _outcome(read, opens)
  finally:
    with open(file, "wb") as f:
      f.write(original)
  if got is None:
    return
  _no_sentinel(got)
  if not exact:
    return
  got_leaves, want = _leaves(got), _leaves(expected)
  if subset:
    assert set(got_leaves) <= set(want), sorted(set(got_leaves) - set(want))
  else:
    assert sorted(got_leaves) == sorted(want)
  for path, leaf in got_leaves.items():
    assert _same_leaf(leaf, want[path]), (path, leaf, want[path])


def check_local_tier_index(index_path: str, read: Callable[[], Any], expected: Any,
                           opens: _Opens) -> None:
  """The hook for the local tier's index (``orbax_flax/tiers/``, changed elsewhere).

  Runs the byte-level and (where the index parses as JSON) field-level
  mutations of this module on the file at ``index_path`` with the same
  property: ``read()`` (e.g. a manager's restore that may fall back to the
  persistent tier) gives a clean orbax_flax error or exactly ``expected``, and
  opens nothing under the sentinel directory. Call it from a test of this
  module with a local-tier checkpoint once the tier's index format settles.
  """
  original = open(index_path, "rb").read()

  @_SETTINGS
  @given(ops=_byte_ops, edit=_json_edit)
  def run(ops, edit):
    data = _apply_bytes(original, ops)
    try:
      parsed = json.loads(original)
    except ValueError:
      parsed = None
    if parsed is not None and edit is not None:
      data = _dumps(_apply_json(parsed, edit)[0])
    check_file_mutation(index_path, data, read, expected, opens)

  run()


# ---------------------------------------------------------------------------
# Mutations

# Strings a crafted file would use: paths out of the directory, names of other
# leaves' kinds, dtypes, empty and odd names.
_NASTY_STRINGS = ["..", ".", "", "/", "../outside", "../../outside/victim", "../s.safetensors",
                  "../outside/s.safetensors", "a/b", "\\", "\x00", "nul\x00.safetensors",
                  "F32", "I32", "U8", "F64", "BF16", "bfloat16", "float32", "int32", "uint32",
                  ">f4", "object", "U10", "a0", "a1", "a2", "default", "scalar", "string",
                  "np.ndarray", "jax.Array", "None", "threefry2x32", "rbg", "leaf", "dict",
                  "namedtuple", "0", "1", "01", "state", "extra", "x" * 300]
_NASTY_INTS = [-1, 0, 1, 2, 3, 7, 8, 16, 4096, 2**31, 2**32, 2**53, 2**62, 2**63, 2**64, -2**63,
               10**30]


def _nasty_values():
  scalar = st.one_of(st.sampled_from(_NASTY_INTS), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                     st.sampled_from(_NASTY_STRINGS), st.text(max_size=6))
  return st.one_of(scalar, st.lists(st.one_of(st.sampled_from(_NASTY_INTS), st.integers(-4, 12)),
                                    max_size=4),
                   st.dictionaries(st.sampled_from(_NASTY_STRINGS), scalar, max_size=2))


# One field-level edit: (which node, counted in document order), an action and a value.
_json_edit = st.one_of(st.none(), st.tuples(
    st.integers(0, 10_000), st.sampled_from(["replace", "nudge", "delete", "rename", "append"]),
    _nasty_values(), st.integers(-20, 20)))

# Byte-level edits: (op, position, bytes).
_byte_ops = st.lists(st.tuples(st.sampled_from(["set", "insert", "delete", "truncate"]),
                               st.integers(0, 1 << 20), st.binary(min_size=1, max_size=4)),
                     min_size=1, max_size=3)


def _apply_bytes(data: bytes, ops, within: int | None = None) -> bytes:
  buf = bytearray(data)
  for op, pos, b in ops:
    n = len(buf) if within is None else min(within, len(buf))
    at = pos % max(n, 1)
    if op == "set":
      buf[at:at + len(b)] = b
    elif op == "insert":
      buf[at:at] = b
    elif op == "delete":
      del buf[at:at + len(b)]
    else:
      del buf[at:]
  return bytes(buf)


def _nodes(doc: Any) -> list[tuple[Any, Any, tuple]]:
  """Every (container, key, path from the root) of a JSON document, in document order."""
  out, todo = [], [(doc, ())]
  while todo:
    node, path = todo.pop(0)
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
      out.append((node, k, path + (k,)))
      todo.append((v, path + (k,)))
  return out


def _apply_json(doc: Any, edit) -> tuple[Any, tuple]:
  """A copy of ``doc`` with one edit applied (to the n-th node, modulo their number), and
  the path of the node edited."""
  doc = json.loads(json.dumps(doc))
  nodes = _nodes(doc)
  if not nodes or edit is None:
    return doc, ()
  index, action, value, delta = edit
  node, key, path = nodes[index % len(nodes)]
  old = node[key]
  if action == "nudge" and isinstance(old, int) and not isinstance(old, bool):
    node[key] = old + delta
  elif action == "delete":
    del node[key]
  elif action == "rename" and isinstance(node, dict) and isinstance(value, str):
    del node[key]
    node[value] = old
  elif action == "append" and isinstance(old, list):
    old.append(value)
  else:
    node[key] = value
  return doc, path


def _dumps(doc: Any) -> bytes:
  return json.dumps(doc, allow_nan=True).encode()


# ---------------------------------------------------------------------------
# safetensors


def _safetensors_bytes(header: Any, data: bytes) -> bytes:
  raw = _dumps(header)
  raw += b" " * (-len(raw) % 8)
  return struct.pack("<Q", len(raw)) + raw + data


def _split_safetensors(blob: bytes) -> tuple[dict, bytes]:
  (n,) = struct.unpack("<Q", blob[:8])
  return json.loads(blob[8:8 + n]), blob[8 + n:]


@pytest.fixture(scope="module")
def st_file(tmp_path_factory, outside):
  d = tmp_path_factory.mktemp("st")
  rng = np.random.default_rng(0)
  save_file({"model.layers.0.mlp.down_proj.weight": rng.standard_normal((3, 4)).astype(np.float32),
             "model.layers.0.mlp.up_proj.weight": rng.standard_normal((4, 3)).astype(np.float64),
             "model.norm.weight": np.arange(5, dtype=np.int32),
             "model.ids": np.arange(6, dtype=np.uint8).reshape(2, 3),
             "model.empty": np.zeros((0, 3), np.float32),
             "lm_head.weight": rng.standard_normal(2).astype(np.float32)},
            str(d / "model.safetensors"), metadata={"format": "pt"})
  f = str(d / "model.safetensors")
  return f, ofx.restore(f)


def _reference(file: str) -> dict[str, np.ndarray] | None:
  try:
    return load_file(file)
  except Exception:  # pylint: disable=broad-except  # the reference refuses the file, however
    return None


def _check_safetensors(file: str, data: bytes, expected: Any, opens: _Opens) -> None:
  original = open(file, "rb").read()
  with open(file, "wb") as f:
    f.write(data)
  try:
    ref = _reference(file)
    got = _outcome(lambda: (ofx.restore(file), ofx.metadata(file))[0], opens)
  finally:
    with open(file, "wb") as f:
      f.write(original)
  if got is None:
    return
  leaves = {k.replace("/", "."): v for k, v in _leaves(got["params"]).items()}
  want = ref if ref is not None else {k.replace("/", "."): v
                                      for k, v in _leaves(expected["params"]).items()}
  assert sorted(leaves) == sorted(want), (sorted(leaves), sorted(want))
  for name, leaf in leaves.items():
    assert _same_leaf(leaf, want[name]), (name, leaf, want[name])


@_SETTINGS
@given(edit=_json_edit.filter(lambda e: e is not None))
def test_fuzz_safetensors_header_fields(st_file, outside, edit):
  file, expected = st_file
  header, data = _split_safetensors(open(file, "rb").read())
  _check_safetensors(file, _safetensors_bytes(_apply_json(header, edit)[0], data), expected,
                     outside[1])


@_SETTINGS
@given(ops=_byte_ops)
def test_fuzz_safetensors_header_bytes(st_file, outside, ops):
  file, expected = st_file
  blob = open(file, "rb").read()
  (n,) = struct.unpack("<Q", blob[:8])
  # The length, the header and the first bytes of the data section.
  _check_safetensors(file, _apply_bytes(blob, ops, within=8 + n + 16), expected, outside[1])


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory, outside):
  d = tmp_path_factory.mktemp("hf")
  rng = np.random.default_rng(1)
  parts = [{"model.layers.0.mlp.up_proj.weight": rng.standard_normal((4, 2)).astype(np.float32)},
           {"model.layers.1.mlp.up_proj.weight": rng.standard_normal((4, 2)).astype(np.float32),
            "lm_head.weight": rng.standard_normal((3, 2)).astype(np.float32)}]
  weight_map = {}
  for k, part in enumerate(parts):
    name = f"model-{k + 1:05d}-of-00002.safetensors"
    save_file(part, str(d / name))
    weight_map.update(dict.fromkeys(part, name))
  (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  return str(d), ofx.restore(str(d))


_ESCAPES = st.sampled_from(["../outside/s.safetensors", "../s.safetensors", "/", "..", ".",
                            "model-00001-of-00002.safetensors/../../s.safetensors"])


@_SETTINGS
@given(edit=_json_edit.filter(lambda e: e is not None), escape=st.one_of(st.none(), _ESCAPES),
       absolute=st.booleans())
def test_fuzz_safetensors_index(st_dir, outside, edit, escape, absolute):
  d, expected = st_dir
  root, opens = outside
  index = os.path.join(d, "model.safetensors.index.json")
  doc, _ = _apply_json(json.load(open(index)), edit)
  if escape is not None and isinstance(doc.get("weight_map"), dict) and doc["weight_map"]:
    name = sorted(doc["weight_map"])[0]
    doc["weight_map"][name] = (os.path.join(root, "s.safetensors") if absolute else
                               escape.replace("../outside", os.path.relpath(root, d)))
  check_file_mutation(index, _dumps(doc), lambda: (ofx.restore(d), ofx.metadata(d))[0],
                      expected, opens, subset=True)


# ---------------------------------------------------------------------------
# orbax-checkpoint


@pytest.fixture(scope="module")
def ocp_step(tmp_path_factory, outside):
  """A real orbax-checkpoint step (CheckpointManager, a pytree item and a JSON item)."""
  run = tmp_path_factory.mktemp("run")
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  state = {"weights_matrix": jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8),
                                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))),
           "layers_list": [np.arange(3, dtype=np.int32), np.ones((2, 2), np.float64)],
           "counter_value": 7}
  mngr = ocp.CheckpointManager(str(run), item_names=("state", "extra"))
  mngr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                       extra=ocp.args.JsonSave({"learning_rate": 0.5})))
  mngr.wait_until_finished()
  mngr.close()
  step = str(run / "3")
  assert os.path.exists(os.path.join(step, "state", "_sharding"))
  return step, ofx.restore(step)


_OCP_FILES = ["state/_METADATA", "state/_sharding", "_CHECKPOINT_METADATA"]
_ITEM_ESCAPES = st.sampled_from(["../../outside/victim", "../victim", "..", ".", "/", "",
                                 "state/../../..", "victim"])


@_SETTINGS
@given(which=st.sampled_from(_OCP_FILES), edit=_json_edit, ops=st.one_of(st.none(), _byte_ops),
       escape=st.one_of(st.none(), _ITEM_ESCAPES), absolute=st.booleans())
def test_fuzz_orbax_checkpoint_metadata(ocp_step, outside, which, edit, ops, escape, absolute):
  step, expected = ocp_step
  root, opens = outside
  file = os.path.join(step, which)
  original = open(file, "rb").read()
  doc, _ = _apply_json(json.loads(original), edit)
  handlers = doc.get("item_handlers") if isinstance(doc, dict) else None
  if escape is not None and isinstance(handlers, dict) and "state" in handlers:
    victim = os.path.join(root, "victim") if absolute else escape.replace(
        "../../outside", os.path.relpath(root, step))
    handlers[victim] = handlers.pop("state")
  data = _dumps(doc)
  if ops is not None:
    data = _apply_bytes(data, ops)
  # orbax-checkpoint's files carry no checksum over their list of leaves: a
  # mutation may drop leaves or an item, but what comes back must be exact.
  check_file_mutation(file, data, lambda: (ofx.restore(step), ofx.metadata(step))[0],
                      expected, opens, subset=True)


# ---------------------------------------------------------------------------
# our own manifest


@pytest.fixture(scope="module")
def own_ckpt(tmp_path_factory, outside):
  import optax  # pylint: disable=g-import-not-at-top
  path = str(tmp_path_factory.mktemp("own") / "ckpt")
  rng = np.random.default_rng(3)
  params = {"weights_matrix": rng.standard_normal((520, 512)).astype(np.float32),  # chunked
            "bias_vector": np.arange(5, dtype=np.float32),
            "embedding_table": rng.standard_normal((3, 7)).astype(np.float64)}
  opt = optax.adam(0.1).init(params)
  ofx.save(path, {"state": {"params": params, "opt": opt, "rng_key": jax.random.key(4),
                            "step_count": 11, "name_tag": "run-7", "pair_tuple": (1.5, None),
                            "by_int": {1: np.int16(3), 2: np.int16(4)}},
                  "extra": {"epoch_list": [1, 2]}})
  return path, ofx.restore(path)


def _rehash(summary: dict, body: dict) -> bytes:
  line = json.dumps(summary, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
  text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
  sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
  return (b"orbax_flax checkpoint v1 " + f"summary_sha256={sha(line)} sha256={sha(text)}".encode()
          + b"\n" + line + b"\n" + text)


# Fields whose value the manifest legitimately states (its hash is no signature):
# a changed inline value or custom metadata comes back changed. Elsewhere one
# changed field must be refused or leave every value as saved.
_STATED = ("value", "custom", "created", "library_version", "device_count", "item_bytes", "casts",
           "sharding")


def _edited_manifest(path: str, edit, in_summary: bool) -> tuple[str, bytes, tuple]:
  """The manifest file of ``path``, its bytes after ``edit`` (digests redone), and the edit's place."""
  file = os.path.join(path, "_CHECKPOINT")
  _, line, body = open(file, "rb").read().split(b"\n", 2)
  summary, body = json.loads(line), json.loads(body)
  mutated, where = _apply_json(summary if in_summary else body, edit)
  data = _rehash(mutated, body) if in_summary else _rehash(summary, mutated)
  return file, data, where


def _own_read(path: str) -> Any:
  out = ofx.restore(path)
  ofx.metadata(path)
  return out


@_SETTINGS
@given(edit=_json_edit.filter(lambda e: e is not None), in_summary=st.booleans())
def test_fuzz_own_manifest_fields(own_ckpt, outside, edit, in_summary):
  path, expected = own_ckpt
  file, data, where = _edited_manifest(path, edit, in_summary)
  # An item as a whole (dropped, renamed) is the manifest's to state, as a value is.
  exact = not any(k in _STATED for k in where if isinstance(k, str)) and not (
      not in_summary and len(where) == 2 and where[0] == "items")
  check_file_mutation(file, data, lambda: _own_read(path), expected, outside[1], exact=exact)


@_SETTINGS
@given(ops=_byte_ops)
def test_fuzz_own_manifest_bytes(own_ckpt, outside, ops):
  path, expected = own_ckpt
  file = os.path.join(path, "_CHECKPOINT")
  check_file_mutation(file, _apply_bytes(open(file, "rb").read(), ops), lambda: _own_read(path),
                      expected, outside[1])


# ---------------------------------------------------------------------------
# The reported crafted files, one by one, through every public entry point.


def _entry_points(path: str, tmp_path) -> dict[str, Callable[[], Any]]:
  return {"restore": lambda: ofx.restore(path), "metadata": lambda: ofx.metadata(path),
          "verify": lambda: ofx.verify(path),
          "convert": lambda: ofx.convert(path, str(tmp_path / "converted"), format="safetensors")}


def test_safetensors_index_cannot_name_files_outside(tmp_path, outside, capsys):
  root, opens = outside
  d = tmp_path / "downloaded_model"
  d.mkdir()
  save_file({"w": np.ones(2, np.float32)}, str(d / "model-00001-of-00002.safetensors"))
  for shard, field in [("../" + os.path.relpath(os.path.join(root, "s.safetensors"), tmp_path),
                        "'../"), (os.path.join(root, "s.safetensors"), f"'{root}")]:
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w": "model-00001-of-00002.safetensors", "secret": shard}}))
    for name, call in _entry_points(str(d), tmp_path).items():
      opens.active, opens.seen = True, []
      try:
        with pytest.raises(ofx.CheckpointFormatError,
                           match=rf"model.safetensors.index.json: weight_map\['secret'\] is {field}"):
          call()
      finally:
        opens.active = False
      assert not opens.seen, (name, opens.seen)
    assert cli.main(["show", str(d)]) == cli.EXIT_CORRUPT
    assert "not a plain name inside the checkpoint directory" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "converted")


def test_orbax_item_names_cannot_leave_the_step(tmp_path, outside, capsys):
  root, opens = outside
  step = tmp_path / "downloaded" / "7"
  step.mkdir(parents=True)
  handler = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
  for name in [os.path.relpath(os.path.join(root, "victim"), step), os.path.join(root, "victim"),
               "..", "a/../../victim"]:
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps({"item_handlers": {name: handler}}))
    for call in _entry_points(str(step), tmp_path).values():
      opens.active, opens.seen = True, []
      try:
        with pytest.raises(ofx.CheckpointFormatError,
                           match=r"_CHECKPOINT_METADATA: item name is .* not a plain name"):
          call()
      finally:
        opens.active = False
      assert not opens.seen
    assert cli.main(["show", str(step)]) == cli.EXIT_CORRUPT
    capsys.readouterr()


def test_orbax_array_names_cannot_leave_the_item(tmp_path, outside):
  """An array's name is its keys joined by '.': a key '..', '/abs' or 'x/../..' would name a
  directory elsewhere in the per-array (non-OCDBT) layout ('x/y' nests inside the item: read,
  tests/test_interop.py)."""
  root, _ = outside
  item = tmp_path / "item"
  ck = ocp.StandardCheckpointer()
  ck.save(str(item), {"w": np.ones(3, np.float32)})
  ck.wait_until_finished()
  meta = json.loads((item / "_METADATA").read_text())
  entry = meta["tree_metadata"].pop("('w',)")
  rel = os.path.relpath(os.path.join(root, "victim", "weights_matrix"), item)
  for key in ["..", rel, "a/../../x", "/abs", "a//b"]:
    entry["key_metadata"] = [{"key": key, "key_type": 2}]
    (item / "_METADATA").write_text(json.dumps({**meta, "use_ocdbt": False, "tree_metadata": {
        repr((key,)): entry}}))
    with pytest.raises(ofx.CheckpointFormatError, match=r"_METADATA: the array name of leaf"):
      ofx.restore(str(item))


def _write_header(path, header, data=b""):
  with open(path, "wb") as f:
    f.write(_safetensors_bytes(header, data))
  return str(path)


_PAYLOAD = np.arange(4, dtype=np.float32).tobytes()


@pytest.mark.parametrize("header,match", [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},
     r"tensor 'w' \(float32\[2\], 8 bytes\) has data_offsets \[-8, 0\], not 8 bytes inside"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
     r"tensors 'a' \(data_offsets \[0, 16\]\) and 'b' \(\[4, 12\]\) share bytes"),
    ({"w": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}},
     r"tensor 'w' has shape \[-2, -2\]: dimension -2 is negative"),
    ({"w": {"dtype": "U8", "shape": [2**33, 2**31], "data_offsets": [0, 0]}},
     r"tensor 'w' has shape \[8589934592, 2147483648\]: spans more than 2\*\*62 bytes"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-10**6, -10**6 + 4]}},
     r"tensor .w. .* has data_offsets \[-1000000, -999996\]"),
    (["w"], r"the header is a list \(\['w'\]\), not a JSON object"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}},
     r"tensor 'w' has data_offsets \[0, 4, 8\], not two integers"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
     r"no tensor holds the last 8 bytes of the data section"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
     r"no tensor holds bytes \[0, 8\) of the data section \(before 'w'\)"),
    ({"w": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}},
     r"tensor 'w' has shape \[4.0\]: dimension 4.0 is not an integer"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [True, 16]}},
     r"tensor 'w' has data_offsets \[True, 16\], not two integers"),
    ({"w": {"dtype": "X9", "shape": [2], "data_offsets": [0, 16]}}, r"tensor 'w' has dtype 'X9'"),
    ({"w": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}, r"tensor 'w' has dtype \['F32'\]"),
    ({"w": "F32"}, r"tensor 'w' is a string \('F32'\), not an object"),
    ({"__metadata__": {"a": 1}, "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
     r"__metadata__ is \{'a': 1\}, not an object of strings"),
])
def test_crafted_safetensors_headers_are_refused(tmp_path, header, match):
  f = _write_header(tmp_path / "x.safetensors", header, _PAYLOAD)
  for name, call in _entry_points(f, tmp_path).items():
    with pytest.raises(ofx.CheckpointFormatError, match=rf"x.safetensors: {match}"):
      call()
  assert cli.main(["show", f]) == cli.EXIT_CORRUPT
  assert _reference(f) is None  # the safetensors package refuses each of them too


def test_safetensors_raw_damage_is_refused(tmp_path):
  base = tmp_path / "x.safetensors"
  good = _safetensors_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, _PAYLOAD)
  raw = good[8:8 + struct.unpack("<Q", good[:8])[0]]
  entry = b'{"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}'
  twice = b'{"w": ' + entry + b', "w": ' + entry + b'}'
  cases = {
      "too short": (b"\x01\x02", r"2 bytes, too short to be a safetensors file"),
      "length beyond the file": (struct.pack("<Q", 10**6) + raw + _PAYLOAD, r"header length 1000000"),
      "not JSON": (struct.pack("<Q", 8) + b"\xff\xfe{[[[[" + _PAYLOAD, r"header: not valid JSON"),
      "deeply nested": (struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000,
                        r"header: not valid JSON"),
      "a name twice": (struct.pack("<Q", len(twice)) + twice + _PAYLOAD, r"key 'w' appears twice"),
  }
  for name, (blob, match) in cases.items():
    base.write_bytes(blob)
    with pytest.raises(ofx.CheckpointFormatError, match=match):
      ofx.restore(str(base))


def test_safetensors_shards_must_agree_with_the_index(tmp_path):
  d = tmp_path / "hf"
  d.mkdir()
  save_file({"a": np.ones(2, np.float32)}, str(d / "one.safetensors"))
  save_file({"a": np.zeros(2, np.float32), "b": np.ones(1, np.float32)}, str(d / "two.safetensors"))
  index = d / "model.safetensors.index.json"
  index.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
  with pytest.raises(ofx.CheckpointFormatError, match=r"tensor 'a' is in both .*one.safetensors and"):
    ofx.restore(str(d))
  index.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "c": "one.safetensors"}}))
  with pytest.raises(ofx.CheckpointFormatError, match=r"weight_map places tensors in files whose"
                     r" headers do not hold them: 'c'"):
    ofx.restore(str(d))
  for doc, match in [([], r"the file is a list"), ({"weight_map": {}}, r"weight_map is \{\}"),
                     ({"weight_map": {"a": 3}}, r"weight_map\['a'\] is 3, not a plain name")]:
    index.write_text(json.dumps(doc))
    with pytest.raises(ofx.CheckpointFormatError, match=match):
      ofx.metadata(str(d))


@pytest.mark.parametrize("order", [["a", "a.b"], ["a.b", "a"], ["a.b.c", "a.b"]])
def test_leaf_and_subtree_of_one_name_is_refused_in_either_order(tmp_path, order):
  header = {t: {"dtype": "F32", "shape": [2], "data_offsets": [8 * k, 8 * k + 8]}
            for k, t in enumerate(order)}
  f = _write_header(tmp_path / "t.safetensors", header, np.ones(4, np.float32).tobytes())
  leaf = min(order, key=len).replace(".", "/")
  for call in _entry_points(f, tmp_path).values():
    with pytest.raises(ofx.CheckpointFormatError, match=rf"t.safetensors: tensor names .*: {leaf} is"
                       r" both a leaf"):
      call()


def test_orbax_leaf_and_subtree_of_one_name_is_refused(tmp_path):
  item = tmp_path / "item"
  ck = ocp.StandardCheckpointer()
  ck.save(str(item), {"a": {"b": np.ones(2, np.float32)}, "c": np.zeros(2, np.float32)})
  ck.wait_until_finished()
  meta = json.loads((item / "_METADATA").read_text())
  tm = meta["tree_metadata"]
  for first in ("('a', 'b')", "('c',)"):
    c = tm["('c',)"]
    c = {**c, "key_metadata": [{"key": "a", "key_type": 2}]}
    entries = {"('a', 'b')": tm["('a', 'b')"], "('c',)": c}
    ordered = {k: entries[k] for k in sorted(entries, key=lambda k: k != first)}
    (item / "_METADATA").write_text(json.dumps({**meta, "tree_metadata": ordered}))
    with pytest.raises(ofx.CheckpointFormatError, match=r"_METADATA: a is both a leaf"):
      ofx.restore(str(item))


def test_convert_refuses_colliding_names_before_writing(tmp_path):
  src = str(tmp_path / "ck")
  ofx.save(src, {"params": {"a.b": np.ones(3, np.float32), "a": {"b": np.full(3, 2.0, np.float32)}}})
  dst = tmp_path / "st"
  with pytest.raises(ValueError, match=r"params/a/b and params/a.b are both named 'a.b'|"
                                       r"params/a.b and params/a/b are both named 'a.b'"):
    ofx.convert(src, str(dst), format="safetensors")
  assert not dst.exists() and not os.path.exists(str(dst) + ".ofx-tmp-export")
  src2 = str(tmp_path / "ck2")
  ofx.save(src2, {"params": {"a": np.ones(3, np.float32), "a.b": np.zeros(3, np.float32)}})
  with pytest.raises(ValueError, match=r"a is both a leaf \(a\) and a subtree"):
    ofx.convert(src2, str(dst), format="safetensors")
  assert not dst.exists()
  assert cli.main(["convert", src, str(dst), "--format=safetensors"]) != 0
  assert not dst.exists()


def test_own_manifest_crafted_but_rehashed_is_refused(tmp_path):
  """A manifest's hashes prove it intact, not trustworthy: consistent-looking lies are refused."""
  path = str(tmp_path / "ck")
  ofx.save(path, {"state": {"w": np.arange(4, dtype=np.float32), "v": np.ones(4, np.float32),
                            "n": 3, "t": (1, 2)}})
  file = os.path.join(path, "_CHECKPOINT")
  original = open(file, "rb").read()
  _, line, body = original.split(b"\n", 2)
  summary, body = json.loads(line), json.loads(body)
  leaves = body["items"]["state"]["leaves"]
  by_path = {"/".join(r["path"]): r for r in leaves}

  def crafted(change):
    b = json.loads(json.dumps(body))
    s = dict(summary)
    change(s, b, {"/".join(r["path"]): r for r in b["items"]["state"]["leaves"]})
    with open(file, "wb") as f:
      f.write(_rehash(s, b))

  cases = [
      (lambda s, b, r: r["v"].update(name=r["w"]["name"]), r"array name 'a\d' is also that of leaf"),
      (lambda s, b, r: r["v"].update(packed_offset=r["v"]["packed_offset"] + 4),
       r"packed array .* is at byte \d+ of process 0's buffer, where a save puts it at byte"),
      (lambda s, b, r: r["w"].update(dtype="int32"), r"stored_dtype 'float32' for dtype int32"),
      (lambda s, b, r: r["w"].update(dtype=">f4", stored_dtype=">f4"), r"dtype '>f4' is not"),
      (lambda s, b, r: r["w"].update(shape=[2]), r"nbytes 16, where shape \[2\] of float32 has 8"),
      (lambda s, b, r: r["w"].update(path=["v"]), r"the structure's leaf \d at 'w' is not one of"),
      (lambda s, b, r: b["items"]["state"]["structure"]["c"].__setitem__(0, {"t": "none"}),
       r"the structure omits leaf"),
      (lambda s, b, r: r["n"].update(value={"t": "int", "v": [3]}),
       r"inline value .* of an unknown type, or malformed"),
      (lambda s, b, r: r["n"].update(value={"t": "np", "dtype": "float32", "b64": ""}),
       r"inline value"),
      (lambda s, b, r: b["items"]["state"].update(structure=[]), r"structure node \[\]"),
      (lambda s, b, r: s.update(format="safetensors"), r"format 'safetensors', not 'orbax_flax'"),
      (lambda s, b, r: s.update(created="noon"), r"created is 'noon', not a time"),
      (lambda s, b, r: b["items"].update(state=[]), r"item 'state' has no list of leaves"),
  ]
  try:
    for change, match in cases:
      crafted(change)
      for call in (lambda: ofx.restore(path), lambda: ofx.metadata(path), lambda: ofx.verify(path)):
        with pytest.raises(ofx.CheckpointFormatError, match=match):
          call()
  finally:
    with open(file, "wb") as f:
      f.write(original)
  assert by_path and ofx.restore(path)["state"]["n"] == 3


@pytest.fixture(scope="module")
def diff_ckpt(tmp_path_factory, outside):
  """Two steps of a differential run; step 1 borrows its big array and packed norms from 0."""
  root = tmp_path_factory.mktemp("diff")
  rng = np.random.default_rng(19)
  w = rng.standard_normal((520, 512)).astype(np.float32)
  norms = [rng.standard_normal(64).astype(np.float32) for _ in range(3)]
  ckptr = ofx.Checkpointer(differential=True)
  for step in range(2):
    ckptr.save(str(root / str(step)), {"state": {"weights_matrix": w, "norms": norms,
                                                 "bias_vector": np.full(5, step, np.float32)}})
  ckptr.close()
  path = str(root / "1")
  return path, ofx.restore(path)


@settings(_SETTINGS, max_examples=600 if LONG else 100)
@given(edit=_json_edit.filter(lambda e: e is not None), in_summary=st.booleans())
def test_fuzz_differential_references(diff_ckpt, outside, edit, in_summary):
  """A crafted reference (bases, chunk_base, packed_pieces, owners) gives a clean error or
  values, never a read outside the run's directory (it may legitimately name other chunks)."""
  path, expected = diff_ckpt
  file, data, _ = _edited_manifest(path, edit, in_summary)
  check_file_mutation(file, data, lambda: _own_read(path), expected, outside[1], exact=False)


# ---------------------------------------------------------------------------
# Sizes and links (issue 26): a crafted size is refused before it is allocated; a link is
# never followed.


@pytest.fixture(scope="module")
def sized_ckpt(tmp_path_factory, outside):
  """A chunked array (one chunk per device) and a packed one."""
  path = str(tmp_path_factory.mktemp("sized") / "ckpt")
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  w = jax.device_put(np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
  ofx.save(path, {"state": {"w": w, "b": np.arange(5, dtype=np.float32)}})
  return path, ofx.restore(path)


# Dimensions a crafted manifest would claim: the stored ones, near them, and huge.
_DIMS = st.one_of(st.sampled_from([1, 2, 5, 64, 128, 256, 512, 1024, 2048, 2**20, 2**31, 2**40]),
                  st.integers(1, 4096))


def _resize(body: dict, shape: list[int], chunk: list[int], nbytes_delta: int) -> dict:
  """``body`` with leaf ``w`` claiming ``shape`` in chunks of ``chunk``: every other field
  consistent (nbytes, one owner per chunk, compact when many), so only the sizes lie."""
  body = json.loads(json.dumps(body))
  (rec,) = [r for r in body["items"]["state"]["leaves"] if r["path"] == ["w"]]
  grid = int(np.prod([-(-s // c) for s, c in zip(shape, chunk)]))
  rec.update(shape=shape, chunk_shape=chunk, nbytes=int(np.prod(shape)) * 4 + nbytes_delta)
  rec.pop("owners", None)
  if grid >= 1024:
    import zlib  # pylint: disable=g-import-not-at-top
    import base64  # pylint: disable=g-import-not-at-top
    rec["owners_z"] = base64.b64encode(zlib.compress(np.zeros(grid, "<u4").tobytes())).decode()
    body["version"] = 2
  else:
    rec["owners"] = [0] * grid
  return body


@settings(_SETTINGS, max_examples=400 if LONG else 60)
@given(shape=st.lists(_DIMS, min_size=1, max_size=3), chunk=st.lists(_DIMS, min_size=1, max_size=3),
       nbytes_delta=st.sampled_from([0, 0, 0, 4, -4]))
def test_fuzz_own_manifest_sizes(sized_ckpt, outside, shape, chunk, nbytes_delta):
  """Shapes, chunk shapes and owner counts a crafted manifest states consistently (hashes
  redone): restore and verify refuse them (a ``CheckpointError``) before allocating, or read
  what is stored; never a ``MemoryError``/``OSError``, never a value from outside."""
  path, expected = sized_ckpt
  chunk = (chunk + [1] * 3)[:len(shape)]
  grid = int(np.prod([-(-s // c) for s, c in zip(shape, chunk)], dtype=object))
  if grid > 2**20 or any(c > s for c, s in zip(chunk, shape)):
    chunk = [min(c, s) for c, s in zip(chunk, shape)]
    grid = int(np.prod([-(-s // c) for s, c in zip(shape, chunk)], dtype=object))
  if grid > 2**20:  # a million chunks at most: the owners list itself must stay small here
    chunk = list(shape)
  file = os.path.join(path, "_CHECKPOINT")
  _, line, body = open(file, "rb").read().split(b"\n", 2)
  summary, body = json.loads(line), json.loads(body)
  body = _resize(body, shape, chunk, nbytes_delta)
  if body["version"] == 2:
    summary["version"] = 2
  check_file_mutation(file, _rehash(summary, body),
                      lambda: (ofx.restore(path), ofx.verify(path))[0], expected, outside[1],
                      exact=False)


def _entries(root: str) -> list[str]:
  """Every file and directory below ``root`` (relative), in a stable order."""
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames.sort()
    out += [os.path.relpath(os.path.join(dirpath, n), root) for n in sorted(dirnames + filenames)]
  return out


@settings(_SETTINGS, max_examples=200 if LONG else 40)
@given(which=st.integers(0, 10_000), to_outside=st.booleans(), absolute=st.booleans())
def test_fuzz_links_inside_a_checkpoint_are_never_followed(own_ckpt, outside, which, to_outside,
                                                            absolute):
  """Any file or directory of a checkpoint replaced by a symbolic link, to the same content
  moved aside inside the checkpoint or to the sentinel checkpoint outside: every read
  refuses it with a ``CheckpointFormatError`` naming the link (never follows it)."""
  path, _ = own_ckpt
  entries = _entries(path)
  rel = entries[which % len(entries)]
  link = os.path.join(path, rel)
  if to_outside:
    target = os.path.join(outside[0], "ours", "_CHECKPOINT" if rel == "_CHECKPOINT" else "state")
    aside = link + ".aside"
  else:
    target = aside = link + ".aside"
  os.rename(link, aside)
  try:
    os.symlink(target if absolute else os.path.relpath(target, os.path.dirname(link)), link)
    outside[1].active, outside[1].seen = True, []
    try:
      for read in (lambda: ofx.restore(path), lambda: ofx.verify(path)):
        with pytest.raises(ofx.CheckpointFormatError, match="symbolic link") as e:
          read()
        assert link in str(e.value) or rel.split(os.sep)[0] in str(e.value)
    finally:
      outside[1].active = False
    assert not outside[1].seen, outside[1].seen
  finally:
    os.remove(link)
    os.rename(aside, link)
