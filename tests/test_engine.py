"""Round trips through real tensorstore files: leaves, containers, shardings."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

import engine_worker
import orbax_flax as ofx

DTYPES = ["bool", "int2", "int4", "int8", "int16", "int32", "uint2", "uint4", "uint8", "uint16",
          "uint32", "float16", "bfloat16", "float32", "complex64", "float8_e4m3fn",
          "float8_e5m2", "float8_e4m3b11fnuz", "float8_e4m3fnuz", "float8_e5m2fnuz",
          "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "float4_e2m1fn"]
DTYPES_X64 = ["int64", "uint64", "float64", "complex128"]


def _dtype(name):
  return np.dtype(getattr(ml_dtypes, name, None) or name)


def _values(name, shape, seed=0):
  rng = np.random.default_rng(seed)
  dtype = _dtype(name)
  if dtype == np.bool_:
    return rng.integers(0, 2, shape).astype(bool)
  if dtype.kind in "iu" or name.startswith(("int", "uint")):
    info = ml_dtypes.iinfo(dtype) if name in ("int2", "int4", "uint2", "uint4") else np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100) + 1, shape).astype(dtype)
  x = rng.standard_normal(shape)
  if dtype.kind == "c":
    x = x + 1j * rng.standard_normal(shape)
  return np.abs(x).astype(dtype) if "e8m0" in name else x.astype(dtype)


def _mesh():
  """(2, 4) over the 8 CPU devices, or every device there is, so that the dtype tests run on
  an accelerator too (conftest.py)."""
  return engine_worker.make_mesh()


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _assert_same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  assert a.tobytes() == b.tobytes()  # bitwise, NaNs included


@pytest.mark.parametrize("how", ["save", "memcpy", "device_copy"])
@pytest.mark.parametrize("name", DTYPES)
def test_every_dtype_round_trips_bitwise(ckpt_dir, name, how):
  """A blocking save, and an async save through each of the CPU's snapshots (the staging copy,
  XLA's copy of the arrays)."""
  mesh = _mesh()
  host = _values(name, (16, 8))
  sharded = jax.device_put(host, NamedSharding(mesh, P("data", "model")))
  big = jax.device_put(_values(name, (512, 1024), seed=1), NamedSharding(mesh, P("model")))
  items = {"s": {"sharded": sharded, "big": big, "np": host, "scalar": host[0, 0],
                 "zero_d": jax.device_put(host[0, 0]), "empty": np.zeros((0, 4), host.dtype)}}
  if how == "save":
    ofx.save(ckpt_dir, items)
  else:
    with ofx.Checkpointer(host_transfer=how) as ckptr:
      assert ckptr.save_async(ckpt_dir, items).transfer == how
  on_host = ofx.restore(ckpt_dir)["s"]
  _assert_same(on_host["sharded"], host)
  _assert_same(on_host["big"], big)
  _assert_same(on_host["np"], host)
  assert on_host["scalar"].dtype == host.dtype and on_host["scalar"].tobytes() == host[0, 0].tobytes()
  _assert_same(on_host["empty"], items["s"]["empty"])
  restored = ofx.restore(ckpt_dir, {"s": _abstract({k: items["s"][k] for k in ("sharded", "big", "zero_d")})},
                         partial=True)["s"]
  for k in ("sharded", "big", "zero_d"):
    assert restored[k].sharding == items["s"][k].sharding
    _assert_same(restored[k], items["s"][k])


@pytest.mark.parametrize("name", DTYPES_X64)
def test_64_bit_dtypes_with_x64(ckpt_dir, name):
  host = _values(name, (8, 8))
  with jax.enable_x64(True):
    x = jax.device_put(host, NamedSharding(_mesh(), P("data")))
    ofx.save(ckpt_dir, {"s": {"x": x, "np": host}})
    restored = ofx.restore(ckpt_dir, {"s": {"x": _abstract(x), "np": host}})["s"]
    assert np.asarray(x).dtype == host.dtype  # x64 is on: the device holds 64-bit values
    if jax.devices()[0].platform == "cpu":
      _assert_same(restored["x"], host)
    else:  # a TPU keeps float64 in its own format: within 2e-15 of the host's values (a v5e)
      np.testing.assert_allclose(np.asarray(x), host, rtol=1e-14)
    _assert_same(restored["x"], np.asarray(x))  # bitwise what the device held
    _assert_same(restored["np"], host)


def test_a_64_bit_device_target_with_x64_off_is_a_checked_conversion(ckpt_dir):
  """x64 off: a target asking for int64/uint64/float64 on devices got 32-bit arrays with
  wrapped values and no error (device_put narrowed them). Now it is a conversion like any
  other: refused when it loses information, done and reported with allow_lossy_casts."""
  assert not jax.config.jax_enable_x64
  state = {"tokens": np.array([2**40 + 5, -3], np.int64), "u": np.array([2**63 + 1], np.uint64),
           "w": np.array([0.1, 1e300], np.float64), "small": np.array([7, -7], np.int64)}
  ofx.save(ckpt_dir, {"s": state})
  sharding = NamedSharding(_mesh(), P())
  target = {"s": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                  for k, v in state.items()}}
  with pytest.raises(ofx.TreeMismatchError, match="jax_enable_x64 off") as e:
    ofx.restore(ckpt_dir, target)
  assert sorted(d.split(":")[0] for d in e.value.differences) == ["s/small", "s/tokens", "s/u",
                                                                    "s/w"]
  casts = []
  got = ofx.restore(ckpt_dir, target, allow_lossy_casts=True, casts=casts)["s"]
  assert {k: str(v.dtype) for k, v in got.items()} == {"tokens": "int32", "u": "uint32",
                                                       "w": "float32", "small": "int32"}
  assert np.asarray(got["small"]).tolist() == [7, -7]
  assert np.asarray(got["tokens"]).tolist() == state["tokens"].astype(np.int32).tolist()
  assert sorted(c[0] for c in casts) == ["s/small", "s/tokens", "s/u", "s/w"]
  assert all(not c[3] for c in casts)  # each reported as losing information


def test_casts_numpy_calls_safe_but_that_round_are_refused(ckpt_dir):
  """int64/uint64 -> float64 and int8 -> float8_e4m3fn are "safe" to numpy and ml_dtypes but
  round (2**53 + 1, 17): they were done without allow_lossy_casts and reported as exact."""
  state = {"big": np.array([2**53 + 1, 5], np.int64), "ubig": np.array([2**64 - 1], np.uint64),
           "q": np.array([17, 19, 127], np.int8), "ok": np.array([-2**31, 7], np.int32)}
  ofx.save(ckpt_dir, {"s": state})
  f8 = ml_dtypes.float8_e4m3fn
  sharding = NamedSharding(_mesh(), P())
  target = {"s": {"big": np.zeros(2, np.float64), "ubig": np.zeros(1, np.float64),
                  "q": jax.ShapeDtypeStruct((3,), f8, sharding=sharding),
                  "ok": np.zeros(2, np.float64)}}
  with pytest.raises(ofx.TreeMismatchError) as e:
    ofx.restore(ckpt_dir, target)
  assert sorted(d.split(":")[0] for d in e.value.differences) == ["s/big", "s/q", "s/ubig"]
  casts = []
  got = ofx.restore(ckpt_dir, target, allow_lossy_casts=True, casts=casts)["s"]
  assert {c[0]: c[3] for c in casts} == {"s/big": False, "s/ubig": False, "s/q": False,
                                         "s/ok": True}
  assert np.asarray(got["ok"]).tolist() == [-2**31, 7]  # int32 -> float64 is exact
  assert np.asarray(got["q"]).astype(np.float32).tolist() == [16, 20, 128]


def test_sub_byte_types_widen_exactly_without_allow_lossy_casts(ckpt_dir):
  """int4 weights dequantised into int8, float32 or bfloat16 (and uint4, int2, float4_e2m1fn
  likewise) were refused as losing information: numpy calls ml_dtypes' types kind "V", so
  their check went over all 256 byte patterns, most of them no value of the type; and
  ml_dtypes' table lacks float4_e2m1fn -> float16. Each widens exactly, reported so; a real
  narrowing (int4 -> uint8, float4_e2m1fn -> int8) is still refused."""
  state = {"i4": np.arange(-8, 8).astype(ml_dtypes.int4),
           "u4": np.arange(16).astype(ml_dtypes.uint4),
           "i2": np.arange(-2, 2).astype(ml_dtypes.int2),
           "f4": np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)}
  ofx.save(ckpt_dir, {"s": state})
  sharding = NamedSharding(_mesh(), P())
  target = {"s": {"i4": np.zeros(16, np.int8),
                  "u4": jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=sharding),
                  "i2": np.zeros(4, np.float32), "f4": np.zeros(16, np.float16)}}
  casts = []
  got = ofx.restore(ckpt_dir, target, casts=casts)["s"]
  assert all(c[3] for c in casts) and len(casts) == 4, casts
  for name in state:
    assert np.array_equal(np.asarray(got[name]).astype(np.float32),
                          state[name].astype(np.float32)), name
  with pytest.raises(ofx.TreeMismatchError) as e:
    ofx.restore(ckpt_dir, {"s": {**target["s"], "i4": np.zeros(16, np.uint8),
                                 "f4": np.zeros(16, np.int8)}})
  assert sorted(d.split(":")[0] for d in e.value.differences) == ["s/f4", "s/i4"]


def test_a_python_scalar_restores_into_any_dtype_that_holds_its_value(ckpt_dir):
  """TrainState.create's step is the Python int 0 until a jitted step runs; a target from
  jax.eval_shape asks for int32. It was judged as int64 and refused as losing information."""
  ofx.save(ckpt_dir, {"s": {"step": 0, "big": 2**40, "lr": 0.5, "x": 0.1}})
  sharding = NamedSharding(_mesh(), P())
  i32 = lambda: jax.ShapeDtypeStruct((), np.int32, sharding=sharding, weak_type=True)  # noqa: E731
  f32 = jax.ShapeDtypeStruct((), np.float32, sharding=sharding)
  target = {"s": {"step": i32(), "big": i32(), "lr": f32, "x": f32}}
  with pytest.raises(ofx.TreeMismatchError) as e:
    ofx.restore(ckpt_dir, target)
  assert sorted(d.split(":")[0] for d in e.value.differences) == ["s/big", "s/x"]
  del target["s"]["big"], target["s"]["x"]
  got = ofx.restore(ckpt_dir, target, partial=True)["s"]
  assert got["step"].dtype == np.int32 and int(got["step"]) == 0 and got["step"].weak_type
  assert got["lr"].dtype == np.float32 and float(got["lr"]) == 0.5
  assert int(jax.jit(lambda s: s + 1)(got["step"])) == 1


def test_a_64_bit_save_dtype_for_device_arrays_with_x64_off_is_refused(ckpt_dir):
  """x64 off: save(..., dtype="float64") of a jax.Array left it float32 (astype cannot make
  64-bit device arrays) and recorded a cast that never happened; numpy leaves were cast."""
  assert not jax.config.jax_enable_x64
  x = jax.device_put(np.ones((4, 4), np.float32), NamedSharding(_mesh(), P("data")))
  with pytest.raises(ValueError, match=r"s/x.*float64.*jax_enable_x64") as e:
    ofx.save(ckpt_dir, {"s": {"x": x, "h": np.ones(2, np.float32)}}, dtype="float64")
  assert "jax.device_get" in str(e.value)
  assert not os.path.exists(ckpt_dir)  # refused before anything was written
  ofx.save(ckpt_dir, {"s": {"h": np.ones(2, np.float32)}}, dtype="float64")  # numpy: cast
  meta = ofx.metadata(ckpt_dir)
  assert meta.items["s"].tree["h"].dtype == "float64" and meta.casts == {"s/h": "float32"}


@pytest.mark.parametrize("spec", [P("data", "model"), P("data", None), P(None, "model"), P(),
                                  P(("data", "model"))])
def test_shardings_restore_onto_other_meshes(ckpt_dir, spec):
  mesh = _mesh()
  host = _values("float32", (64, 32))
  x = jax.device_put(host, NamedSharding(mesh, spec))
  single = jax.device_put(host, jax.devices()[3])
  ofx.save(ckpt_dir, {"s": {"x": x, "single": single}})
  targets = [
      NamedSharding(jax.make_mesh((8,), ("a",)), P(None, "a")),
      NamedSharding(jax.make_mesh((4,), ("a",), devices=jax.devices()[4:]), P("a")),
      NamedSharding(jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4]), P("b", "a")),
      NamedSharding(mesh, P()),
      SingleDeviceSharding(jax.devices()[5]),
  ]
  for sharding in targets:
    target = {"s": {k: jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=sharding) for k in ("x", "single")}}
    restored = ofx.restore(ckpt_dir, target)["s"]
    for k in ("x", "single"):
      assert restored[k].sharding == sharding
      for shard in restored[k].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])


def test_concrete_arrays_as_target_and_dtype_cast(ckpt_dir):
  mesh = _mesh()
  host = _values("float32", (64, 32))
  ofx.save(ckpt_dir, {"s": {"x": jax.device_put(host, NamedSharding(mesh, P("data")))}})
  like = jnp.zeros((64, 32), jnp.bfloat16, device=NamedSharding(mesh, P("model")))
  with pytest.raises(ofx.TreeMismatchError, match=r"s/x: float32 in checkpoint, bfloat16 in target.*allow_lossy_casts"):
    ofx.restore(ckpt_dir, {"s": {"x": like}})
  restored = ofx.restore(ckpt_dir, {"s": {"x": like}}, allow_lossy_casts=True)["s"]["x"]
  assert restored.dtype == jnp.bfloat16 and restored.sharding == like.sharding
  np.testing.assert_array_equal(np.asarray(restored), host.astype(jnp.bfloat16))
  as_np = ofx.restore(ckpt_dir, {"s": {"x": np.zeros((64, 32), np.float64)}})["s"]["x"]
  assert isinstance(as_np, np.ndarray) and as_np.dtype == np.float64
  np.testing.assert_array_equal(as_np, host.astype(np.float64))


def test_prng_keys(ckpt_dir):
  mesh = _mesh()
  key = jax.random.key(42)
  keys = jax.device_put(jax.random.split(key, 8), NamedSharding(mesh, P(("data", "model"))))
  rbg = jax.random.key(3, impl="rbg")
  ofx.save(ckpt_dir, {"rng": {"key": key, "keys": keys, "rbg": rbg}})
  target = {"rng": {"key": _abstract(key), "rbg": _abstract(rbg),
                    "keys": jax.ShapeDtypeStruct((8,), keys.dtype,
                                                 sharding=NamedSharding(jax.make_mesh((4,), ("x",), devices=jax.devices()[:4]), P("x")))}}
  restored = ofx.restore(ckpt_dir, target)["rng"]
  for k, want in (("key", key), ("keys", keys), ("rbg", rbg)):
    assert restored[k].dtype == want.dtype
    np.testing.assert_array_equal(jax.random.key_data(restored[k]), jax.random.key_data(want))
  np.testing.assert_array_equal(jax.random.normal(restored["key"], (3,)), jax.random.normal(key, (3,)))
  host = ofx.restore(ckpt_dir)["rng"]
  assert host["keys"].dtype == keys.dtype
  np.testing.assert_array_equal(jax.random.key_data(host["keys"]), jax.random.key_data(keys))


class _MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


def _train_state(tx):
  model = _MLP()
  params = model.init(jax.random.key(0), jnp.ones((1, 8)))
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


@pytest.mark.parametrize("tx", [
    optax.adam(1e-3),
    optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)),
    optax.masked(optax.sgd(0.1, momentum=0.9), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4),
], ids=["adam", "chain_inject", "masked", "multisteps"])
def test_flax_train_state_with_optax_states(ckpt_dir, tx):
  state = _train_state(tx)
  grads = jax.tree.map(jnp.ones_like, state.params)
  state = state.apply_gradients(grads=grads)
  ofx.save(ckpt_dir, {"state": state})
  fresh = _train_state(tx)
  restored = ofx.restore(ckpt_dir, {"state": fresh})["state"]
  assert type(restored) is type(state) and restored.step == 1
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Params alone, written as plain dicts: each item restores without the rest.
  params = ofx.restore(ckpt_dir, {"state": {"params": fresh.params}}, partial=True)["state"]["params"]
  jax.tree.map(np.testing.assert_array_equal, params, state.params)
  # Without a target the structure comes back: namedtuples as namedtuples.
  host = ofx.restore(ckpt_dir)["state"]
  assert host["step"] == 1
  jax.tree.map(np.testing.assert_array_equal, host["params"], jax.device_get(state.params))


def test_nnx_model_and_optimizer_state(ckpt_dir):

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.linear = nnx.Linear(8, 4, rngs=rngs)
      self.bn = nnx.BatchNorm(4, rngs=rngs)

  model = Model(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  _, state = nnx.split(model)
  opt_state = nnx.state(optimizer)
  ofx.save(ckpt_dir, {"model": state, "optimizer": opt_state})
  other = Model(nnx.Rngs(1))
  other_opt = nnx.Optimizer(other, optax.adam(1e-3), wrt=nnx.Param)
  graphdef, abstract = nnx.split(other)
  restored = ofx.restore(ckpt_dir, {"model": abstract, "optimizer": nnx.state(other_opt)})
  assert isinstance(restored["model"], nnx.State)
  nnx.update(other, restored["model"])
  np.testing.assert_array_equal(other.linear.kernel.value, model.linear.kernel.value)
  for a, b in zip(jax.tree.leaves(restored["optimizer"]), jax.tree.leaves(opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_containers_and_scalars_round_trip_without_target(ckpt_dir):
  from collections import namedtuple  # pylint: disable=g-import-not-at-top
  Pt = namedtuple("Pt", ["x", "y"])
  tree = {"list": [1, 2.5, "three", None, b"\x00\xff"], "tuple": (np.int8(-3), np.float32(0.1), True),
          "nt": Pt(np.arange(3), {"deep": [np.ones(2)]}), "complex": 1 + 2j, "big_int": 2**80,
          "nan": float("nan"), "inf": -float("inf"), "empty_dict": {}, "empty_list": [],
          "optax_empty": optax.EmptyState(), "masked": optax.MaskedNode(), 7: "int key"}
  tree = {"t": {str(k): v for k, v in tree.items()}, "ints": {1: np.zeros(2), 2: "b"}}
  ofx.save(ckpt_dir, tree)
  got = ofx.restore(ckpt_dir)
  t = got["t"]
  assert t["list"][:3] == [1, 2.5, "three"] and t["list"][3] is None and t["list"][4] == b"\x00\xff"
  assert t["tuple"][0] == np.int8(-3) and t["tuple"][0].dtype == np.int8
  assert t["tuple"][1] == np.float32(0.1) and t["tuple"][2] is True
  assert type(t["nt"]).__name__ == "Pt" and t["nt"].y["deep"][0].tolist() == [1.0, 1.0]
  assert t["complex"] == 1 + 2j and t["big_int"] == 2**80
  assert np.isnan(t["nan"]) and t["inf"] == -float("inf")
  assert t["empty_dict"] == {} and t["empty_list"] == []
  assert type(t["optax_empty"]).__name__ == "EmptyState" and type(t["masked"]).__name__ == "MaskedNode"
  assert set(got["ints"]) == {1, 2} and got["ints"][2] == "b"


def test_trees_jax_accepts_are_readable_after_an_overwrite(ckpt_dir):
  """Bool dict keys and a namedtuple made with rename=True were saved, even over a good
  checkpoint, into a manifest the reader then refused as "not written by orbax_flax"."""
  from collections import namedtuple  # pylint: disable=g-import-not-at-top
  Renamed = namedtuple("Renamed", ["a", "def", "a"], rename=True)  # fields a, _1, _2
  tree = {"mask": {True: np.ones(2), False: np.zeros(2)},
          "nt": Renamed(np.arange(3), np.float32(2), {"x": np.ones(1)})}
  ofx.save(ckpt_dir, {"good": {"w": np.ones(3)}})
  ofx.save(ckpt_dir, {"state": tree}, overwrite=True)
  assert ofx.verify(ckpt_dir) > 0
  got = ofx.restore(ckpt_dir)["state"]
  assert got["mask"]["True"].tolist() == [1, 1] and got["mask"]["False"].tolist() == [0, 0]
  assert type(got["nt"])._fields == ("a", "_1", "_2")
  assert got["nt"].a.tolist() == [0, 1, 2] and got["nt"]._1 == np.float32(2)
  # With the tree as the target, each leaf comes back where it was saved.
  again = ofx.restore(ckpt_dir, {"state": tree})["state"]
  assert again["mask"][True].tolist() == [1, 1] and again["nt"]._2["x"].tolist() == [1.0]


def test_byte_order_and_numpy_strings(ckpt_dir):
  big_endian = {"small": np.arange(4, dtype=">f4"), "large": np.arange(1 << 19, dtype=">i4"),
                "scalar": np.dtype(">f8").type(1.5), "name": np.str_("abc"), "raw": np.bytes_(b"xy")}
  ofx.save(ckpt_dir, {"s": big_endian})
  got = ofx.restore(ckpt_dir)["s"]
  np.testing.assert_array_equal(got["small"], np.arange(4, dtype=np.float32))
  np.testing.assert_array_equal(got["large"], np.arange(1 << 19, dtype=np.int32))
  assert got["scalar"] == 1.5 and got["name"] == "abc" and got["raw"] == b"xy"


def test_prime_length_arrays_are_not_cut_into_tiny_chunks(ckpt_dir):
  x = np.arange(8388617, dtype=np.float32)  # a prime number of elements, > one chunk
  ofx.save(ckpt_dir, {"s": {"x": x}})
  np.testing.assert_array_equal(ofx.restore(ckpt_dir)["s"]["x"], x)


def test_partial_restore_reads_only_named_items(ckpt_dir):
  ofx.save(ckpt_dir, {"state": {"a": np.ones(3), "b": np.zeros(2)}, "extra": {"epoch": 3}})
  # Destroy the data of "state": restoring "extra" alone still works.
  for root, _, files in os.walk(os.path.join(ckpt_dir, "state")):
    for f in files:
      os.remove(os.path.join(root, f))
  assert ofx.restore(ckpt_dir, {"extra": {"epoch": 0}}) == {"extra": {"epoch": 3}}


def test_file_count_does_not_grow_with_leaves(tmp_path):
  mesh = _mesh()

  def files_for(n):
    path = str(tmp_path / f"c{n}")
    tree = {f"w{i}": jax.device_put(np.full((64, 64), i, np.float32), NamedSharding(mesh, P("data", "model")))
            for i in range(n)}
    tree["big"] = jax.device_put(np.ones((1024, 1024), np.float32), NamedSharding(mesh, P("model")))
    ofx.save(path, {"state": tree})
    return sum(len(f) for _, _, f in os.walk(path))

  # _CHECKPOINT, the OCDBT manifest and one or two data files (OCDBT may
  # flush twice), whether the item has 11 leaves or 1001.
  few, many = files_for(10), files_for(1000)
  assert few <= 5 and many <= 5, (few, many)


def test_metadata_without_data(ckpt_dir):
  mesh = _mesh()
  x = jax.device_put(np.ones((16, 8), np.float32), NamedSharding(mesh, P("data", "model")))
  ofx.save(ckpt_dir, {"state": {"params": {"w": x}, "step": 7}, "rng": {"k": jax.random.key(0)}},
           custom_metadata={"note": "hello"})
  meta = ofx.metadata(ckpt_dir)
  w = meta.items["state"].arrays[0]
  assert (w.path, w.shape, w.dtype, w.nbytes) == ("params/w", (16, 8), "float32", 512)
  assert "'data', 'model'" in w.sharding and "'data': 2" in w.sharding
  assert meta.items["state"].tree["step"] == 7
  assert meta.items["rng"].arrays[0].dtype == "key<threefry2x32>"
  assert meta.custom == {"note": "hello"} and meta.device_count == 8 and meta.process_count == 1
  assert "params/w" in str(meta)


def test_a_host_offloaded_target_restores_into_its_memory_kind(ckpt_dir):
  """Optimizer moments offloaded to pinned host memory: a restore onto the state read every
  byte, then failed in JAX ("Memory kind mismatch"): each shard was put in device memory."""
  mesh = _mesh()
  state = {"w": jax.device_put(np.ones(16, np.float32), NamedSharding(mesh, P("model"))),
           "mu": jax.device_put(np.arange(16.0, dtype=np.float32),
                                NamedSharding(mesh, P("model"), memory_kind="pinned_host"))}
  ofx.save(ckpt_dir, {"state": state})
  got = ofx.restore(ckpt_dir, {"state": ofx.abstract(state)})["state"]
  assert got["mu"].sharding == state["mu"].sharding  # pinned_host, as the target
  assert got["w"].sharding == state["w"].sharding
  _assert_same(got["mu"], np.asarray(state["mu"]))
  moved = jax.jit(lambda w, mu: w + jax.device_put(mu, state["w"].sharding))(got["w"], got["mu"])
  assert np.asarray(moved).tolist() == (np.arange(16.0) + 1).tolist()


def test_a_host_offloaded_prng_key_restores_into_its_memory_kind(ckpt_dir):
  """A typed PRNG key kept in pinned host memory beside offloaded arrays came back in device
  memory: its key data's sharding was rebuilt from the mesh and spec alone."""
  mesh = _mesh()
  keys = jax.random.split(jax.random.key(0), 8)
  state = {"keys": jax.device_put(keys, NamedSharding(mesh, P("model"), memory_kind="pinned_host")),
           "key": jax.device_put(jax.random.key(1), NamedSharding(mesh, P(), memory_kind="pinned_host"))}
  ofx.save(ckpt_dir, {"state": state})
  got = ofx.restore(ckpt_dir, {"state": ofx.abstract(state)})["state"]
  for name in state:
    assert got[name].sharding == state[name].sharding, name  # pinned_host, as the target
    assert np.array_equal(jax.random.key_data(got[name]), jax.random.key_data(state[name]))


@pytest.mark.parametrize("budget", [0, 1024, 1 << 20])
def test_a_converting_restore_onto_another_layout_is_exact_under_any_budget(ckpt_dir, budget):
  """With a budget a converted array is read a stored chunk at a time, each piece converted
  into its place: every box of another sharding must come out as the saved values."""
  mesh = _mesh()
  x = np.arange(37 * 24, dtype=np.int16).reshape(37, 24) - 400
  saved = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P(None, "model")),
                                       lambda i: x[i])
  ofx.save(ckpt_dir, {"s": {"x": saved, "h": x[:5]}})
  target = {"s": {"x": jax.ShapeDtypeStruct(x.shape, np.float32,
                                            sharding=NamedSharding(mesh, P(None, "data"))),
                  "h": np.zeros((5, 24), np.float64)}}
  got = ofx.restore(ckpt_dir, target, max_host_bytes=budget)["s"]
  assert got["x"].dtype == np.float32 and got["x"].sharding == target["s"]["x"].sharding
  np.testing.assert_array_equal(np.asarray(got["x"]), x.astype(np.float32))
  np.testing.assert_array_equal(got["h"], x[:5].astype(np.float64))


def test_a_misspelt_dtype_name_is_refused_naming_it_before_anything_is_written(tmp_path):
  """save(dtype="bf16") and transforms.Cast("w", "bf16") raised AttributeError from ml_dtypes
  ("module 'ml_dtypes' has no attribute 'bf16'"), naming neither the argument nor the fix."""
  path = str(tmp_path / "c")
  with pytest.raises(ValueError, match="dtype 'bf16' is not a name.*'bfloat16'"):
    ofx.save(path, {"s": {"w": np.ones(3, np.float32)}}, dtype="bf16")
  assert not os.path.exists(path)
  ofx.save(path, {"s": {"w": np.ones(3, np.float32)}})
  with pytest.raises(ValueError, match="dtype 'bf16' is not a name"):
    ofx.restore(path, {"s": {"w": np.zeros(3, np.float16)}},
                transforms=[ofx.transforms.Cast("w", "bf16")])


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_a_save_through_a_symbolic_link_writes_where_it_points_and_keeps_the_link(tmp_path, how):
  """`model -> /bigdisk/model`: an overwrite swapped the link itself for a new directory on the
  link's disk (the target kept the old checkpoint, read as current); a link to an empty
  directory (or to nothing yet) was written in full, then refused as "created by someone else
  during the save" (paths review)."""
  def save(path, value, **kw):
    tree = {"s": {"w": np.full(3, value, np.float32)}}
    if how == "save":
      ofx.save(path, tree, **kw)
    else:
      ofx.save_async(path, tree, **kw).wait()

  disk = tmp_path / "bigdisk"
  disk.mkdir()
  target, link = str(disk / "model"), str(tmp_path / "model")
  save(target, 0.0)
  os.symlink(target, link)
  save(link, 1.0, overwrite=True)
  assert os.path.islink(link) and os.readlink(link) == target
  assert ofx.restore(target)["s"]["w"][0] == 1.0 and ofx.restore(link)["s"]["w"][0] == 1.0
  assert sorted(os.listdir(tmp_path)) == ["bigdisk", "model"]  # nothing left beside the link
  for name, made in (("empty", True), ("later", False)):
    dest, link2 = str(disk / name), str(tmp_path / f"to_{name}")
    if made:
      os.makedirs(dest)
    os.symlink(dest, link2)
    save(link2, 2.0)
    assert os.path.islink(link2) and ofx.restore(dest)["s"]["w"][0] == 2.0


@pytest.mark.skipif(os.environ.get("ORBAX_FLAX_FAULTS") != "long",
                    reason="long run: ORBAX_FLAX_FAULTS=long (a 2.1 GB chunk: ~1 min, ~5 GB)")
def test_a_chunk_over_2_gib_restores(tmp_path):
  """A 1-D array of prime length has no chunk shape but itself: stored as one chunk over
  2 GiB, it was read with one pread, which Linux ends at 0x7ffff000 bytes, and the restore
  called the good checkpoint corrupted ("shorter than its index says"). Reads loop."""
  n = 2_147_483_659  # a prime over 2**31
  a = np.empty(n, np.uint8)
  a[:] = 7
  a[::4096] = np.arange(len(a[::4096])) % 251
  path = str(tmp_path / "big")
  ofx.save(path, {"s": {"a": a}})
  probe = a[::4096].copy()
  del a
  got = ofx.restore(path)["s"]["a"]
  assert got.shape == (n,) and np.array_equal(got[::4096], probe) and got[-1] == 7
  del got
  assert ofx.verify(path) == n


@pytest.mark.parametrize("budget", [0, 1000, 1 << 20])
def test_transforms_read_in_slabs_under_a_budget_give_the_same_values(ckpt_dir, budget):
  """With max_host_bytes a cast or a transpose reads its box in slabs of rows within the
  budget (one row a slab at 1000 bytes): the values are those of a read without a budget,
  for a chain of both, onto a sharded target too."""
  x = np.arange(64 * 48, dtype=np.float32).reshape(64, 48) / 7
  layers = np.arange(2 * 16 * 16, dtype=np.float32).reshape(2, 16, 16) / 3  # a row > 1000 B
  ofx.save(ckpt_dir, {"s": {"w": x, "v": x[:, :5].copy(), "z": np.float32(2.5), "l": layers}})
  t = ofx.transforms
  got = ofx.restore(ckpt_dir, max_host_bytes=budget,
                    transforms=[t.Cast("l", "bfloat16"), t.Transpose("l", (0, 2, 1))])["s"]["l"]
  np.testing.assert_array_equal(got, layers.astype(jnp.bfloat16).transpose(0, 2, 1))
  for transforms, want in (([t.Transpose("w")], x.T),
                           ([t.Cast(".*", "bfloat16")], x.astype(jnp.bfloat16)),
                           ([t.Cast(".*", "bfloat16"), t.Transpose("w", (1, 0))],
                            x.astype(jnp.bfloat16).T)):
    got = ofx.restore(ckpt_dir, max_host_bytes=budget, transforms=transforms)["s"]
    assert got["w"].dtype == want.dtype and got["w"].shape == want.shape
    np.testing.assert_array_equal(np.asarray(got["w"]), want)
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  target = {"s": {"w": jax.ShapeDtypeStruct((48, 64), jnp.bfloat16,
                                            sharding=NamedSharding(mesh, P("a", "b"))),
                  "v": np.zeros((64, 5), jnp.bfloat16), "z": np.float32(0),
                  "l": np.zeros((2, 16, 16), jnp.bfloat16)}}
  got = ofx.restore(ckpt_dir, target, max_host_bytes=budget,
                    transforms=[t.Cast(".*", "bfloat16"), t.Transpose("w")])["s"]
  np.testing.assert_array_equal(np.asarray(got["w"]), x.astype(jnp.bfloat16).T)
  np.testing.assert_array_equal(got["v"], x[:, :5].astype(jnp.bfloat16))


def test_python_float_nans_keep_their_sign_and_payload(ckpt_dir):
  """A Python float leaf was stored as float.hex(), which writes every NaN as 'nan': a
  negative NaN, one with a payload, a signalling one, came back as the plain NaN. Their
  64 bits come back now (complex parts too); the plain NaN and other floats are written as
  before, so older readers read them."""
  import struct  # pylint: disable=g-import-not-at-top
  as_float = lambda bits: struct.unpack("<d", struct.pack("<Q", bits))[0]  # noqa: E731
  bits_of = lambda x: struct.unpack("<Q", struct.pack("<d", x))[0]  # noqa: E731
  patterns = [0xFFF8000000000000, 0x7FF8000000000001, 0x7FF0000000000001, 0x7FF8000000000000]
  values = {f"n{i}": as_float(b) for i, b in enumerate(patterns)}
  values.update(z=-0.0, c=complex(as_float(0xFFF8000000000123), 1.5), inf=float("-inf"))
  ofx.save(ckpt_dir, {"v": values})
  got = ofx.restore(ckpt_dir)["v"]
  for i, b in enumerate(patterns):
    assert bits_of(got[f"n{i}"]) == b, (i, hex(bits_of(got[f"n{i}"])))
  assert bits_of(got["c"].real) == 0xFFF8000000000123 and got["c"].imag == 1.5
  assert bits_of(got["z"]) == bits_of(-0.0) and got["inf"] == float("-inf")
  manifest = open(os.path.join(ckpt_dir, "_CHECKPOINT"), "rb").read()
  assert b'"nan"' in manifest and b"nan:7ff8000000000001" in manifest  # plain NaN as before


def test_bool_arrays_whose_bytes_are_not_0_or_1_are_saved_as_their_booleans(ckpt_dir, tmp_path):
  """np.frombuffer(..., bool) of bytes 0, 1, 2, 255: saved as they were, a restore through
  tensorstore (an object store's, orbax-checkpoint's) and export_orbax's output refused them
  as damage ('Invalid bool value: 2'). They are stored as the booleans they hold, 0/1."""
  raw = np.frombuffer(bytes([0, 1, 2, 255] * 64), dtype=np.bool_).reshape(16, 16)
  want = raw.view(np.uint8) != 0
  ofx.save(ckpt_dir, {"s": {"m": raw, "small": raw[:2, :2].copy()}})
  got = ofx.restore(ckpt_dir)["s"]
  assert got["m"].view(np.uint8).tolist() == want.view(np.uint8).tolist()
  np.testing.assert_array_equal(got["small"], want[:2, :2])
  out = ofx.export_orbax(str(tmp_path / "o"), {"m": raw})
  np.testing.assert_array_equal(ofx.restore(out)["default"]["m"], want)  # tensorstore's read
