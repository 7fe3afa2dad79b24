"""How a training state becomes checkpoint items, and back.

Each part of the state is its own item, so that inference code can restore
the parameters alone and a data pipeline can restore its position alone:

=============  ===========================================================
item           holds
=============  ===========================================================
``params``     the model parameters
``opt_state``  the optimizer state
``rng``        PRNG keys (TrainState fields holding keys; NNX ``RngState``)
``train_state`` everything else: the step, batch statistics, custom fields
=============  ===========================================================

Supported states:

* a flax Linen ``TrainState`` (or any ``flax.struct`` dataclass with
  ``params`` and ``opt_state`` fields), restored as a new state;
* flax NNX objects: a model, an ``nnx.Optimizer``, an ``nnx.ModelAndOptimizer``,
  or a ``(model, optimizer)`` tuple, updated in place;
* any other pytree, stored whole as the item ``state``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

try:
  from flax import nnx
except ImportError:  # pragma: no cover
  nnx = None


def _is_key_tree(tree: Any) -> bool:
  leaves = jax.tree.leaves(tree)
  return bool(leaves) and all(
      isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      for x in leaves)


def _is_nnx(x: Any) -> bool:
  return nnx is not None and isinstance(x, nnx.Pytree)


def _nnx_parts(state: Any) -> tuple[Any, Any]:
  """(model, optimizer) of an NNX state; either may be None."""
  if isinstance(state, (tuple, list)) and state and all(_is_nnx(x) for x in state):
    model = next((x for x in state if not isinstance(x, nnx.Optimizer)), None)
    opt = next((x for x in state if isinstance(x, nnx.Optimizer)), None)
    return model, opt
  if hasattr(nnx, "ModelAndOptimizer") and isinstance(state, nnx.ModelAndOptimizer):
    return state.model, state
  if isinstance(state, nnx.Optimizer):
    return None, state
  return state, None


def kind(state: Any) -> str:
  """"linen", "nnx" or "pytree"."""
  if _is_nnx(state) or (isinstance(state, (tuple, list)) and state and all(_is_nnx(x) for x in state)):
    return "nnx"
  if dataclasses.is_dataclass(state) and hasattr(state, "params") and hasattr(state, "opt_state") \
      and hasattr(state, "replace"):
    return "linen"
  return "pytree"


def to_items(state: Any) -> dict[str, Any]:
  """The items a state is saved as (concrete arrays, usable as restore targets)."""
  k = kind(state)
  if k == "pytree":
    return {"state": state}
  if k == "linen":
    rest = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if f.metadata.get("pytree_node", True) and f.name not in ("params", "opt_state")}
    items = {"params": state.params, "opt_state": state.opt_state}
    rngs = {n: v for n, v in rest.items() if _is_key_tree(v)}
    if rngs:
      items["rng"] = rngs
    items["train_state"] = {n: v for n, v in rest.items() if n not in rngs}
    return items
  model, opt = _nnx_parts(state)
  items = {}
  if model is not None:
    items["params"] = nnx.state(model, nnx.Param)
    rng = nnx.state(model, nnx.RngState)
    other = nnx.state(model, nnx.Not(nnx.Any(nnx.Param, nnx.RngState)))
    if jax.tree.leaves(rng):
      items["rng"] = rng
    items["train_state"] = other
  if opt is not None:
    opt_state = nnx.state(opt, nnx.Not(nnx.Param)) if model is None else _optimizer_only(opt)
    items["opt_state"] = opt_state
  return items


def _optimizer_only(opt: Any) -> Any:
  """The optimizer's own state (step, moments), without the model's variables."""
  return nnx.state(opt, nnx.Any(nnx.OptState, nnx.Intermediate)) if hasattr(nnx, "OptState") \
      else nnx.state(opt)


def from_items(state: Any, restored: dict[str, Any]) -> Any:
  """Puts restored items back: a new Linen state, or NNX objects updated in place."""
  k = kind(state)
  if k == "pytree":
    return restored["state"]
  if k == "linen":
    fields = dict(restored.get("train_state", {}))
    fields.update(restored.get("rng", {}))
    return state.replace(params=restored["params"], opt_state=restored["opt_state"], **fields)
  model, opt = _nnx_parts(state)
  if model is not None:
    nnx.update(model, restored["params"])
    if "rng" in restored:
      nnx.update(model, restored["rng"])
    nnx.update(model, restored["train_state"])
  if opt is not None and "opt_state" in restored:
    nnx.update(opt, restored["opt_state"])
  return state


def params_of(state: Any) -> Any:
  """The parameters part (what ``init_from`` restores)."""
  return to_items(state).get("params", to_items(state).get("state"))


def step_of(state: Any) -> int | None:
  """The state's step counter if it has one (one device-to-host read)."""
  k = kind(state)
  if k == "linen":
    return int(state.step)
  if k == "nnx":
    _, opt = _nnx_parts(state)
    if opt is not None:
      step = opt.step
      if hasattr(step, "get_value"):  # an nnx Variable (``.value`` is deprecated)
        step = step.get_value()
      return int(step)
    return None
  step = getattr(state, "step", None)
  if step is None and isinstance(state, dict):
    step = state.get("step")
  return None if step is None else int(step)
