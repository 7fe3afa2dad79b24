"""Moving runs out: ``export_orbax``, ``convert --format orbax`` and selectors.

A checkpoint written by :func:`orbax_flax.export_orbax` is restored by the real
orbax-checkpoint 0.12.8 (``StandardCheckpointer``, ``CheckpointManager``)
bitwise onto another mesh; ``convert`` and the ``export_*`` functions take the
``init_from`` selector so that a model leaves without its optimizer moments,
keys, data position and config.
"""

import io
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import jobs
import orbax_flax as ofx
from orbax_flax import cli


def _state(mesh):
  model = nn.Dense(16)
  params = model.init(jax.random.key(0), jnp.ones((1, 8)))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  params["params"]["kernel"] = jax.device_put(params["params"]["kernel"] + 0.5,
                                              NamedSharding(mesh, P("data", "model")))
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def _same(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def _onto(tree, mesh):
  """orbax's restore target of ``tree``: every array split over the mesh where it divides."""
  def one(x):
    if not isinstance(x, jax.Array):
      return x
    spec = P("all") if x.ndim and x.shape[0] % mesh.size == 0 else P()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
  return jax.tree.map(one, tree)


def test_export_orbax_restores_bitwise_with_orbax_checkpoint_onto_another_mesh(tmp_path):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  state = _state(mesh)
  tree = {"state": state, "bf16": jnp.arange(12, dtype=jnp.bfloat16), "host": np.arange(5),
          "lr": 0.5, "empty": None}
  path = ofx.export_orbax(str(tmp_path / "item"), tree)
  other = jax.make_mesh((4,), ("all",), devices=jax.devices()[4:])
  target = _onto(tree, other)
  got = ocp.StandardCheckpointer().restore(path, target)
  _same(got, tree)
  assert got["state"].params["params"]["kernel"].sharding == target["state"].params["params"]["kernel"].sharding
  assert got["state"].params["params"]["kernel"].sharding.mesh == other
  # A CheckpointManager run: the step is found, its "default" item restores.
  run = str(tmp_path / "run")
  ofx.export_orbax(run, tree, step=1000)
  with ocp.CheckpointManager(run) as mgr:
    assert mgr.all_steps() == [1000]
    _same(mgr.restore(1000, args=ocp.args.StandardRestore(target)), tree)
  # orbax without a target places arrays as they were (the _sharding file).
  with pytest.warns(UserWarning, match="from sharding file"):  # orbax's own note
    whole = ocp.PyTreeCheckpointer().restore(path)
  assert whole["state"]["params"]["params"]["kernel"].sharding.spec == P("data", "model")
  # Our own reader reads it too.
  np.testing.assert_array_equal(ofx.restore(path)["default"]["host"], np.arange(5))


def test_export_orbax_splits_shards_into_chunks_each_written_once(tmp_path):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  x = jax.device_put(jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48),
                     NamedSharding(mesh, P("data", "model")))  # shards of (32, 12): 1536 bytes
  path = ofx.export_orbax(str(tmp_path / "x"), {"x": x}, max_chunk_bytes=512)
  zarr = json.load(open(os.path.join(path, "x", "zarr.json"), encoding="utf-8"))
  chunk = zarr["chunk_grid"]["configuration"]["chunk_shape"]
  assert chunk == [8, 12] and 32 % chunk[0] == 0  # a chunk tiles a shard: one writer each
  files = [f for _, _, fs in os.walk(os.path.join(path, "x", "c")) for f in fs]
  assert len(files) == (64 // 8) * (48 // 12)
  meta = json.load(open(os.path.join(path, "_METADATA"), encoding="utf-8"))
  assert meta["tree_metadata"]["('x',)"]["value_metadata"]["write_shape"] == [32, 12]
  other = jax.make_mesh((8,), ("all",))
  got = ocp.StandardCheckpointer().restore(path, _onto({"x": x}, other))
  _same(got, {"x": x})
  with pytest.raises(ValueError, match="max_chunk_bytes=0"):
    ofx.export_orbax(str(tmp_path / "y"), {"x": x}, max_chunk_bytes=0)


def test_export_orbax_refuses_what_orbax_cannot_hold_before_writing(tmp_path):
  d = str(tmp_path / "x")
  with pytest.raises(ValueError, match=r"key: a PRNG key array; export jax.random.key_data"):
    ofx.export_orbax(d, {"key": jax.random.key(0), "w": np.ones(2)})
  with pytest.raises(ValueError, match="single leaf"):
    ofx.export_orbax(d, np.ones(2))
  assert not os.path.exists(d) and not os.listdir(tmp_path)
  ofx.export_orbax(d, {"w": np.ones(2)})
  with pytest.raises(ValueError, match="exists; pass overwrite=True"):
    ofx.export_orbax(d, {"w": np.zeros(2)})
  ofx.export_orbax(d, {"w": np.zeros(2)}, overwrite=True)
  np.testing.assert_array_equal(ocp.PyTreeCheckpointer().restore(d)["w"], np.zeros(2))


def test_export_orbax_from_two_processes_each_writing_its_shards(tmp_path):
  d = str(tmp_path / "exported")
  jobs.run("interop_worker.py", ["--mode=export_orbax", f"--path={d}"], 2, 4).check()
  import interop_worker  # pylint: disable=g-import-not-at-top
  values = interop_worker.expected_state()
  mesh = jax.make_mesh((8,), ("all",))
  target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
      mesh, P("all") if v.shape[0] % 8 == 0 else P())) for k, v in values.items()}, "step": 0}
  got = ocp.StandardCheckpointer().restore(d, target)
  # Process 1's shards are not addressable on process 0: they are there only if it wrote them.
  for name, value in values.items():
    np.testing.assert_array_equal(np.asarray(got["params"][name]), value, err_msg=name)
  assert got["step"] == 7


def test_convert_takes_a_selector_and_writes_orbax(tmp_path):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  state = _state(mesh)
  run = str(tmp_path / "run")
  with ofx.CheckpointCallback(run, ofx.CheckpointPolicy(save_interval_steps=1)) as ckpt:
    ckpt.on_step_end(1, ckpt.restore_or_init(state))
  step = os.path.join(run, "checkpoints", "1")
  # Only the params: no optimizer moments, no step.
  out = str(tmp_path / "st")
  buf = io.StringIO()
  assert cli.main(["convert", f"{step}:params", out, "--format", "safetensors"], out=buf) == 0
  tensors = load_file(os.path.join(out, "model.safetensors"))
  assert sorted(tensors) == ["params.bias", "params.kernel"]
  np.testing.assert_array_equal(tensors["params.kernel"], np.asarray(state.params["params"]["kernel"]))
  # To orbax-checkpoint, the params: StandardCheckpointer restores them bitwise.
  out = str(tmp_path / "ocp")
  assert cli.main(["convert", f"{step}:params", out, "--format", "orbax"], out=buf) == 0
  target = _onto(jax.device_get(state.params), jax.make_mesh((8,), ("all",)))
  _same(ocp.StandardCheckpointer().restore(out, target), state.params)
  half = str(tmp_path / "ocp16")
  assert cli.main(["convert", f"{step}:params", half, "--format", "orbax", "--dtype", "bfloat16"],
                  out=buf) == 0
  got = ocp.StandardCheckpointer().restore(half, jax.tree.map(
      lambda t: jax.ShapeDtypeStruct(t.shape, jnp.bfloat16, sharding=t.sharding),
      _onto(state.params, jax.make_mesh((8,), ("all",)))))
  np.testing.assert_array_equal(np.asarray(got["params"]["kernel"]),
                                np.asarray(state.params["params"]["kernel"]).astype(jnp.bfloat16))
  meta = json.load(open(os.path.join(out, "_METADATA"), encoding="utf-8"))
  assert sorted(meta["tree_metadata"]) == ["('params', 'bias')", "('params', 'kernel')"]
  # Into our own format: the selected items only.
  ours = str(tmp_path / "ours")
  ofx.convert(f"{step}:params", ours)
  assert sorted(ofx.metadata(ours).items) == ["params"]
  _same(ofx.restore(ours)["params"], jax.device_get(state.params))
  # Several selections, and one that names nothing.
  both = str(tmp_path / "both")
  ofx.convert(f"{step}:params,opt_state/0/mu", both, format="safetensors")
  assert sorted(load_file(os.path.join(both, "model.safetensors"))) == [
      "opt_state.0.mu.params.bias", "opt_state.0.mu.params.kernel", "params.params.bias",
      "params.params.kernel"]
  with pytest.raises(ValueError, match=r"no 'paramz'; the keys at '<root>' are \['opt_state'"):
    ofx.convert(f"{step}:paramz", str(tmp_path / "none"), format="safetensors")
  assert not os.path.exists(tmp_path / "none")


def test_export_functions_take_the_selector(tmp_path):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  state = _state(mesh)
  ofx.export_safetensors(str(tmp_path / "st"), state, select="params/params")
  assert sorted(load_file(str(tmp_path / "st" / "model.safetensors"))) == ["bias", "kernel"]
  path = ofx.export_orbax(str(tmp_path / "ocp"), state, select="params,step")
  got = ocp.StandardCheckpointer().restore(
      path, _onto({"params": state.params, "step": 0}, jax.make_mesh((8,), ("all",))))
  _same(got["params"], state.params)
  assert got["step"] == 0


def test_exports_refuse_what_would_not_read_back_before_writing(tmp_path):
  """export_safetensors committed a file with non-string metadata (the safetensors package
  refuses its header) and one with names "a" and "a.b" (no tree reads back); convert wrote a
  PRNG key's raw data to orbax and safetensors, which interop.md says are refused."""
  with pytest.raises(TypeError, match="metadata must map strings to strings"):
    ofx.export_safetensors(str(tmp_path / "m"), {"w": np.ones(2, np.float32)},
                           metadata={"step": 5})
  with pytest.raises(ValueError, match="tensor names split at"):
    ofx.export_safetensors(str(tmp_path / "n"), {"a": np.ones(2), "a.b": np.zeros(2)})
  src = str(tmp_path / "src")
  ofx.save(src, {"state": {"w": np.arange(3.0), "key": jax.random.key(0)}})
  for fmt in ("orbax", "safetensors"):
    with pytest.raises(ValueError, match="PRNG key arrays.*state/key"):
      ofx.convert(src, str(tmp_path / fmt), format=fmt)
  assert sorted(os.listdir(tmp_path)) == ["src"]  # nothing else was written
  ofx.convert(src + ":state/w", str(tmp_path / "w"), format="safetensors")  # the way around
  assert ofx.restore(str(tmp_path / "w"))["params"]["w"].tolist() == [0.0, 1.0, 2.0]


def test_export_orbax_writes_empty_nodes_and_numpy_scalars_as_orbax_does(tmp_path):
  """{} and [] were exported as None (orbax 0.12 records Dict and List), and numpy scalars as
  Python scalars (orbax keeps them as 0-d arrays of their dtype)."""
  tree = {"w": np.arange(2), "bn": {}, "ls": [], "n": None, "f": np.float32(0.5),
          "i": np.int8(-3), "py": 7}
  ofx.export_orbax(str(tmp_path / "ours"), tree)
  with ocp.StandardCheckpointer() as c:
    c.save(str(tmp_path / "theirs"), tree)
  ours = ocp.PyTreeCheckpointer().restore(str(tmp_path / "ours"))
  theirs = ocp.PyTreeCheckpointer().restore(str(tmp_path / "theirs"))
  assert ours["bn"] == theirs["bn"] == {} and ours["ls"] == theirs["ls"] == []
  assert ours["n"] is None and theirs["n"] is None
  for k in ("f", "i"):
    assert np.asarray(ours[k]).dtype == np.asarray(theirs[k]).dtype == tree[k].dtype, k
    assert np.asarray(ours[k]) == tree[k]
  assert ours["py"] == theirs["py"] == 7
  back = ofx.restore(str(tmp_path / "ours"))["default"]
  assert back["bn"] == {} and back["ls"] == [] and back["f"].dtype == np.float32


@pytest.mark.parametrize("opt", ["sgd", "chain_clip_scale", "inject_hyperparams_sgd",
                                 "empty_tuple_and_empty_state"])
def test_export_orbax_records_each_empty_node_of_a_subtree_as_orbax_does(tmp_path, opt):
  """A subtree with no leaves but several empty nodes (optax.sgd's state
  ``(EmptyState(), EmptyState())``) was written as one empty node; orbax-checkpoint 0.12
  records each empty node (``opt_state.0``, ``opt_state.1``; ``()`` as ``Tuple``) and its
  StandardCheckpointer refused to restore ours."""
  model = nn.Dense(4)
  params = model.init(jax.random.key(0), jnp.ones((1, 8)))
  tx = {"sgd": optax.sgd(0.1),
        "chain_clip_scale": optax.chain(optax.clip(1.0), optax.scale(0.1)),
        "inject_hyperparams_sgd": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        "empty_tuple_and_empty_state": optax.sgd(0.1)}[opt]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  if opt == "empty_tuple_and_empty_state":
    state = state.replace(opt_state=((), optax.EmptyState()))
  ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
  ofx.export_orbax(ours, state)
  with ocp.StandardCheckpointer() as c:
    c.save(theirs, state)
  read = lambda p: json.load(open(os.path.join(p, "_METADATA"), encoding="utf-8"))["tree_metadata"]
  assert read(ours) == read(theirs)
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  with ocp.StandardCheckpointer() as c:
    got = c.restore(ours, target)
  _same(got, state)
  assert jax.tree.structure(got) == jax.tree.structure(state)
  _same(ofx.restore(ours, {"state": ofx.abstract(state)})["state"], state)


@pytest.mark.parametrize("export", ["export_orbax", "export_safetensors"])
def test_an_export_to_an_object_store_url_is_refused_not_written_here(tmp_path, monkeypatch,
                                                                     export):
  """An export to s3://bucket/x said it wrote s3://bucket/x and wrote a local directory
  named 's3:/bucket/x' under the working directory instead."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=r"writes files to a file system.*'s3://bucket/x' is not"):
    getattr(ofx, export)("s3://bucket/x", {"w": np.ones(3, np.float32)})
  assert os.listdir(tmp_path) == []


def test_export_orbax_chunks_carry_a_crc32c_that_verify_and_orbax_check(tmp_path):
  """A byte flipped inside a chunk of an export decoded into other values, and verify said OK
  ("compressed chunks fail to decode when damaged"). Each chunk now carries a CRC-32C (zarr3's
  crc32c codec), which verify, restore and orbax-checkpoint itself check. On orbax-checkpoint's
  own checkpoints, which carry none, verify's report says that such damage goes unseen."""
  w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)  # compressible: a flip still decodes
  d, theirs = str(tmp_path / "export"), str(tmp_path / "theirs")
  ofx.export_orbax(d, {"w": w})
  with ocp.StandardCheckpointer() as c:
    c.save(theirs, {"w": w})
    np.testing.assert_array_equal(c.restore(d)["w"], w)

  def verify(path):
    out = io.StringIO()
    return cli.main(["verify", path], out=out), out.getvalue()

  rc, out = verify(d)
  assert rc == 0 and "orbax-checkpoint: checked every chunk's CRC-32C" in out, out
  rc, out = verify(theirs)
  assert rc == 0 and "stores no checksums: a damaged byte inside a chunk that still decodes goes" \
      " unseen" in out, out
  chunk = os.path.join(d, "w", "c", "0", "0")
  data = bytearray(open(chunk, "rb").read())
  data[len(data) // 2] ^= 0x55
  open(chunk, "wb").write(bytes(data))
  rc, out = verify(d)
  assert rc == 1 and "CORRUPTED" in out and "'w'" in out and "Digest mismatch" in out, out
  with pytest.raises(ofx.errors.CheckpointCorruptedError, match="Digest mismatch"):
    ofx.restore(d)
  with pytest.raises(ValueError, match="Digest mismatch"), ocp.StandardCheckpointer() as c:
    c.restore(d)
