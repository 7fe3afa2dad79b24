"""Foreign formats: orbax-checkpoint and safetensors in, safetensors out, transforms, convert."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.flax import save_file as flax_save_file
from safetensors.numpy import load_file, save_file

import jobs
import orbax_flax as ofx
from orbax_flax import cli


def _mesh(shape=(2, 4), names=("x", "y")):
  return jax.make_mesh(shape, names)


def _state(mesh):
  sh = NamedSharding(mesh, P("x", "y"))
  rng = np.random.default_rng(0)
  w = rng.standard_normal((16, 32)).astype(np.float32)
  return {
      "params": {"dense": {"kernel": jax.device_put(w, sh),
                           "bias": jax.device_put(np.arange(32, dtype=np.float32),
                                                  NamedSharding(mesh, P("y")))},
                 "emb": jax.device_put(jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16),
                                       NamedSharding(mesh, P("x")))},
      "layers": [np.arange(6, dtype=np.int32), np.ones((2, 2), np.float64)],
      "step": 42, "lr": 0.25, "tag": "run-7",
  }


def _abstract(tree, mesh, spec=P()):
  def one(x):
    if isinstance(x, np.ndarray) and jax.dtypes.canonicalize_dtype(x.dtype) != x.dtype:
      return x  # 64-bit with x64 off: no jax.Array holds it; restored on the host
    if isinstance(x, (jax.Array, np.ndarray)):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
    return x
  return jax.tree.map(one, tree)


def _same(a, b):
  for (pa, x), (pb, y) in zip(jax.tree_util.tree_leaves_with_path(a),
                              jax.tree_util.tree_leaves_with_path(b)):
    assert pa == pb
    if isinstance(x, (jax.Array, np.ndarray)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(pa))
    else:
      assert x == y, (pa, x, y)


@pytest.mark.parametrize("layout", ["standard", "pytree_ocdbt_zarr3", "no_ocdbt", "no_ocdbt_zarr3"])
def test_orbax_checkpoint_item_restores_onto_another_mesh(tmp_path, layout):
  state = _state(_mesh())
  path = str(tmp_path / "ocp")
  if layout == "standard":
    arrays_only = {k: v for k, v in state.items() if k not in ("tag",)}
    with ocp.StandardCheckpointer() as saver:
      saver.save(path, arrays_only)
      saver.wait_until_finished()
    state = arrays_only
  else:
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=layout.startswith("pytree"),
                                          use_zarr3=layout.endswith("zarr3"))
    ocp.Checkpointer(handler).save(path, args=ocp.args.PyTreeSave(state))
  assert ofx.metadata(path).format == "orbax-checkpoint"
  other = _mesh((4, 2), ("a", "b"))
  target = _abstract(state, other, P("a"))
  target["params"]["dense"]["bias"] = jax.ShapeDtypeStruct((32,), np.float32,
                                                           sharding=NamedSharding(other, P("b")))
  target["layers"] = [np.zeros(6, np.int32), np.zeros((2, 2), np.float64)]
  restored = ofx.restore(path, {"state": target})["state"]
  _same(restored, state)
  k = restored["params"]["dense"]["kernel"]
  assert k.sharding == NamedSharding(other, P("a")) and k.dtype == np.float32
  # Without a target: host values in the saved structure.
  whole = ofx.restore(path)["default"]
  assert isinstance(whole["layers"], list) and whole["step"] == 42
  np.testing.assert_array_equal(whole["params"]["dense"]["kernel"], np.asarray(state["params"]["dense"]["kernel"]))


@pytest.mark.parametrize("layout", ["standard", "no_ocdbt"])
def test_orbax_checkpoint_with_a_slash_in_a_key_restores(tmp_path, layout):
  """Keys such as 'layer_00/attn' (a flattened module path) are common: orbax-checkpoint
  nests those arrays inside the item, and we read them (a '..' is what we refuse)."""
  state = {"mu": {"layer_00/attn/wk": np.arange(16, dtype=np.float32).reshape(4, 4)},
           "nu": {"layer_00/attn/wk": np.ones((4, 4), np.float32)}}
  path = str(tmp_path / "ocp")
  if layout == "standard":
    with ocp.StandardCheckpointer() as saver:
      saver.save(path, state)
      saver.wait_until_finished()
  else:
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(
        path, args=ocp.args.PyTreeSave(state))
  _same(ofx.restore(path)["default"], state)
  target = _abstract(state, _mesh(), P("x"))
  _same(ofx.restore(path, {"state": target})["state"], state)


def test_orbax_checkpoint_errors_by_key_path_before_reading(tmp_path):
  state = _state(_mesh())
  path = str(tmp_path / "ocp")
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(path, args=ocp.args.PyTreeSave(state))
  mesh = _mesh()
  target = _abstract(state, mesh)
  target["params"]["dense"]["kernel"] = jax.ShapeDtypeStruct((16, 30), np.float32,
                                                             sharding=NamedSharding(mesh, P()))
  target["params"]["dense"]["bias"] = jax.ShapeDtypeStruct((32,), np.int8,
                                                           sharding=NamedSharding(mesh, P()))
  with pytest.raises(ofx.TreeMismatchError) as e:
    ofx.restore(path, {"state": target})
  text = str(e.value)
  assert "params/dense/kernel: shape (16, 32) in checkpoint, (16, 30) in target" in text
  assert "params/dense/bias: float32 in checkpoint, int8 in target" in text


def test_orbax_checkpoint_manager_steps_and_composite_items(tmp_path):
  state = _state(_mesh())
  root = str(tmp_path / "run")
  with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as m:
    for step in (10, 20):
      m.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                           extra=ocp.args.JsonSave({"epoch": step // 10})))
    m.wait_until_finished()
  step_dir = os.path.join(root, "20")
  meta = ofx.metadata(step_dir)
  assert meta.format == "orbax-checkpoint" and sorted(meta.items) == ["extra", "state"]
  out = ofx.restore(step_dir, {"state": _abstract(state, _mesh((8, 1), ("x", "y"))),
                               "extra": None})
  assert out["extra"] == {"epoch": 2}
  _same(out["state"], state)
  # The run directory is not a checkpoint: the error says which steps it holds.
  with pytest.raises(ofx.CheckpointNotFoundError, match=r"orbax-checkpoint run directory.*\[10, 20\].*20"):
    ofx.restore(root)
  # show and verify work on it.
  buf = io.StringIO()
  assert cli.main(["show", step_dir], out=buf) == 0
  assert "orbax-checkpoint" in buf.getvalue() and "state/step = 42" in buf.getvalue()
  buf = io.StringIO()
  assert cli.main(["verify", step_dir], out=buf) == 0
  assert "OK" in buf.getvalue() and "orbax-checkpoint" in buf.getvalue()


@pytest.mark.parametrize("zarr3", [False, True])
def test_a_missing_orbax_chunk_is_corruption_not_zeros(tmp_path, zarr3):
  """A chunk file deleted from an orbax-checkpoint item read as zeros, and verify said OK;
  orbax-checkpoint's own reader raises."""
  path = str(tmp_path / "item")
  ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=zarr3))
  ckptr.save(path, {"w": np.arange(1, 9, dtype=np.float32), "z": np.zeros(4, np.float32)})
  # The zero array's chunk is written too (orbax stores data equal to the fill value).
  assert ofx.restore(path)["default"]["z"].tolist() == [0.0] * 4
  chunks = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(path, "w")) for f in fs
            if f not in ("zarr.json", ".zarray", ".zattrs")]
  assert chunks
  for c in chunks:
    os.remove(c)
  with pytest.raises(ofx.CheckpointCorruptedError, match="'w'"):
    ofx.restore(path)
  with pytest.raises(ofx.CheckpointCorruptedError):
    ofx.verify(path)
  buf = io.StringIO()
  assert cli.main(["verify", path], out=buf) != 0


def test_orbax_empty_dicts_lists_and_nones_are_read_as_orbax_reads_them(tmp_path):
  """orbax-checkpoint 0.12 records {} and [] as value types Dict and List (skip_deserialize):
  the reader looked for an old aggregate file and called the checkpoint incomplete; a None
  inside a list came back as a dict with a gap."""
  path = str(tmp_path / "item")
  tree = {"w": np.arange(2), "bn": {}, "ls": [], "l": [np.arange(2), None, np.arange(3)]}
  ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  ckptr.save(path, tree)
  theirs = ckptr.restore(path)
  ours = ofx.restore(path)["default"]
  assert ours["bn"] == theirs["bn"] == {} and ours["ls"] == theirs["ls"] == []
  assert isinstance(ours["l"], list) and ours["l"][1] is None and ours["l"][2].tolist() == [0, 1, 2]
  with_target = ofx.restore(path, {"default": tree})["default"]
  assert with_target["bn"] == {} and with_target["w"].tolist() == [0, 1]
  buf = io.StringIO()
  assert cli.main(["verify", path], out=buf) == 0, buf.getvalue()


def test_orbax_empty_tuples_are_read_as_orbax_reads_them(tmp_path):
  """orbax-checkpoint 0.12 records ``()`` (optax.MultiSteps' skip_state) as value type Tuple:
  restore, metadata, verify, show and convert took it for a leaf of the old aggregate file
  and called the checkpoint incomplete."""
  import optax
  from flax.training import train_state
  model = _Model()
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(0), jnp.ones((1, 8)))["params"],
      tx=optax.MultiSteps(optax.adam(1e-3), 4))
  tree = {"state": state, "nested": (((),), [()], {"a": ()}), "pair": (optax.EmptyState(),) * 2}
  path = str(tmp_path / "run" / "100" / "default")
  with ocp.StandardCheckpointer() as c:
    c.save(path, tree)
    theirs = c.restore(path)  # without a target: what orbax makes of the empty nodes
  ours = ofx.restore(path)["default"]
  assert ours["state"]["opt_state"]["skip_state"] == ()
  assert theirs["state"]["opt_state"]["skip_state"] == ()
  assert ours["nested"] == theirs["nested"] == [[()], [()], {"a": ()}]
  assert ours["pair"] == theirs["pair"] == [None, None]
  got = ofx.restore(path, {"default": {**tree, "state": ofx.abstract(state)}})["default"]
  _same(got["state"], state)
  assert got["state"].opt_state.skip_state == () and got["nested"] == tree["nested"]
  assert ofx.metadata(path).format == "orbax-checkpoint"
  ofx.verify(path)
  for args in (["verify", path], ["show", path]):
    buf = io.StringIO()
    assert cli.main(args, out=buf) == 0, buf.getvalue()
  ofx.convert(path, str(tmp_path / "ours"))
  back = ofx.restore(str(tmp_path / "ours"), {"default": {**tree, "state": ofx.abstract(state)}})
  _same(back["default"]["state"], state)
  assert back["default"]["state"].opt_state.skip_state == ()


def test_orbax_checkpoint_written_by_two_processes_restores_on_one_and_four(tmp_path):
  path = str(tmp_path / "ocp")
  jobs.run("interop_worker.py", ["--mode=ocp_save", f"--path={path}"], 2, 4).check()
  assert ofx.metadata(path).format == "orbax-checkpoint"
  res = jobs.run("interop_worker.py", ["--mode=restore", f"--path={path}"], 4, 2).check()
  assert all("CHECKED" in o for o in res.outputs), res.outputs
  whole = ofx.restore(path)["default"]
  import interop_worker
  for name, value in interop_worker.expected_state().items():
    np.testing.assert_array_equal(whole[name], value, err_msg=name)


def _hf_dir(tmp_path):
  rng = np.random.default_rng(1)
  tensors = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((8, 4)).astype(np.float32)
             for i in range(3)}
  tensors["model.embed_tokens.weight"] = rng.standard_normal((16, 4)).astype(np.float32)
  tensors["lm_head.weight"] = rng.standard_normal((16, 4)).astype(np.float32)
  d = tmp_path / "hf"
  d.mkdir()
  names = sorted(tensors)
  shards = [names[:2], names[2:]]
  weight_map = {}
  for k, part in enumerate(shards):
    f = f"model-{k + 1:05d}-of-00002.safetensors"
    save_file({n: tensors[n] for n in part}, str(d / f), metadata={"format": "pt"})
    weight_map.update({n: f for n in part})
  (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  return str(d), tensors


def test_safetensors_directory_reads_each_process_slice(tmp_path):
  d, tensors = _hf_dir(tmp_path)
  meta = ofx.metadata(d)
  assert meta.format == "safetensors"
  mesh = _mesh()
  sd = lambda shape, spec: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))
  target = {"model": {"layers": {str(i): {"mlp": {"up_proj": {"weight": sd((8, 4), P("x", "y"))}}}
                                 for i in range(3)},
                      "embed_tokens": {"weight": sd((16, 4), P(None, "y"))}},
            "lm_head": {"weight": sd((16, 4), P("y"))}}
  out = ofx.restore(d, {"params": target})["params"]
  np.testing.assert_array_equal(np.asarray(out["model"]["embed_tokens"]["weight"]),
                                tensors["model.embed_tokens.weight"])
  np.testing.assert_array_equal(np.asarray(out["model"]["layers"]["2"]["mlp"]["up_proj"]["weight"]),
                                tensors["model.layers.2.mlp.up_proj.weight"])
  # A column block of a matrix is read by byte runs, not whole.
  from orbax_flax.formats import _cbytes
  runs = list(_cbytes.runs((16, 4), ((0, 16), (2, 3)), 4))
  assert len(runs) == 16 and all(n == 4 for _, _, n in runs)


def test_safetensors_bfloat16_float8_and_casts(tmp_path):
  f = str(tmp_path / "w.safetensors")
  bf = jnp.asarray(np.linspace(-2, 2, 12).reshape(3, 4), jnp.bfloat16)
  f8 = jnp.asarray(np.linspace(-1, 1, 8), jnp.float8_e4m3fn)
  flax_save_file({"a.bf": bf, "a.f8": f8}, f)
  out = ofx.restore(f)["params"]["a"]
  assert out["bf"].dtype == ml_dtypes.bfloat16 and out["f8"].dtype == ml_dtypes.float8_e4m3fn
  np.testing.assert_array_equal(out["bf"], np.asarray(bf))
  np.testing.assert_array_equal(out["f8"], np.asarray(f8))
  # bfloat16 -> float32 is exact; float32 checkpoint -> bfloat16 needs the opt-in.
  up = ofx.restore(f, {"w": {"a": {"bf": np.zeros((3, 4), np.float32)}}}, partial=True)["w"]
  np.testing.assert_array_equal(up["a"]["bf"], np.asarray(bf, np.float32))
  with pytest.raises(ofx.TreeMismatchError, match="a/bf: bfloat16 in checkpoint, int8 in target"):
    ofx.restore(f, {"w": {"a": {"bf": np.zeros((3, 4), np.int8)}}}, partial=True)


def test_export_safetensors_shards_index_and_loads_back(tmp_path):
  mesh = _mesh()
  rng = np.random.default_rng(2)
  tree = {"params": {f"layer_{i}": {"kernel": jax.device_put(
      rng.standard_normal((64, 32)).astype(np.float32), NamedSharding(mesh, P("x", "y")))}
      for i in range(4)}, "count": np.arange(3, dtype=np.int64)}
  d = str(tmp_path / "export")
  names = ofx.export_safetensors(d, tree, dtype="bfloat16", max_shard_bytes=2 * 64 * 32 * 2)
  assert names == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
  index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
  assert index["weight_map"]["params.layer_0.kernel"] == names[0]
  loaded = {}
  for n in names:
    loaded.update(load_file(os.path.join(d, n)))
  assert loaded["count"].dtype == np.int64  # one dtype converts floating arrays only
  np.testing.assert_array_equal(loaded["count"], np.arange(3))
  from safetensors.flax import load_file as flax_load
  bf = flax_load(os.path.join(d, names[1]))["params.layer_2.kernel"]
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(bf),
                                np.asarray(tree["params"]["layer_2"]["kernel"]).astype(ml_dtypes.bfloat16))
  # And we read our own export back, resharded.
  back = ofx.restore(d, {"p": {"params": {"layer_3": {"kernel": jax.ShapeDtypeStruct(
      (64, 32), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x")))}}}}, partial=True)
  np.testing.assert_array_equal(np.asarray(back["p"]["params"]["layer_3"]["kernel"]),
                                np.asarray(tree["params"]["layer_3"]["kernel"]).astype(ml_dtypes.bfloat16))


def test_export_refuses_bad_input_before_writing(tmp_path):
  d = str(tmp_path / "export")
  with pytest.raises(ValueError, match=r"a: safetensors cannot store complex64"):
    ofx.export_safetensors(d, {"a": np.ones(2, np.complex64), "b": np.ones(2)})
  with pytest.raises(ValueError, match=r"tensor name 'x' is also the name of"):
    ofx.export_safetensors(d, {"a": np.ones(2), "b": np.ones(2)}, name_fn=lambda p: "x")
  assert not os.path.exists(d)
  ofx.export_safetensors(d, {"a": np.ones(2)})
  with pytest.raises(ValueError, match="exists; pass overwrite=True"):
    ofx.export_safetensors(d, {"a": np.zeros(2)})
  np.testing.assert_array_equal(load_file(os.path.join(d, "model.safetensors"))["a"], np.ones(2))
  ofx.export_safetensors(d, {"a": np.zeros(2)}, overwrite=True)
  np.testing.assert_array_equal(load_file(os.path.join(d, "model.safetensors"))["a"], np.zeros(2))


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_a_failed_export_leaves_nothing_behind(tmp_path, fmt):
  """``convert`` of a damaged checkpoint to safetensors or orbax fails, naming the damage;
  it left its unfinished ``<dst>.ofx-tmp-export`` directory behind (an earlier export at
  ``dst`` stays as it was). The failure was a RuntimeError of gathered text, which
  ``python -m orbax_flax convert`` showed as a traceback."""
  src, dst = str(tmp_path / "src"), str(tmp_path / "out")
  w = np.random.default_rng(8).standard_normal((512, 1024)).astype(np.float32)
  ofx.save(src, {"s": {"w": w}})
  ofx.convert(src, dst, format=fmt)
  data = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs
          if os.path.basename(d) == "d" and os.path.getsize(os.path.join(d, f)) > 100_000]
  with open(data[0], "r+b") as f:  # bytes of the array's chunk: its CRC-32C fails now
    f.seek(50_000)
    f.write(b"\xff" * 64)
  with pytest.raises(ofx.errors.CheckpointCorruptedError,
                     match="failed.*nothing was committed(.|\n)*Corrupted"):
    ofx.convert(src, dst, format=fmt, overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["out", "src"]
  # The command line says it in one error and exits 1 (corruption), with no traceback.
  r = subprocess.run([sys.executable, "-m", "orbax_flax", "convert", src, dst, f"--format={fmt}",
                      "--overwrite"], capture_output=True, text=True, env=jobs.env_for(1),
                     cwd=jobs.ROOT, check=False)
  assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
  assert r.stderr.startswith("CORRUPTED: export to") and "Traceback" not in r.stderr, r.stderr
  assert sorted(os.listdir(tmp_path)) == ["out", "src"]
  got = [x for x in jax.tree.leaves(ofx.restore(dst)) if np.shape(x) == w.shape]
  assert [x.tobytes() for x in got] == [w.tobytes()]


def _files_under(root):
  """Every path under ``root`` with its bytes (None for a directory): what is there."""
  out = {}
  for d, dirs, files in os.walk(root):
    for name in dirs:
      out[os.path.relpath(os.path.join(d, name), root)] = None
    for name in files:
      with open(os.path.join(d, name), "rb") as f:
        out[os.path.relpath(os.path.join(d, name), root)] = f.read()
  return out


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_an_export_with_overwrite_replaces_only_an_export_a_checkpoint_or_nothing(tmp_path, fmt):
  """``overwrite=True`` commits the export where ``path`` was, and what was there goes: it
  deleted a CheckpointManager's run directory or a project's files pointed at by mistake, and
  swapped a file for the export, leaving ``<path>.ofx-tmp-export``. Now anything but an empty
  directory, an orbax_flax checkpoint or an earlier export of the same format is refused
  before anything is written, naming the path and what is there."""
  export = ofx.export_safetensors if fmt == "safetensors" else ofx.export_orbax
  other = ofx.export_orbax if fmt == "safetensors" else ofx.export_safetensors
  tree = {"w": np.arange(4, dtype=np.float32)}
  keep = tmp_path / "keep"
  run = str(keep / "run")
  with ofx.CheckpointManager(run, ofx.CheckpointPolicy(save_interval_steps=1)) as m:
    for step in (1, 2):
      m.save(step, {"s": {"w": np.zeros(4, np.float32)}})
  (keep / "project").mkdir()
  (keep / "project" / "notes.txt").write_text("precious")
  (keep / "model.bin").write_bytes(b"weights")
  other(str(keep / "other_format"), tree)
  ofx.export_orbax(str(keep / "orbax_run"), tree, step=3)  # an orbax run: steps, no item
  before = _files_under(keep)
  for name, there in [("run", "holds 1, 2"), ("project", "holds notes.txt"),
                      ("model.bin", "is a file"), ("other_format", "holds "),
                      ("orbax_run", "holds 3")]:
    for overwrite in (True, False):
      with pytest.raises(ValueError, match=re.escape(f"{keep / name} exists and is not an earlier")
                         + f"(.|\n)*: it {there}(.|\n)*even with overwrite=True"):
        export(str(keep / name), tree, overwrite=overwrite)
  assert _files_under(keep) == before
  assert sorted(os.listdir(tmp_path)) == ["keep"]
  # What overwrite replaces: an empty directory, an earlier export, one of our checkpoints.
  (tmp_path / "empty").mkdir()
  ofx.save(str(tmp_path / "ckpt"), {"s": {"w": np.zeros(4, np.float32)}})
  export(str(tmp_path / "earlier"), {"w": np.zeros(4, np.float32)})
  for name in ("empty", "earlier", "ckpt"):
    export(str(tmp_path / name), tree, overwrite=True)
    (got,) = ofx.restore(str(tmp_path / name)).values()
    np.testing.assert_array_equal(got["w"], tree["w"])
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "earlier", "empty", "keep"]
  # An empty directory (made first, as for ofx.save) needs no overwrite: it holds nothing.
  (tmp_path / "made").mkdir()
  export(str(tmp_path / "made"), tree)
  (got,) = ofx.restore(str(tmp_path / "made")).values()
  np.testing.assert_array_equal(got["w"], tree["w"])
  with pytest.raises(ValueError, match="exists; pass overwrite=True"):
    export(str(tmp_path / "made"), tree)  # now it holds the export


def test_a_lost_shard_or_orbax_metadata_is_corruption_not_a_missing_checkpoint(tmp_path):
  """A sharded safetensors export that lost a shard its index names, and a committed
  orbax-checkpoint item or step whose ``_METADATA`` (or a whole item) is gone, were "no such
  checkpoint" (CheckpointNotFoundError: `verify` exit 2); they are damage (exit 1)."""
  import shutil  # pylint: disable=g-import-not-at-top
  tree = {f"layer{i}": np.full((64,), i, np.float32) for i in range(3)}
  st = str(tmp_path / "st")
  ofx.export_safetensors(st, tree, max_shard_bytes=256)
  os.remove(os.path.join(st, "model-00002-of-00003.safetensors"))
  item = str(tmp_path / "item")
  with ocp.StandardCheckpointer() as c:
    c.save(item, tree)
  os.remove(os.path.join(item, "_METADATA"))
  with ocp.CheckpointManager(str(tmp_path / "run")) as mgr:
    mgr.save(1, args=ocp.args.StandardSave(tree))
  os.remove(str(tmp_path / "run" / "1" / "default" / "_METADATA"))
  with ocp.CheckpointManager(str(tmp_path / "composite"), item_names=("a", "b")) as mgr:
    mgr.save(1, args=ocp.args.Composite(a=ocp.args.StandardSave(tree),
                                        b=ocp.args.JsonSave({"epoch": 1})))
  shutil.rmtree(str(tmp_path / "composite" / "1" / "a"))
  for path, says in [(st, "model-00002-of-00003.safetensors, which model.safetensors.index.json"
                          " names for 1 tensor(s), does not exist"),
                     (item, "committed orbax-checkpoint item or step"),
                     (str(tmp_path / "run" / "1"), "committed orbax-checkpoint item"),
                     (str(tmp_path / "composite" / "1"), "whose item 'a'")]:
    with pytest.raises(ofx.errors.CheckpointCorruptedError, match=re.escape(says)):
      ofx.verify(path)
  r = subprocess.run([sys.executable, "-m", "orbax_flax", "verify", st], capture_output=True,
                     text=True, env=jobs.env_for(1), cwd=jobs.ROOT, check=False)
  assert r.returncode == 1 and r.stdout.startswith("CORRUPTED: "), (r.returncode, r.stdout, r.stderr)


def test_convert_to_safetensors_refuses_bytes_that_are_not_text_before_writing(tmp_path):
  """A ``bytes`` leaf goes into the header's ``__metadata__``, which holds text: one that is
  not UTF-8 was decoded with errors="replace" (``b"\\x00\\xff"`` became ``"\\x00\\ufffd"``)
  and the conversion succeeded. It is refused, naming the leaf and the fix; UTF-8 bytes are
  kept as their text."""
  src, dst = str(tmp_path / "ckpt"), str(tmp_path / "st")
  ofx.save(src, {"params": {"w": np.ones(2, np.float32)},
                 "extra": {"vocab": b"\x00\xff\xfe blob", "note": "caf\u00e9".encode()}})
  with pytest.raises(ValueError, match=r"not UTF-8 text(.|\n)*extra/vocab \(8 bytes\)(.|\n)*"
                     r"selector(.|\n)*Nothing was written"):
    ofx.convert(src, dst, format="safetensors")
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]
  ofx.convert(src + ":params,extra/note", dst, format="safetensors")
  assert ofx.metadata(dst).custom["extra.note"] == "caf\u00e9"


def test_safetensors_exports_refuse_an_empty_tensor_name_before_writing(tmp_path):
  """A leaf under the key '' was exported as a tensor named '', which the safetensors package
  reads but orbax_flax's own reader (verify, restore) calls damaged. Exports refuse an empty
  (or non-string) name before writing, naming the leaf; the reader's rule stays."""
  src, dst = str(tmp_path / "ckpt"), str(tmp_path / "st")
  ofx.save(src, {"params": {"": np.arange(3, dtype=np.float32)}})
  with pytest.raises(ValueError, match=r"the leaf 'params/' \(its key path is one empty key"
                     r"(.|\n)*Nothing was written"):
    ofx.convert(src, dst, format="safetensors")
  with pytest.raises(ValueError, match=r"key path \('',\): tensor name ''"):
    ofx.export_safetensors(dst, {"": np.ones(2), "w": np.ones(2)})
  with pytest.raises(ValueError, match=r"key path \('w',\): tensor name 7"):
    ofx.export_safetensors(dst, {"w": np.ones(2)}, name_fn=lambda p: 7)
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_export_from_two_processes_writes_owned_shards(tmp_path):
  d = str(tmp_path / "export")
  res = jobs.run("interop_worker.py", ["--mode=export", f"--path={d}"], 2, 4).check()
  import interop_worker
  loaded = {}
  for n in os.listdir(d):
    if n.endswith(".safetensors"):
      loaded.update(load_file(os.path.join(d, n)))
  for name, value in interop_worker.expected_state().items():
    np.testing.assert_array_equal(loaded[name], value, err_msg=name)
  # Each process wrote only what it owns: the worker counts its bytes.
  written = [int(o.split("WROTE ")[1].split()[0]) for o in res.outputs]
  total = sum(v.nbytes for v in interop_worker.expected_state().values())
  assert sum(written) == total and max(written) < total, written


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Dense(8)(x))


class _Model(nn.Module):
  classes: int = 3

  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = _Block(name=f"layers_{i}")(x)
    return nn.Dense(self.classes, name="head")(x)


def test_transforms_on_a_flax_model_rename_new_head_stack_unstack(tmp_path):
  x = jnp.ones((1, 8))
  params = _Model().init(jax.random.key(0), x)["params"]
  path = str(tmp_path / "ckpt")
  ofx.save(path, {"state": {"model": params, "opt_mu": jax.tree.map(jnp.zeros_like, params)}})
  t = ofx.engine.transforms
  # 1) Rename + drop: the old "model" prefix becomes "params", the optimizer is dropped.
  target = {"params": ofx.abstract(params)}
  out = ofx.restore(path, {"state": target}, transforms=[
      t.Rename(r"model/(.*)", r"params/\1"), t.Drop(r"opt_mu/.*")])["state"]
  _same(out["params"], params)
  # 2) Fine-tuning: a new 5-class head from the target's own initialisation.
  new = _Model(classes=5).init(jax.random.key(1), x)["params"]
  out = ofx.restore(path, {"state": {"params": new}}, transforms=[
      t.Rename(r"model/(.*)", r"params/\1"), t.Drop(r"opt_mu/.*|params/head/.*"),
      t.FromTarget(r"params/head/.*")])["state"]["params"]
  np.testing.assert_array_equal(out["head"]["kernel"], new["head"]["kernel"])
  np.testing.assert_array_equal(out["layers_1"]["Dense_0"]["kernel"], params["layers_1"]["Dense_0"]["kernel"])
  # 3) Stack per-layer blocks into a scanned array, and back.
  stacked = {"layers": jax.tree.map(lambda *xs: jnp.stack(xs), *[params[f"layers_{i}"] for i in range(3)]),
             "head": params["head"]}
  out = ofx.restore(path, {"state": {"model": ofx.abstract(stacked)}}, partial=True, transforms=[
      t.Stack(r"model/layers_(?P<i>\d+)/(.*)", r"model/layers/\2")])["state"]["model"]
  _same(out, stacked)
  scanned = str(tmp_path / "scanned")
  ofx.save(scanned, {"state": {"model": stacked}})
  out = ofx.restore(scanned, {"state": {"model": ofx.abstract(params)}}, transforms=[
      t.Unstack(r"model/layers/(.*)", r"model/layers_{i}/\1")])["state"]["model"]
  _same(out, params)
  # 4) Cast on restore is explicit; mismatches are still named before reading.
  out = ofx.restore(path, {"state": {"model": jax.tree.map(lambda a: np.zeros(a.shape, ml_dtypes.bfloat16), params)}},
                    partial=True, transforms=[t.Cast(r"model/.*", "bfloat16")])["state"]["model"]
  assert out["head"]["kernel"].dtype == ml_dtypes.bfloat16
  with pytest.raises(ofx.TreeMismatchError, match=r"cannot stack.*layers 0..1|not 0..") as e:
    ofx.restore(path, {"state": {}}, partial=True, transforms=[
        t.Drop(r"model/layers_1/.*"), t.Stack(r"model/layers_(?P<i>\d+)/(.*)", r"model/layers/\2")])
  with pytest.raises(ofx.TreeMismatchError, match=r"params/head/kernel: in target, not in checkpoint"):
    ofx.restore(path, {"state": {"params": new}}, transforms=[
        t.Rename(r"model/(.*)", r"params/\1"), t.Drop(r"opt_mu/.*|params/head/.*")])


def test_save_with_dtype_records_the_cast(tmp_path):
  path = str(tmp_path / "ckpt")
  w = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
  ofx.save(path, {"s": {"w": jnp.asarray(w), "n": np.arange(3), "step": 5}}, dtype="bfloat16")
  meta = ofx.metadata(path)
  arrays = {a.path: a for a in meta.items["s"].arrays}
  assert arrays["w"].dtype == "bfloat16" and arrays["n"].dtype == "int64"
  assert meta.casts == {"s/w": "float32"}
  back = ofx.restore(path)["s"]
  np.testing.assert_array_equal(back["w"], w.astype(ml_dtypes.bfloat16))


def test_convert_cli_streams_orbax_checkpoint_to_safetensors_and_ours(tmp_path):
  state = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": {"c": np.ones(5, np.int32)}}
  src = str(tmp_path / "ocp")
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(src, args=ocp.args.PyTreeSave(state))
  st = str(tmp_path / "st")
  buf = io.StringIO()
  assert cli.main(["convert", src, st, "--format=safetensors", "--dtype=bfloat16"], out=buf) == 0, buf.getvalue()
  from safetensors.flax import load_file as flax_load
  got = flax_load(os.path.join(st, "model.safetensors"))
  assert got["a"].dtype == jnp.bfloat16 and got["b.c"].dtype == jnp.int32
  ours = str(tmp_path / "ours")
  assert cli.main(["convert", st, ours], out=io.StringIO()) == 0
  back = ofx.restore(ours)["params"]
  np.testing.assert_array_equal(back["a"], state["a"].astype(ml_dtypes.bfloat16))
  np.testing.assert_array_equal(back["b"]["c"], state["b"]["c"])
  assert ofx.metadata(ours).format == "orbax_flax"


def test_init_from_an_orbax_checkpoint_run_directory(tmp_path):
  import optax
  from flax.training import train_state
  model = _Model()
  x = jnp.ones((1, 8))

  def make(seed):
    return train_state.TrainState.create(apply_fn=model.apply,
                                         params=model.init(jax.random.key(seed), x)["params"],
                                         tx=optax.adam(1e-3))
  donor = make(5)
  root = str(tmp_path / "orbax_run")
  with ocp.CheckpointManager(root) as m:  # the flax/orbax docs' way: one "default" item
    m.save(100, args=ocp.args.StandardSave(donor))
    m.wait_until_finished()
  fine = ofx.CheckpointCallback(str(tmp_path / "fine"), {"init_from": root})
  state = fine.restore_or_init(make(1))
  fine.close()
  _same(state.params, donor.params)
  assert int(state.step) == 0


def test_orbax_checkpoint_leaves_in_the_legacy_aggregate_file(tmp_path):
  """Older orbax versions kept small leaves in a msgpack ``checkpoint`` file (skip_deserialize)."""
  from flax import serialization
  path = tmp_path / "ocp"
  tree = {"w": np.arange(6, dtype=np.float32), "step": 3}
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(str(path), args=ocp.args.PyTreeSave(tree))
  meta = json.loads((path / "_METADATA").read_text())
  for key in meta["tree_metadata"].values():
    key["value_metadata"]["skip_deserialize"] = True
  (path / "_METADATA").write_text(json.dumps(meta))
  (path / "checkpoint").write_bytes(serialization.msgpack_serialize(
      {"w": np.arange(6, dtype=np.float32) * 2, "step": 9}))
  out = ofx.restore(str(path), {"s": {"w": np.zeros(6, np.float32), "step": 0}})["s"]
  assert out["step"] == 9
  np.testing.assert_array_equal(out["w"], np.arange(6, dtype=np.float32) * 2)
  (path / "checkpoint").unlink()
  with pytest.raises(ofx.errors.CheckpointFormatError, match="aggregate file 'checkpoint'.*missing"):
    ofx.restore(str(path))


def _doc_blocks(name):
  text = open(os.path.join(jobs.ROOT, "docs", name)).read()
  return re.findall(r"```python\n(.*?)```", text, re.S)


def test_docs_interop_runs_end_to_end(tmp_path, monkeypatch):
  """docs/hf_llama.md's blocks run in order, as a reader would paste them, and print what it says."""
  monkeypatch.chdir(tmp_path)
  blocks = _doc_blocks("hf_llama.md")
  assert len(blocks) == 5
  out = io.StringIO()
  scope = {"__name__": "interop_doc"}
  with contextlib.redirect_stdout(out):
    for code in blocks:
      exec(compile(code, "docs/hf_llama.md", "exec"), scope)  # pylint: disable=exec-used
  assert out.getvalue().split("\n")[:2] == ["P(None, 'model')", "(1, 8, 64)"]


class _Linear(nn.Module):
  """A two-layer MLP named like a Hugging Face checkpoint's modules."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, use_bias=False, name="up_proj")(x))
    return nn.Dense(8, use_bias=False, name="down_proj")(x)


class _TinyHF(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = x + _Linear(name=f"layers_{i}")(nn.RMSNorm(name=f"norm_{i}")(x))
    return x


def test_transpose_loads_torch_layout_weights_as_flax_kernels_shard_by_shard(tmp_path, monkeypatch):
  """safetensors in torch layout ((out, in) weights) into a Flax model's (in, out) kernels on a
  mesh: each device's box is read as the transposed region of the weight, not the whole."""
  rng = np.random.default_rng(5)
  hf = {}
  for i in range(2):
    hf[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((16, 8)).astype(np.float32)
    hf[f"model.layers.{i}.mlp.down_proj.weight"] = rng.standard_normal((8, 16)).astype(np.float32)
    hf[f"model.norm_{i}.weight"] = rng.standard_normal(8).astype(np.float32)
  f = str(tmp_path / "model.safetensors")
  save_file(hf, f, metadata={"format": "pt"})
  model, x = _TinyHF(), jnp.ones((2, 8))
  mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
  target = {f"layers_{i}": {"up_proj": {"kernel": jax.ShapeDtypeStruct((8, 16), np.float32,
                                                                       sharding=sharding(P(None, "model")))},
                            "down_proj": {"kernel": jax.ShapeDtypeStruct((16, 8), np.float32,
                                                                         sharding=sharding(P("model")))}}
            for i in range(2)}
  target.update({f"norm_{i}": {"scale": jax.ShapeDtypeStruct((8,), np.float32, sharding=sharding(P()))}
                 for i in range(2)})
  assert jax.tree.map(lambda a: a.shape, target) == jax.tree.map(lambda a: a.shape, shapes)
  from orbax_flax.formats import _cbytes
  reads = []
  original = _cbytes.pread_box

  def counting(fd, base, shape, box, out):
    reads.append((tuple(shape), tuple(box)))
    return original(fd, base, shape, box, out)
  monkeypatch.setattr(_cbytes, "pread_box", counting)
  t = ofx.engine.transforms
  params = ofx.restore(f, {"params": target}, transforms=[
      t.Rename(r"model/(.*)", r"\1"), t.Rename(r"layers/(\d+)/mlp/(.*)", r"layers_\1/\2"),
      t.Rename(r"(norm_\d+)/weight", r"\1/scale"), t.Rename(r"(.*)/weight", r"\1/kernel"),
      t.Transpose(r".*/kernel")])["params"]
  monkeypatch.undo()
  for i in range(2):
    up, down = params[f"layers_{i}"]["up_proj"]["kernel"], params[f"layers_{i}"]["down_proj"]["kernel"]
    assert up.sharding == target[f"layers_{i}"]["up_proj"]["kernel"].sharding
    np.testing.assert_array_equal(np.asarray(up), hf[f"model.layers.{i}.mlp.up_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(down), hf[f"model.layers.{i}.mlp.down_proj.weight"].T)
    for shard in up.addressable_shards:  # column block j of the kernel: rows j of the weight
      np.testing.assert_array_equal(np.asarray(shard.data),
                                    hf[f"model.layers.{i}.mlp.up_proj.weight"][shard.index[::-1]].T)
  # Each of the 8 devices' column blocks of up_proj (8, 16) is read as 2 rows of the (16, 8)
  # weight; each row block of down_proj (16, 8) as 2 columns of the (8, 16) weight.
  up_reads = [b for s, b in reads if s == (16, 8)]
  down_reads = [b for s, b in reads if s == (8, 16)]
  assert len(up_reads) == len(down_reads) == 16
  assert sorted(up_reads)[:2] == [((0, 2), (0, 8)), ((0, 2), (0, 8))]
  assert sorted(down_reads)[:2] == [((0, 8), (0, 2)), ((0, 8), (0, 2))]
  # The result runs in the model, and gives what the same weights transposed by hand (and
  # placed alike) give.
  by_hand = {f"layers_{i}": {"up_proj": {"kernel": hf[f"model.layers.{i}.mlp.up_proj.weight"].T},
                             "down_proj": {"kernel": hf[f"model.layers.{i}.mlp.down_proj.weight"].T}}
             for i in range(2)}
  by_hand.update({f"norm_{i}": {"scale": hf[f"model.norm_{i}.weight"]} for i in range(2)})
  by_hand = jax.device_put(by_hand, jax.tree.map(lambda a: a.sharding, target))
  apply = jax.jit(model.apply)
  np.testing.assert_array_equal(np.asarray(apply({"params": params}, x)),
                                np.asarray(apply({"params": by_hand}, x)))
  # A permutation that does not fit the array is named before anything is read.
  with pytest.raises(ofx.TreeMismatchError, match=r"norm_0/weight: Transpose axes \(1, 0\) are not"
                     r" a permutation of the 1 axes of shape \[8\]"):
    ofx.restore(f, transforms=[t.Transpose(r"model/norm_0/weight", axes=(1, 0))])


def _keyed_state(seed):
  import optax
  from flax.training import train_state

  class KeyedState(train_state.TrainState):
    dropout_key: Any = None

  model = _Model()
  return KeyedState.create(apply_fn=model.apply, tx=optax.adam(1e-3),
                           params=model.init(jax.random.key(seed), jnp.ones((1, 8)))["params"],
                           dropout_key=jax.random.key(seed + 1))


def _is_key(x):
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def test_orbax_typed_prng_keys_are_read_as_keys(tmp_path):
  """orbax-checkpoint 0.12 stores a new-style PRNG key (jax.random.key) as its key data and
  names its implementation in ``array_metadatas`` (``ext_metadata.random_key_impl``), and
  restores a key; we read plain data, so a target holding a key (a dropout key, an NNX
  Dropout's RNG stream) was refused and an orbax run with one could not be continued."""
  mesh = _mesh()
  keys = jax.device_put(jax.random.split(jax.random.key(3), 8), NamedSharding(mesh, P("x")))
  tree = {"k": jax.random.key(1), "rbg": jax.random.key(2, impl="rbg"), "keys": keys,
          "raw": jax.random.PRNGKey(4), "w": np.arange(3.0)}
  path = str(tmp_path / "keys")
  with ocp.StandardCheckpointer() as c:
    c.save(path, tree)
  other = _mesh((8,), ("a",))
  target = {"k": ofx.abstract(tree["k"]), "rbg": ofx.abstract(tree["rbg"]),
            "keys": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=NamedSharding(other, P("a"))),
            "raw": ofx.abstract(tree["raw"]), "w": np.zeros(3)}
  got = ofx.restore(path, {"t": target})["t"]
  for name in ("k", "rbg", "keys"):
    assert _is_key(got[name]) and got[name].dtype == tree[name].dtype, name
    np.testing.assert_array_equal(jax.random.key_data(got[name]), jax.random.key_data(tree[name]))
  assert got["keys"].sharding == NamedSharding(other, P("a"))
  assert not _is_key(got["raw"]) and got["raw"].tolist() == tree["raw"].tolist()
  whole = ofx.restore(path)["default"]  # without a target too, as orbax restores them
  assert _is_key(whole["k"]) and whole["rbg"].dtype == tree["rbg"].dtype
  assert whole["keys"].shape == (8,)
  arrays = {a.path: a for a in ofx.metadata(path).items["default"].arrays}
  assert arrays["keys"].dtype == "key<threefry2x32>" and arrays["keys"].shape == (8,)
  assert arrays["rbg"].dtype == "key<rbg>" and arrays["raw"].dtype == "uint32"
  ofx.verify(path)
  buf = io.StringIO()
  assert cli.main(["show", path], out=buf) == 0 and "key<threefry2x32>[8]" in buf.getvalue()
  ofx.convert(path, str(tmp_path / "ours"))  # into our format: still keys
  converted = ofx.metadata(str(tmp_path / "ours")).items["default"].arrays
  assert [a.dtype for a in converted if a.path == "k"] == ["key<threefry2x32>"]
  with pytest.raises(ValueError, match="PRNG key arrays.*default/k"):
    ofx.convert(path, str(tmp_path / "st"), format="safetensors")

  # A TrainState with a dropout key, saved by a CheckpointManager run: read and continued.
  state = _keyed_state(0)
  run = str(tmp_path / "workdir")
  with ocp.CheckpointManager(run) as mngr:
    mngr.save(100, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
  back = ofx.restore(os.path.join(run, "100", "default"), {"state": ofx.abstract(state)})["state"]
  np.testing.assert_array_equal(jax.random.key_data(back.dropout_key),
                                jax.random.key_data(state.dropout_key))
  with ofx.CheckpointCallback(run, {"save_interval_steps": 10}) as ckpt:
    resumed = ckpt.restore_or_init(_keyed_state(7))
    assert ckpt.restored_step == 100
  _same(resumed.params, state.params)
  np.testing.assert_array_equal(jax.random.key_data(resumed.dropout_key),
                                jax.random.key_data(state.dropout_key))

  # The Flax NNX guide's pattern: orbax saves nnx.state(model), whose Dropout has an RNG stream.
  from flax import nnx

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 4, rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)

  net = Net(nnx.Rngs(0, dropout=1))
  with ocp.StandardCheckpointer() as c:
    c.save(str(tmp_path / "nnx"), nnx.state(net))
  fresh = Net(nnx.Rngs(5, dropout=6))
  nnx.update(fresh, ofx.restore(str(tmp_path / "nnx"), {"s": ofx.abstract(nnx.state(fresh))})["s"])
  _same(jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, nnx.state(fresh)),
        jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, nnx.state(net)))


def _orbax_key_item(tmp_path):
  path = str(tmp_path / "item")
  with ocp.StandardCheckpointer() as c:
    c.save(path, {"k": jax.random.key(1), "w": jnp.arange(3.0)})
  return path, os.path.join(path, "array_metadatas", "process_0")


def _with_entry(**fields):
  def edit(doc):
    for entry in doc["array_metadatas"]:
      if entry["array_metadata"]["param_name"] == "k":
        entry["array_metadata"].update(fields)
    return json.dumps(doc)
  return edit


@pytest.mark.parametrize("edit,match", [
    (_with_entry(ext_metadata={"random_key_impl": "threefry_9000"}),
     r"array 'k': random_key_impl 'threefry_9000' is not a PRNG implementation jax knows.*"
     r"threefry2x32.*jax.random.key\(0, impl='threefry_9000'\)"),
    (_with_entry(ext_metadata={"random_key_impl": "rbg"}),  # rbg keys are 4 words, not 2
     r"array 'k' holds uint32\[2\], not the key data of rbg keys \(uint32\[..., 4\]\)"),
    (_with_entry(ext_metadata={"random_key_impl": 7}), r"random_key_impl is 7, not a string"),
    (_with_entry(ext_metadata=["random_key_impl"]), r"ext_metadata is \['random_key_impl'\], not"),
    (_with_entry(param_name=["k"]), r"param_name is \['k'\], not a string"),
    (lambda doc: json.dumps({"array_metadatas": {"k": 1}}),
     r"array_metadatas is \{'k': 1\}, not a list"),
    (lambda doc: json.dumps({"array_metadatas": [7]}), r"entry 7 is not an object"),
    (lambda doc: json.dumps({"array_metadatas": doc["array_metadatas"] * 2}).replace(
        "threefry2x32", "rbg", 1), r"array 'k' is listed twice"),
    (lambda doc: json.dumps(doc)[:-3], r"not valid JSON"),
    (lambda doc: json.dumps(doc) + " " * 2000, r"larger than 1000 bytes"),
])
def test_orbax_array_metadatas_are_checked_before_keys_are_made(tmp_path, monkeypatch, edit,
                                                                 match):
  """``array_metadatas`` is input like any other file of a checkpoint: a crafted or damaged
  one is refused naming the file, the array and the value, before anything is read."""
  from orbax_flax.formats import orbax_checkpoint
  monkeypatch.setattr(orbax_checkpoint, "_MAX_ARRAY_METADATAS_BYTES", 1000)
  path, file = _orbax_key_item(tmp_path)
  with open(file, encoding="utf-8") as f:
    doc = json.load(f)
  with open(file, "w", encoding="utf-8") as f:
    f.write(edit(doc))
  for read in (ofx.restore, ofx.metadata, ofx.verify):
    with pytest.raises(ofx.errors.CheckpointFormatError, match=match) as e:
      read(path)
    assert "array_metadatas/process_0" in str(e.value)


@pytest.mark.parametrize("which", ["array_metadatas", "array_metadatas/process_0"])
def test_orbax_array_metadatas_behind_a_link_are_refused(tmp_path, which):
  """A link in place of the directory or the file could lead anywhere: refused, not followed."""
  path, _ = _orbax_key_item(tmp_path)
  elsewhere = tmp_path / "elsewhere"
  os.rename(os.path.join(path, which), elsewhere)
  os.symlink(elsewhere, os.path.join(path, which))
  for read in (ofx.restore, ofx.metadata):
    with pytest.raises(ofx.errors.CheckpointFormatError, match="symbolic link"):
      read(path)


def test_orbax_keys_without_array_metadatas_are_their_key_data(tmp_path):
  """Without the record (an older orbax, or a file removed), a key's data is what is there:
  plain uint32 words, as orbax-checkpoint restores them then; an impl of null is no key."""
  path, file = _orbax_key_item(tmp_path)
  with open(file, encoding="utf-8") as f:
    doc = json.load(f)
  doc["array_metadatas"][0]["array_metadata"]["ext_metadata"] = {"random_key_impl": None}
  with open(file, "w", encoding="utf-8") as f:
    json.dump(doc, f)
  assert ofx.restore(path)["default"]["k"].dtype == np.uint32
  os.remove(file)
  got = ofx.restore(path)["default"]
  assert got["k"].dtype == np.uint32
  assert got["k"].tolist() == jax.random.key_data(jax.random.key(1)).tolist()


@pytest.fixture(scope="module")
def orbax_key_item(tmp_path_factory):
  path, file = _orbax_key_item(tmp_path_factory.mktemp("keys"))
  with open(file, "rb") as f:
    return path, file, f.read()


_JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(),
              st.text(max_size=6), st.sampled_from(["threefry2x32", "rbg", "unsafe_rbg",
                                                    "philox2x32", "k", "w", "../k", ""])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(
        ["array_metadatas", "array_metadata", "param_name", "ext_metadata", "random_key_impl"]),
        inner, max_size=3)), max_leaves=6)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(at=st.integers(0, 1000), value=st.one_of(st.none(), _JSON_VALUES),
       cut=st.integers(-1200, 400))  # cut < 0: the whole file, with the value replaced
def test_fuzz_orbax_array_metadatas(orbax_key_item, at, value, cut):
  """Any one value of ``array_metadatas`` replaced, or the file cut short: a clean
  CheckpointError, or the saved key data (as keys of the implementation the file then
  names, or as plain words where it names none), never another value or a raw exception."""
  path, file, original = orbax_key_item
  doc = json.loads(original)
  nodes, todo = [], [doc]
  while todo:
    node = todo.pop(0)
    for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
      nodes.append((node, k))
      if isinstance(v, (dict, list)):
        todo.append(v)
  node, k = nodes[at % len(nodes)]
  node[k] = value
  data = json.dumps(doc).encode()
  try:
    with open(file, "wb") as f:
      f.write(data if cut < 0 else original[:cut])
    try:
      got = ofx.restore(path)["default"]
    except ofx.CheckpointError as e:
      event(f"refused: {type(e).__name__}")
      return
  finally:
    with open(file, "wb") as f:
      f.write(original)
  k = got["k"]
  event("read back as keys" if _is_key(k) else "read back as words")
  words = jax.random.key_data(k) if _is_key(k) else k
  assert np.asarray(words).tolist() == jax.random.key_data(jax.random.key(1)).tolist()
  assert not _is_key(got["w"]) and np.asarray(got["w"]).tolist() == [0.0, 1.0, 2.0]
