"""Jobs at the edges: pmap metrics, runs that arrive from elsewhere, slips in the workdir,
mistyped metric names (issue 28)."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_flax as ofx


def _policy(**kw):
  kw.setdefault("save_on_preemption", False)
  return ofx.CheckpointPolicy(**kw)


# -- anything visible at step 1 is checked at step 1 ------------------------------------------

def test_pmap_metrics_are_refused_at_the_first_step_with_the_fix(tmp_path):
  """A pmap loop's per-device metrics (shape [devices]) fail at step 1, not at the first save
  20 steps later, and the error names the fix (unreplicate / mean)."""
  n = jax.device_count()
  step_fn = jax.pmap(lambda w, x: (w + x, jnp.mean((w + x) ** 2)))
  policy = _policy(save_interval_steps=20, save_on_exception=False)
  ckpt = ofx.CheckpointCallback(str(tmp_path), policy)
  w = ckpt.restore_or_init(jnp.zeros((n, 4)))
  w, loss = step_fn(w, jnp.ones((n, 4)))
  with pytest.raises(TypeError, match=r"'loss' has shape \(8,\).*unreplicate") as e:
    ckpt.on_step_end(1, w, {"loss": loss})
  assert "jnp.mean" in str(e.value)
  # The fix the message names works: device 0's copy of a pmean'd metric is a scalar.
  import flax.jax_utils  # pylint: disable=g-import-not-at-top
  for step in range(1, 21):
    w, loss = step_fn(w, jnp.ones((n, 4)))
    ckpt.on_step_end(step, w, flax.jax_utils.unreplicate({"loss": loss}))
  ckpt.close()
  assert ckpt.manager.all_steps() == [20]
  assert ckpt.manager.step_info(20).metrics["loss"] == pytest.approx(float(loss[0]))


@pytest.mark.parametrize("bad, match", [
    ({"acc": np.ones(2)}, r"'acc' has shape \(2,\)"),
    ({"acc": "high"}, r"'acc' must be a scalar number, got str"),
    ([("loss", 1.0)], r"metrics must be a mapping"),
    ({"key": jax.random.key(0)}, r"'key' is an array of key"),
])
def test_metrics_a_save_could_not_record_fail_on_the_step_they_appear(tmp_path, bad, match):
  with ofx.CheckpointCallback(str(tmp_path), _policy(save_interval_steps=100)) as ckpt:
    state = {"w": jnp.zeros(2)}
    ckpt.on_step_end(1, state, {"acc": 0.5})
    with pytest.raises(TypeError, match=match):
      ckpt.on_step_end(2, state, bad)
  assert ckpt.manager.all_steps() == [1]  # the final save records step 1's good metrics


def test_a_state_that_cannot_be_saved_fails_at_step_one_without_restore_or_init(tmp_path):
  ckpt = ofx.CheckpointCallback(str(tmp_path), _policy(save_interval_steps=50,
                                                       save_on_exception=False))
  with pytest.raises(ofx.UnsupportedLeafError, match="fn"):
    ckpt.on_step_end(1, {"w": jnp.zeros(2), "fn": lambda x: x})
  ckpt.close()


# -- the metric the policy ranks by ---------------------------------------------------------

def test_a_mistyped_best_metric_fails_at_the_first_step_with_did_you_mean(tmp_path):
  policy = _policy(save_interval_steps=10, max_to_keep=2, keep_best=1, best_metric="eval_acc",
                   best_mode="max", save_on_exception=False)
  ckpt = ofx.CheckpointCallback(str(tmp_path), policy)
  state = ckpt.restore_or_init({"w": jnp.zeros(4)})
  with pytest.raises(ValueError, match=r"best_metric='eval_acc'.*did you mean 'eval_accuracy'"):
    ckpt.on_step_end(1, state, {"loss": 1.0, "eval_accuracy": 0.5})
  ckpt.close()
  assert ckpt.manager.all_steps() == []


def test_a_best_metric_reported_only_on_eval_steps_warns_once_and_ranks(tmp_path, caplog):
  """Eval metrics that arrive only on eval steps are legitimate: one WARNING, then the best step
  is kept."""
  policy = _policy(save_interval_steps=10, max_to_keep=2, keep_best=1,
                   best_metric="eval_accuracy", best_mode="max")
  accuracy = {10: 0.5, 20: 0.9, 30: 0.7, 40: 0.6}
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):
    with ofx.CheckpointCallback(str(tmp_path), policy) as ckpt:
      state = ckpt.restore_or_init({"w": jnp.zeros(4)})
      for step in range(1, 41):
        metrics = {"loss": 1.0 / step}
        if step in accuracy:
          metrics["eval_accuracy"] = accuracy[step]
        ckpt.on_step_end(step, state, metrics)
  said = [r.getMessage() for r in caplog.records if "eval_accuracy" in r.getMessage()]
  assert len(said) == 1 and "only on some steps" in said[0], said
  assert ckpt.manager.best_step() == 20 and 20 in ckpt.manager.all_steps()
