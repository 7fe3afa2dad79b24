"""Flax users' edge cases at the edges of the library: exports a zarr3 store cannot hold, a
failed export's leftovers, fine-tuning from a Flax NNX run, a pmap-replicated state.

Each test goes through the public API on real files with real tensorstore.
"""

import io
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import orbax_flax as ofx
from orbax_flax import cli


@pytest.mark.parametrize("dtype", [jnp.uint4, jnp.uint2, jnp.float8_e4m3])
def test_export_orbax_refuses_a_dtype_zarr3_lacks_naming_the_key_path_before_writing(
    tmp_path, dtype):
  state = {"params": {"w": np.ones(2, np.float32)}, "quant": {"q": jnp.arange(4).astype(dtype)}}
  dst = str(tmp_path / "out")
  with pytest.raises(ValueError, match=r"quant/q: dtype \w+ .*zarr3.*cast.*select="):
    ofx.export_orbax(dst, state)
  assert not os.listdir(tmp_path)
  # the fixes the message names: leave the leaf out, or cast it
  ofx.export_orbax(dst, state, select="params")
  assert sorted(os.listdir(dst))[:2] == ["_CHECKPOINT_METADATA", "_METADATA"]
  wider = jnp.uint8 if jnp.issubdtype(dtype, jnp.integer) else jnp.bfloat16
  ofx.export_orbax(str(tmp_path / "cast"), {"q": state["quant"]["q"].astype(wider)})


def test_convert_to_orbax_refuses_a_dtype_zarr3_lacks_as_bad_input(tmp_path, capsys):
  src = str(tmp_path / "ckpt")
  ofx.save(src, {"params": {"w": np.ones(2, np.float32), "q": jnp.arange(4, dtype=jnp.uint4)}})
  code = cli.main(["convert", src, str(tmp_path / "out"), "--format", "orbax"], io.StringIO())
  err = capsys.readouterr().err
  assert code == cli.EXIT_MISSING
  assert "q: dtype uint4" in err and "select=" in err and "StorageError" not in err
  assert not os.path.exists(tmp_path / "out") and not os.path.exists(
      str(tmp_path / "out") + ".ofx-tmp-export")


def test_a_failed_export_orbax_leaves_no_temporary_directory_behind(tmp_path):
  # A key too long for a file name: its array's create fails while the creates of the arrays
  # after it are in flight; the failed export must wait for them before it removes its
  # unfinished directory, or they write their zarr.json into a new one.
  tree = {"a" * 300: np.ones(4, np.float32), "b": np.ones((256, 256), np.float32),
          "c": np.ones((256, 256), np.float32)}
  for i in range(3):
    with pytest.raises(ofx.errors.StorageError, match="nothing was committed"):
      ofx.export_orbax(str(tmp_path / f"out{i}"), tree)
  time.sleep(0.5)  # anything still in flight lands
  assert not os.listdir(tmp_path)


# ------------------------------------------------------------------ init_from a Flax NNX run


class _Net(nnx.Module):
  """An NNX model whose state holds more than Params: BatchNorm stats, Dropout's own rngs."""

  def __init__(self, rngs, width=16):
    self.l1 = nnx.Linear(8, width, rngs=rngs)
    self.bn = nnx.BatchNorm(width, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.l2 = nnx.Linear(width, 8, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(self.bn(self.l1(x))))


def _gemma_style_run(root, model):
  """A step as the Flax Gemma example writes it: nnx.state(model) whole, optimizer, step."""
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  with ocp.CheckpointManager(root, item_names=("model", "optimizer", "step")) as m:
    m.save(2, args=ocp.args.Composite(model=ocp.args.StandardSave(nnx.state(model)),
                                      optimizer=ocp.args.StandardSave(nnx.state(opt)),
                                      step=ocp.args.JsonSave(2)))
    m.wait_until_finished()


def test_init_from_a_whole_nnx_model_item_takes_weights_and_batch_stats_not_its_rngs(tmp_path):
  donor = _Net(nnx.Rngs(0))
  donor(jnp.ones((4, 8)))  # a training-mode call: batch stats and the dropout count move
  root = str(tmp_path / "gemma_run" / "checkpoints")
  _gemma_style_run(root, donor)

  model = _Net(nnx.Rngs(7))
  fresh_rngs = np.asarray(jax.random.key_data(model.drop.rngs.key.get_value()))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  with ofx.CheckpointCallback(str(tmp_path / "fine"), {"init_from": f"{root}:model"}) as fine:
    fine.restore_or_init((model, opt))
  for got, want in ((model.l1.kernel, donor.l1.kernel), (model.bn.scale, donor.bn.scale),
                    (model.bn.mean, donor.bn.mean), (model.bn.var, donor.bn.var)):
    np.testing.assert_array_equal(np.asarray(got.get_value()), np.asarray(want.get_value()))
  assert np.asarray(donor.bn.mean.get_value()).any()  # the stats taken are the donor's, not 0
  # the new run keeps its own fresh RNG state
  np.testing.assert_array_equal(jax.random.key_data(model.drop.rngs.key.get_value()), fresh_rngs)
  assert int(model.drop.rngs.count.get_value()) == 0 < int(donor.drop.rngs.count.get_value())
  assert int(opt.step.get_value()) == 0

  # A model that does not fit: the error's suggested init_from is never the one refused.
  passed = f"{root}:model"
  with ofx.CheckpointCallback(str(tmp_path / "bad"), {"init_from": passed}) as bad:
    with pytest.raises(ofx.TreeMismatchError) as e:
      narrow = _Net(nnx.Rngs(1), width=4)
      bad.restore_or_init((narrow, nnx.Optimizer(narrow, optax.adam(1e-2), wrt=nnx.Param)))
  advice = str(e.value).rsplit("\n", 1)[-1]
  assert "init_from" in advice and f"{passed!r}" not in advice, str(e.value)


# ------------------------------------------------------------------ a pmap-replicated state


def _train_state():
  from flax import linen as nn  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  model = nn.Dense(4)
  return train_state.TrainState.create(apply_fn=model.apply, tx=optax.adam(1e-2),
                                       params=model.init(jax.random.key(0), jnp.ones((1, 4))))


def test_a_pmap_replicated_state_is_refused_at_the_first_step_naming_unreplicate(tmp_path):
  from flax import jax_utils  # pylint: disable=g-import-not-at-top
  n = jax.local_device_count()
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1}) as ckpt:
    state = jax_utils.replicate(ckpt.restore_or_init(_train_state()))
    with pytest.raises(TypeError, match=rf"(?s)leading axis of {n}.*flax\.jax_utils\.unreplicate"):
      ckpt.on_step_end(1, state)  # forgot jax_utils.unreplicate(state)
    assert not os.path.exists(tmp_path / "checkpoints" / "1")
    ckpt.on_step_end(1, jax_utils.unreplicate(state))  # the fix the message names
  assert ofx.metadata(str(tmp_path / "checkpoints" / "1")).items["params"].arrays[0].shape[0] != n


def test_a_state_replicated_on_purpose_from_restore_or_init_on_is_saved(tmp_path):
  """A template given to restore_or_init already replicated: the state is meant to be saved so."""
  from flax import jax_utils  # pylint: disable=g-import-not-at-top
  n = jax.local_device_count()
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1}) as ckpt:
    state = ckpt.restore_or_init(jax_utils.replicate(_train_state()))
    ckpt.on_step_end(1, state)
  shapes = {a.shape for a in ofx.metadata(str(tmp_path / "checkpoints" / "1")).items["params"].arrays}
  assert shapes == {(n, 4), (n, 4, 4)}


def test_resuming_a_pmap_replicated_checkpoint_is_diagnosed_as_one(tmp_path):
  """Checkpoints a replicated state was saved to (by a version that did not refuse it): the
  resume names the replication and the way to restore them, not "another model"."""
  from flax import jax_utils  # pylint: disable=g-import-not-at-top
  n = jax.local_device_count()
  replicated = jax_utils.replicate(_train_state())
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1}) as ckpt:
    ckpt.restore_or_init(replicated)
    ckpt.on_step_end(1, replicated)
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1}) as ckpt:
    with pytest.raises(ofx.TreeMismatchError) as e:
      ckpt.restore_or_init(_train_state())
  text = str(e.value)
  assert f"leading axis of {n}" in text and "unreplicate" in text, text
  assert "a different model configuration" not in text and "--workdir" not in text, text
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1}) as ckpt:
    back = ckpt.restore_or_init(jax_utils.replicate(_train_state()))  # the fix the error names
  assert ckpt.restored_step == 1 and back.params["params"]["kernel"].shape == (n, 4, 4)
