"""Jobs at the edges: pmap metrics, runs that arrive from elsewhere, slips in the workdir,
mistyped metric names (issue 28)."""

import logging
import os
import re

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


def test_a_save_without_the_best_metric_does_not_warn_a_second_time(tmp_path, caplog):
  """The manager's save checks metrics too (for users of the manager alone); the callback's
  check and its save's kept two memories, so a saved step without the eval metric warned
  again."""
  policy = _policy(save_interval_steps=10, max_to_keep=2, keep_best=1,
                   best_metric="eval_accuracy", best_mode="max")
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):
    with ofx.CheckpointCallback(str(tmp_path), policy) as ckpt:
      state = ckpt.restore_or_init({"w": jnp.zeros(4)})
      for step in range(1, 31):
        metrics = {"loss": 1.0 / step}
        if step == 20:
          metrics["eval_accuracy"] = 0.5
        ckpt.on_step_end(step, state, metrics)
  said = [r.getMessage() for r in caplog.records if "eval_accuracy" in r.getMessage()]
  assert len(said) == 1 and "only on some steps" in said[0], said
  assert ckpt.manager.best_step() == 20


# -- a run that arrives from another library, or from a slip of the workdir ------------------

def _trained_state(step):
  """A Linen TrainState at ``step`` with distinct params and Adam moments."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax.training import train_state  # pylint: disable=g-import-not-at-top
  model = nn.Dense(8)
  params = model.init(jax.random.key(step), jnp.ones((1, 4)))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-2))
  grads = jax.tree.map(jnp.ones_like, params)
  for _ in range(step // 10):
    state = state.apply_gradients(grads=grads)
  return state.replace(step=jnp.asarray(step, jnp.int32))


def _mesh_state(state):
  """``state`` with every array placed on a (4, 2) mesh: params sharded, the rest replicated."""
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  def place(x):
    spec = jax.sharding.PartitionSpec(*([None, "model"] if x.ndim == 2 else []))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  return jax.tree.map(place, state)


def _ocp_run(directory, layout):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  logging.getLogger("absl").setLevel(logging.ERROR)
  if layout == "legacy":
    for step in (20, 40):
      ocp.PyTreeCheckpointer().save(os.path.join(directory, f"checkpoint_{step}"),
                                    _trained_state(step))
    return
  with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as m:
    for step in (20, 40):
      m.save(step, args=ocp.args.StandardSave(_trained_state(step)))
    m.wait_until_finished()


@pytest.mark.parametrize("layout", ["manager", "legacy"])
def test_an_orbax_checkpoint_run_in_the_workdir_is_continued_whole(tmp_path, layout, caplog):
  """A job switched from orbax-checkpoint (a CheckpointManager in the workdir, or flax's legacy
  checkpoint_<N>) continues from step 40: params, Adam moments and step, resharded onto this
  job's mesh, with one WARNING that says so; then it trains and its own saves resume."""
  workdir = str(tmp_path / "run")
  _ocp_run(workdir, layout)
  want = _trained_state(40)
  fresh = _mesh_state(_trained_state(0))
  policy = _policy(save_interval_steps=10)
  with caplog.at_level(logging.INFO, logger="orbax_flax"):
    with ofx.CheckpointCallback(workdir, policy) as ckpt:
      state = ckpt.restore_or_init(fresh)
      assert ckpt.restored_step == 40 and int(state.step) == 40
      for got, w in zip(jax.tree.leaves((state.params, state.opt_state)),
                        jax.tree.leaves((want.params, want.opt_state))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
      assert state.params["params"]["kernel"].sharding == fresh.params["params"]["kernel"].sharding
      grads = jax.tree.map(jnp.ones_like, state.params)
      state = jax.jit(lambda s: s.apply_gradients(grads=grads))(state)  # the user's jitted step
      ckpt.on_step_end(41, state)
  said = [r for r in caplog.records if "continuing it from step 40" in r.getMessage()]
  assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text
  assert ckpt.manager.all_steps() == [41]
  with ofx.CheckpointCallback(workdir, policy) as again:  # our own step now comes first
    resumed = again.restore_or_init(fresh)
  assert again.restored_step == 41 and int(resumed.step) == 41


def test_an_orbax_checkpoint_run_in_the_checkpoints_directory_is_refused_with_the_line(tmp_path):
  """ocp.CheckpointManager(workdir/checkpoints): orbax_flax would write among its steps; the
  error gives the directory setting, with which the run then continues from step 40."""
  workdir = str(tmp_path / "run")
  _ocp_run(os.path.join(workdir, "checkpoints"), "manager")
  fresh = _trained_state(0)
  with pytest.raises(ofx.CheckpointExistsError,
                     match=r"orbax-checkpoint run \(step\(s\) 20, 40\).*checkpoint.directory="):
    ofx.CheckpointCallback(workdir, _policy(save_interval_steps=10)).restore_or_init(fresh)
  policy = _policy(save_interval_steps=10,
                   directory=os.path.join(workdir, "checkpoints_orbax_flax"))
  with ofx.CheckpointCallback(workdir, policy) as ckpt:
    state = ckpt.restore_or_init(fresh)
  assert ckpt.restored_step == 40 and int(state.step) == 40
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["20", "40"]  # left alone


def test_the_refusals_params_only_line_works_as_printed(tmp_path):
  """The CheckpointExistsError's line for taking only the params, followed as printed (every
  --config.checkpoint flag on it), fine-tunes from step 40; before, it named init_from alone,
  which the same error refused again (the directory still held that run)."""
  workdir = str(tmp_path / "run")
  checkpoints = os.path.join(workdir, "checkpoints")
  _ocp_run(checkpoints, "manager")
  with pytest.raises(ofx.CheckpointExistsError) as e:
    ofx.CheckpointCallback(workdir, _policy(save_interval_steps=10)).restore_or_init(
        _trained_state(0))
  line = str(e.value).split("To take only its params instead")[1]
  flags = dict(re.findall(r"--config\.checkpoint\.(\w+)=(\S+)", line))
  assert sorted(flags) == ["directory", "init_from"], line
  config = {"save_interval_steps": 10, "save_on_preemption": False, **flags}
  with ofx.CheckpointCallback(workdir, config) as ckpt:
    state = ckpt.restore_or_init(_trained_state(0))
  assert ckpt.restored_step is None and int(state.step) == 0  # fine-tuning: params only
  np.testing.assert_array_equal(state.params["params"]["kernel"],
                                _trained_state(40).params["params"]["kernel"])
  assert sorted(os.listdir(checkpoints)) == ["20", "40"]  # left alone


def test_an_orbax_checkpoint_run_beside_a_stray_step_directory_is_still_refused(tmp_path):
  """A half-deleted orbax step (5/ holding only default/_sharding) beside the run's steps: still
  CheckpointExistsError, not its healthy steps called damaged (CANNOT RESUME FROM STEP 40)."""
  workdir = str(tmp_path / "run")
  checkpoints = os.path.join(workdir, "checkpoints")
  _ocp_run(checkpoints, "manager")
  os.makedirs(os.path.join(checkpoints, "5", "default"))
  with open(os.path.join(checkpoints, "5", "default", "_sharding"), "w") as f:
    f.write("{}")
  with pytest.raises(ofx.CheckpointExistsError,
                     match=r"orbax-checkpoint run \(step\(s\) 20, 40\).*checkpoint.directory="):
    ofx.CheckpointCallback(workdir, _policy(save_interval_steps=10)).restore_or_init(
        _trained_state(0))
  assert sorted(os.listdir(checkpoints)) == ["20", "40", "5"]


def test_another_runs_state_that_does_not_fit_is_refused_with_init_from(tmp_path):
  workdir = str(tmp_path / "run")
  _ocp_run(workdir, "manager")
  with pytest.raises(ofx.TreeMismatchError, match=r"init_from=.*run/40"):
    ofx.CheckpointCallback(workdir, _policy(save_interval_steps=10)).restore_or_init(
        {"w": jnp.zeros(3)})


def test_init_from_takes_the_params_of_a_legacy_flax_workdir(tmp_path):
  legacy = str(tmp_path / "legacy")
  _ocp_run(legacy, "legacy")
  fresh = _trained_state(0)
  policy = _policy(save_interval_steps=10, init_from=legacy)
  with ofx.CheckpointCallback(str(tmp_path / "ft"), policy) as ckpt:
    state = ckpt.restore_or_init(fresh)
  assert ckpt.restored_step is None and int(state.step) == 0  # fine-tuning: params only
  np.testing.assert_array_equal(state.params["params"]["kernel"],
                                _trained_state(40).params["params"]["kernel"])


def _count_to(run, last, interval):
  """A run of a callback on ``run`` whose state counts its steps, from 1 to ``last``."""
  with ofx.CheckpointCallback(run, _policy(save_interval_steps=interval)) as ckpt:
    state = ckpt.restore_or_init({"w": jnp.zeros(4)})
    for step in range(1, last + 1):
      state = {"w": state["w"] + 1}
      ckpt.on_step_end(step, state)


def test_a_workdir_that_is_a_runs_checkpoints_directory_is_refused(tmp_path):
  """--workdir=<run>/checkpoints: an error naming the run's workdir, not a silent fresh start
  (an INFO line that orbax-checkpoint's root handler would hide)."""
  run = str(tmp_path / "run")
  policy = _policy(save_interval_steps=10)
  _count_to(run, 20, 10)
  wrong = os.path.join(run, "checkpoints")
  with pytest.raises(ValueError, match=rf"holds orbax_flax checkpoints itself \(step\(s\) 10, 20\)"
                     rf".*--workdir={run}\b"):
    ofx.CheckpointCallback(wrong, policy).restore_or_init({"w": jnp.zeros(4)})
  with ofx.CheckpointCallback(wrong, _policy(save_interval_steps=10, directory=wrong)) as ckpt:
    assert float(ckpt.restore_or_init({"w": jnp.zeros(4)})["w"][0]) == 20  # the way it names


def test_a_restart_with_the_checkpoint_directory_moved_is_refused_naming_the_run(tmp_path):
  """A run restarted on its workdir with checkpoint.directory changed (to move its steps to
  another disk) started from scratch: one INFO line, "no checkpoint in .../moved". It is refused
  before anything is written, naming the run's steps and the two ways on."""
  run = str(tmp_path / "run")
  _count_to(run, 20, 10)
  moved = str(tmp_path / "other_disk" / "ckpts")
  with pytest.raises(ValueError, match=rf"checkpoints holds this workdir's run \(orbax_flax"
                     rf" step\(s\) 10, 20\).*--config.checkpoint.directory={run}/checkpoints"):
    ofx.CheckpointCallback(run, _policy(save_interval_steps=10, directory=moved)).restore_or_init(
        {"w": jnp.zeros(4)})
  assert not os.path.exists(moved)
  os.makedirs(os.path.dirname(moved))
  # A fine-tune in the same workdir, from the run's step by init_from: not refused.
  tuned = _policy(save_interval_steps=10, directory=str(tmp_path / "tuned"),
                  init_from=os.path.join(run, "checkpoints", "20") + ":state")
  with ofx.CheckpointCallback(run, tuned) as ckpt:
    assert float(ckpt.restore_or_init({"w": jnp.zeros(4)})["w"][0]) == 20
    assert ckpt.restored_step is None  # fine-tuning: starts from the weights, at step 0
  os.rename(os.path.join(run, "checkpoints"), moved)  # the way it names: moved, whole
  with ofx.CheckpointCallback(run, _policy(save_interval_steps=10, directory=moved)) as ckpt:
    assert float(ckpt.restore_or_init({"w": jnp.zeros(4)})["w"][0]) == 20


def test_a_restart_with_another_optimizer_says_so_and_names_the_step_to_start_from(tmp_path):
  """adam -> sgd with momentum on restart: refused before anything is written (as before), but
  diagnosed as "a different model" with a placeholder for the step to take the weights from.
  It says the optimizer differs, and names the step: the way it names starts the new
  optimizer from the run's weights."""
  import optax  # pylint: disable=g-import-not-at-top
  run = str(tmp_path / "run")
  with ofx.CheckpointCallback(run, _policy(save_interval_steps=10)) as ckpt:
    ckpt.on_step_end(10, ckpt.restore_or_init(_trained_state(10)))
  adam = _trained_state(0)
  sgd = adam.replace(tx=optax.sgd(1e-2, momentum=0.9),
                     opt_state=optax.sgd(1e-2, momentum=0.9).init(adam.params))
  step_dir = os.path.join(run, "checkpoints", "10")
  with pytest.raises(ofx.TreeMismatchError) as e:
    ofx.CheckpointCallback(run, _policy(save_interval_steps=10)).restore_or_init(sgd)
  text = str(e.value)
  assert "a different optimizer: only the optimizer state's keys" in text.splitlines()[0], text
  assert f"init_from='{step_dir}:params'" in text, text
  with ofx.CheckpointCallback(str(tmp_path / "new"), _policy(
      save_interval_steps=10, init_from=f"{step_dir}:params")) as ckpt:
    state = ckpt.restore_or_init(sgd)
  np.testing.assert_array_equal(state.params["params"]["kernel"],
                                _trained_state(10).params["params"]["kernel"])
  # A plain dict state: the same diagnosis, and the init_from that works for it.
  plain = str(tmp_path / "plain")
  params = {"w": jnp.ones(4)}
  with ofx.CheckpointCallback(plain, _policy(save_interval_steps=10)) as ckpt:
    ckpt.on_step_end(10, ckpt.restore_or_init(
        {"params": params, "opt_state": optax.adam(1e-2).init(params)}))
  dict_sgd = {"params": params, "opt_state": optax.sgd(1e-2, momentum=0.9).init(params)}
  with pytest.raises(ofx.TreeMismatchError) as e:
    ofx.CheckpointCallback(plain, _policy(save_interval_steps=10)).restore_or_init(dict_sgd)
  text = str(e.value)
  assert "a different optimizer" in text.splitlines()[0], text
  source = os.path.join(plain, "checkpoints", "10") + ":state/params=state/params"
  assert f"init_from='{source}'" in text, text
  with ofx.CheckpointCallback(str(tmp_path / "new2"), _policy(
      save_interval_steps=10, init_from=source)) as ckpt:
    np.testing.assert_array_equal(ckpt.restore_or_init(dict_sgd)["params"]["w"], np.ones(4))


def test_a_step_copied_under_another_name_is_not_resumed_as_that_step(tmp_path, caplog):
  """cp -r checkpoints/5 checkpoints/15: the resume reported "restored step 15" with step 5's
  state (the manifest records its step; nothing compared it with the name). It is unreadable
  as step 15: the resume falls back to the newest real step (or raises, by the policy)."""
  import shutil  # pylint: disable=g-import-not-at-top
  run = str(tmp_path / "run")
  _count_to(run, 10, 5)
  steps = os.path.join(run, "checkpoints")
  shutil.copytree(os.path.join(steps, "5"), os.path.join(steps, "15"))
  with pytest.raises(ofx.CheckpointCorruptedError, match="records step 5, not 15"):
    ofx.CheckpointCallback(run, _policy(save_interval_steps=5,
                                        on_unreadable_checkpoint="raise")).restore_or_init(
                                            {"w": jnp.zeros(4)})
  with caplog.at_level(logging.ERROR, logger="orbax_flax"):
    with ofx.CheckpointCallback(run, _policy(save_interval_steps=5,
                                             on_unreadable_checkpoint="fallback")) as ckpt:
      state = ckpt.restore_or_init({"w": jnp.zeros(4)})
      assert ckpt.restored_step == 10 and float(state["w"][0]) == 10
      for step in range(11, 16):  # training goes on: its step 15 replaces the copy
        state = {"w": state["w"] + 1}
        ckpt.on_step_end(step, state)
  assert "its manifest records step 5, not 15" in caplog.text, caplog.text
  assert float(ofx.restore(os.path.join(steps, "15"))["state"]["w"][0]) == 15


# -- overriding a checkpoint field the user's config block does not list --------------------

_PARTIAL_BLOCK = """
import ml_collections
def get_config():
  config = ml_collections.ConfigDict()
  config.checkpoint = ml_collections.ConfigDict({"save_interval_steps": 100})
  return config
"""

_FULL_BLOCK = """
import dataclasses
import ml_collections
import orbax_flax as ofx
def get_config():
  config = ml_collections.ConfigDict()
  config.checkpoint = ml_collections.ConfigDict(
      dataclasses.asdict(ofx.CheckpointPolicy(save_interval_steps=100)))
  return config
"""


@pytest.mark.parametrize("block", ["partial", "full"])
def test_a_field_the_config_block_does_not_list_is_overridden_as_docs_training_says(tmp_path,
                                                                                  block):
  """ml_collections refuses --config.checkpoint.<field> for a field the block lacks; a block
  built from CheckpointPolicy (docs/training.md) lists every field, so any can be overridden."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import jobs  # pylint: disable=g-import-not-at-top
  path = tmp_path / "config.py"
  path.write_text(_FULL_BLOCK if block == "full" else _PARTIAL_BLOCK)
  r = subprocess.run([sys.executable, os.path.join(jobs.HERE, "config_main.py"),
                      f"--config={path}", "--config.checkpoint.allow_lossy_casts=True"],
                     capture_output=True, text=True, timeout=120, env=jobs.env_for(1),
                     check=False)
  if block == "partial":
    assert r.returncode != 0 and "allow_lossy_casts" in r.stderr, r.stdout + r.stderr
  else:
    assert r.returncode == 0, r.stderr[-3000:]
    assert "POLICY save_interval_steps=100 allow_lossy_casts=True" in r.stdout


# -- meshes with Explicit axes (jax.make_mesh's default in this JAX) -------------------------

def _mesh(shape, kind):
  return jax.make_mesh(shape, ("data", "model"), axis_types=(kind,) * 2)


def test_save_and_restore_on_explicit_axes_meshes(tmp_path):
  """A state saved on an Explicit (2, 4) mesh restores bitwise onto an Explicit (4, 2) mesh with
  the target's shardings (axis types included), and a jitted step runs on it."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  explicit = jax.sharding.AxisType.Explicit
  mesh = _mesh((2, 4), explicit)
  state = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8),
                               NamedSharding(mesh, P("data", "model"))),
           "b": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("model")))}
  ofx.save(str(tmp_path / "ckpt"), {"state": state})
  other = _mesh((4, 2), explicit)
  target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32,
                                     sharding=NamedSharding(other, P(None, "model"))),
            "b": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(other, P("model")))}
  got = ofx.restore(str(tmp_path / "ckpt"), {"state": target})["state"]
  for k in state:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))
    assert got[k].sharding == target[k].sharding
    assert got[k].sharding.mesh.axis_types == (explicit, explicit)
  x = jax.device_put(jnp.ones((4, 8)), NamedSharding(other, P("data")))
  y = jax.jit(lambda s, x: x @ s["w"] + s["b"])(got, x)
  np.testing.assert_allclose(np.asarray(y), np.ones((4, 8)) @ np.asarray(state["w"]) + np.arange(8.0))


@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
def test_a_restored_dropout_key_on_the_mesh_needs_auto_axes_as_the_readme_says(tmp_path, kind):
  """A Linen step with nn.Dropout after a resume: the restored key lives on the mesh. On Auto
  axes the step runs; on Explicit axes (make_mesh without axis_types) JAX itself raises
  ShardingTypeError inside dropout, which is why the README passes axis_types."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dropout(0.1, deterministic=False)(nn.Dense(16)(x))

  mesh = _mesh((2, 4), getattr(jax.sharding.AxisType, kind))
  model = Model()
  params = model.init(jax.random.key(0), jnp.ones((1, 8)))
  state = jax.device_put({"params": params, "key": jax.random.key(1)}, NamedSharding(mesh, P()))
  with ofx.CheckpointCallback(str(tmp_path), _policy(save_interval_steps=1)) as ckpt:
    ckpt.restore_or_init(state)
    ckpt.on_step_end(1, state)
  with ofx.CheckpointCallback(str(tmp_path), _policy(save_interval_steps=1)) as ckpt:
    state = ckpt.restore_or_init(state)
  assert ckpt.restored_step == 1
  x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data")))
  step = jax.jit(lambda s, x: model.apply(s["params"], x, rngs={"dropout": s["key"]}).sum())
  if kind == "Auto":
    assert np.isfinite(float(step(state, x)))
  else:
    with pytest.raises(Exception, match="must be scalar or have the same sharding") as e:
      step(state, x)
    assert type(e.value).__name__ == "ShardingTypeError"  # not exported by jax


@pytest.mark.parametrize("save_step", [40, 20])
def test_a_bare_manager_refuses_to_write_among_an_orbax_checkpoint_runs_steps(tmp_path, save_step):
  """ofx.CheckpointManager put where an ocp.CheckpointManager saved (a port that kept the
  directory): it listed that run's steps as its own and its keep rules deleted them (or a
  save of the same number went into one). It reads them; it refuses to write there."""
  directory = str(tmp_path / "ckpts")
  _ocp_run(directory, "manager")
  before = sorted(os.path.relpath(os.path.join(d, f), directory)
                  for d, _, fs in os.walk(directory) for f in fs)
  with ofx.CheckpointManager(directory, ofx.CheckpointPolicy(max_to_keep=1,
                                                             async_save=False)) as m:
    with pytest.raises(ofx.CheckpointExistsError, match=r"holds orbax-checkpoint steps \[20, 40\]"
                       r".*Nothing was written"):
      m.save(save_step, {"state": {"w": np.ones(3, np.float32)}}, force=True)
    got = m.restore(40)  # reading is fine
  assert int(np.asarray(got["default"]["step"] if "default" in got else got["state"]["step"])) == 40
  after = sorted(os.path.relpath(os.path.join(d, f), directory)
                 for d, _, fs in os.walk(directory) for f in fs)
  assert after == before
