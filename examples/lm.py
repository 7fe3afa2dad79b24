"""A small decoder-only transformer language model, its data and its sharding.

Everything here is deterministic: the synthetic corpus is a function of
(seed, record index), dropout draws from a key carried in the train state, so a
run that is stopped and resumed ends bitwise where an uninterrupted one does.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orbax_flax.data import ElasticIterator


class Block(nn.Module):
  d_model: int
  num_heads: int
  d_ff: int
  dropout: float

  @nn.compact
  def __call__(self, x, *, train: bool):
    h = nn.LayerNorm()(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dropout_rate=self.dropout,
                                        deterministic=not train)(h, h, mask=mask)
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(self.d_ff)(h)
    h = nn.gelu(h)
    h = nn.Dense(self.d_model)(h)
    h = nn.Dropout(self.dropout, deterministic=not train)(h)
    return x + h


class TransformerLM(nn.Module):
  vocab_size: int
  d_model: int
  num_heads: int
  num_layers: int
  d_ff: int
  seq_len: int
  dropout: float = 0.0

  @nn.compact
  def __call__(self, tokens, *, train: bool = False):
    x = nn.Embed(self.vocab_size, self.d_model)(tokens)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02), (self.seq_len, self.d_model))
    x = x + pos[None, : tokens.shape[1]]
    for _ in range(self.num_layers):
      x = Block(self.d_model, self.num_heads, self.d_ff, self.dropout)(x, train=train)
    x = nn.LayerNorm()(x)
    return nn.Dense(self.vocab_size)(x)


class TrainState(train_state.TrainState):
  """Flax's TrainState plus the dropout key, so the RNG is checkpointed too."""
  rng: jax.Array


def model_from_config(config) -> TransformerLM:
  return TransformerLM(config.vocab_size, config.d_model, config.num_heads, config.num_layers,
                       config.d_ff, config.seq_len, config.dropout)


def make_mesh(config) -> jax.sharding.Mesh:
  """("data", "model") over every device of the job, "model" within each process.

  Each process reads its own rows of every batch (:func:`text_batches`), so the devices
  that share rows (a "model" group) must be one process's: the default takes 2 of a
  process's devices when it has an even number, else 1.
  """
  n, local = jax.device_count(), jax.local_device_count()
  model = config.model_parallel or (2 if local % 2 == 0 and local > 1 else 1)
  if local % model:
    raise ValueError(f"model_parallel={model} does not divide the {local} devices of each"
                     f" process: the devices of a model group must be one process's (each"
                     f" process reads its own rows of the batch); choose a divisor of {local}")
  return jax.make_mesh((n // model, model), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def param_spec(x: Any, mesh: jax.sharding.Mesh) -> P:
  """Large matrices are sharded along "model" on their last dim; the rest replicated."""
  model = mesh.shape["model"]
  if getattr(x, "ndim", 0) >= 2 and x.shape[-1] % model == 0 and x.size >= 4096:
    return P(*([None] * (x.ndim - 1)), "model")
  return P()


def create_state(config, mesh: jax.sharding.Mesh) -> TrainState:
  """A freshly initialised, sharded train state (the same on every process)."""
  model = model_from_config(config)
  tx = optax.adam(config.learning_rate)
  init_key, dropout_key = jax.random.split(jax.random.key(config.seed))

  def init():
    params = model.init(init_key, jnp.zeros((1, config.seq_len), jnp.int32))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=dropout_key)

  abstract = jax.eval_shape(init)
  shardings = jax.tree.map(lambda x: NamedSharding(mesh, param_spec(x, mesh)), abstract)
  return jax.jit(init, out_shardings=shardings)()


def make_train_step(mesh: jax.sharding.Mesh, state: TrainState):
  """The jitted step: (state, tokens) -> (state, {"loss": ...}); donates the old state."""
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  data_sharding = NamedSharding(mesh, P("data", None))
  replicated = NamedSharding(mesh, P())

  def step(state: TrainState, tokens):
    rng, dropout_key = jax.random.split(state.rng)

    def loss_fn(params):
      logits = state.apply_fn({"params": params}, tokens[:, :-1], train=True,
                              rngs={"dropout": dropout_key})
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    state = state.apply_gradients(grads=grads).replace(rng=rng)
    return state, {"loss": loss}

  return jax.jit(step, in_shardings=(state_sharding, data_sharding),
                 out_shardings=(state_sharding, replicated), donate_argnums=0)


def corpus(config) -> grain.MapDataset:
  """The synthetic corpus, as a grain ``MapDataset``: record ``i`` is ``{"id": i, "tokens": ...}``.

  The tokens follow a fixed random bigram chain (each token has a few likely
  successors: learnable structure) and are a pure function of (seed, i), so
  any process reads any record. 2**40 records: endless for any run here.
  """
  rng = np.random.default_rng(config.seed + 7)
  logits = rng.standard_normal((config.vocab_size, config.vocab_size)) * 3.0
  cumulative = np.cumsum(np.exp(logits) / np.exp(logits).sum(1, keepdims=True), axis=1)
  length, last = config.seq_len + 1, config.vocab_size - 1

  def record(i: int) -> dict[str, Any]:
    r = np.random.default_rng([config.seed, i])
    tokens = np.empty(length, np.int32)
    tokens[0] = r.integers(0, config.vocab_size)
    u = r.random(length)
    for t in range(1, length):
      tokens[t] = min(np.searchsorted(cumulative[tokens[t - 1]], u[t]), last)
    return {"id": i, "tokens": tokens}

  return grain.MapDataset.range(2**40).map(record)


def check_batch_size(config) -> None:
  """Raises ValueError unless each process can take an equal share of every batch."""
  n = jax.process_count()
  if config.batch_size % n:
    raise ValueError(f"batch_size={config.batch_size} must be a multiple of the {n} processes:"
                     " each process puts an equal share of the batch on its devices; set"
                     f" --config.batch_size={max(n, config.batch_size // n * n)}")


def text_batches(config, mesh: jax.sharding.Mesh, ledger=None) -> ElasticIterator:
  """The corpus read through ``orbax_flax.data.ElasticIterator``: global token batches.

  Each process reads its share of every global batch (``batch_size //
  process_count`` records, grain's prefetch threads) and puts it on its own
  devices' rows of the ``("data", None)``-sharded batch. The iterator's
  position is checkpointed with every step and resumes exactly on any process
  count: every record is trained on once. ``ledger(ids)``, if given, is told
  the ids of this process's records of each batch.
  """
  check_batch_size(config)
  sharding = NamedSharding(mesh, P("data", None))
  shape = (config.batch_size, config.seq_len + 1)

  def to_global(records):  # grain's batch_fn: this process's records -> its rows of the batch
    if ledger is not None:
      ledger([r["id"] for r in records])
    local = np.stack([r["tokens"] for r in records])
    return jax.make_array_from_process_local_data(sharding, local, shape)

  return ElasticIterator(corpus(config), config.batch_size, batch_fn=to_global,
                         read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
