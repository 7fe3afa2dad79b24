"""Pure policies: tables of cases, no I/O."""

import dataclasses

import ml_collections
import pytest

from configs import default as default_config
from orbax_flax import CheckpointPolicy
from orbax_flax.manager import policy as P


def S(step, now=0.0, last_step=None, last_time=0.0, first=False):  # pylint: disable=invalid-name
  return P.SaveState(step, now, last_step, last_time, first)


@pytest.mark.parametrize("trigger,state,reason", [
    (P.EveryNSteps(10), S(10), "interval"),
    (P.EveryNSteps(10), S(11), None),
    (P.EveryNSteps(10), S(0), "interval"),
    (P.EveryNSeconds(60), S(5, now=59.9, last_time=0.0), None),
    (P.EveryNSeconds(60), S(5, now=60.0, last_time=0.0), "time"),
    (P.EveryNSeconds(60), S(5, now=100.0, last_time=50.0), None),
    (P.OnSteps(frozenset({3, 7})), S(7), "scheduled"),
    (P.OnSteps(frozenset({3, 7})), S(8), None),
    (P.FirstStep(), S(1, first=True), "first"),
    (P.FirstStep(), S(2), None),
    (P.any_of(P.EveryNSteps(5), P.EveryNSeconds(10)), S(5, now=100), "interval"),
    (P.any_of(P.EveryNSteps(5), P.EveryNSeconds(10)), S(6, now=100), "time"),
    (P.any_of(P.EveryNSteps(5), P.EveryNSeconds(10)), S(6, now=1), None),
    (P.any_of(), S(6), None),
])
def test_triggers(trigger, state, reason):
  assert trigger(state) == reason


def infos(*steps, metric=None, times=None):
  out = []
  for i, s in enumerate(steps):
    m = {} if metric is None or metric[i] is None else {"loss": metric[i]}
    out.append(P.StepInfo(s, time=float(times[i]) if times else float(s), metrics=m))
  return out


@pytest.mark.parametrize("rules,steps,deleted", [
    ([], infos(1, 2, 3), []),
    ([P.KeepLast(2)], infos(1, 2, 3, 4), [1, 2]),
    ([P.KeepLast(10)], infos(1, 2, 3), []),
    ([P.KeepLast(1), P.KeepEvery(2)], infos(1, 2, 3, 4, 5), [1, 3]),
    ([P.KeepBest("loss", "min", 2)], infos(1, 2, 3, 4, metric=[0.5, 0.1, 0.3, 0.9]), [1]),
    ([P.KeepBest("loss", "max", 1)], infos(1, 2, 3, 4, metric=[0.5, 0.1, 0.9, 0.3]), [1, 2]),
    # Steps without the metric: ranked worst (deleted unless newest) or kept.
    ([P.KeepBest("loss", "min", 1)], infos(1, 2, 3, metric=[None, 0.1, None]), [1]),
    ([P.KeepBest("loss", "min", 1, missing="keep")], infos(1, 2, 3, 4, metric=[None, 0.1, 0.5, 0.2]), [3]),
    # Ranked worst, but still ranked: they fill places the scored steps leave free.
    ([P.KeepBest("loss", "min", 3)], infos(1, 2, 3, 4, 5, metric=[0.2, None, 0.1, None, None]), [2, 4]),
    # NaN is not a score.
    ([P.KeepBest("loss", "min", 1)], infos(1, 2, 3, metric=[float("nan"), 0.3, 0.4]), [1]),
    # Union of rules: last 1 plus best 1.
    ([P.KeepLast(1), P.KeepBest("loss", "min", 1)], infos(1, 2, 3, 4, metric=[0.3, 0.1, 0.2, 0.4]), [1, 3]),
    # One per 100 s window (the first in each), plus the newest.
    ([P.KeepLast(1), P.KeepOnePer(100)], infos(1, 2, 3, 4, 5, times=[10, 50, 120, 190, 250]), [2, 4]),
    # The newest step is never deleted, whatever the rules say.
    ([P.KeepBest("loss", "min", 1)], infos(1, 2, metric=[0.1, 0.9]), []),
    # KeepLast keeps the newest step numbers, not the latest saved: step 1 re-saved (force=True)
    # after step 2 has the later time (mutation review: ranked by time, step 2 was deleted).
    ([P.KeepLast(2)], infos(1, 2, 3, times=[30, 20, 40]), [1]),
    # A tie on the metric goes to the newer step (ranked the other way, 1 was kept, 2 deleted).
    ([P.KeepBest("loss", "max", 1)], infos(1, 2, 3, metric=[1.0, 1.0, 0.5]), [1]),
])
def test_keep_rules(rules, steps, deleted):
  assert P.to_delete(steps, rules) == deleted


@pytest.mark.parametrize("build,error,match", [
    # A user's spelling of "min" was read as "max": the best steps were deleted.
    (lambda: P.KeepBest("val_loss", "Min", 1), ValueError,
     r"KeepBest.mode='Min': must be one of 'min', 'max'\.$"),
    (lambda: P.KeepBest("loss", "minimize"), ValueError, r"KeepBest.mode='minimize'"),
    (lambda: P.KeepBest("loss", missing="drop"), ValueError,
     r"KeepBest.missing='drop': must be one of 'worst', 'keep'"),
    (lambda: P.KeepBest("", "min", 1), ValueError, r"KeepBest.metric='': must be the name"),
    (lambda: P.KeepBest("loss", "min", 0), ValueError, r"KeepBest.n=0: must be >= 1"),
])
def test_keep_best_checks_its_mode_and_missing_when_built(build, error, match):
  with pytest.raises(error, match=match):
    build()


def test_keep_best_and_the_policy_check_the_mode_alike():
  with pytest.raises(ValueError, match=r"best_mode='Min': must be one of 'min', 'max'\.$"):
    CheckpointPolicy(best_mode="Min")
  assert P.KeepBest("loss", "max").mode == "max"


@pytest.mark.parametrize("build,error,match", [
    # Accepted, a step written, then a bare ZeroDivisionError naming neither rule nor fix.
    (lambda: P.KeepEvery(0), ValueError, r"KeepEvery.period=0: must be >= 1 \(.*leave the rule"),
    (lambda: P.KeepOnePer(0), ValueError, r"KeepOnePer.seconds=0: must be a finite number > 0"),
    (lambda: P.KeepOnePer(float("inf")), ValueError, r"KeepOnePer.seconds=inf"),
    (lambda: P.EveryNSteps(0), ValueError, r"EveryNSteps.n=0: must be >= 1 \(save every n steps"),
    (lambda: P.KeepLast(0), ValueError, r"KeepLast.n=0: must be >= 1"),
    (lambda: P.KeepLast(2.5), TypeError, r"KeepLast.n=2.5: must be an integer, got float"),
    (lambda: P.EveryNSteps(True), TypeError, r"EveryNSteps.n=True: must be an integer"),
    (lambda: P.EveryNSeconds(-1.0), ValueError, r"EveryNSeconds.seconds=-1.0: must be a finite"
     r" number > 0 \(to save every step, use EveryNSteps\(1\)\)"),
    (lambda: P.EveryNSeconds("60"), TypeError, r"EveryNSeconds.seconds='60': must be a number"),
    (lambda: P.YoungDaly(0.0), ValueError, r"YoungDaly.mtbf_seconds=0.0: must be a finite number"
     r" > 0 \(the job's mean time between failures"),
    (lambda: P.YoungDaly(3600.0, -1.0), ValueError, r"YoungDaly.assumed_cost_seconds=-1.0"),
    (lambda: P.OnSteps(frozenset({5, -1})), ValueError, r"OnSteps.steps=-1: must be >= 0"),
    (lambda: P.OnSteps(5), TypeError, r"OnSteps.steps=5: must be a set of steps"),
    (lambda: P.any_of(P.EveryNSteps(5), 10), TypeError, r"any_of: 10 is not a trigger"),
])
def test_triggers_and_keep_rules_check_their_counts_when_built(build, error, match):
  with pytest.raises(error, match=match):
    build()


def test_checked_rules_keep_their_values_as_plain_numbers():
  import numpy as np  # pylint: disable=g-import-not-at-top
  assert P.OnSteps([3, 7]).steps == frozenset({3, 7})
  n = P.EveryNSteps(np.int64(5)).n
  assert n == 5 and type(n) is int  # pylint: disable=unidiomatic-typecheck
  assert P.KeepOnePer(60).seconds == 60.0 and P.YoungDaly(3600).interval(2.0) == 120.0


def test_best_step():
  steps = infos(1, 2, 3, metric=[0.5, 0.1, None])
  assert P.best_step(steps, "loss", "min") == 2
  assert P.best_step(steps, "loss", "max") == 1
  assert P.best_step(steps, "acc") is None
  assert P.best_step(infos(1, 2, 3, metric=[1.0, 1.0, 0.5]), "loss", "max") == 2  # a tie: newer


@pytest.mark.parametrize("values,error,match", [
    ({"max_to_kep": 3}, ValueError, r"checkpoint.max_to_kep: unknown field; did you mean max_to_keep\?"),
    ({"save_interval_steps": -1}, ValueError, r"checkpoint.save_interval_steps=-1: must be >= 0"),
    ({"save_interval_seconds": -5.0}, ValueError, r"save_interval_seconds=-5.0: must be a finite number >= 0"),
    ({"save_interval_seconds": float("inf")}, ValueError, r"save_interval_seconds=inf"),
    ({"keep_best": 2}, ValueError, r"keep_best=2: needs best_metric; set checkpoint.best_metric"),
    ({"best_mode": "lowest"}, ValueError, r"best_mode='lowest': must be one of 'min', 'max'"),
    ({"if_busy": "queue"}, ValueError, r"if_busy='queue': must be one of 'wait', 'skip'"),
    ({"best_missing": "drop"}, ValueError, r"best_missing"),
    ({"preemption_signals": ("SIGTERN",)}, ValueError, r"'SIGTERN' is not a signal name"),
    ({"preemption_signals": ("SIGKILL",)}, ValueError, r"SIGKILL cannot be caught"),
    ({"save_interval_steps": "100"}, TypeError, r"save_interval_steps='100': must be an integer, got str"),
    ({"max_to_keep": 2.5}, TypeError, r"max_to_keep=2.5: must be an integer"),
    ({"async_save": 1}, TypeError, r"async_save=1: must be True or False"),
    ({"save_on_steps": [1, -2]}, ValueError, r"save_on_steps.*must be >= 0"),
    ({"save_on_steps": ["a"]}, TypeError, r"save_on_steps.*list of integers"),
    ({"preemption_signals": ()}, ValueError, r"preemption_signals=\(\): is empty while save_on_preemption"),
])
def test_from_config_validates(values, error, match):
  with pytest.raises(error, match=match):
    CheckpointPolicy.from_config(values)


def test_from_config_accepts_configdict_dataclass_and_dict():
  cfg = default_config.get_config()
  from_cd = CheckpointPolicy.from_config(cfg.checkpoint)
  assert from_cd.save_interval_steps == 50 and from_cd.max_to_keep == 3
  assert from_cd.preemption_signals == ("SIGTERM",)

  @dataclasses.dataclass
  class Ckpt:
    save_interval_steps: int = 7
    max_to_keep: int = 2
    preemption_signals: tuple = ("SIGTERM", "SIGUSR1")

  from_dc = CheckpointPolicy.from_config(Ckpt())
  assert (from_dc.save_interval_steps, from_dc.preemption_signals) == (7, ("SIGTERM", "SIGUSR1"))
  assert CheckpointPolicy.from_config({"save_on_steps": [5, 9]}).save_on_steps == (5, 9)
  assert CheckpointPolicy.from_config({"preemption_signals": "SIGTERM,SIGUSR1"}).preemption_signals == (
      "SIGTERM", "SIGUSR1")
  with pytest.raises(TypeError, match="ConfigDict, a dataclass or a dict"):
    CheckpointPolicy.from_config(3)
  # Every field of the default config is a policy field, with a comment.
  assert set(cfg.checkpoint.keys()) == {f.name for f in dataclasses.fields(CheckpointPolicy)}
  source = open(default_config.__file__).read()
  for key in cfg.checkpoint.keys():
    line = next(l for l in source.splitlines() if l.strip().startswith(f"c.{key} ="))
    previous = source.splitlines()[source.splitlines().index(line) - 1].strip()
    assert previous.startswith("#"), key


def test_default_config_is_ml_collections():
  assert isinstance(default_config.get_config(), ml_collections.ConfigDict)


@pytest.mark.parametrize("kwargs,num_steps,saved,kept", [
    (dict(save_interval_steps=10), 35, [(10, "interval"), (20, "interval"), (30, "interval"), (35, "final")],
     [10, 20, 30, 35]),
    (dict(save_interval_steps=10, save_final_step=False, max_to_keep=2), 35,
     [(10, "interval"), (20, "interval"), (30, "interval")], [20, 30]),
    (dict(save_interval_seconds=25.0, save_final_step=False), 100,
     [(25, "time"), (50, "time"), (75, "time"), (100, "time")], [25, 50, 75, 100]),
    (dict(save_on_steps=(3, 17), save_first_step=True, save_final_step=False), 20,
     [(1, "first"), (3, "scheduled"), (17, "scheduled")], [1, 3, 17]),
    (dict(save_interval_steps=10, max_to_keep=1, keep_period=20, save_final_step=False), 60,
     [(s, "interval") for s in (10, 20, 30, 40, 50, 60)], [20, 40, 60]),
])
def test_plan(kwargs, num_steps, saved, kept):
  plan = CheckpointPolicy(**kwargs).plan(num_steps)
  assert plan.saved == saved
  assert plan.kept == kept


def test_plan_with_metrics_and_time_windows():
  policy = CheckpointPolicy(save_interval_steps=10, keep_best=1, best_metric="loss", save_final_step=False)
  plan = policy.plan(50, metrics=lambda s: {"loss": abs(s - 20)})
  assert plan.kept == [20, 50]
  policy = CheckpointPolicy(save_interval_steps=10, max_to_keep=1, keep_time_interval_seconds=25,
                            save_final_step=False)
  assert policy.plan(60, seconds_per_step=1.0).kept == [10, 30, 50, 60]
