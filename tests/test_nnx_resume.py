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


# ------------------------------------------------------------------ exception saves


def test_an_error_after_an_nnx_update_saves_nothing_under_an_older_label(tmp_path, caplog):
  """NNX objects change in place: the error after step 5's update must not be saved as step 4."""
  model, opt, rngs = make()
  policy = {"save_interval_steps": 3}
  with pytest.raises(FloatingPointError), caplog.at_level(logging.WARNING, logger="orbax_flax"):
    with ofx.CheckpointCallback(str(tmp_path), policy) as ckpt:
      ckpt.restore_or_init((model, opt, rngs))
      for step in range(1, 11):
        loss = train_step(model, opt, rngs, batch(step))
        if step == 5:  # an eval or a loss check that fails after the update
          raise FloatingPointError("loss check failed after the update of step 5")
        ckpt.on_step_end(step, (model, opt, rngs), {"loss": loss})
  assert ckpt.manager.all_steps() == [3]
  warning = [r for r in caplog.records if "not saving it" in r.getMessage()]
  assert len(warning) == 1 and warning[0].levelno == logging.WARNING, caplog.text
  assert "NNX objects are updated in place" in warning[0].getMessage()
  assert "A resume continues from step 3" in warning[0].getMessage()
  # What a resume gets is labelled by the state it holds.
  model, opt, rngs = make(7)
  with ofx.CheckpointCallback(str(tmp_path), policy) as again:
    again.restore_or_init((model, opt, rngs))
  assert again.restored_step == 3 and int(opt.step.get_value()) == 3


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


def test_a_resume_with_fewer_members_says_which_saved_items_it_leaves_out(tmp_path, caplog):
  """A run saved (model, optimizer, rngs); resumed with (model, optimizer), the Rngs' counts
  (the "extra" item) were left out without a word. The resume goes on (the state has no part
  for them) and names the item it did not restore."""
  policy = {"save_interval_steps": 1, "save_final_step": False}
  model, opt, rngs = make(0)
  with ofx.CheckpointCallback(str(tmp_path), policy) as ckpt:
    model, opt, rngs = ckpt.restore_or_init((model, opt, rngs))
    ckpt.on_step_end(1, (model, opt, rngs), {"loss": train_step(model, opt, rngs, batch(1))})
  assert "extra" in ofx.metadata(ckpt.manager.step_path(1)).items
  model, opt, _ = make(5)
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):
    with ofx.CheckpointCallback(str(tmp_path), policy) as again:
      again.restore_or_init((model, opt))
  assert again.restored_step == 1
  assert "step 1 holds state item(s) extra, which the state passed to restore_or_init" \
      in caplog.text, caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):  # the whole state: no word
    with ofx.CheckpointCallback(str(tmp_path), policy) as third:
      third.restore_or_init(make(7))
  assert third.restored_step == 1 and "holds state item(s)" not in caplog.text


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


CTRL_C = r"""
import itertools, logging, sys, time
import jax, jax.numpy as jnp
import orbax_flax as ofx
logging.basicConfig(format="%(levelname)s %(message)s")
signals = tuple(sys.argv[2].split(","))
ckpt = ofx.CheckpointCallback(sys.argv[1], {"save_interval_steps": 0,
                                            "preemption_signals": signals})
update = jax.jit(lambda s: {"w": s["w"] + 1, "step": s["step"] + 1}, donate_argnums=0)
def step_fn(s, batch):
  s = update(s)  # donates the previous state, as a real train step does
  if int(s["step"]) == 3:
    print("TRAINING", flush=True)
  if int(s["step"]) >= 3:
    time.sleep(float(sys.argv[3]))  # the Ctrl-C arrives here
  return s, {}
state = ofx.Trainer(step_fn, [ckpt]).fit({"w": jnp.zeros(4), "step": jnp.int32(0)},
                                         itertools.repeat(None), 50)
step = int(state["step"])
print("STOPPED", step, ckpt.preempted, ckpt.manager.all_steps(), flush=True)
"""


def _ctrl_c(tmp_path, signals, sleep):
  script = tmp_path / "ctrlc.py"
  script.write_text(CTRL_C)
  proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), signals, str(sleep)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=jobs.env_for(1))
  assert proc.stdout.readline().strip() == "TRAINING"
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  return proc.returncode, out, err


def test_ctrl_c_is_reported_as_an_interrupt_with_the_way_to_save_on_it(tmp_path):
  rc, out, err = _ctrl_c(tmp_path, "SIGTERM", 60)
  assert rc != 0 and "STOPPED" not in out
  assert "WARNING interrupted after step 2 (KeyboardInterrupt" in err, err[-3000:]
  assert "buffers were donated" in err and "add SIGINT to the policy's preemption_signals" in err
  assert "training failed" not in err and "ERROR" not in err, err[-3000:]


def test_sigint_as_a_preemption_signal_saves_and_stops(tmp_path):
  rc, out, err = _ctrl_c(tmp_path, "SIGTERM,SIGINT", 0.2)
  assert rc == 0, err[-3000:]
  (line,) = [l for l in out.splitlines() if l.startswith("STOPPED")]
  _, step, preempted, steps = line.split(" ", 3)
  assert preempted == "True" and steps == f"[{step}]", line
  manager = ofx.CheckpointManager(str(tmp_path / "run" / "checkpoints"), ofx.CheckpointPolicy())
  assert manager.step_info(int(step)).reason == "preemption"
  assert "KeyboardInterrupt" not in err


# ------------------------------------------------------------------ init_from


def _gemma_style_run(root, model, opt, step):
  """A step as the Flax Gemma example writes it: items model, optimizer and step."""
  with ocp.CheckpointManager(root, item_names=("model", "optimizer", "step")) as m:
    m.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave(nnx.state(model)),
                                         optimizer=ocp.args.StandardSave(nnx.state(opt)),
                                         step=ocp.args.JsonSave(step)))
    m.wait_until_finished()


def test_init_from_names_the_item_of_an_orbax_checkpoint_manager_run(tmp_path):
  donor, donor_opt, donor_rngs = make(3)
  for step in range(1, 3):
    train_step(donor, donor_opt, donor_rngs, batch(step))
  root = str(tmp_path / "gemma_run" / "checkpoints")
  _gemma_style_run(root, donor, donor_opt, 2)

  model, opt, rngs = make(9)
  with ofx.CheckpointCallback(str(tmp_path / "fine"), {"init_from": f"{root}:model"}) as fine:
    fine.restore_or_init((model, opt, rngs))
  same(nnx.state(model, nnx.Param), nnx.state(donor, nnx.Param))
  assert int(opt.step.get_value()) == 0  # only the model's params were taken
  before = np.asarray(model.linear.kernel.get_value())
  loss = train_step(model, opt, rngs, batch(3))  # the model trains: one jitted step
  assert np.isfinite(float(loss)) and not np.array_equal(before, model.linear.kernel.get_value())

  # The run directory alone names no item: the error says what the checkpoint holds.
  with ofx.CheckpointCallback(str(tmp_path / "f2"), {"init_from": root}) as bad:
    with pytest.raises(ofx.errors.TreeMismatchError) as e:
      bad.restore_or_init(make(1))
  text = str(e.value)
  assert "items model (linear); optimizer (opt_state, step); step (a value)" in text, text
  assert f"'{root}:model'" in text
  # A wrong item or subtree: the keys it does hold.
  with ofx.CheckpointCallback(str(tmp_path / "f3"), {"init_from": f"{root}:optimizer"}) as bad:
    with pytest.raises(ofx.errors.TreeMismatchError) as e:
      bad.restore_or_init(make(1))
  assert any(d.endswith("linear/kernel/value: in target, not in checkpoint")
             for d in e.value.differences), e.value.differences
  assert "key paths in optimizer include opt_state/0/count/value" in str(e.value), str(e.value)
  with ofx.CheckpointCallback(str(tmp_path / "f4"), {"init_from": f"{root}:model/nothing"}) as bad:
    with pytest.raises(ofx.errors.TreeMismatchError, match="item 'model' has no subtree 'nothing'"):
      bad.restore_or_init(make(1))


def test_init_from_plain_named_safetensors_into_an_nnx_model_is_diagnosed_boxed(tmp_path):
  """An NNX model (arrays at .../value) pointed at plain-named safetensors: the part taken is
  compared strictly, so both sides' keys show and the diagnosis is boxed against unboxed, not
  "the target has 2 key(s) the checkpoint lacks (a newer model?)"."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / "model.safetensors")
  save_file({"linear.kernel": np.ones((8, 8), np.float32),
             "linear.bias": np.ones(8, np.float32)}, path)
  with ofx.CheckpointCallback(str(tmp_path / "ft"), {"init_from": path}) as ckpt:
    with pytest.raises(ofx.TreeMismatchError, match="boxed against unboxed") as e:
      ckpt.restore_or_init(make(1))
  assert "params/linear/kernel: in checkpoint, not in target" in e.value.differences


def test_init_from_a_subtree_of_our_own_checkpoint_and_a_path_with_a_colon(tmp_path):
  donor, _, _ = make(4)
  params = nnx.state(donor, nnx.Param)
  run = tmp_path / "10:00"  # a timestamped directory: the ':' is part of the path
  ofx.save(str(run / "checkpoints" / "5"), {"state": {"student": params, "step": 5}})
  model, opt, rngs = make(1)
  with ofx.CheckpointCallback(str(tmp_path / "fine"),
                              {"init_from": f"{run}:state/student"}) as fine:
    fine.restore_or_init((model, opt, rngs))
  same(nnx.state(model, nnx.Param), params)
  with ofx.CheckpointCallback(str(tmp_path / "fine2"), {"init_from": str(run)}) as bad:
    with pytest.raises(ofx.errors.TreeMismatchError, match=r"(?s)no item 'params'.*items state"
                       r" \(step, student\)"):
      bad.restore_or_init(make(1))


# ------------------------------------------------------------------ the int step


def test_a_python_int_step_comes_back_as_an_int(tmp_path):
  """The target's int step stays an int, from orbax-checkpoint and from our own format."""
  module = nn.Dense(4)
  x = jnp.ones((2, 3))

  def fresh():
    return train_state.TrainState.create(apply_fn=module.apply, tx=optax.adam(1e-2),
                                         params=module.init(jax.random.key(0), x)["params"])

  @jax.jit
  def step_fn(state):
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  trained = step_fn(step_fn(fresh()))
  assert isinstance(trained.step, jax.Array)  # a jitted update makes it an array
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(str(tmp_path / "ocp"), trained)
  checkpointer.wait_until_finished()
  checkpointer.close()
  ofx.save(str(tmp_path / "ours"), {"state": trained})
  for path in ("ocp", "ours"):
    target = ofx.abstract(fresh())
    assert type(target.step) is int
    restored = ofx.restore(str(tmp_path / path), {"state": target})["state"]
    assert type(restored.step) is int and restored.step == 2, (path, type(restored.step))
    assert int(step_fn(restored).step) == 3
