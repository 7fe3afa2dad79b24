"""The training plugin in-process: hooks, Linen and NNX states, iterators, errors."""

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import periodic_actions
from flax import nnx
from flax import struct
from flax.training import train_state

import disks
import jobs
import orbax_flax as ofx


class Dataset:
  """A resumable iterator in grain's style: get_state()/set_state()."""

  def __init__(self):
    self.i = 0

  def __iter__(self):
    return self

  def __next__(self):
    self.i += 1
    return jnp.full((4, 8), float(self.i))

  def get_state(self):
    return {"i": self.i, "tag": b"\x00bytes"}

  def set_state(self, s):
    assert s["tag"] == b"\x00bytes"
    self.i = s["i"]


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))


class RngState(train_state.TrainState):
  rng: jax.Array


def linen_state(seed=0):
  model = MLP()
  params = model.init(jax.random.key(seed), jnp.ones((1, 8)))
  return RngState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2),
                         rng=jax.random.key(seed + 100))


@jax.jit
def linen_step(state, batch):
  rng, noise_key = jax.random.split(state.rng)

  def loss_fn(p):
    noise = jax.random.normal(noise_key, batch.shape) * 0.01
    return jnp.mean((state.apply_fn(p, batch + noise) - 1.0) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads).replace(rng=rng), {"loss": loss}


def leaves_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_trainer_resume_is_bitwise_and_items_are_separate(tmp_path):
  cfg = {"save_interval_steps": 5, "max_to_keep": 2}
  uninterrupted = ofx.Trainer(linen_step).fit(linen_state(), Dataset(), num_steps=12)

  ckpt = ofx.CheckpointCallback(str(tmp_path), cfg)
  first = ofx.Trainer(linen_step, [ckpt]).fit(linen_state(), Dataset(), num_steps=7)
  assert int(first.step) == 7 and ckpt.manager.all_steps() == [5, 7]  # 7: final step
  # Each part of the state is its own item: params restore alone.
  meta = ofx.metadata(os.path.join(tmp_path, "checkpoints", "7"))
  assert set(meta.items) == {"params", "opt_state", "rng", "train_state", "data"}
  params = ofx.restore(os.path.join(tmp_path, "checkpoints", "7"),
                       {"params": first.params})["params"]
  leaves_equal(params, first.params)

  data = Dataset()
  ckpt2 = ofx.CheckpointCallback(str(tmp_path), cfg)
  resumed = ofx.Trainer(linen_step, [ckpt2]).fit(linen_state(seed=9), data, num_steps=12)
  assert ckpt2.restored_step == 7 and int(resumed.step) == 12 and data.i == 12
  leaves_equal(resumed, uninterrupted)
  assert ckpt2.manager.all_steps() == [10, 12]


def test_trainer_after_restore_or_init_starts_data_afresh_and_restores_once(tmp_path):
  """`Trainer.fit` after `ckpt.restore_or_init(state, data_iterator=it, restore_data=False)`
  (the call a changed dataset's refusal names): the model resumes, the data goes on from where
  it is (not moved back to the saved position), and the checkpoint is read once."""
  cfg = {"save_interval_steps": 5, "max_to_keep": 2}
  ckpt = ofx.CheckpointCallback(str(tmp_path), cfg)
  first = ofx.Trainer(linen_step, [ckpt]).fit(linen_state(), Dataset(), num_steps=5)

  data = Dataset()
  data.i = 1000  # the new dataset's order starts elsewhere
  ckpt2 = ofx.CheckpointCallback(str(tmp_path), cfg)
  state = ckpt2.restore_or_init(linen_state(seed=9), data_iterator=data, restore_data=False)
  assert ckpt2.restored_step == 5 and data.i == 1000
  leaves_equal((state.params, state.opt_state), (first.params, first.opt_state))
  reads = []
  original = ckpt2.manager.restore
  ckpt2.manager.restore = lambda *a, **k: reads.append(a) or original(*a, **k)
  resumed = ofx.Trainer(linen_step, [ckpt2]).fit(state, data, num_steps=8)
  assert reads == []  # fit did not restore a second time
  assert int(resumed.step) == 8 and data.i == 1003  # three batches of the new order
  # The new order's position is saved: the next restart continues it.
  data3 = Dataset()
  ckpt3 = ofx.CheckpointCallback(str(tmp_path), cfg)
  again = ofx.Trainer(linen_step, [ckpt3]).fit(linen_state(seed=4), data3, num_steps=8)
  assert ckpt3.restored_step == 8 and data3.i == 1003 and int(again.step) == 8


def test_trainer_restores_again_when_restore_or_init_result_was_not_passed_on(tmp_path):
  """`ckpt.restore_or_init(fresh, data_iterator=it, restore_data=False)` whose result is
  dropped, then `fit(fresh, it)`: `fit` restores again (with restore_data=False still), rather
  than train the fresh state."""
  cfg = {"save_interval_steps": 5}
  ofx.Trainer(linen_step, [ofx.CheckpointCallback(str(tmp_path), cfg)]).fit(
      linen_state(), Dataset(), num_steps=5)
  ckpt = ofx.CheckpointCallback(str(tmp_path), cfg)
  fresh, data = linen_state(seed=2), Dataset()
  data.i = 1000
  ckpt.restore_or_init(fresh, data_iterator=data, restore_data=False)
  resumed = ofx.Trainer(linen_step, [ckpt]).fit(fresh, data, num_steps=7)
  assert ckpt.restored_step == 5 and int(resumed.step) == 7 and data.i == 1002


def test_trainer_restores_the_data_when_restore_or_init_was_given_no_iterator(tmp_path):
  """A `restore_or_init(state)` without the iterator, then `fit(state, data)`: the data's
  position is restored by `fit` (nothing skips a batch silently)."""
  cfg = {"save_interval_steps": 5}
  ofx.Trainer(linen_step, [ofx.CheckpointCallback(str(tmp_path), cfg)]).fit(
      linen_state(), Dataset(), num_steps=5)
  ckpt = ofx.CheckpointCallback(str(tmp_path), cfg)
  state = ckpt.restore_or_init(linen_state(seed=2))
  data = Dataset()
  resumed = ofx.Trainer(linen_step, [ckpt]).fit(state, data, num_steps=7)
  assert int(resumed.step) == 7 and data.i == 7


def test_hand_written_loop_and_final_save(tmp_path):
  it = Dataset()
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 4}) as ckpt:
    state = ckpt.restore_or_init(linen_state(), data_iterator=it)
    for step in range(int(state.step), 6):
      state, metrics = linen_step(state, next(it))
      if ckpt.on_step_end(step + 1, state, metrics):
        break
  assert ckpt.manager.all_steps() == [4, 6]
  assert ckpt.manager.step_info(6).reason == "final"
  it2 = Dataset()
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 4}) as ckpt:
    state = ckpt.restore_or_init(linen_state(seed=3), data_iterator=it2)
  assert int(state.step) == 6 and it2.i == 6


def test_no_device_to_host_transfer_when_nothing_is_saved(tmp_path):
  state = linen_state()
  state, metrics = linen_step(state, jnp.ones((4, 8)))
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 100}) as ckpt:
    ckpt.restore_or_init(state)
    with jax.transfer_guard_device_to_host("disallow"):
      for step in range(1, 50):
        assert not ckpt.on_step_end(step, state, metrics)


def test_nnx_model_and_optimizer(tmp_path):

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.linear = nnx.Linear(8, 8, rngs=rngs)
      self.bn = nnx.BatchNorm(8, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.bn(self.linear(x)))

  def make(seed):
    model = Model(nnx.Rngs(seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    def loss_fn(m):
      return jnp.mean(m(x) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  def train(model, optimizer, data, steps, ckpt):
    for s in range(int(optimizer.step.value), steps):
      loss = step(model, optimizer, next(data))
      if ckpt is not None and ckpt.on_step_end(s + 1, (model, optimizer), {"loss": loss}):
        break

  ref = make(0)
  train(*ref, Dataset(), 6, None)
  model, opt = make(0)
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 3}) as ckpt:
    ckpt.restore_or_init((model, opt))
    train(model, opt, Dataset(), 3, ckpt)
  assert ckpt.manager.all_steps() == [3]
  assert set(ofx.metadata(ckpt.manager.step_path(3)).items) == {"params", "opt_state", "rng", "train_state"}
  model, opt = make(42)  # other init: everything must come from the checkpoint
  data = Dataset()
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 3}) as ckpt:
    ckpt.restore_or_init((model, opt), data_iterator=None)
    data.i = 3
    train(model, opt, data, 6, ckpt)
  leaves_equal(nnx.state(model), nnx.state(ref[0]))
  leaves_equal(nnx.state(opt), nnx.state(ref[1]))


def test_grain_iterator_position_is_restored(tmp_path):
  ds = grain.MapDataset.range(1000).shuffle(seed=3).map(lambda x: np.float32(x)).batch(4)
  it = iter(ds.to_iter_dataset())
  state = {"w": jnp.zeros(4), "step": 0}

  def step_fn(s, batch):
    return {"w": s["w"] + batch, "step": s["step"] + 1}, {}

  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 5, "save_final_step": False})
  ofx.Trainer(step_fn, [ckpt]).fit(state, it, num_steps=5)
  expected_next = next(it)
  it2 = iter(ds.to_iter_dataset())
  ckpt2 = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 5})
  restored = ckpt2.restore_or_init(state, data_iterator=it2)
  ckpt2.close()
  assert restored["step"] == 5
  np.testing.assert_array_equal(next(it2), expected_next)


def test_exception_saves_last_good_state_and_reraises(tmp_path):

  def failing_step(state, batch):
    if int(state.step) == 6:
      raise RuntimeError("loss is NaN")
    return linen_step(state, batch)

  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 4})
  with pytest.raises(RuntimeError, match="loss is NaN"):
    ofx.Trainer(failing_step, [ckpt]).fit(linen_state(), Dataset(), num_steps=20)
  assert ckpt.manager.all_steps() == [4, 6]
  assert ckpt.manager.step_info(6).reason == "exception"
  # The failing step had taken batch 7; the save records the position after step 6.
  data = Dataset()
  again = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 4})
  state = again.restore_or_init(linen_state(), data_iterator=data)
  again.close()
  assert int(state.step) == 6 and data.i == 6
  off = ofx.CheckpointCallback(str(tmp_path / "off"), {"save_interval_steps": 4, "save_on_exception": False})
  with pytest.raises(RuntimeError):
    ofx.Trainer(failing_step, [off]).fit(linen_state(), Dataset(), num_steps=20)
  assert off.manager.all_steps() == [4]


def _resumes_as_an_uninterrupted_run(workdir, cfg, from_step):
  """A resume in ``workdir`` continues from ``from_step`` to step 10, on the data where that
  step left it: the state equals an uninterrupted run's."""
  data = Dataset()
  again = ofx.CheckpointCallback(str(workdir), cfg)
  resumed = ofx.Trainer(linen_step, [again]).fit(linen_state(), data, num_steps=10)
  reference = ofx.Trainer(linen_step, []).fit(linen_state(), Dataset(), num_steps=10)
  assert again.restored_step == from_step and data.i == 10
  leaves_equal(resumed, reference)


def test_exception_in_a_callback_before_the_checkpoint_one_saves_the_data_position(tmp_path):
  """A user's callback listed first raises at step 7: the checkpoint callback never saw step 7,
  and its exception save of step 7 went without the data position, so a resume trained
  steps 8.. on the data from the start."""

  class LossCheck(ofx.Callback):
    def on_step_end(self, step, state, metrics):
      if step == 7:
        raise FloatingPointError("loss check failed at step 7")
      return False

  cfg = {"save_interval_steps": 5}
  ckpt = ofx.CheckpointCallback(str(tmp_path), cfg)
  with pytest.raises(FloatingPointError):
    ofx.Trainer(linen_step, [LossCheck(), ckpt]).fit(linen_state(), Dataset(), num_steps=10)
  assert ckpt.manager.all_steps() == [5, 7]
  assert "data" in ofx.metadata(ckpt.manager.step_path(7)).items
  _resumes_as_an_uninterrupted_run(tmp_path, cfg, from_step=7)


def test_a_failing_get_state_makes_no_exception_save_without_the_data_position(tmp_path):
  """The data iterator's get_state() raised at step 7: the exception save committed step 7
  without a data position, and a resume (which only warned) trained steps 8.. on the data
  from its start, though step 5 held a good position."""

  class BrokenAt7(Dataset):
    def get_state(self):
      if self.i == 7:
        raise OSError("the data service went away")
      return super().get_state()

  cfg = {"save_interval_steps": 5}
  ckpt = ofx.CheckpointCallback(str(tmp_path), cfg)
  with pytest.raises(OSError, match="data service"):
    ofx.Trainer(linen_step, [ckpt]).fit(linen_state(), BrokenAt7(), num_steps=10)
  assert ckpt.manager.all_steps() == [5]  # step 7's position is unknown: not saved
  _resumes_as_an_uninterrupted_run(tmp_path, cfg, from_step=5)


def test_data_that_runs_out_ends_the_run_with_its_final_save(tmp_path, caplog):
  """Trainer.fit over a finite iterator shorter than num_steps: the StopIteration was taken
  as a training failure (logged at ERROR, an "exception" save) and raised to the caller."""

  class Five(Dataset):
    def __next__(self):
      if self.i == 5:
        raise StopIteration
      return super().__next__()

  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 100})
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):
    state = ofx.Trainer(linen_step, [ckpt]).fit(linen_state(), Five(), num_steps=10)
  assert int(state.step) == 5 and "the data ran out after step 5" in caplog.text
  assert ckpt.manager.all_steps() == [5] and ckpt.manager.step_info(5).reason == "final"
  assert "training failed" not in caplog.text


def test_preemption_save_goes_ahead_after_an_earlier_background_save_failed(tmp_path):
  """Step 6's background save fails (the disk is full), space comes back, then SIGTERM: the
  preemption save raised step 6's old error instead of saving, and everything after the last
  committed step was lost."""
  with disks.small_disk(str(tmp_path / "disk"), "4m") as disk:
    # SIGUSR1 as the scheduler's signal, as test_preemption_signal_single_process does: a
    # SIGTERM sent to the suite's own process ended the whole run there (alone it passed).
    cfg = {"save_interval_steps": 3, "max_to_keep": 1, "directory": os.path.join(disk, "ck"),
           "preemption_signals": ("SIGUSR1",)}
    with ofx.CheckpointCallback(disk, cfg) as ckpt:
      state = ckpt.restore_or_init({"w": np.zeros(256 * 1024, np.float32)})  # 1 MiB
      filler = os.path.join(disk, "filler")
      for step in range(1, 8):
        state = {"w": state["w"] + 1}
        if step == 6:  # another writer fills the disk before step 6 is saved
          ckpt.manager.wait()
          st = os.statvfs(disk)
          with open(filler, "wb") as f:
            f.write(b"\0" * (st.f_bavail * st.f_frsize - (64 << 10)))
        if step == 7:
          assert ckpt.manager.wait_for_save(60)  # step 6's save has failed, unseen so far
          os.remove(filler)  # the space is back, and the job is preempted
          os.kill(os.getpid(), signal.SIGUSR1)
        if ckpt.on_step_end(step, state):
          break
      assert ckpt.preempted and step == 7
    assert ofx.CheckpointManager(os.path.join(disk, "ck")).all_steps() == [7]


def test_preemption_signal_single_process(tmp_path):
  seen = []

  def step_fn(state, batch):
    state, metrics = linen_step(state, batch)
    if int(state.step) == 3:
      os.kill(os.getpid(), signal.SIGUSR1)  # as a scheduler would
    seen.append(int(state.step))
    return state, metrics

  cfg = {"save_interval_steps": 100, "preemption_signals": ("SIGUSR1",)}
  ckpt = ofx.CheckpointCallback(str(tmp_path), cfg)
  final = ofx.Trainer(step_fn, [ckpt]).fit(linen_state(), Dataset(), num_steps=50)
  assert ckpt.preempted and int(final.step) == 3 and seen == [1, 2, 3]
  assert ckpt.manager.all_steps() == [3] and ckpt.manager.step_info(3).reason == "preemption"
  assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # handler removed again


def test_grace_period_abandons_a_save_that_cannot_commit(tmp_path):
  big = {"w": jnp.ones((64 << 20) // 4), "step": 0}

  def step_fn(s, batch):
    del batch
    if s["step"] == 1:
      os.kill(os.getpid(), signal.SIGUSR1)
    return {"w": s["w"], "step": s["step"] + 1}, {}

  cfg = {"save_interval_steps": 1, "preemption_signals": ("SIGUSR1",), "preemption_grace_seconds": 1e-3}
  ckpt = ofx.CheckpointCallback(str(tmp_path), cfg)
  ofx.Trainer(step_fn, [ckpt]).fit(big, Dataset(), num_steps=10)
  assert ckpt.preempted
  assert ckpt.manager.all_steps() == [1]  # step 2 was abandoned, never committed
  assert not any(n == "2" for n in os.listdir(tmp_path / "checkpoints"))


def test_grace_period_runs_out_on_one_process_only(tmp_path):
  """Process 0 cancels its save; process 1, which would wait, stops cleanly too."""
  res = jobs.run("grace_worker.py", [f"--dir={tmp_path}"], 2, 2).check()
  results = [re.findall(r"RESULT preempted=(\w+) stopped_at=(\d+) committed=(.*)", o)
             for o in res.outputs]
  assert all(len(r) == 1 for r in results), res.outputs
  (p0,), (p1,) = results
  assert p0[0] == p1[0] == "True" and p0[1] == p1[1], results  # same step, both stopped
  assert p0[2] == p1[2] == "[]", results                        # nothing committed
  assert "grace period" in res.outputs[0]
  assert "was cancelled on process 0" in res.outputs[1], res.outputs[1][-3000:]
  assert not any(n.isdigit() for n in os.listdir(tmp_path / "checkpoints"))


def test_exception_on_one_process_reraises_it_without_a_save(tmp_path):
  start = time.monotonic()
  r = subprocess.run([sys.executable, "-m", "orbax_flax.launch", "-n", "2", "--grace=5", "--",
                      os.path.join(jobs.HERE, "exception_worker.py"), str(tmp_path)],
                     capture_output=True, text=True, env=jobs.env_for(2), cwd=jobs.ROOT,
                     timeout=300, check=False)
  out = r.stdout + r.stderr
  assert r.returncode != 0, out[-3000:]
  assert "RuntimeError: boom on process 1" in out, out[-3000:]
  assert "not every process stopped at that step" in out and "no exception save" in out, out[-3000:]
  assert "TimeoutError" not in out, out[-3000:]
  assert time.monotonic() - start < 200
  d = tmp_path / "checkpoints"
  assert not d.exists() or not any(n.isdigit() for n in os.listdir(d))


def test_clu_periodic_actions_and_metric_writer(tmp_path):
  calls = []

  class Action(periodic_actions.PeriodicCallback):
    pass

  writer = jobs.RecordingWriter()
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2}, writer=writer)
  action = Action(every_steps=3, callback_fn=lambda step, t: calls.append(step))
  ofx.Trainer(linen_step, [ckpt, action, ofx.LogProgress(2, writer)]).fit(linen_state(), Dataset(), 6)
  assert calls == [3, 6]
  ckpt_events = [(s, d) for s, d in writer.scalars if "checkpoint/total_s" in d]
  assert [s for s, _ in ckpt_events] == [2, 4, 6]
  assert all(d["checkpoint/bytes"] > 0 and d["checkpoint/blocking_s"] <= d["checkpoint/total_s"]
             for _, d in ckpt_events)
  assert any("loss" in d and "steps_per_sec" in d for _, d in writer.scalars)
  with pytest.raises(TypeError, match="Callback or clu PeriodicAction"):
    ofx.Trainer(linen_step, [object()])


def test_tensorboard_records_a_metric_beyond_float32_as_inf(tmp_path):
  """A finite float64 metric beyond float32's range (a diverging perplexity) is written as
  +-inf, as TensorFlow's writer does, instead of raising inside Trainer.fit."""
  logdir = str(tmp_path / "tb")

  def step_fn(s, batch):
    big = np.float64(1e300) * s["step"]
    return {"step": s["step"] + 1}, {"ppl": big, "neg": -big, "loss": np.float64(0.5)}

  with ofx.TensorBoardWriter(logdir) as writer:
    ofx.Trainer(step_fn, [ofx.LogProgress(1, writer)]).fit({"step": 0}, iter(range(9)), 3)
    writer.write_scalars(4, {"ppl": 10**400, "neg": -10**400, "loss": 0.25})  # beyond float64
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  ea = event_accumulator.EventAccumulator(logdir)
  ea.Reload()
  read = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ("ppl", "neg", "loss")}
  assert read == {"ppl": [(1, 0.0), (2, np.inf), (3, np.inf), (4, np.inf)],
                  "neg": [(1, 0.0), (2, -np.inf), (3, -np.inf), (4, -np.inf)],
                  "loss": [(1, 0.5), (2, 0.5), (3, 0.5), (4, 0.25)]}, read


@pytest.mark.parametrize("every,start,num_steps,rows", [
    (10, 0, 30, [(10, 1.0), (20, 1.0), (30, 1.0)]),
    (10, 20, 40, [(30, 1.0), (40, 1.0)]),     # a resumed run: its first step is 21
    (1, 0, 3, [(1, None), (2, 1.0), (3, 1.0)]),  # nothing is timed at the first step
])
def test_log_progress_rate_counts_the_steps_it_timed(every, start, num_steps, rows):
  """A loop at exactly 1 step/s reports 1 step/s from its first window on; the clock starts
  at the end of the first step (its compile), so that step is not counted."""
  now = [0.0]

  def step_fn(s, batch):
    now[0] += 1.0
    return {"step": s["step"] + 1}, {"loss": 0.5}

  writer = jobs.RecordingWriter()
  ofx.Trainer(step_fn, [ofx.LogProgress(every, writer, clock=lambda: now[0])]).fit(
      {"step": start}, iter(range(100)), num_steps)
  assert [(s, d.get("steps_per_sec")) for s, d in writer.scalars] == rows
  assert all(d["loss"] == 0.5 for _, d in writer.scalars)


def test_misuse_is_reported(tmp_path):
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2})
  state = ckpt.restore_or_init(linen_state())
  with pytest.raises(ValueError, match="non-negative int .the loop counter"):
    ckpt.on_step_end(jnp.asarray(1), state)
  ckpt.close()
  with pytest.raises(RuntimeError, match="CheckpointCallback is closed"):
    ckpt.on_step_end(1, state)
  with pytest.raises(RuntimeError, match="CheckpointCallback is closed"):
    ofx.Trainer(linen_step, [ckpt]).fit(state, Dataset(), 4)


_FAILED_START = """
import os, signal, sys, time
import jax.numpy as jnp
import orbax_flax as ofx

class FailingStart(ofx.Callback):
  def on_train_start(self, state, data):
    raise ValueError("the eval set is missing")

step = lambda s, b: ({"w": s["w"] + b, "step": s["step"] + 1}, {})
cfg = {"save_interval_steps": 2}
ofx.Trainer(step, [ofx.CheckpointCallback(sys.argv[1], cfg)]).fit(
    {"w": jnp.zeros(3), "step": jnp.int32(0)}, iter([1.0] * 4), 4)
# Another model in the same workdir (the restore raises), then a later callback failing to start.
for width, later in ((5, []), (3, [FailingStart()])):
  ckpt = ofx.CheckpointCallback(sys.argv[1], cfg)
  state = {"w": jnp.zeros(width), "step": jnp.int32(0)}
  try:
    ofx.Trainer(step, [ckpt, *later]).fit(state, iter([1.0] * 8), 8)
  except Exception as e:
    print("RAISED", type(e).__name__, getattr(e, "__notes__", None), flush=True)
  try:
    ckpt.on_step_end(6, state)
    print("OPEN", flush=True)
  except RuntimeError as e:
    print("CLOSED", "CheckpointCallback is closed" in str(e), flush=True)
  print("DEFAULT HANDLER", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "STEPS", ckpt.manager.all_steps(), flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler ends the job
time.sleep(5)
print("ALIVE after SIGTERM", flush=True)
"""


def test_a_fit_whose_start_fails_closes_the_checkpoint_callback(tmp_path):
  """A restore that raises in Trainer.fit (or a later callback's on_train_start) leaves no
  SIGTERM handler behind: the process still dies of SIGTERM, and nothing was saved."""
  r = subprocess.run([sys.executable, "-c", _FAILED_START, str(tmp_path)], capture_output=True,
                     text=True, env=jobs.env_for(1), cwd=jobs.ROOT, timeout=120, check=False)
  out = r.stdout + r.stderr
  assert r.returncode == -signal.SIGTERM, out
  assert "ALIVE" not in r.stdout, out
  assert r.stdout.splitlines() == [
      "RAISED TreeMismatchError None", "CLOSED True", "DEFAULT HANDLER True STEPS [2, 4]",
      "RAISED ValueError None", "CLOSED True", "DEFAULT HANDLER True STEPS [2, 4]"], out


class _Recorder(ofx.Callback):
  """Records its hooks in ``events``; raises ``fail`` from the hook named ``fail_in``."""

  def __init__(self, name, events, fail_in=None, fail=None):
    self.name, self.events, self.fail_in, self.fail = name, events, fail_in, fail

  def _hook(self, hook, *args):
    self.events.append((self.name, hook, *args))
    if hook == self.fail_in:
      raise self.fail

  def on_train_start(self, state, data):
    self._hook("start")
    return state

  def on_train_end(self, step, state):
    self._hook("end", step)

  def on_exception(self, step, state, error):
    self._hook("exception", step, error)


def test_a_failing_start_or_end_hook_still_tells_the_other_callbacks(tmp_path):
  step_fn = lambda s, b: ({"step": s["step"] + 1}, {})  # noqa: E731
  events, error = [], ValueError("no eval set")
  cbs = [_Recorder("a", events), _Recorder("b", events, "start", error), _Recorder("c", events)]
  with pytest.raises(ValueError) as raised:
    ofx.Trainer(step_fn, cbs).fit({"step": 7}, iter(range(10)), 9)
  assert raised.value is error
  # The callbacks that started (b was starting) are told, at the step the run starts from.
  assert events == [("a", "start"), ("b", "start"), ("a", "exception", 7, error),
                    ("b", "exception", 7, error)]

  events, error = [], OSError("the eval writer's disk is gone")
  handler = signal.getsignal(signal.SIGTERM)
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 100})
  cbs = [_Recorder("a", events, "end", error), ckpt, _Recorder("c", events)]
  with pytest.raises(OSError) as raised:
    ofx.Trainer(step_fn, cbs).fit({"step": 0}, iter(range(10)), 3)
  assert raised.value is error
  assert events == [("a", "start"), ("c", "start"), ("a", "end", 3), ("c", "end", 3)]
  assert ckpt.manager.all_steps() == [3]  # the final save, after a's end failed
  assert signal.getsignal(signal.SIGTERM) == handler


def test_state_without_step_counter_resumes_where_it_stopped(tmp_path):
  def step_fn(s, batch):
    return {"w": s["w"] + batch[0, 0]}, {}

  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2})
  ofx.Trainer(step_fn, [ckpt]).fit({"w": jnp.zeros(())}, Dataset(), num_steps=4)
  data = Dataset()
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2})
  out = ofx.Trainer(step_fn, [ckpt]).fit({"w": jnp.zeros(())}, data, num_steps=6)
  assert data.i == 6 and float(out["w"]) == sum(range(1, 7))  # batches 5 and 6, once each


@struct.dataclass
class CountingState:
  """A flax.struct state with params and opt_state whose counter is not called ``step``."""
  params: dict
  opt_state: optax.OptState
  iteration: jax.Array
  tx: optax.GradientTransformation = struct.field(pytree_node=False)


def test_a_struct_state_without_a_step_field_resumes_from_the_restored_step(tmp_path):
  tx = optax.sgd(0.1)

  def step_fn(s, batch):
    updates, opt_state = tx.update({"w": batch[0]}, s.opt_state, s.params)
    return s.replace(params=optax.apply_updates(s.params, updates), opt_state=opt_state,
                     iteration=s.iteration + 1), {}

  def fresh():
    return CountingState({"w": jnp.zeros(8)}, tx.init({"w": jnp.zeros(8)}), jnp.int32(0), tx)

  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1})
  assert int(ofx.Trainer(step_fn, [ckpt]).fit(fresh(), Dataset(), 3).iteration) == 3
  data = Dataset()
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1})
  out = ofx.Trainer(step_fn, [ckpt]).fit(fresh(), data, 5)
  assert ckpt.restored_step == 3 and int(out.iteration) == 5 and data.i == 5
  assert ckpt.manager.all_steps()[-1] == 5
  np.testing.assert_allclose(out.params["w"], -0.1 * sum(range(1, 6)))  # batches 1..5, once each


def test_checkpoint_without_data_position_resumes_with_a_warning(tmp_path, caplog):
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2})
  ofx.Trainer(linen_step, [ckpt]).fit(linen_state(), (b for b in Dataset()), num_steps=2)
  assert "has no get_state()/set_state()" in caplog.text
  data = Dataset()
  again = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2})
  state = again.restore_or_init(linen_state(), data_iterator=data)
  again.close()
  assert int(state.step) == 2 and data.i == 0 and "holds no data iterator position" in caplog.text


def test_init_from_another_run_params_only(tmp_path):
  donor = linen_state(seed=5)
  ckpt = ofx.CheckpointCallback(str(tmp_path / "donor"), {"save_interval_steps": 1})
  ofx.Trainer(linen_step, [ckpt]).fit(donor, Dataset(), num_steps=2)
  source = ckpt.manager.step_path(2)
  trained = ofx.restore(source, {"params": donor.params})["params"]
  fine = ofx.CheckpointCallback(str(tmp_path / "fine"), {"init_from": source})
  state = fine.restore_or_init(linen_state(seed=1))
  fine.close()
  leaves_equal(state.params, trained)
  assert int(state.step) == 0  # only the params came from the donor
  leaves_equal(state.opt_state, linen_state(seed=1).opt_state)
  # The donor's workdir works too: its latest step.
  fine = ofx.CheckpointCallback(str(tmp_path / "fine2"), {"init_from": str(tmp_path / "donor")})
  state = fine.restore_or_init(linen_state(seed=1))
  fine.close()
  leaves_equal(state.params, trained)
  bad = ofx.CheckpointCallback(str(tmp_path / "fine3"), {"init_from": str(tmp_path / "nothing")})
  with pytest.raises(ofx.CheckpointNotFoundError, match="init_from=.*point it at a checkpoint"):
    bad.restore_or_init(linen_state(seed=1))
  bad.close()


def test_init_from_into_a_plain_pytree_takes_its_params_only(tmp_path):
  """A plain dict state {params, opt_state, step}: init_from took the donor's whole state, its
  step counter (10) and Adam state too, so a fine-tune of num_steps=10 ran no step. The
  params are taken, from a plain-pytree run's state/params or a TrainState run's params."""
  tx = optax.adam(1e-1)
  def make(seed):
    params = {"w": jax.random.normal(jax.random.key(seed), (4, 4))}
    return {"params": params, "opt_state": tx.init(params), "step": 0}
  @jax.jit
  def train_step(s, x):
    grads = jax.grad(lambda p: ((x @ p["w"]) ** 2).mean())(s["params"])
    updates, opt_state = tx.update(grads, s["opt_state"], s["params"])
    return {"params": optax.apply_updates(s["params"], updates), "opt_state": opt_state,
            "step": s["step"] + 1}
  with ofx.CheckpointCallback(str(tmp_path / "pretrain"), {"save_interval_steps": 10}) as ckpt:
    state = ckpt.restore_or_init(make(0))
    for step in range(1, 11):
      state = train_step(state, jnp.ones((2, 4)))
      ckpt.on_step_end(step, state)
  with ofx.CheckpointCallback(str(tmp_path / "finetune"), {"init_from": str(tmp_path / "pretrain")}
                              ) as ckpt:
    fine = ckpt.restore_or_init(make(1))
    leaves_equal(fine["params"], state["params"])
    assert int(fine["step"]) == 0 and int(fine["opt_state"][0].count) == 0
    fine = train_step(fine, jnp.ones((2, 4)))  # the user's jitted step on it
    ckpt.on_step_end(1, fine)
  assert ofx.CheckpointManager(str(tmp_path / "finetune" / "checkpoints")).all_steps() == [1]


@pytest.mark.parametrize("init_from", ["{}", "{}:params=params"])  # load and load_parts
def test_init_from_with_allow_lossy_casts_fine_tunes_a_bfloat16_model(tmp_path, caplog, init_from):
  """A bfloat16 model fine-tuned from a float32 run with allow_lossy_casts=True: the policy's
  flag reached the resume's restore but not init_from's, which refused, naming the flag already
  set. Every dtype change is logged, as a resume logs them."""
  donor = linen_state(seed=5)
  with ofx.CheckpointCallback(str(tmp_path / "donor"), {"save_interval_steps": 1}) as ckpt:
    ckpt.on_step_end(1, ckpt.restore_or_init(donor))
  bf16 = linen_state(seed=1)
  bf16 = bf16.replace(params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), bf16.params))
  config = {"init_from": init_from.format(tmp_path / "donor")}
  with pytest.raises(ofx.TreeMismatchError, match="allow_lossy_casts"):
    ofx.CheckpointCallback(str(tmp_path / "refused"), config).restore_or_init(bf16)
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):
    with ofx.CheckpointCallback(str(tmp_path / "fine"), dict(config, allow_lossy_casts=True)) as fine:
      state = fine.restore_or_init(bf16)
  leaves_equal(state.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), donor.params))
  assert re.search(r"converted from float32 \(checkpoint\) to bfloat16 \(this run's state\),"
                   r" losing information \(allow_lossy_casts\) \(and 3 more", caplog.text), caplog.text


class Deep(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = nn.Dense(8)(x)
    return x


def deep_state(layers, seed):
  model = Deep(layers)
  return train_state.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(seed), jnp.ones((1, 8))),
      tx=optax.sgd(0.1))


def test_init_from_refuses_a_model_that_lacks_layers_of_the_part_it_takes(tmp_path):
  """init_from a 4-layer run into a 2-layer model (a num_layers slip) took Dense_0 and Dense_1
  and dropped Dense_2 and Dense_3 without a word: the part taken is compared strictly, and only
  what lies outside it (the optimizer state, other subtrees) is left out."""
  donor = deep_state(4, seed=1)
  with ofx.CheckpointCallback(str(tmp_path / "donor"), {"save_interval_steps": 1}) as ckpt:
    ckpt.on_step_end(1, ckpt.restore_or_init(donor))
  source = str(tmp_path / "donor")
  with pytest.raises(ofx.TreeMismatchError, match=r"subset of the checkpoint \(4 key\(s\) left out") as e:
    ofx.CheckpointCallback(str(tmp_path / "a"), {"init_from": source}).restore_or_init(
        deep_state(2, seed=2))
  assert sorted(e.value.differences) == [
      f"params/params/Dense_{i}/{k}: in checkpoint, not in target" for i in (2, 3)
      for k in ("bias", "kernel")]
  # One layer named: the other layers lie outside what is taken.
  part = "params/params/Dense_1"
  with ofx.CheckpointCallback(str(tmp_path / "b"), {"init_from": f"{source}:{part}={part}"}) as b:
    state = b.restore_or_init(deep_state(2, seed=2))
  leaves_equal(state.params["params"]["Dense_1"], donor.params["params"]["Dense_1"])
  leaves_equal(state.params["params"]["Dense_0"], deep_state(2, seed=2).params["params"]["Dense_0"])


class _Classifier(nn.Module):
  classes: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.classes, name="head")(nn.relu(nn.Dense(16, name="trunk")(x)))


@pytest.mark.parametrize("selector", ["", ":params/params/trunk"])
def test_init_from_into_a_new_head_suggests_an_init_from_that_works(tmp_path, selector):
  """A pretrained 10-class model fine-tuned with a new 4-class head: the refusal suggested
  init_from='<ckpt>:params', counted by key paths alone, which failed again on the head's
  shapes, and never the dst=src form that takes the trunk. The advice now fits, and
  following it restores the trunk (the head fresh)."""
  def classifier(classes, seed):
    model = _Classifier(classes)
    return train_state.TrainState.create(apply_fn=model.apply, tx=optax.adam(1e-2),
                                         params=model.init(jax.random.key(seed), jnp.ones((1, 8))))
  pretrained = classifier(10, seed=0)
  with ofx.CheckpointCallback(str(tmp_path / "pretrain"), {}) as ckpt:
    ckpt.on_step_end(1, ckpt.restore_or_init(pretrained))
  source = str(tmp_path / "pretrain")
  with pytest.raises(ofx.TreeMismatchError, match="write it as dst=src") as e:
    with ofx.CheckpointCallback(str(tmp_path / "a"), {"init_from": source + selector}) as ckpt:
      ckpt.restore_or_init(classifier(4, seed=1))
  advice = re.search(r"dst=src: '([^']+)'", str(e.value)).group(1)
  assert advice == f"{source}:params/params/trunk=params/params/trunk", advice
  with ofx.CheckpointCallback(str(tmp_path / "b"), {"init_from": advice}) as ckpt:
    state = ckpt.restore_or_init(classifier(4, seed=1))
  leaves_equal(state.params["params"]["trunk"], pretrained.params["params"]["trunk"])
  leaves_equal(state.params["params"]["head"], classifier(4, seed=1).params["params"]["head"])


_PURE_JAX_LOOP = """
import sys
import jax.numpy as jnp
import orbax_flax as ofx
for run in range(2):  # the second run resumes
  with ofx.CheckpointCallback(sys.argv[1], ofx.CheckpointPolicy(save_interval_steps=1)) as ckpt:
    state = ckpt.restore_or_init({"w": jnp.zeros(3), "step": jnp.int32(0)})
    state = {"w": state["w"] + 1, "step": state["step"] + 1}
    ckpt.on_step_end(int(state["step"]), state)
print("W", state["w"].tolist(), "IMPORTED", sorted(
    m for m in sys.modules if m.split(".")[0] in ("flax", "optax", "clu")))
"""


def test_a_pure_jax_loop_with_the_callback_imports_no_flax(tmp_path):
  """A loop over a plain pytree pays for no flax, optax or clu import at start-up (0.4 s of a
  restart): the callback asks for NNX and Linen types only when they are imported already."""
  r = subprocess.run([sys.executable, "-c", _PURE_JAX_LOOP, str(tmp_path)], capture_output=True,
                     text=True, env=jobs.env_for(2), cwd=jobs.ROOT, timeout=300, check=False)
  out = r.stdout + r.stderr
  assert r.returncode == 0, out
  assert "W [2.0, 2.0, 2.0] IMPORTED []" in out, out  # resumed from step 1, trained on


def test_a_run_off_the_main_thread_is_told_what_to_do_and_closes_from_there(tmp_path):
  """A loop in a worker thread: restore_or_init raised 'PreemptionWatcher must be created in
  the main thread', naming a class the user never made and no fix; and a run started in the
  main thread whose loop and close() ran in a worker raised from close() ('signal only works
  in main thread'), leaving the callback's SIGTERM handler catching signals after the run."""
  out = {}
  def worker(policy):
    try:
      ckpt = ofx.CheckpointCallback(str(tmp_path / "a"), policy)
      ckpt.restore_or_init({"w": np.zeros(4, np.float32)})
      ckpt.close()
      out["ok"] = True
    except RuntimeError as e:
      out["error"] = str(e)
  t = threading.Thread(target=worker, args=({"save_interval_steps": 5},))
  t.start()
  t.join(60)
  assert "set save_on_preemption=False" in out.get("error", ""), out
  t = threading.Thread(target=worker, args=({"save_on_preemption": False},))
  t.start()
  t.join(60)
  assert out.get("ok"), out
  got = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
  try:
    ckpt = ofx.CheckpointCallback(str(tmp_path / "b"), {"save_interval_steps": 5})
    state = ckpt.restore_or_init({"w": np.zeros(4, np.float32)})  # handlers: the main thread
    def loop():
      try:
        for step in range(1, 11):
          ckpt.on_step_end(step, {"w": state["w"] + step})
        ckpt.close()
      except Exception as e:  # pylint: disable=broad-except
        out["close"] = e
    t = threading.Thread(target=loop)
    t.start()
    t.join(120)
    assert "close" not in out, out
    assert ckpt.manager.all_steps() == [5, 10]
    os.kill(os.getpid(), signal.SIGTERM)  # after the run: the handler from before gets it
    time.sleep(0.1)
    assert got == [signal.SIGTERM] and not ckpt.preempted
  finally:
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "int4"])
def test_a_mixed_precision_loss_is_a_metric(tmp_path, dtype):
  """A bf16 model's loss comes out in bf16; the callback refused it ("is an array of
  bfloat16, not a number": numpy calls ml_dtypes' numbers kind 'V'), so a mixed-precision
  loop died at its first on_step_end. It is recorded and ranks steps like a float16 one."""
  state = {"w": jnp.ones(2, jnp.bfloat16)}
  with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 1, "best_metric": "loss",
                                               "keep_best": 1}) as ckpt:
    state = ckpt.restore_or_init(state)
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
      ckpt.on_step_end(step, state, {"loss": jnp.asarray(loss, dtype)})
    ckpt.manager.wait()
    assert ckpt.manager.best_step() == 2
    assert ckpt.manager.all_steps() == [2, 3]


def test_a_complex_metric_is_refused(tmp_path):
  """Recording a complex number as a metric would keep its real part only."""
  with ofx.CheckpointManager(str(tmp_path)) as m:
    with pytest.raises(TypeError, match="complex64, not a number"):
      m.save(1, {"s": {"w": np.ones(2)}}, force=True, metrics={"loss": np.complex64(1 + 2j)})
    assert m.all_steps() == []
