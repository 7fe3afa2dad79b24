"""Two official Flax examples' patterns, ported as a user would, saved and resumed.

* ``examples/lm1b``: a Linen model whose params are boxed with logical axis
  names (``nn.with_logical_partitioning``), initialised by ``jax.jit`` with
  ``out_shardings`` from ``nn.logical_to_mesh_sharding``. Saved on a (2, 2, 2)
  mesh with one set of rules, resumed on 4 devices with other rules: the
  shardings are the ones the example's own init gives there, the values bitwise.
* ``examples/imagenet``: a ResNet-ish model with ``batch_stats``, the state
  replicated with ``flax.jax_utils.replicate`` and a ``jax.pmap`` step, batches
  from ``flax.jax_utils.prefetch_to_device`` (through :class:`ofx.Prefetched`,
  so a resume continues at the first batch not trained on).

Tiny models and synthetic data; every resume runs the user's step afterwards.
"""

import collections
import functools
import queue
import threading
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils
from flax.training import train_state

import orbax_flax as ofx

part = nn.with_logical_partitioning


class LM(nn.Module):
  """lm1b's shape, in miniature: an embedding shared with the output, an MLP block."""

  @nn.compact
  def __call__(self, tokens):
    emb = self.param("embedding", part(nn.initializers.normal(0.02), ("vocab", "embed")), (32, 16))
    x = emb[tokens]
    h = nn.Dense(32, kernel_init=part(nn.initializers.lecun_normal(), ("embed", "mlp")),
                 bias_init=part(nn.initializers.zeros, ("mlp",)))(x)
    x = x + nn.Dense(16, kernel_init=part(nn.initializers.lecun_normal(), ("mlp", "embed")))(
        nn.relu(h))
    return x @ emb.T


def _lm_init(rng):
  model = LM()
  params = model.init(rng, jnp.zeros((2, 8), jnp.int32))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def _lm_setup(mesh, rules):
  """lm1b's train.setup_initial_state: the abstract state, its shardings, the jitted init."""
  abstract = jax.eval_shape(_lm_init, jax.random.key(0))
  sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
  state = jax.jit(_lm_init, out_shardings=sharding)(jax.random.key(0))
  return abstract, sharding, state


@jax.jit
def _lm_step(state, tokens):
  def loss(params):
    logits = state.apply_fn({"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
  value, grads = jax.value_and_grad(loss)(state.params)
  return state.apply_gradients(grads=grads), value


def _shardings(tree):
  return [x.sharding for x in jax.tree.leaves(nn.unbox(tree))]


def _bitwise(a, b):
  for x, y in zip(jax.tree.leaves(nn.unbox(a)), jax.tree.leaves(nn.unbox(b)), strict=True):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_lm1b_boxed_state_resumes_on_another_mesh_with_other_rules(tmp_path):
  auto = (jax.sharding.AxisType.Auto,)
  rules_a = (("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"))
  mesh_a = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=auto * 3)
  _, _, state = _lm_setup(mesh_a, rules_a)
  tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 32
  workdir = str(tmp_path / "lm1b")
  policy = ofx.CheckpointPolicy(save_interval_steps=2)
  with ofx.CheckpointCallback(workdir, policy) as ckpt:
    state = ckpt.restore_or_init(state)
    for step in (1, 2):
      state, _ = _lm_step(state, tokens)
      ckpt.on_step_end(step, state)
  saved = jax.device_get(state)

  # Resumed on 4 devices with other rules, as the example resumes: init, then restore into it.
  rules_b = (("vocab", "model"), ("embed", None), ("mlp", "model"))
  mesh_b = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4], axis_types=auto * 2)
  abstract, sharding_b, fresh = _lm_setup(mesh_b, rules_b)
  with ofx.CheckpointCallback(workdir, policy) as ckpt:
    resumed = ckpt.restore_or_init(fresh)
  assert ckpt.restored_step == 2
  assert isinstance(resumed.params["Dense_0"]["kernel"], nn.LogicallyPartitioned)
  assert resumed.params["Dense_0"]["kernel"].names == ("embed", "mlp")
  assert _shardings(resumed) == _shardings(fresh)
  assert resumed.params["Dense_0"]["kernel"].value.sharding.spec == jax.P(None, "model")
  _bitwise(resumed, saved)
  # ofx.abstract of the eval_shape, under the example's rules, gives the same target.
  with nn.logical_axis_rules(rules_b):
    target = ofx.abstract(abstract, mesh_b)
  for got, want in zip(_shardings(target), _shardings(fresh), strict=True):
    assert got.is_equivalent_to(want, 2)
  for got, want in zip(_shardings(ofx.abstract(abstract, sharding_b)), _shardings(fresh),
                       strict=True):
    assert got.is_equivalent_to(want, 2)
  # The user's jitted step trains on: the same loss as the run that did not stop.
  after, loss = _lm_step(resumed, tokens)
  _, want_loss = _lm_step(state, tokens)
  assert np.isfinite(float(loss)) and np.allclose(float(loss), float(want_loss), rtol=1e-5)
  assert int(after.step) == 3


class ResNetish(nn.Module):
  """imagenet's ResNet, in miniature: conv, BatchNorm, a residual block, a head."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    x = nn.relu(norm()(nn.Conv(8, (3, 3), use_bias=False)(x)))
    y = norm()(nn.Conv(8, (3, 3), use_bias=False)(x))
    x = nn.relu(x + y).mean(axis=(1, 2))
    return nn.Dense(10)(x)


class TrainState(train_state.TrainState):  # imagenet's: batch_stats beside the params
  batch_stats: Any
  dynamic_scale: Any = None


@jax.jit
def _init_variables():
  return ResNetish().init(jax.random.key(0), jnp.ones((1, 8, 8, 3)), train=False)


def _imagenet_state():
  variables = _init_variables()  # one compilation, not one per initializer (2 cores)
  return TrainState.create(apply_fn=ResNetish().apply, params=variables["params"],
                           batch_stats=variables["batch_stats"],
                           tx=optax.sgd(0.1, momentum=0.9))


@functools.partial(jax.pmap, axis_name="batch")
def _pmap_step(state, batch):
  def loss(params):
    logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                     batch["image"], mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), updates
  (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
  grads = jax.lax.pmean(grads, "batch")
  stats = jax.lax.pmean(updates["batch_stats"], "batch")
  return state.apply_gradients(grads=grads, batch_stats=stats), jax.lax.pmean(value, "batch")


class Batches:
  """A synthetic loader with a position, like a grain iterator: batch ``i`` is a function of i."""

  def __init__(self, devices):
    self.i, self.devices = 0, devices

  def __iter__(self):
    return self

  def __next__(self):
    rng = np.random.default_rng(self.i)
    self.i += 1
    return {"image": rng.standard_normal((self.devices, 2, 8, 8, 3)).astype(np.float32),
            "label": rng.integers(0, 10, (self.devices, 2)).astype(np.int32),
            "index": np.full((self.devices,), self.i - 1, np.int32)}

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    self.i = state["i"]


def _imagenet_run(workdir, steps, seen):
  """imagenet's train_and_evaluate, ported: restore, replicate, pmap, save unreplicated."""
  devices = jax.local_device_count()
  data = ofx.Prefetched(Batches(devices), lambda it: jax_utils.prefetch_to_device(it, 2))
  with ofx.CheckpointCallback(workdir, ofx.CheckpointPolicy(save_interval_steps=3)) as ckpt:
    state = ckpt.restore_or_init(_imagenet_state(), data_iterator=data)
    start = int(state.step)
    state = jax_utils.replicate(state)
    for step in range(start + 1, steps + 1):
      batch = next(data)
      seen.append(int(batch["index"][0]))
      state, _ = _pmap_step(state, batch)
      ckpt.on_step_end(step, jax_utils.unreplicate(state))
  return jax.device_get(jax_utils.unreplicate(state)), ckpt.restored_step


def test_imagenet_pmap_loop_with_batch_stats_resumes_at_the_next_batch(tmp_path):
  seen = []
  straight, _ = _imagenet_run(str(tmp_path / "straight"), 5, seen)
  assert seen == list(range(5))
  # The same run, stopped after step 3 (a save step; prefetch_to_device had read batches 3 and
  # 4 already) and resumed: it trains on batches 3 and 4, not 5 and 6.
  seen = []
  _imagenet_run(str(tmp_path / "run"), 3, seen)
  seen = []
  resumed, restored = _imagenet_run(str(tmp_path / "run"), 5, seen)
  assert restored == 3 and seen == [3, 4]
  _bitwise(resumed.params, straight.params)
  _bitwise(resumed.batch_stats, straight.batch_stats)
  assert int(resumed.step) == 5


def test_prefetched_counts_a_source_without_a_position():
  made = []

  def fresh():
    made.append(1)
    return iter(range(100))
  ahead = lambda it: jax_utils.prefetch_to_device(  # noqa: E731
      ({"x": np.full((jax.local_device_count(),), v)} for v in it), 3)
  data = ofx.Prefetched(fresh, ahead)
  assert [int(next(data)["x"][0]) for _ in range(4)] == [0, 1, 2, 3]
  assert data.get_state() == 4  # four consumed, though the source gave out more
  data.set_state(2)
  assert int(next(data)["x"][0]) == 2 and len(made) == 2
  with pytest.raises(ValueError, match="number of batches consumed"):
    data.set_state({"i": 3})
  with pytest.raises(TypeError, match="no get_state"):
    ofx.Prefetched(iter(range(3)), ahead)
  assert not data.checkpoint_state_is_global

  class Global(Batches):  # a position in the global order: resumes on any process count
    checkpoint_state_is_global = True
  assert ofx.Prefetched(Global(1), lambda it: it).checkpoint_state_is_global


def test_prefetched_around_a_background_thread_resumes_at_the_next_batch(tmp_path):
  """A read-ahead on a thread of its own (docs/training.md: "a background queue"). The
  wrapper started one when it was built, and the resume's ``set_state`` a second; the
  first thread went on taking batches from the source, so the resumed run skipped some
  (e.g. trained on 13, 14, 17, 18, 19 instead of 10-14)."""

  class Source:  # a loader with a position, a few ms a batch
    def __init__(self):
      self.i, self.lock = 0, threading.Lock()

    def __iter__(self):
      return self

    def __next__(self):
      with self.lock:
        time.sleep(0.005)
        self.i += 1
        return self.i - 1

    def get_state(self):
      return {"i": self.i}

    def set_state(self, state):
      self.i = state["i"]

  class BackgroundQueue:  # like prefetch_generator.BackgroundGenerator
    def __init__(self, it):
      self.q = queue.Queue(4)
      threading.Thread(target=lambda: [self.q.put(x) for x in it], daemon=True).start()

    def __iter__(self):
      return self

    def __next__(self):
      return self.q.get(timeout=60)

  def run(num_steps):
    data, seen = ofx.Prefetched(Source(), BackgroundQueue), []
    with ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 5}) as ckpt:
      state = ckpt.restore_or_init({"w": jnp.zeros(()), "step": jnp.int32(0)},
                                   data_iterator=data)
      for step in range(int(state["step"]), num_steps):
        seen.append(next(data))
        state = {"w": state["w"] + seen[-1], "step": state["step"] + 1}
        ckpt.on_step_end(step + 1, state)
    return seen, float(state["w"])

  assert run(10) == (list(range(10)), 45.0)
  assert run(15) == (list(range(10, 15)), 105.0)  # trains on from batch 10, as one run would

  # A set_state in the middle of a run: the read-ahead it replaces takes no more batches.
  def ahead(it):  # a generator reading 3 ahead
    buffered = collections.deque()
    for x in it:
      buffered.append(x)
      if len(buffered) > 3:
        yield buffered.popleft()
  source = Source()
  data = ofx.Prefetched(source, ahead)
  assert [next(data) for _ in range(3)] == [0, 1, 2] and source.i == 6
  data.set_state({"i": 1})
  assert [next(data) for _ in range(4)] == [1, 2, 3, 4] and data.get_state() == {"i": 5}


def test_init_from_takes_params_and_batch_stats_at_once(tmp_path):
  """Fine-tuning a BatchNorm model: its params and batch_stats, not the optimizer or the step."""
  seen = []
  pretrained, _ = _imagenet_run(str(tmp_path / "pretrain"), 3, seen)
  policy = ofx.CheckpointPolicy(save_interval_steps=3, init_from=str(
      tmp_path / "pretrain") + ":params,train_state/batch_stats")
  with ofx.CheckpointCallback(str(tmp_path / "finetune"), policy) as ckpt:
    state = ckpt.restore_or_init(_imagenet_state())
  assert ckpt.restored_step is None and int(state.step) == 0
  _bitwise(state.params, pretrained.params)
  _bitwise(state.batch_stats, pretrained.batch_stats)
  fresh = _imagenet_state()
  _bitwise(state.opt_state, fresh.opt_state)  # the optimizer starts fresh
  state = jax_utils.replicate(state)
  batch = jax_utils.replicate(next(Batches(1)))
  batch = jax.tree.map(lambda x: x[:, 0], batch)
  state, loss = _pmap_step(state, batch)
  assert np.isfinite(float(loss[0]))
  # A destination this run's state does not have is refused, naming its items.
  bad = ofx.CheckpointPolicy(save_interval_steps=3, init_from=str(
      tmp_path / "pretrain") + ":params,stats=train_state/batch_stats")
  with ofx.CheckpointCallback(str(tmp_path / "bad"), bad) as ckpt:
    with pytest.raises(ValueError, match=r"'stats' is not a part of this run's state"):
      ckpt.restore_or_init(_imagenet_state())
  # Another model's params: a diagnosis and a few lines, not one line per leaf.
  other = ofx.CheckpointPolicy(save_interval_steps=3, init_from=str(tmp_path / "pretrain"))
  with ofx.CheckpointCallback(str(tmp_path / "other"), other) as ckpt:
    with pytest.raises(ofx.TreeMismatchError, match="a different model: 3 key.s. only in the"
                       " target, 6 only in the checkpoint, 2 in both") as e:
      ckpt.restore_or_init(_lm_init(jax.random.key(0)))
  assert len(str(e.value).splitlines()) < 12, str(e.value)
