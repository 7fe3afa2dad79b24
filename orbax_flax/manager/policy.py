"""When to save and what to keep: pure policies, no I/O, no clock of their own.

A *trigger* looks at a :class:`SaveState` (the step, the time now, the last
save) and returns the reason to save, or None. A *keep rule* looks at the
committed steps and returns the ones it keeps. Both are frozen dataclasses;
combine triggers with :func:`any_of` and rules with :func:`to_delete`. Each checks
its arguments when built (with :func:`check_int`, :func:`check_number` and
:func:`check_choice`, the checks :class:`~orbax_flax.CheckpointPolicy` uses for its
fields). The checks of what a save is given (:func:`as_step`, :func:`check_metrics`)
are pure too.
What has state (the last save, recent save costs, the clock) is the
:class:`~orbax_flax.manager.schedule.Schedule` around the triggers.

Example:
  >>> trigger = any_of(EveryNSteps(100), OnSteps(frozenset({42})))
  >>> trigger(SaveState(step=200, now=0.0, last_step=100, last_time=0.0))
  'interval'
  >>> trigger(SaveState(step=42, now=0.0, last_step=None, last_time=0.0))
  'scheduled'
  >>> steps = [StepInfo(s, time=float(s), metrics={"loss": 10 - s}) for s in range(1, 6)]
  >>> to_delete(steps, [KeepLast(2)])
  [1, 2, 3]
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import ClassVar, NamedTuple, Protocol

import numpy as np

from orbax_flax.core import _tree

# Why a save happened, as recorded in each step's metadata.
REASONS = ("interval", "time", "auto", "scheduled", "first", "final", "forced", "preemption",
           "exception")
# The reasons of saves made whatever the triggers say: they never skip, and replace a committed
# step, except "final" (the run's last step, saved already by its interval, stays as it is).
FORCED = ("forced", "final", "preemption", "exception")
MODES = ("min", "max")         # how a metric ranks: KeepBest.mode, CheckpointPolicy.best_mode
MISSING = ("worst", "keep")    # a step without the metric: KeepBest.missing, best_missing


def fail(name: str, value: object, problem: str) -> None:
  """Raises the ``ValueError`` of a bad setting: ``"<name>=<value>: <problem>."``."""
  raise ValueError(f"{name}={value!r}: {problem}.")


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
  """``value`` if it is one of ``choices`` (exactly: "Min" is not "min"), else raises.

  Raises:
    ValueError: naming the setting, the value and the choices.

  Example:
    >>> check_choice("KeepBest.mode", "Min", MODES)
    Traceback (most recent call last):
    ...
    ValueError: KeepBest.mode='Min': must be one of 'min', 'max'.
  """
  if not isinstance(value, str) or value not in choices:
    fail(name, value, f"must be one of {', '.join(repr(c) for c in choices)}")
  return value  # type: ignore[return-value]


def check_int(name: str, value: object, minimum: int | None = None, note: str = "") -> int:
  """``value`` as an int (numpy integers too, never a bool), at least ``minimum``.

  Raises:
    TypeError: not an integer.
    ValueError: below ``minimum`` (``note``, e.g. the fix, follows the bound).

  Example:
    >>> check_int("KeepEvery.period", 0, 1, " (the period of the steps kept forever)")
    Traceback (most recent call last):
    ...
    ValueError: KeepEvery.period=0: must be >= 1 (the period of the steps kept forever).
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name}={value!r}: must be an integer, got {type(value).__name__}.")
  if minimum is not None and value < minimum:
    fail(name, value, f"must be >= {minimum}{note}")
  return int(value)


def check_number(name: str, value: object, minimum: float | None = None, *,
                 above: bool = False, note: str = "") -> float:
  """``value`` as a float: a finite number at least ``minimum`` (greater, with ``above``).

  Raises:
    TypeError: not a number.
    ValueError: infinite, NaN or out of bounds (``note`` follows the bound).

  Example:
    >>> check_number("EveryNSeconds.seconds", 0, 0, above=True)
    Traceback (most recent call last):
    ...
    ValueError: EveryNSeconds.seconds=0: must be a finite number > 0.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                    np.floating)):
    raise TypeError(f"{name}={value!r}: must be a number, got {type(value).__name__}.")
  if minimum is not None and (not math.isfinite(value) or value < minimum
                              or (above and value == minimum)):
    fail(name, value, f"must be a finite number {'>' if above else '>='} {minimum:g}{note}")
  return float(value)


def as_step(step: object) -> int:
  """A step number as every entry point takes it: a non-negative int (numpy integers too).

  A jax.Array is refused like any other non-integer: reading it would force a
  device-to-host sync at every step. One validator for the manager and the callback.

  Raises:
    ValueError: naming the value and the fix.

  Example:
    >>> as_step(7), as_step(np.int64(8))
    (7, 8)
  """
  if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be a non-negative int (the loop counter, a Python int), got"
                     f" {step!r} ({type(step).__name__}); for a step held in a jax.Array pass"
                     " the loop's own counter: reading the array would force a device-to-host"
                     " sync every step")
  return int(step)


class SaveState(NamedTuple):
  """What a trigger may look at.

  Attributes:
    step: the step just finished.
    now: wall time, seconds (from the manager's injectable clock).
    last_step: the step of the last save or restore in this run, if any.
    last_time: when that save happened, or when the run started.
    first: True for the first step the manager sees in this run.
    save_cost: what a save costs the job, seconds (the median blocking time of
      recent saves, less their wait for the train step's computation), or None
      before the first is measured.
  """
  step: int
  now: float
  last_step: int | None
  last_time: float
  first: bool = False
  save_cost: float | None = None


class Trigger(Protocol):
  """A callable of a :class:`SaveState` returning the reason to save, or None.

  ``reads_clock`` says whether the answer depends on ``now`` (or the save
  cost), which differs between processes: such a trigger is decided by
  process 0 (see :class:`orbax_flax.manager.schedule.Schedule`). A trigger without the
  attribute is taken as reading the clock.
  """
  reads_clock: ClassVar[bool]

  def __call__(self, s: SaveState) -> str | None:
    ...


@dataclasses.dataclass(frozen=True)
class EveryNSteps:
  """Saves at every multiple of ``n``."""
  reads_clock: ClassVar[bool] = False
  n: int

  def __post_init__(self):
    _set(self, "n", check_int("EveryNSteps.n", self.n, 1, " (save every n steps; to save only"
                              " when asked, pass no trigger)"))

  def __call__(self, s: SaveState) -> str | None:
    return "interval" if s.step % self.n == 0 else None


@dataclasses.dataclass(frozen=True)
class EveryNSeconds:
  """Saves once ``seconds`` of wall time passed since the last save."""
  reads_clock: ClassVar[bool] = True
  seconds: float

  def __post_init__(self):
    _set(self, "seconds", check_number("EveryNSeconds.seconds", self.seconds, 0, above=True,
                                       note=" (to save every step, use EveryNSteps(1))"))

  def __call__(self, s: SaveState) -> str | None:
    return "time" if s.now - s.last_time >= self.seconds else None


def young_daly_interval(save_cost_seconds: float, mtbf_seconds: float) -> float:
  """The checkpoint interval that minimises expected lost time (Young 1974, Daly 2006).

  ``sqrt(2 * save cost * mean time between failures)``: saving more often
  spends more time saving, less often loses more work per failure.

  Example:
    >>> young_daly_interval(2.0, 3600.0)   # 2 s saves, a failure an hour: every 2 minutes
    120.0
  """
  return math.sqrt(2.0 * max(save_cost_seconds, 0.0) * mtbf_seconds)


@dataclasses.dataclass(frozen=True)
class YoungDaly:
  """Saves every :func:`young_daly_interval` of wall time, from the measured save cost.

  Attributes:
    mtbf_seconds: the job's mean time between failures (preemptions included).
    assumed_cost_seconds: the cost used before a save has been measured.
  """
  reads_clock: ClassVar[bool] = True
  mtbf_seconds: float
  assumed_cost_seconds: float = 1.0

  def __post_init__(self):
    _set(self, "mtbf_seconds", check_number(
        "YoungDaly.mtbf_seconds", self.mtbf_seconds, 0, above=True, note=" (the job's mean"
        " time between failures, e.g. 86400 for about one a day)"))
    _set(self, "assumed_cost_seconds", check_number(
        "YoungDaly.assumed_cost_seconds", self.assumed_cost_seconds, 0,
        note=" (a save's cost until one is measured)"))

  def interval(self, save_cost: float | None) -> float:
    cost = self.assumed_cost_seconds if save_cost is None else save_cost
    return young_daly_interval(cost, self.mtbf_seconds)

  def __call__(self, s: SaveState) -> str | None:
    return "auto" if s.now - s.last_time >= self.interval(s.save_cost) else None


@dataclasses.dataclass(frozen=True)
class OnSteps:
  """Saves at an explicit set of steps (any iterable of steps, kept as a frozenset)."""
  reads_clock: ClassVar[bool] = False
  steps: frozenset[int]

  def __post_init__(self):
    if isinstance(self.steps, (str, bytes)) or not hasattr(self.steps, "__iter__"):
      raise TypeError(f"OnSteps.steps={self.steps!r}: must be a set of steps, e.g."
                      " OnSteps(frozenset({100, 500})).")
    _set(self, "steps", frozenset(check_int("OnSteps.steps", s, 0, " (steps are non-negative)")
                                  for s in self.steps))

  def __call__(self, s: SaveState) -> str | None:
    return "scheduled" if s.step in self.steps else None


@dataclasses.dataclass(frozen=True)
class FirstStep:
  """Saves the first step of a run."""
  reads_clock: ClassVar[bool] = False

  def __call__(self, s: SaveState) -> str | None:
    return "first" if s.first else None


@dataclasses.dataclass(frozen=True)
class AnyOf:
  """The first reason any of ``triggers`` gives."""
  triggers: tuple[Trigger, ...]

  def __post_init__(self):
    _set(self, "triggers", tuple(self.triggers))
    for t in self.triggers:
      if not callable(t):
        raise TypeError(f"any_of: {t!r} is not a trigger (a callable of a SaveState, e.g."
                        " EveryNSteps(100)).")

  @property
  def reads_clock(self) -> bool:
    return any(getattr(t, "reads_clock", True) for t in self.triggers)

  def __call__(self, s: SaveState) -> str | None:
    for t in self.triggers:
      reason = t(s)
      if reason is not None:
        return reason
    return None


def any_of(*triggers: Trigger) -> AnyOf:
  """Combines triggers: saves when any of them fires."""
  return AnyOf(tuple(triggers))


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """A committed step, as keep rules see it.

  Attributes:
    step: the step number.
    time: wall time when the save was started (the manager's clock), seconds since the epoch.
    metrics: scalar metrics recorded with the save.
    reason: why it was saved.
  """
  step: int
  time: float
  metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
  reason: str = "interval"


class KeepRule(Protocol):
  """``keep(steps)`` returns the steps the rule keeps.

  ``reads_metadata`` says whether it looks at more than step numbers (times,
  metrics), which then have to be read; a rule without it is taken as reading them.
  """
  reads_metadata: ClassVar[bool]

  def keep(self, steps: Sequence[StepInfo]) -> set[int]:
    ...


@dataclasses.dataclass(frozen=True)
class KeepLast:
  """Keeps the ``n`` most recent steps."""
  reads_metadata: ClassVar[bool] = False
  n: int

  def __post_init__(self):
    _set(self, "n", check_int("KeepLast.n", self.n, 1, " (to keep every step, pass no keep"
                              " rule that deletes)"))

  def keep(self, steps: Sequence[StepInfo]) -> set[int]:
    return {s.step for s in sorted(steps, key=lambda s: s.step)[-self.n:]}


@dataclasses.dataclass(frozen=True)
class KeepEvery:
  """Keeps every step that is a multiple of ``period``, forever."""
  reads_metadata: ClassVar[bool] = False
  period: int

  def __post_init__(self):
    _set(self, "period", check_int("KeepEvery.period", self.period, 1, " (the steps kept forever"
                                   " are its multiples; to protect none, leave the rule out)"))

  def keep(self, steps: Sequence[StepInfo]) -> set[int]:
    return {s.step for s in steps if s.step % self.period == 0}


@dataclasses.dataclass(frozen=True)
class KeepBest:
  """Keeps the ``n`` best steps by ``metric``.

  Attributes:
    metric: metric name, e.g. "loss".
    mode: "min" or "max".
    n: how many to keep.
    missing: steps without the metric are ranked "worst", or always "keep"-ed.
  """
  reads_metadata: ClassVar[bool] = True
  metric: str
  mode: str = "min"
  n: int = 1
  missing: str = "worst"

  def __post_init__(self):
    if not isinstance(self.metric, str) or not self.metric:
      fail("KeepBest.metric", self.metric, "must be the name of a metric the saves record,"
           " e.g. 'loss'")
    check_choice("KeepBest.mode", self.mode, MODES)
    _set(self, "n", check_int("KeepBest.n", self.n, 1, " (how many of the best steps to keep)"))
    check_choice("KeepBest.missing", self.missing, MISSING)

  def keep(self, steps: Sequence[StepInfo]) -> set[int]:
    scored = [s for s in steps if _finite(s.metrics.get(self.metric))]
    sign = 1.0 if self.mode == "min" else -1.0
    # Ties go to the newer step.
    best = sorted(scored, key=lambda s: (sign * s.metrics[self.metric], -s.step))[:self.n]
    kept = {s.step for s in best}
    unscored = sorted((s.step for s in steps if not _finite(s.metrics.get(self.metric))),
                      reverse=True)
    if self.missing == "keep":
      kept |= set(unscored)
    else:  # ranked after every scored step: they fill free places, newest first
      kept |= set(unscored[:self.n - len(best)])
    return kept


@dataclasses.dataclass(frozen=True)
class KeepOnePer:
  """Keeps the first step saved in each ``seconds``-long window of wall time: the lowest step
  whose recorded time falls in it (not the earliest time: a step saved after the wall clock
  stepped back, or by a job restarted on a host whose clock is behind, never displaces the
  step a window has kept)."""
  reads_metadata: ClassVar[bool] = True
  seconds: float

  def __post_init__(self):
    _set(self, "seconds", check_number("KeepOnePer.seconds", self.seconds, 0, above=True,
                                       note=" (the length of the window of wall time)"))

  def keep(self, steps: Sequence[StepInfo]) -> set[int]:
    first: dict[int, StepInfo] = {}
    for s in sorted(steps, key=lambda s: s.step):
      first.setdefault(math.floor(s.time / self.seconds), s)
    return {s.step for s in first.values()}


def _set(obj: object, name: str, value: object) -> None:
  """Sets a field of a frozen rule to its checked value (an int for a numpy integer)."""
  object.__setattr__(obj, name, value)


def _finite(x: object) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def best_step(steps: Sequence[StepInfo], metric: str, mode: str = "min") -> int | None:
  """The step with the best ``metric``; None if no step has it."""
  kept = KeepBest(metric, mode, 1).keep([s for s in steps if _finite(s.metrics.get(metric))])
  return next(iter(kept)) if kept else None


def to_delete(steps: Sequence[StepInfo], rules: Sequence[KeepRule]) -> list[int]:
  """Steps no rule keeps. With no rules nothing is deleted; the newest never is."""
  if not rules or not steps:
    return []
  keep = set().union(*(r.keep(steps) for r in rules))
  keep.add(max(s.step for s in steps))
  return sorted(s.step for s in steps if s.step not in keep)


def check_metrics(metrics: object) -> None:
  """Raises unless ``metrics`` is a mapping of scalar numbers; reads no device value.

  What a step's metrics must be to be recorded with a save: a mapping of names
  to Python or numpy numbers, or 0-d arrays (a ``jax.Array`` of shape ``()`` is
  checked by its shape and dtype, never fetched). An array of any other shape
  is refused, whatever its elements: a ``jax.pmap`` step's per-device metrics
  (shape ``[devices]``) need one number chosen first.

  Raises:
    TypeError: not a mapping, or a value that is not a scalar number (names it
      and the fix).

  Example:
    >>> import numpy as np
    >>> check_metrics({"loss": 0.5, "acc": np.float32(0.9)})
    >>> check_metrics({"loss": np.ones(8)})
    Traceback (most recent call last):
    ...
    TypeError: metric 'loss' has shape (8,), not a scalar: ...
  """
  if not isinstance(metrics, Mapping):
    raise TypeError(f"metrics must be a mapping of names to scalar numbers, got"
                    f" {type(metrics).__name__}; pass e.g. {{'loss': loss}}")
  for name, value in metrics.items():
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:  # an array: look at it, do not fetch it
      if tuple(shape) != ():
        raise TypeError(
            f"metric {name!r} has shape {tuple(shape)}, not a scalar: a checkpoint records one"
            " number per metric. A jax.pmap step returns one value per device: average them in"
            " the step (jax.lax.pmean) and pass flax.jax_utils.unreplicate(metrics) (device"
            " 0's copy), or pass jax.tree.map(jnp.mean, metrics)")
      if not _is_number_dtype(dtype):
        raise TypeError(f"metric {name!r} is an array of {dtype}, not a number")
      continue
    if isinstance(value, (str, bytes)) or not _is_number(value):
      raise TypeError(f"metric {name!r} must be a scalar number, got {type(value).__name__}"
                      f" ({str(value)[:40]!r})")


def _is_number_dtype(dtype: object) -> bool:
  kind = getattr(dtype, "kind", None)
  if kind is None:  # e.g. a jax extended dtype (PRNG keys)
    return False
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    return False
  # ml_dtypes' numbers count (a bfloat16 loss: mixed precision); complex does not (its
  # imaginary part would be dropped), nor strings or objects
  return _tree.number_kind(dtype) in "biuf"


def _is_number(value: object) -> bool:
  try:
    float(value)  # type: ignore[arg-type]
  except (TypeError, ValueError):
    return False
  return True


def missing_metric(metric: str, reported: Sequence[str]) -> str | None:
  """What is wrong when the metric a policy ranks by is not among the ``reported`` names.

  Returns:
    None if ``metric`` is reported (or none is needed); else a sentence naming
    it, the names reported, and the closest of them (``difflib``) as "did you
    mean".

  Example:
    >>> missing_metric("eval_acc", ["loss", "eval_accuracy"])
    "best_metric='eval_acc' is not among the metrics reported (eval_accuracy, loss); did you mean 'eval_accuracy'?"
    >>> missing_metric("loss", ["loss"]) is None
    True
  """
  if not metric or metric in reported:
    return None
  names = sorted(str(n) for n in reported)
  close = difflib.get_close_matches(metric, names, n=1, cutoff=0.6)
  return (f"best_metric={metric!r} is not among the metrics reported ({', '.join(names)})"
          + (f"; did you mean {close[0]!r}?" if close else ""))


def check_step_metrics(metrics: object, best_metric: str, seen: frozenset | None
                       ) -> tuple[frozenset | None, str | None]:
  """One step's metrics, checked for what a save records and what the policy ranks by.

  The values are checked by :func:`check_metrics` (shapes and dtypes only).
  ``best_metric`` is looked for whenever the set of names differs from
  ``seen`` (the names last checked; None before the first step with metrics):
  absent while a reported name is close to it (a typo), it raises; absent with
  nothing close, a warning is returned the first time (eval metrics reported
  only on eval steps are legitimate).

  Returns:
    ``(the names now seen, a warning to log or None)``.

  Raises:
    TypeError: a metric that is not a scalar number.
    ValueError: ``best_metric`` is not reported and a reported name is close to it.

  Example:
    >>> check_step_metrics({"loss": 1.0}, "eval_accuracy", None)[1][:40]
    "best_metric='eval_accuracy' is not among"
    >>> check_step_metrics({"loss": 1.0, "eval_accuracy": 0.5}, "eval_acc", None)
    Traceback (most recent call last):
    ...
    ValueError: best_metric='eval_acc' is not among the metrics reported (eval_accuracy, loss); did you mean 'eval_accuracy'? ...
  """
  check_metrics(metrics)
  names = frozenset(metrics)  # type: ignore[arg-type]
  if not best_metric or names == seen:
    return seen, None
  problem = missing_metric(best_metric, sorted(map(str, names)))
  if problem is None:
    return names, None
  if "did you mean" in problem:
    raise ValueError(f"{problem} keep_best and best_step() rank the saved steps by it, and a step"
                     " saved without it ranks last: keep_best would keep the newest steps instead"
                     " of the best. Set checkpoint.best_metric to the name the loop reports, or"
                     " report it.")
  warning = None if seen is not None else (
      f"{problem}: keep_best and best_step() rank the saved steps by it, and steps saved without"
      " it rank last (keep_best then keeps the newest). Fine if the loop reports it only on some"
      " steps (e.g. eval steps); otherwise set checkpoint.best_metric to a name the loop reports.")
  return names, warning
