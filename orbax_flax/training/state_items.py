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
``extra``      the other members of a tuple state, by position (``"2"``: the
               third member), e.g. an ``nnx.Rngs``, metrics, an EMA copy
=============  ===========================================================

Supported states:

* a flax Linen ``TrainState`` (or any ``flax.struct`` dataclass with
  ``params`` and ``opt_state`` fields), restored as a new state;
* flax NNX objects: a model, an ``nnx.Optimizer``, an ``nnx.ModelAndOptimizer``,
  or a tuple (or list) of members such as ``(model, optimizer, rngs)``. The
  model is the first ``nnx.Module`` member, the optimizer the first
  ``nnx.Optimizer``; every other member (another NNX object, or any pytree
  such as a dict of arrays) is saved too, in the item ``extra``. NNX members
  are updated in place; pytree members come back in the returned tuple;
* any other pytree, stored whole as the item ``state`` (NNX objects nested
  inside it are refused: pass them as members of a tuple).

Example:
  >>> import jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  >>> rngs = nnx.Rngs(dropout=1)
  >>> sorted(to_items((model, opt, rngs, {"ema": jnp.zeros(2)})))
  ['extra', 'opt_state', 'params', 'train_state']
  >>> sorted(to_items((model, opt, rngs, {"ema": jnp.zeros(2)}))["extra"])
  ['2', '3']
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax

from orbax_flax.core import _tree
from orbax_flax import errors


def _nnx() -> Any:
  """``flax.nnx`` if this process imported it, else None: a state that holds NNX objects
  implies it did, and a state that does not need not pay for importing flax (as
  :func:`orbax_flax.core._tree.loaded`, asked here on every step without leaving the module)."""
  return sys.modules.get("flax.nnx")


def _is_key_tree(tree: Any) -> bool:
  leaves = jax.tree.leaves(tree)
  return bool(leaves) and all(
      isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      for x in leaves)


def _is_nnx(x: Any) -> bool:
  nnx = _nnx()
  return nnx is not None and isinstance(x, getattr(nnx, "Pytree", ()))


def _is_members(state: Any) -> bool:
  """A tuple or list with at least one NNX member: each member is saved."""
  return isinstance(state, (tuple, list)) and any(_is_nnx(x) for x in state)


def _model_member(members: Any) -> Any:
  """The model of a tuple state: its first ``nnx.Module`` (else the first other NNX object)."""
  nnx = _nnx()
  opt_like = (nnx.Optimizer, nnx.Rngs) + ((nnx.Metric,) if hasattr(nnx, "Metric") else ())
  modules = [x for x in members if isinstance(x, nnx.Module) and not isinstance(x, opt_like)]
  others = [x for x in members if _is_nnx(x) and not isinstance(x, opt_like)]
  return (modules or others or [None])[0]


def _nnx_parts(state: Any) -> tuple[Any, Any]:
  """(model, optimizer) of an NNX state; either may be None."""
  nnx = _nnx()
  if _is_members(state):
    model = _model_member(state)
    opt = next((x for x in state if isinstance(x, nnx.Optimizer)), None)
    return model, opt
  if hasattr(nnx, "ModelAndOptimizer") and isinstance(state, nnx.ModelAndOptimizer):
    return state.model, state
  if isinstance(state, nnx.Optimizer):
    return None, state
  return state, None


def _extra_members(state: Any) -> list[tuple[int, Any]]:
  """(position, member) of every member of a tuple state that is not its model or optimizer."""
  if not _is_members(state):
    return []
  model, opt = _nnx_parts(state)
  return [(i, x) for i, x in enumerate(state) if x is not model and x is not opt]


def kind(state: Any) -> str:
  """"linen", "nnx" or "pytree"; "nnx" states are updated in place (mutable), the others not."""
  if _is_nnx(state) or _is_members(state):
    return "nnx"
  if dataclasses.is_dataclass(state) and hasattr(state, "params") and hasattr(state, "opt_state") \
      and hasattr(state, "replace"):
    return "linen"
  return "pytree"


def to_items(state: Any) -> dict[str, Any]:
  """The items a state is saved as (concrete arrays, usable as restore targets)."""
  k = kind(state)
  if k == "pytree":
    _refuse_nested_nnx(state)
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
  nnx = _nnx()
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
  extra = {str(i): nnx.state(x) if _is_nnx(x) else x for i, x in _extra_members(state)}
  if extra:
    items["extra"] = extra
  return items


def _refuse_nested_nnx(state: Any) -> None:
  """NNX objects inside a plain pytree would come back as new objects, not in place."""
  nested = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_nnx)[0]
            if _is_nnx(x)]
  if nested:
    path, x = nested[0]
    where = _tree.path_str(tuple(_tree.key_part(k) for k in path))
    raise TypeError(
        f"the state holds an NNX object ({type(x).__name__} at {where}) inside a"
        f" {type(state).__name__}: it would be restored as a new object, not into yours. Hand"
        " NNX objects to the callback as the members of a tuple, e.g. (model, optimizer, rngs,"
        " metrics): each member is then saved and restored in place.")


def check(state: Any) -> dict[str, Any]:
  """The items of ``state``, after checking that every leaf of every member can be saved.

  Raises:
    UnsupportedLeafError: a leaf that cannot be saved, naming the item and key path
      (for a tuple member, ``extra/<position>/...``) and how to include it.
    TypeError: NNX objects nested inside a plain pytree.
  """
  items = to_items(state)
  for name, tree in items.items():
    for path, leaf in _tree.flatten(tree):
      if _tree.leaf_kind(leaf) is None and not isinstance(leaf, jax.ShapeDtypeStruct):
        e = _tree.unsupported_leaf_error(name, path, leaf)
        raise errors.UnsupportedLeafError(
            f"{e} Every part of the state handed to the checkpoint callback is saved: turn"
            " this value into arrays or scalars (e.g. an nnx.Variable holding an array), or"
            " keep it out of the state and rebuild it when the run resumes.") from None
  return items


def _optimizer_only(opt: Any) -> Any:
  """The optimizer's own state (step, moments), without the model's variables."""
  nnx = _nnx()
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
  nnx = _nnx()
  model, opt = _nnx_parts(state)
  if model is not None:
    nnx.update(model, restored["params"])
    if "rng" in restored:
      nnx.update(model, restored["rng"])
    nnx.update(model, restored["train_state"])
  if opt is not None and "opt_state" in restored:
    nnx.update(opt, restored["opt_state"])
  extra = _extra_members(state)
  if not extra:
    return state
  members = list(state)
  for i, x in extra:
    value = restored["extra"][str(i)]
    if _is_nnx(x):
      nnx.update(x, value)
    else:
      members[i] = value  # a pytree member: immutable, so the returned tuple holds it
  if all(_is_nnx(x) for _, x in extra):
    return state  # every member was updated in place
  return state._make(members) if hasattr(state, "_make") else type(state)(members)


def params_of(state: Any) -> Any:
  """The parameters part (what ``init_from`` restores)."""
  return to_items(state).get("params", to_items(state).get("state"))


def step_of(state: Any) -> int | None:
  """The state's step counter if it has one (one device-to-host read), else None.

  A Linen ``TrainState`` has ``step``; a ``flax.struct`` dataclass with ``params`` and
  ``opt_state`` may count under another name, or not at all: None, as for a dict.
  """
  k = kind(state)
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
