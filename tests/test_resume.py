"""What one resume reads: the manifest decoded once, the data position restored with the state."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import orbax_flax as ofx
from orbax_flax.engine import restoring
from orbax_flax.format import _manifest


class Positions:
  """A resumable iterator in grain's style: get_state()/set_state()."""

  def __init__(self):
    self.i = 0

  def __next__(self):
    self.i += 1
    return self.i

  def get_state(self):
    return {"i": self.i}

  def set_state(self, s):
    self.i = s["i"]


def _state(seed):
  model = nn.Dense(4)
  params = model.init(jax.random.key(seed), jnp.ones((1, 8)))
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def _counted(monkeypatch, module, name):
  calls = []
  original = getattr(module, name)

  def counting(*args, **kwargs):
    calls.append(name)
    return original(*args, **kwargs)
  monkeypatch.setattr(module, name, counting)
  return calls


def test_a_resume_decodes_the_manifest_once_and_restores_the_data_position_in_the_same_read(
    tmp_path, monkeypatch):
  data = Positions()
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2}) as ckpt:
    state = ckpt.restore_or_init(_state(0), data_iterator=data)
    for step in (1, 2, 3):
      next(data)
      state = state.replace(step=step)
      ckpt.on_step_end(step, state, {"loss": 1.0})
  # Saved at step 2 (position 2) and at the end (step 3, position 3).
  again = Positions()
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2}) as ckpt:
    decodes = _counted(monkeypatch, _manifest, "decode")
    restores = _counted(monkeypatch, restoring, "restore")
    resumed = ckpt.restore_or_init(_state(1), data_iterator=again)
  assert ckpt.restored_step == 3 and int(resumed.step) == 3 and again.i == 3
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), resumed.params,
                                   state.params))
  assert len(decodes) == 1, f"the manifest was decoded {len(decodes)} times"
  assert len(restores) == 1, f"{len(restores)} restores (the data position is a second one?)"


def test_a_step_saved_without_a_data_position_resumes_and_leaves_the_iterator(tmp_path):
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1}) as ckpt:
    state = ckpt.restore_or_init(_state(0))
    ckpt.on_step_end(1, state.replace(step=1), {"loss": 1.0})
  data = Positions()
  data.i = 5
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1}) as ckpt:
    resumed = ckpt.restore_or_init(_state(1), data_iterator=data)
  assert ckpt.restored_step == 1 and int(resumed.step) == 1 and data.i == 5


def test_a_read_once_resume_restores_the_data_position_and_trains_on(tmp_path):
  """``read_once_restore`` with a data iterator: the read-once path resharded every item
  like the target and raised ``ValueError: Expected dict, got None`` on the data item."""
  config = {"save_interval_steps": 1, "read_once_restore": True}
  data = Positions()
  with ofx.CheckpointCallback(str(tmp_path), config) as ckpt:
    state = ckpt.restore_or_init(_state(0), data_iterator=data)
    next(data)
    next(data)
    ckpt.on_step_end(1, state.replace(step=1), {"loss": 1.0})
  again = Positions()
  with ofx.CheckpointCallback(str(tmp_path), config) as ckpt:
    resumed = ckpt.restore_or_init(_state(1), data_iterator=again)
  assert ckpt.restored_step == 1 and again.i == 2
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), resumed.params,
                                   state.params))

  @jax.jit
  def train_step(s, x):
    grads = jax.grad(lambda p: jnp.sum(s.apply_fn(p, x) ** 2))(s.params)
    return s.apply_gradients(grads=grads)

  trained = train_step(resumed, jnp.ones((2, 8)))
  assert int(trained.step) == 2
