"""Users' own loops, resumed: NNX states and their members, exceptions, signals, init_from.

The first hour of a new user's NNX loop (the Flax Gemma example's layout: a
model, an optimizer and an ``nnx.Rngs``), the signals a job gets before and
during training, and fine-tuning from an orbax-checkpoint ``CheckpointManager``
run. Signal tests send real signals to real subprocesses.
"""

import logging
import os
import signal
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state

import jobs
import orbax_flax as ofx


class Model(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, rngs=None):
    return self.drop(self.linear(x), rngs=rngs)


def make(seed=0):
  rngs = nnx.Rngs(params=seed, dropout=seed + 1)
  model = Model(rngs)
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), rngs


@nnx.jit
def train_step(model, optimizer, rngs, x):
  loss, grads = nnx.value_and_grad(lambda m, r: jnp.mean((m(x, r) - 1.0) ** 2))(model, rngs)
  optimizer.update(model, grads)
  return loss


def batch(step):
  return jnp.full((4, 8), 0.1 * step)


def same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    if not hasattr(x, "dtype"):
      assert x == y
      continue
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------ every member saved


def test_every_member_of_a_tuple_state_is_saved_and_restored(tmp_path):
  """(model, optimizer, rngs, metrics, a pytree): each comes back; the resume is bitwise."""

  def members(seed):
    model, opt, rngs = make(seed)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    return model, opt, rngs, metrics, {"ema": jnp.zeros((8,)), "epoch": 0}

  def run(state, start, stop, ckpt=None):
    model, opt, rngs, metrics, extra = state
    losses = []
    for step in range(start + 1, stop + 1):
      loss = train_step(model, opt, rngs, batch(step))
      metrics.update(loss=loss)
      extra = {"ema": 0.9 * extra["ema"] + 0.1 * model.linear.bias.get_value(), "epoch": step // 2}
      state = (model, opt, rngs, metrics, extra)
      losses.append(float(loss))
      if ckpt is not None:
        ckpt.on_step_end(step, state, {"loss": loss})
    return state, losses

  reference, ref_losses = run(members(0), 0, 6)
  policy = {"save_interval_steps": 3, "save_final_step": False}
  with ofx.CheckpointCallback(str(tmp_path), policy) as ckpt:
    run(ckpt.restore_or_init(members(0)), 0, 3, ckpt)
  assert set(ofx.metadata(ckpt.manager.step_path(3)).items) == {
      "params", "opt_state", "train_state", "extra"}
  fresh = members(5)
  with ofx.CheckpointCallback(str(tmp_path), policy) as again:
    resumed = again.restore_or_init(fresh)
  assert again.restored_step == 3
  assert all(a is b for a, b in zip(resumed[:4], fresh[:4]))  # NNX members: updated in place
  assert int(fresh[2].dropout.count.get_value()) == 3           # the separate Rngs came back
  assert resumed[4]["epoch"] == 1                                # the pytree member: returned
  final, losses = run(resumed, 3, 6)
  assert losses == ref_losses[3:]
  for got, want in zip(final, reference):
    same(nnx.state(got) if isinstance(got, nnx.Pytree) else got,
         nnx.state(want) if isinstance(want, nnx.Pytree) else want)


def test_a_member_that_cannot_be_saved_is_refused_before_training(tmp_path):
  model, opt, rngs = make()
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1})
  with pytest.raises(ofx.errors.UnsupportedLeafError,
                     match=r"extra/2/schedule.*keep it out of the state"):
    ckpt.restore_or_init((model, opt, {"schedule": lambda step: 0.1}))
  with pytest.raises(TypeError, match=r"NNX object \(Model at model\).*members of a tuple"):
    ckpt.restore_or_init({"model": model, "opt": opt})
  ckpt.close()
  assert not os.path.exists(tmp_path / "checkpoints") or not os.listdir(tmp_path / "checkpoints")


# ------------------------------------------------------------------ signals

BUILT_ONLY = r"""
import sys, time
import orbax_flax as ofx
ckpt = ofx.CheckpointCallback(sys.argv[1], {"save_interval_steps": 10})
print("BUILT", flush=True)
time.sleep(60)  # a long data-loading start, or a run that never trains
print("STILL ALIVE", flush=True)
"""


def test_sigterm_before_the_run_starts_ends_the_process(tmp_path):
  script = tmp_path / "built.py"
  script.write_text(BUILT_ONLY)
  proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=jobs.env_for(1))
  assert proc.stdout.readline().strip() == "BUILT"
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == -signal.SIGTERM, (proc.returncode, out, err[-2000:])
  assert "STILL ALIVE" not in out


def test_the_signal_handler_is_installed_when_the_run_starts(tmp_path):
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"preemption_signals": ("SIGUSR1",)})
  assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # built: nothing installed yet
  state = ckpt.restore_or_init({"w": np.zeros(2)})
  assert signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL
  os.kill(os.getpid(), signal.SIGUSR1)
  assert ckpt.on_step_end(1, state) is True and ckpt.manager.all_steps() == [1]
  ckpt.close()
  assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
  # A loop that never calls restore_or_init is watched from its first step end.
  ckpt = ofx.CheckpointCallback(str(tmp_path / "b"), {"preemption_signals": ("SIGUSR1",)})
  assert ckpt.on_step_end(1, state) is False
  os.kill(os.getpid(), signal.SIGUSR1)
  assert ckpt.on_step_end(2, state) is True and ckpt.manager.all_steps() == [2]
  ckpt.close()
