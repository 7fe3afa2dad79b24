"""After every kind of resume, the user's own jitted step runs on the restored state.

Equal values are not enough: a leaf restored onto the wrong devices, or
committed where the original was not, makes the first step after a resume fail
("Received incompatible devices for jitted computation"). Each case builds the
state the way users build it and trains one step on what came back:

* the README's pattern: parameters ``device_put`` replicated on a mesh, then
  ``TrainState.create(tx=optax.adam)``, whose ``count`` is an *uncommitted*
  scalar;
* ``jax.jit(init, out_shardings=...)``: everything committed to the mesh;
* NNX: a module and ``nnx.Optimizer`` with its parameters placed on a mesh.
"""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_flax as ofx

_QUIET = dict(save_final_step=False, save_on_preemption=False, save_on_exception=False)


class _Dense(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(x)


def _readme_state(mesh, seed=0):
  """The README's pattern: replicated params, then TrainState.create (count uncommitted)."""
  m = _Dense()
  params = jax.device_put(m.init(jax.random.key(seed), jnp.ones((1, 4))), NamedSharding(mesh, P()))
  return train_state.TrainState.create(apply_fn=m.apply, params=params, tx=optax.adam(1e-3))


def _jit_init_state(mesh, seed=0):
  """jax.jit(init, out_shardings=...): every leaf committed to the mesh."""
  m = _Dense()

  def init():
    params = m.init(jax.random.key(seed), jnp.ones((1, 4)))
    return train_state.TrainState.create(apply_fn=m.apply, params=params, tx=optax.adam(1e-3))

  shapes = jax.eval_shape(init)
  shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), shapes)
  return jax.jit(init, out_shardings=shardings)()


_BUILDERS = {"readme": _readme_state, "jit_out_shardings": _jit_init_state}


@jax.jit
def _train_step(state):
  grads = jax.tree.map(jnp.ones_like, state.params)
  return state.apply_gradients(grads=grads)


def _trained(state, steps=2):
  for _ in range(steps):
    state = _train_step(state)
  return state


def _assert_trains_and_equals(restored, saved):
  """The restored state trains one step, and that step equals the same step on the saved state."""
  np.testing.assert_array_equal(np.asarray(restored.opt_state[0].count),
                                np.asarray(saved.opt_state[0].count))
  for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
    if hasattr(y, "aval") and hasattr(x, "aval"):
      assert x.aval.weak_type == y.aval.weak_type  # a TrainState's step is weakly typed
  after = _train_step(restored)  # raises "incompatible devices" when placement is wrong
  expected = _train_step(saved)
  for x, y in zip(jax.tree.leaves(after), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _mesh(n=None):
  """A mesh of the first ``n`` devices (every device by default: 8 simulated CPU devices here,
  the chips of an accelerator machine, see conftest.py)."""
  n = n or len(jax.devices())
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


@pytest.mark.parametrize("build", sorted(_BUILDERS))
@pytest.mark.parametrize("where", ["persistent", "local_tier"])
def test_callback_resume_trains_on(tmp_path, build, where):
  mesh = _mesh()
  local = dict(local_directory=str(tmp_path / "shm"), local_save_interval_steps=1) if where == "local_tier" else {}
  policy = ofx.CheckpointPolicy(save_interval_steps=2, **local, **_QUIET)
  with ofx.CheckpointCallback(str(tmp_path / "run"), policy) as ckpt:
    state = ckpt.restore_or_init(_BUILDERS[build](mesh))
    state = _trained(state)
    ckpt.on_step_end(2, state, {})
  saved = state
  template = _BUILDERS[build](mesh, seed=1)
  _train_step(template)  # the job compiles its step for the state it builds
  compiled = _train_step._cache_size()  # pylint: disable=protected-access
  with ofx.CheckpointCallback(str(tmp_path / "run"), policy) as ckpt:
    restored = ckpt.restore_or_init(template)
    assert ckpt.restored_step == 2
  _train_step(restored)
  # The step compiled for the state the job built takes the restored one as it is: the
  # restored step counter is weakly typed as TrainState.create made it (it was not, and the
  # step compiled again after every resume).
  assert _train_step._cache_size() == compiled  # pylint: disable=protected-access
  _assert_trains_and_equals(restored, saved)


@pytest.mark.parametrize("build", sorted(_BUILDERS))
def test_resume_onto_another_mesh_trains_on(tmp_path, build):
  saved = _trained(_BUILDERS[build](_mesh()))
  path = str(tmp_path / "ckpt")
  ofx.save(path, {"state": saved})
  half = max(1, len(jax.devices()) // 2)  # 8 -> 4 devices (one chip: the same one)
  target = _BUILDERS[build](_mesh(half), seed=1)
  restored = ofx.restore(path, {"state": ofx.abstract(target)})["state"]
  assert restored.params["params"]["Dense_0"]["kernel"].sharding.mesh.size == half
  _assert_trains_and_equals(restored, saved)


@pytest.mark.parametrize("build", sorted(_BUILDERS))
def test_orbax_checkpoint_resume_trains_on(tmp_path, build):
  saved = _trained(_BUILDERS[build](_mesh()))
  path = str(tmp_path / "ocp")
  with ocp.StandardCheckpointer() as c:
    c.save(path, saved)
  restored = ofx.restore(path, {"state": ofx.abstract(_BUILDERS[build](_mesh(), seed=1))})["state"]
  _assert_trains_and_equals(restored, saved)


def test_uncommitted_leaf_restores_uncommitted_and_committed_stays_committed(tmp_path):
  mesh = _mesh()
  state = {"count": jnp.zeros((), jnp.int32),
           "pinned": jax.device_put(jnp.ones(3), jax.devices()[-1]),
           "w": jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))}
  path = str(tmp_path / "ckpt")
  ofx.save(path, {"state": state})
  for target in (state, ofx.abstract(state)):
    out = ofx.restore(path, {"state": target})["state"]
    assert not out["count"].committed
    assert out["pinned"].committed and out["pinned"].devices() == {jax.devices()[-1]}
    assert out["w"].sharding == state["w"].sharding
    jax.jit(lambda s: s["w"] + s["count"])(out)  # usable beside the mesh


def test_safetensors_params_into_readme_state_trains_on(tmp_path):
  mesh = _mesh()
  saved = _trained(_readme_state(mesh))
  path = str(tmp_path / "st")
  ofx.export_safetensors(path, jax.device_get(saved.params))
  fresh = _readme_state(mesh, seed=1)
  params = ofx.restore(path, {"params": ofx.abstract(fresh.params)})["params"]
  restored = fresh.replace(params=params)
  after = _train_step(restored)
  np.testing.assert_array_equal(np.asarray(jax.tree.leaves(after.params)[0]),
                                np.asarray(jax.tree.leaves(_train_step(saved.replace(
                                    opt_state=fresh.opt_state, step=fresh.step)).params)[0]))


class _NnxModel(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 8, rngs=rngs)

  def __call__(self, x):
    return self.linear(x)


def _nnx_make(mesh, seed):
  model = _NnxModel(nnx.Rngs(seed))
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, NamedSharding(mesh, P())))
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@nnx.jit
def _nnx_step(model, optimizer, x):
  loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
  optimizer.update(model, grads)
  return loss


@pytest.mark.parametrize("where", ["persistent", "local_tier"])
def test_nnx_resume_trains_on(tmp_path, where):
  mesh = _mesh()
  x = jnp.ones((2, 4))
  local = dict(local_directory=str(tmp_path / "shm"), local_save_interval_steps=1) if where == "local_tier" else {}
  policy = ofx.CheckpointPolicy(save_interval_steps=2, **local, **_QUIET)
  model, opt = _nnx_make(mesh, 0)
  with ofx.CheckpointCallback(str(tmp_path / "run"), policy) as ckpt:
    ckpt.restore_or_init((model, opt))
    for s in (1, 2):
      _nnx_step(model, opt, x)
      ckpt.on_step_end(s, (model, opt), {})
  ref_loss = float(_nnx_step(model, opt, x))
  model2, opt2 = _nnx_make(mesh, 7)
  with ofx.CheckpointCallback(str(tmp_path / "run"), policy) as ckpt:
    ckpt.restore_or_init((model2, opt2))
    assert ckpt.restored_step == 2
  assert float(_nnx_step(model2, opt2, x)) == ref_loss
