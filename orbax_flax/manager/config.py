"""The checkpoint policy as data: one frozen dataclass, validated when built.

:class:`CheckpointPolicy` holds every setting of the ``checkpoint`` block of a
config (see ``configs/default.py``). Build it directly, or from an
``ml_collections.ConfigDict``, a dataclass config or a dict with
:meth:`CheckpointPolicy.from_config`. Either way a wrong value raises an error
that names the field and the fix, before any file is touched.

Example:
  >>> policy = CheckpointPolicy(save_interval_steps=100, max_to_keep=2)
  >>> [step for step, _ in policy.plan(450).saved]
  [100, 200, 300, 400, 450]
  >>> policy.plan(450).kept
  [400, 450]
  >>> CheckpointPolicy.from_config({"save_interval_step": 100})
  Traceback (most recent call last):
  ...
  ValueError: checkpoint.save_interval_step: unknown field; did you mean save_interval_steps? Valid fields: ...
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import signal
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from orbax_flax.core._location import Location
from orbax_flax.engine.saving import HOST_TRANSFERS
from orbax_flax.manager import policy as policy_lib
from orbax_flax.manager.schedule import Schedule


class Triggers(NamedTuple):
  """A policy's save triggers, apart by what they read (see :class:`orbax_flax.manager.schedule.Schedule`).

  Attributes:
    steps: triggers of the step alone, decided on every process alike.
    time: every N seconds, decided by process 0.
    auto: the Young/Daly trigger (``save_interval="auto"``), decided by process 0.
  """
  steps: policy_lib.Trigger | None
  time: policy_lib.Trigger | None
  auto: policy_lib.YoungDaly | None


class Plan(NamedTuple):
  """What a policy does over a run, from :meth:`CheckpointPolicy.plan`.

  Attributes:
    saved: ``(step, reason)`` of every save, in order.
    kept: the steps still on disk at the end.
  """
  saved: list[tuple[int, str]]
  kept: list[int]


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
  """When to save, what to keep, and how a training run checkpoints.

  Save triggers combine: a step is saved if any of them fires. Keep rules combine
  too: a step is kept if any rule keeps it. ``max_to_keep`` and ``keep_best``
  delete the steps neither keeps (with both, up to ``max_to_keep + keep_best``
  steps stay);
  ``keep_period`` and ``keep_time_interval_seconds`` protect steps from that
  deletion forever. With neither ``max_to_keep`` nor ``keep_best`` set, every
  step is kept. The newest committed step is never deleted, and a step is
  deleted only after a newer one is committed.

  Attributes:
    save_interval_steps: save every N steps (0: off).
    save_interval_seconds: save once this much wall time has passed since the
      last save (0: off; a wall clock stepped back restarts the interval);
      decided on process 0 and shared.
    save_interval: "auto" saves every ``sqrt(2 x save cost x mtbf_seconds)``
      seconds (Young/Daly), the cost being the median blocking time of the
      last 5 saves less the wait for the train step's own computation (1 s
      assumed before the first), re-evaluated at every step; "" turns it off.
    mtbf_seconds: the job's mean time between failures, preemptions
      included, for ``save_interval="auto"`` and ``local_save_interval="auto"``
      (e.g. 86400 for about one a day).
    save_on_steps: also save at these steps.
    save_first_step: save the first step of every run.
    save_final_step: save the last step of a run (the trainer and the
      callback know the run length).
    max_to_keep: keep the N most recent steps, deleting older ones that no
      other rule keeps (0: keep all).
    keep_period: keep every step that is a multiple of M forever: protects it
      from deletion (0: off).
    keep_time_interval_seconds: keep one step per this many seconds of wall
      time forever (the first step saved in each window, by step number: a clock
      stepped back never displaces it): protects it from deletion (0: off).
    best_metric: the metric that ranks steps for ``keep_best`` and
      ``best_step()``, e.g. "loss" ("": none).
    best_mode: whether a smaller ("min") or larger ("max") ``best_metric``
      is better.
    keep_best: keep the N best steps by ``best_metric``, deleting the others
      that no other rule keeps (0: off).
    best_missing: steps saved without the metric are ranked "worst" (after
      every scored step, newest first) or always "keep"-ed.
    async_save: write in the background; training blocks only for the copy
      to host memory.
    if_busy: a save requested while the previous one still writes: "wait"
      for it, or "skip" the new save (forced, final and preemption saves
      always wait).
    save_on_preemption: on a preemption signal every process saves the same
      step, and the loop stops once it is committed.
    preemption_signals: the signals that mean preemption, by name or number
      (e.g. add "SIGUSR1" for SLURM, "SIGINT" to make Ctrl-C save and stop).
    preemption_grace_seconds: abandon (never commit) a preemption save that
      cannot commit within this many seconds of the signal (0: no limit).
    save_on_exception: if the training step raises, save the last good state,
      then re-raise (not NNX objects, which change in place and may already
      hold the failing step's update: a WARNING says so).
    directory: where checkpoints go ("": ``<workdir>/checkpoints``).
    init_from: a checkpoint to take params from when there is nothing to
      resume (fine-tuning): a checkpoint of any format ``restore`` reads, or
      a run's workdir or ``checkpoints/`` directory (its latest step); "":
      off. ``"<path>:<item>/<sub/tree>"`` names the item and subtree to take,
      e.g. ``"/runs/gemma/checkpoints:model"``.
    max_host_bytes: budget for the host memory of one save or restore, in bytes (0: none); a
      larger async save stages in rounds (the caller waits for all but the last), a restore
      reads in rounds. The manager's checkpointer has this budget; a
      ``restore(max_host_bytes=None)`` of the manager uses it.
    keep_staging_memory: keep the host staging copy between async saves, so that the blocking
      phase copies into memory already touched (False: release it after every save, for
      memory-tight hosts; saves then block longer).
    host_transfer: how an async save snapshots device arrays: "memcpy" (a host copy while the
      caller waits: into the staging memory on CPU, where device buffers are host memory; each
      shard's device-to-host copy on an accelerator; the choice on CPU for a state over 256 MiB
      or in a multi-process job, and on TPU without max_host_bytes), "device_copy" (every array
      copied into new device buffers by XLA in one call, shards found in the background; the
      choice on CPU for a smaller state in a single-process job without max_host_bytes, with
      which it is refused), "pinned_host" (a device-to-host transfer into pinned host memory,
      ordered by XLA before any later donation; the choice on GPU, and on TPU with
      max_host_bytes), or "auto" (the platform's choice).
    differential: a save writes only the chunks that changed since the latest step (xxh3-128
      of every chunk) and references the rest; retention keeps what kept steps reference.
    coordination_timeout_seconds: the deadline of every call to the coordination service in a
      multi-process job (a rendezvous, a decision, a set or read): the error names the
      processes that did not arrive or answer (process 0, which hosts the service).
    on_unreadable_checkpoint: the latest step cannot be read on resume (a
      damaged or missing file): "fallback" logs it loudly and resumes from
      the newest step that restores, "raise" stops; when committed steps
      exist but none restores, resuming raises either way (it never starts
      fresh over them).
    on_save_error: a failed save (e.g. a full disk): "raise" stops training with the error,
      "warn" logs it and goes on (earlier steps stay intact; the next save tries again).
    watchdog_seconds: a save or restore running longer than this logs its
      phase, bytes done, RSS and (once) every thread's Python stack, then
      again every such interval (0: off).
    allow_lossy_casts: resume into dtypes that lose information against the
      checkpoint's (float32 saved, bfloat16 model); refused unless True.
      Every dtype change made is logged either way.
    read_once_restore: a resume reads each array once across the processes
      that replicate it (data-parallel copies) and broadcasts it with a
      resharding jit (collectives), instead of every replica reading it from
      storage (see ``orbax_flax.restore(read_once=True)``).
    local_directory: the local tier's directory on each host's fast disk
      (RAM disk or local SSD, e.g. ``/dev/shm/ckpt``); each process writes
      only its own shards, in ``run-<digest>/process_<i>/``, never reading
      another's; runs with other persistent directories never see its steps
      ("": off).
    local_save_interval_steps: save to the local tier every N steps (0: off).
    local_save_interval: "auto" also saves to the local tier every
      ``sqrt(2 x local save time x mtbf_seconds)`` seconds, from the median
      of the last 5 local saves (1 s assumed before the first); "" turns it
      off.
    local_max_to_keep: committed local steps each process keeps (>= 1).
    replicas: how many other processes hold a copy of each process's local
      shards, sent with JAX collectives; losing any ``replicas`` hosts' local
      disks loses no local step.
    compilation_cache: JAX's compilation cache in ``<workdir>/compilation_cache/``: a restart
      loads its compiled train step. Off by default: it is process-wide and grows unpruned,
      and a workdir on an object store is refused (docs/training.md).
  """
  save_interval_steps: int = 0
  save_interval_seconds: float = 0.0
  save_interval: str = ""
  mtbf_seconds: float = 0.0
  save_on_steps: tuple[int, ...] = ()
  save_first_step: bool = False
  save_final_step: bool = True
  max_to_keep: int = 0
  keep_period: int = 0
  keep_time_interval_seconds: float = 0.0
  best_metric: str = ""
  best_mode: str = "min"
  keep_best: int = 0
  best_missing: str = "worst"
  async_save: bool = True
  if_busy: str = "wait"
  save_on_preemption: bool = True
  preemption_signals: tuple[str, ...] = ("SIGTERM",)
  preemption_grace_seconds: float = 0.0
  save_on_exception: bool = True
  directory: str = ""
  init_from: str = ""
  max_host_bytes: int = 0
  keep_staging_memory: bool = True
  host_transfer: str = "auto"
  differential: bool = False
  coordination_timeout_seconds: float = 600.0
  on_unreadable_checkpoint: str = "fallback"
  on_save_error: str = "raise"
  watchdog_seconds: float = 600.0
  allow_lossy_casts: bool = False
  read_once_restore: bool = False
  local_directory: str = ""
  local_save_interval_steps: int = 0
  local_save_interval: str = ""
  local_max_to_keep: int = 1
  replicas: int = 1
  compilation_cache: bool = False

  def __post_init__(self):
    _check(self)

  @classmethod
  def from_config(cls, config: Any, *, name: str = "checkpoint") -> CheckpointPolicy:
    """Builds a policy from an ml_collections ConfigDict, a dataclass or a dict.

    Args:
      config: the checkpoint block, e.g. ``config.checkpoint``.
      name: how errors refer to the block.

    Raises:
      ValueError: an unknown field or a bad value, naming the field and the fix.
      TypeError: a value of the wrong type.
    """
    if hasattr(config, "to_dict"):
      values = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
      values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    elif isinstance(config, Mapping):
      values = dict(config)
    else:
      raise TypeError(f"{name}: expected an ml_collections ConfigDict, a dataclass or a dict,"
                      f" got {type(config).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
      if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(f"{name}.{key}: unknown field; {hint}Valid fields: {', '.join(known)}.")
    try:
      return cls(**values)
    except (ValueError, TypeError) as e:
      raise type(e)(f"{name}.{e}") from None

  def triggers(self, *, local: bool = False) -> Triggers:
    """The save triggers of the persistent tier (or of the ``local`` one), apart by what they read."""
    if local:
      every = self.local_save_interval_steps
      return Triggers(policy_lib.any_of(policy_lib.EveryNSteps(every)) if every else None, None,
                      policy_lib.YoungDaly(self.mtbf_seconds)
                      if self.local_save_interval == "auto" else None)
    steps: list[policy_lib.Trigger] = []
    if self.save_interval_steps:
      steps.append(policy_lib.EveryNSteps(self.save_interval_steps))
    if self.save_on_steps:
      steps.append(policy_lib.OnSteps(frozenset(self.save_on_steps)))
    if self.save_first_step:
      steps.append(policy_lib.FirstStep())
    return Triggers(policy_lib.any_of(*steps) if steps else None,
                    policy_lib.EveryNSeconds(self.save_interval_seconds)
                    if self.save_interval_seconds else None,
                    policy_lib.YoungDaly(self.mtbf_seconds) if self.save_interval == "auto" else None)

  def trigger(self, *, local: bool = False) -> policy_lib.AnyOf:
    """The save trigger these settings describe, as one (step-based reasons first)."""
    return policy_lib.any_of(*(t for t in self.triggers(local=local) if t is not None))

  @property
  def local_tier(self) -> bool:
    """Whether the local tier saves (a directory and an interval of either kind)."""
    return bool(self.local_directory) and bool(self.local_save_interval_steps
                                               or self.local_save_interval == "auto")

  def keep_rules(self) -> list[policy_lib.KeepRule]:
    """The keep rules; empty means keep everything."""
    deleting: list[policy_lib.KeepRule] = []
    if self.max_to_keep:
      deleting.append(policy_lib.KeepLast(self.max_to_keep))
    if self.keep_best:
      deleting.append(policy_lib.KeepBest(self.best_metric, self.best_mode, self.keep_best,
                                          self.best_missing))
    if not deleting:
      return []
    protecting: list[policy_lib.KeepRule] = []
    if self.keep_period:
      protecting.append(policy_lib.KeepEvery(self.keep_period))
    if self.keep_time_interval_seconds:
      protecting.append(policy_lib.KeepOnePer(self.keep_time_interval_seconds))
    return deleting + protecting

  def plan(self, num_steps: int, *, seconds_per_step: float = 1.0, start_step: int = 0,
           metrics: Any = None, save_cost_seconds: float | None = None) -> Plan:
    """Dry run: the saves over steps ``start_step + 1 .. num_steps`` and what is kept.

    Args:
      num_steps: the last step of the run.
      seconds_per_step: simulated wall time per step, for time-based rules.
      start_step: the step the run starts after (a resumed run).
      metrics: optional ``step -> dict`` giving each step's metrics for keep_best.
      save_cost_seconds: what a save costs, for ``save_interval="auto"`` (None:
        the 1 s assumed before the first save is measured).
    """
    rules = self.keep_rules()
    saved: list[tuple[int, str]] = []
    infos: list[policy_lib.StepInfo] = []
    for step, now, reason in _dry_run(self.triggers(), num_steps, seconds_per_step, start_step,
                                      save_cost_seconds, final=self.save_final_step):
      saved.append((step, reason))
      infos.append(policy_lib.StepInfo(step, now, dict(metrics(step)) if metrics else {}, reason))
      dead = set(policy_lib.to_delete(infos, rules))
      infos = [i for i in infos if i.step not in dead]
    return Plan(saved, [i.step for i in infos])

  def plan_local(self, num_steps: int, *, seconds_per_step: float = 1.0, start_step: int = 0,
                 local_save_cost_seconds: float | None = None) -> list[int]:
    """Dry run of the local tier: the steps it saves over ``start_step + 1 .. num_steps``.

    Example:
      >>> p = CheckpointPolicy(local_directory="/dev/shm/ckpt", local_save_interval="auto",
      ...                      mtbf_seconds=200.0)
      >>> p.plan_local(60, local_save_cost_seconds=1.0)   # sqrt(2 x 1 x 200) = every 20 s
      [20, 40, 60]
    """
    if not self.local_tier:
      return []
    return [step for step, _, _ in _dry_run(self.triggers(local=True), num_steps,
                                            seconds_per_step, start_step,
                                            local_save_cost_seconds, final=False)]


def _check(p: CheckpointPolicy) -> None:
  """Refuses bad settings with an error that names the field, the value and the fix; fixes types."""
  for f in dataclasses.fields(p):
    value = getattr(p, f.name)
    fixed = _check_type(f.name, f.type, value)
    if fixed is not value:
      object.__setattr__(p, f.name, fixed)
  for name in ("save_interval_steps", "max_to_keep", "keep_period", "keep_best", "max_host_bytes"):
    policy_lib.check_int(name, getattr(p, name), 0, " (0 turns it off)")
  for name in ("save_interval_seconds", "keep_time_interval_seconds", "preemption_grace_seconds",
               "watchdog_seconds"):
    policy_lib.check_number(name, getattr(p, name), 0, note=" (0 turns it off)")
  _check_choice("save_interval", p.save_interval, ("", "auto"))
  policy_lib.check_int("local_save_interval_steps", p.local_save_interval_steps, 0, " (0: off)")
  scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", p.local_directory)
  if scheme:  # os paths would take it as a relative directory named "gs:" in the cwd
    path = ""
    if scheme.group(1) == "file":  # the path a file:// URL names, as orbax_flax reads one
      try:
        path = Location.parse(p.local_directory).local_path
      except ValueError:
        path = ""
    _fail("local_directory", p.local_directory, "is a URL, but the local tier writes plain"
          " files on each host's own fast disk (RAM disk or local SSD); give "
          + (f"the path itself, {path!r}" if path else "a local path such as '/dev/shm/ckpt'")
          + " (the persistent directory is the one that takes URLs)")
  if p.local_save_interval_steps and not p.local_directory:
    _fail("local_save_interval_steps", p.local_save_interval_steps, "needs local_directory,"
          " a fast local directory such as /dev/shm/ckpt")
  _check_choice("local_save_interval", p.local_save_interval, ("", "auto"))
  if p.local_save_interval == "auto" and not p.local_directory:
    _fail("local_save_interval", p.local_save_interval, "needs local_directory, a fast"
          " local directory such as /dev/shm/ckpt")
  if p.local_save_interval == "auto" and not p.mtbf_seconds:
    _fail("local_save_interval", p.local_save_interval, "needs mtbf_seconds, the job's mean"
          " time between failures (e.g. mtbf_seconds=86400 for about one failure a day)")
  policy_lib.check_int("local_max_to_keep", p.local_max_to_keep, 1)
  policy_lib.check_int("replicas", p.replicas, 0, " (0: no peer copies)")
  policy_lib.check_number("mtbf_seconds", p.mtbf_seconds, 0, note=" (seconds; 0: none given)")
  if p.save_interval == "auto" and not p.mtbf_seconds:
    _fail("save_interval", p.save_interval, "needs mtbf_seconds, the job's mean time between"
          " failures (e.g. mtbf_seconds=86400 for about one failure a day)")
  policy_lib.check_number("coordination_timeout_seconds", p.coordination_timeout_seconds, 0,
                          above=True, note=" (seconds, e.g. 600)")
  bad = [s for s in p.save_on_steps if s < 0]
  if bad:
    _fail("save_on_steps", p.save_on_steps, f"steps must be >= 0, got {bad}")
  _check_choice("best_mode", p.best_mode, policy_lib.MODES)
  _check_choice("best_missing", p.best_missing, policy_lib.MISSING)
  _check_choice("if_busy", p.if_busy, ("wait", "skip"))
  _check_choice("on_unreadable_checkpoint", p.on_unreadable_checkpoint, ("fallback", "raise"))
  _check_choice("on_save_error", p.on_save_error, ("raise", "warn"))
  _check_choice("host_transfer", p.host_transfer, HOST_TRANSFERS)
  if p.host_transfer == "device_copy" and p.max_host_bytes:
    _fail("host_transfer", p.host_transfer, f"copies the whole state at once, which"
          f" max_host_bytes={p.max_host_bytes} forbids; use 'auto' or 'memcpy' (staged in rounds"
          " within the budget), or set max_host_bytes=0")
  if p.keep_best and not p.best_metric:
    _fail("keep_best", p.keep_best, "needs best_metric; set checkpoint.best_metric to the"
          " metric name (e.g. 'loss') or set keep_best=0")
  if p.save_on_preemption and not p.preemption_signals:
    _fail("preemption_signals", p.preemption_signals, "is empty while save_on_preemption"
          " is on; name the signals (e.g. ('SIGTERM',)) or set save_on_preemption=False")
  for name in p.preemption_signals:
    if not name.startswith("SIG") or not hasattr(signal.Signals, name):
      _fail("preemption_signals", p.preemption_signals,
            f"{name!r} is not a signal name; use names such as 'SIGTERM' or 'SIGUSR1'")
    if name in ("SIGKILL", "SIGSTOP"):
      _fail("preemption_signals", p.preemption_signals, f"{name} cannot be caught")


def _dry_run(triggers: Triggers, num_steps: int, seconds_per_step: float,
             start_step: int, save_cost: float | None, *, final: bool):
  """(step, simulated time, reason) of every step ``triggers`` save; ``final``: the last too.

  The run's own :class:`~orbax_flax.manager.schedule.Schedule` decides, on a simulated
  clock and on this process alone.
  """
  now = [0.0]
  schedule = Schedule(*triggers, key="dry-run", clock=lambda: now[0], shared=False,
                      save_cost=save_cost)
  for step in range(start_step + 1, num_steps + 1):
    now[0] = (step - start_step) * seconds_per_step
    reason = schedule.due(step)
    if reason is None and step == num_steps and final:
      reason = "final"
    if reason is not None:
      schedule.saved(step)
      yield step, now[0], reason


_fail = policy_lib.fail  # the checks of the policy's fields are the rules' own
_check_choice = policy_lib.check_choice


def _signal_name(v: Any) -> Any:
  """15 or "15" -> "SIGTERM"; names and anything else pass through (checked later)."""
  if isinstance(v, str) and v.strip().isdigit():
    v = int(v)
  if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
    try:
      return signal.Signals(int(v)).name
    except ValueError:
      raise ValueError(f"preemption_signals: {v} is not a signal number on this system.") from None
  return v


def _check_type(name: str, annotation: str, value: Any) -> Any:
  """Checks (and normalises lists to tuples) one field against its annotation."""
  def bad(what: str):
    raise TypeError(f"{name}={value!r}: must be {what}, got {type(value).__name__}.")
  if annotation == "int":
    return policy_lib.check_int(name, value)
  elif annotation == "float":
    return policy_lib.check_number(name, value)
  elif annotation == "bool":
    if not isinstance(value, bool):
      bad("True or False")
  elif annotation == "str":
    if not isinstance(value, str):
      bad("a string")
  elif annotation == "tuple[int, ...]":
    if not isinstance(value, (list, tuple)) or any(
        isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) for v in value):
      bad("a list of integers")
    return tuple(int(v) for v in value)  # (numpy integers too, as every integer setting)
  elif annotation == "tuple[str, ...]":
    if isinstance(value, str):
      value = tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
      value = (value,)
    if name == "preemption_signals" and isinstance(value, (list, tuple)):
      value = tuple(_signal_name(v) for v in value)  # numbers (15) and names ("SIGTERM") alike
    if not isinstance(value, (list, tuple)) or any(not isinstance(v, str) for v in value):
      bad("a list of strings" if name != "preemption_signals" else
          "a list of signal names or numbers, e.g. ('SIGTERM', 'SIGUSR1') or (15, 10)")
    return tuple(value)
  return value
