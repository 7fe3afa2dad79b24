"""Linen partitioning metadata (``nn.Partitioned``, ``nn.LogicallyPartitioned``) and mismatch messages.

MaxText-, T5X- and lm1b-style code keeps params boxed with logical axis names
and maps them to the mesh with axis rules. A box is metadata: ``ofx.abstract``
places its value by the box's names, a boxed state and its ``nn.unbox`` save
the same checkpoint and restore into each other, and a resume onto another
mesh with other rules gives the shardings the example's own init gives.
"""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import orbax_flax as ofx

part = nn.with_logical_partitioning
RULES_A = (("batch", "data"), ("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
RULES_B = (("batch", "data"), ("embed", None), ("mlp", "model"), ("vocab", "model"))


class Tiny(nn.Module):
  """An lm1b-shaped Linen model: embedding and MLP, every param logically partitioned."""

  @nn.compact
  def __call__(self, tokens):
    emb = self.param("embedding", part(nn.initializers.normal(0.02), ("vocab", "embed")),
                     (32, 16))
    x = emb[tokens]
    x = nn.Dense(32, kernel_init=part(nn.initializers.lecun_normal(), ("embed", "mlp")),
                 bias_init=part(nn.initializers.zeros, ("mlp",)))(x)
    x = nn.relu(x)
    x = nn.Dense(16, kernel_init=part(nn.initializers.lecun_normal(), ("mlp", "embed")))(x)
    return x @ emb.T


def _specs(tree):
  return {jax.tree_util.keystr(p): x.sharding for p, x in
          jax.tree_util.tree_flatten_with_path(nn.unbox(tree))[0] if hasattr(x, "sharding")}


def _same_shardings(got, want):
  assert got.keys() == want.keys()
  for k, s in want.items():
    assert got[k].is_equivalent_to(s, 2), (k, got[k], s)


def test_abstract_places_boxed_params_by_their_names_and_the_rules():
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rules = (("embed", "data"), ("mlp", "model"), ("vocab", None))
  init = lambda: Tiny().init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))  # noqa: E731
  shapes = jax.eval_shape(init)
  flax_tree = nn.logical_to_mesh_sharding(nn.get_partition_spec(shapes), mesh, rules)
  want = _specs(jax.jit(init, out_shardings=flax_tree)())  # what jax and flax place
  with nn.logical_axis_rules(rules):
    from_context = ofx.abstract(shapes, mesh)
  from_argument = ofx.abstract(shapes, mesh, rules=rules)
  from_flax_tree = ofx.abstract(shapes, flax_tree)  # a prefix of the boxed tree, as jit takes it
  for target in (from_context, from_argument, from_flax_tree):
    _same_shardings(_specs(target), want)
    assert isinstance(target["params"]["Dense_0"]["kernel"], nn.LogicallyPartitioned)
    assert target["params"]["Dense_0"]["kernel"].names == ("embed", "mlp")
  assert want["['params']['Dense_0']['kernel']"].spec == jax.P("data", "model")
  # PartitionSpecs under jax.set_mesh, as jit takes them there (flax's logical_to_mesh tree).
  with jax.set_mesh(mesh):
    from_specs = ofx.abstract(shapes, nn.logical_to_mesh(nn.get_partition_spec(shapes), rules))
  _same_shardings(_specs(from_specs), want)
  with pytest.raises(ValueError, match=r"names no devices outside `with jax.set_mesh"):
    ofx.abstract(shapes, nn.logical_to_mesh(nn.get_partition_spec(shapes), rules))
  # nn.Partitioned names mesh axes directly.
  boxed = {"w": nn.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None))}
  assert ofx.abstract(boxed, mesh)["w"].value.sharding.spec == jax.P("data", None)


def test_logical_names_without_rules_are_refused_not_replicated():
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  shapes = jax.eval_shape(lambda: Tiny().init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  with pytest.raises(ValueError, match=r"LogicallyPartitioned.*no\s+logical axis rules"):
    ofx.abstract(shapes, mesh)


def _state(params):
  return train_state.TrainState.create(apply_fn=Tiny().apply, params=params, tx=optax.adam(1e-3))


def test_a_box_is_metadata_boxed_and_unboxed_restore_each_other(tmp_path):
  params = Tiny().init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  boxed, unboxed = _state(params), _state(nn.unbox(params))
  for name, saved, target in (("u", unboxed, boxed), ("b", boxed, unboxed)):
    path = str(tmp_path / name)
    ofx.save(path, {"state": saved})
    got = ofx.restore(path, {"state": ofx.abstract(target)})["state"]
    # The target's structure comes back: boxes (with their names) where the target had them.
    assert jax.tree.structure(got) == jax.tree.structure(target)
    for a, b in zip(jax.tree.leaves(nn.unbox(got)), jax.tree.leaves(nn.unbox(saved))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  got = ofx.restore(str(tmp_path / "u"), {"state": ofx.abstract(boxed)})["state"]
  assert got.params["Dense_0"]["kernel"].names == ("embed", "mlp")
  # Both save the same keys: a box adds no "value" level.
  keys = lambda p: [jax.tree_util.keystr(k) for k, _ in  # noqa: E731
                    jax.tree_util.tree_flatten_with_path(ofx.metadata(p).items["state"].tree)[0]]
  assert keys(str(tmp_path / "u")) == keys(str(tmp_path / "b"))
  assert "['params']['Dense_0']['kernel']" in keys(str(tmp_path / "b"))


def test_a_checkpoint_that_stored_box_values_keeps_reading(tmp_path):
  """Checkpoints saved boxed before boxes were metadata hold ``.../kernel/value``."""
  params = Tiny().init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  boxed = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
  old = jax.tree.map(lambda b: {"value": b.value} if boxed(b) else b, params, is_leaf=boxed)
  path = str(tmp_path / "old")
  ofx.save(path, {"params": old})
  for target in (params, nn.unbox(params)):
    got = ofx.restore(path, {"params": ofx.abstract(target)})["params"]
    assert jax.tree.structure(got) == jax.tree.structure(target)
    for a, b in zip(jax.tree.leaves(nn.unbox(got)), jax.tree.leaves(nn.unbox(params))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class MLP(nn.Module):
  dtype: jnp.dtype = jnp.float32
  layers: int = 5

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = nn.Dense(16, param_dtype=self.dtype)(x)
    return x


def _mlp_state(dtype=jnp.float32, layers=5):
  model = MLP(dtype, layers)
  params = model.init(jax.random.key(0), jnp.ones((1, 16), dtype))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def _resume_lines(directory, state, caplog, **policy):
  """What a user sees resuming ``state`` through the callback: WARNINGs and the error."""
  caplog.clear()
  error = ""
  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    try:
      with ofx.CheckpointCallback(directory, ofx.CheckpointPolicy(save_interval_steps=10,
                                                                  **policy)) as ckpt:
        ckpt.restore_or_init(state)
    except ofx.TreeMismatchError as e:
      error = str(e)
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING], error


def test_a_dtype_change_is_told_once_per_kind_not_once_per_leaf(tmp_path, caplog):
  directory = str(tmp_path / "run")
  with ofx.CheckpointCallback(directory, ofx.CheckpointPolicy(save_interval_steps=10)) as ckpt:
    ckpt.on_step_end(10, ckpt.restore_or_init(_mlp_state()))
  warnings, error = _resume_lines(directory, _mlp_state(jnp.bfloat16), caplog)
  lines = error.splitlines()
  assert len(lines) <= 4, error  # 30 float arrays: a diagnosis, one line for the kind, the fix
  assert "float32 in checkpoint, bfloat16 in target" in lines[1] and "29 more like it" in lines[1]
  assert "CheckpointPolicy(allow_lossy_casts=True)" in lines[-1] and "partial" not in error
  warnings, error = _resume_lines(directory, _mlp_state(jnp.bfloat16), caplog,
                                  allow_lossy_casts=True)
  assert not error and len(warnings) == 1, warnings
  assert "converted from float32 (checkpoint) to bfloat16" in warnings[0]
  assert "29 more arrays like it" in warnings[0]


def test_a_mismatch_leads_with_a_diagnosis_and_advice_for_the_api_called(tmp_path, caplog):
  directory = str(tmp_path / "run")
  with ofx.CheckpointCallback(directory, ofx.CheckpointPolicy(save_interval_steps=10)) as ckpt:
    ckpt.on_step_end(10, ckpt.restore_or_init(_mlp_state()))
  # Another model (more layers) resumed in this workdir: the callback cannot pass partial=True.
  _, error = _resume_lines(directory, _mlp_state(layers=8), caplog)
  lines = error.splitlines()
  assert "the target has 18 key(s) the checkpoint lacks" in lines[0], lines[0]
  assert len(lines) <= 4, error
  assert "partial=True" not in error and "--workdir" in lines[-1]
  # Another model with other module names: keys on both sides.
  renamed = _mlp_state()
  renamed = renamed.replace(params={"encoder_" + k: v for k, v in renamed.params.items()})
  renamed = renamed.replace(opt_state=renamed.tx.init(renamed.params))
  _, error = _resume_lines(directory, renamed, caplog)
  assert "a different model: 30 key(s) only in the target" in error.splitlines()[0], error
  # A state of another kind entirely (a plain pytree against a TrainState).
  _, error = _resume_lines(directory, {"encoder": {"w": jnp.zeros(3)}}, caplog)
  assert "other items" in error.splitlines()[0] and "different workdir" in error.splitlines()[0]
  # ofx.restore of a subset: there partial=True is the fix.
  step_dir = str(tmp_path / "run" / "checkpoints" / "10")
  params = dict(_mlp_state().params)
  del params["Dense_4"]
  with pytest.raises(ofx.TreeMismatchError) as e:
    ofx.restore(step_dir, {"params": ofx.abstract(params)})
  assert "subset of the checkpoint (2 key(s) left out)" in str(e.value).splitlines()[0]
  assert "partial=True" in str(e.value).splitlines()[-1]
  got = ofx.restore(step_dir, {"params": ofx.abstract(params)}, partial=True)["params"]
  assert sorted(got) == sorted(params)
  # Arrays inside variables on one side only ('.../value': an NNX state against a Linen one).
  plain = str(tmp_path / "plain")
  ofx.save(plain, {"params": {"w": np.ones(2), "b": np.zeros(2)}})
  with pytest.raises(ofx.TreeMismatchError, match="boxed against unboxed") as e:
    ofx.restore(plain, {"params": {"w": {"value": np.ones(2)}, "b": {"value": np.zeros(2)}}})
  assert len(str(e.value).splitlines()) <= 6
