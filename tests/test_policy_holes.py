"""The policy layer's holes found by mutation testing, closed through the public API.

A mutation review of ``orbax_flax/manager/policy.py``, ``schedule.py`` and
``config.py`` changed one behaviour at a time (a boundary, a default, a check, the
order of two triggers) and ran the tests that exercise them: each test's docstring
names the mutants it kills, which survived every one of those tests (one named as
"too" did not). Each test here pins the
behaviour a user relies on, as a user reaches it: ``ofx.CheckpointPolicy`` (built
directly or by ``from_config``) and its ``plan`` dry run, the exported triggers and
keep rules with ``ofx.to_delete``, and ``ofx.CheckpointManager`` on real files with
a fake clock.

One test is an expected failure: a DEFECT the review found (``save_on_steps`` refuses
numpy integers, which every other integer setting takes), kept strict so that the fix
turns it into a failure to remove the mark.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

import orbax_flax as ofx
from orbax_flax.manager import policy as P
from test_manager import FakeClock, on_disk  # the manager tests' helpers
from test_policy import infos  # StepInfos of steps (metric: "loss" values, None: none)


def items(step):
  return {"state": {"w": np.full((4,), step, np.float32)}}


# ---------------------------------------------------------------------------------------------
# Validation: what CheckpointPolicy / from_config refuse, accept and normalise.


@pytest.mark.parametrize("values,error,match", [
    # A negative count or interval was accepted, then refused at the manager's start by the
    # rule built from it (KeepLast.n=-1: "must be >= 1"), not naming the config field, or,
    # beside no deleting rule, ignored.
    ({"max_to_keep": -1}, ValueError, r"^checkpoint\.max_to_keep=-1: must be >= 0 \(0 turns"),
    ({"keep_period": -10}, ValueError, r"^checkpoint\.keep_period=-10: must be >= 0"),
    ({"keep_time_interval_seconds": -60.0}, ValueError,
     r"^checkpoint\.keep_time_interval_seconds=-60\.0: must be a finite number >= 0"),
    ({"preemption_grace_seconds": -1.0}, ValueError, r"^checkpoint\.preemption_grace_seconds=-1\.0"),
    ({"watchdog_seconds": float("inf")}, ValueError, r"^checkpoint\.watchdog_seconds=inf"),
    ({"local_directory": "/dev/shm/ckpt", "local_save_interval_steps": 10,
      "local_max_to_keep": 0}, ValueError, r"^checkpoint\.local_max_to_keep=0: must be >= 1"),
    # A local interval without the local tier's directory was ignored, silently.
    ({"local_save_interval_steps": 10}, ValueError,
     r"^checkpoint\.local_save_interval_steps=10: needs local_directory"),
    ({"replicas": -1}, ValueError, r"^checkpoint\.replicas=-1: must be >= 0"),
    # A zero deadline: every coordination call would fail at once.
    ({"coordination_timeout_seconds": 0}, ValueError,
     r"^checkpoint\.coordination_timeout_seconds=0\.0: must be a finite number > 0"),
    ({"on_unreadable_checkpoint": "ignore"}, ValueError,
     r"on_unreadable_checkpoint='ignore': must be one of 'fallback', 'raise'"),
    ({"on_save_error": "ignore"}, ValueError, r"on_save_error='ignore': must be one of 'raise', 'warn'"),
    ({"host_transfer": "device_copy", "max_host_bytes": 1 << 20}, ValueError,
     r"host_transfer='device_copy': copies the whole state at once"),
    ({"preemption_signals": ("SIGSTOP",)}, ValueError, r"SIGSTOP cannot be caught"),
    # keep_best=1 without a metric: accepted, then refused at the manager's start as KeepBest.metric.
    ({"keep_best": 1}, ValueError, r"^checkpoint\.keep_best=1: needs best_metric"),
    ({"save_on_steps": (100, -1)}, ValueError, r"save_on_steps=\(100, -1\): steps must be >= 0"),
    # Types: a string or a bool is not a number of seconds, a bool not a step, None not a path.
    ({"save_interval_seconds": "60"}, TypeError, r"save_interval_seconds='60': must be a number"),
    ({"keep_time_interval_seconds": True}, TypeError, r"keep_time_interval_seconds=True"),
    ({"save_on_steps": [True, 5]}, TypeError, r"save_on_steps=\[True, 5\]: must be a list of integers"),
    ({"directory": None}, TypeError, r"directory=None: must be a string, got NoneType"),
    ({"best_metric": 0}, TypeError, r"best_metric=0: must be a string"),
])
def test_from_config_refuses_bad_values_naming_the_field(values, error, match):
  """Kills M61 M62 M64 M66 M67 M69 M71 M72 M74 M81 M82 M83 M86 M92."""
  with pytest.raises(error, match=match):
    ofx.CheckpointPolicy.from_config(values)


def test_from_config_refuses_a_dataclass_class_for_its_instance():
  """Passing the config dataclass itself (not an instance) is refused, not read as defaults.

  Kills M56."""

  @dataclasses.dataclass
  class Ckpt:
    save_interval_steps: int = 7

  with pytest.raises(TypeError, match=r"checkpoint: expected an ml_collections ConfigDict, a"
                     r" dataclass or a dict, got type"):
    ofx.CheckpointPolicy.from_config(Ckpt)
  assert ofx.CheckpointPolicy.from_config(Ckpt()).save_interval_steps == 7


def test_no_signals_are_fine_when_preemption_saves_are_off():
  """Kills M73."""
  policy = ofx.CheckpointPolicy(save_on_preemption=False, preemption_signals=())
  assert policy.preemption_signals == ()


@pytest.mark.parametrize("given,signals", [
    (("15",), ("SIGTERM",)),       # a number as a string (an environment variable)
    ("15,10", ("SIGTERM", "SIGUSR1")),
    (15, ("SIGTERM",)),            # one number, not a list
    ([15, "SIGUSR1"], ("SIGTERM", "SIGUSR1")),
])
def test_preemption_signals_by_number(given, signals):
  """Kills M79 M80."""
  assert ofx.CheckpointPolicy.from_config({"preemption_signals": given}).preemption_signals == signals


def test_checked_numbers_become_plain_floats():
  """A numpy or int number of seconds is stored as a float: the policy serialises as JSON.

  Kills M07."""
  policy = ofx.CheckpointPolicy(save_interval_seconds=np.float32(30.0), keep_time_interval_seconds=60,
                                max_to_keep=np.int64(2))
  assert type(policy.save_interval_seconds) is float  # pylint: disable=unidiomatic-typecheck
  assert type(policy.keep_time_interval_seconds) is float  # pylint: disable=unidiomatic-typecheck
  assert json.loads(json.dumps(dataclasses.asdict(policy)))["save_interval_seconds"] == 30.0
  assert type(ofx.EveryNSeconds(np.float32(2.5)).seconds) is float  # pylint: disable=unidiomatic-typecheck
  assert type(ofx.KeepOnePer(np.float32(60)).seconds) is float  # pylint: disable=unidiomatic-typecheck


def test_a_local_directory_alone_is_no_local_tier():
  """The local tier saves only with an interval, steps or "auto" (docstring of local_tier).

  Kills M57 M78."""
  assert not ofx.CheckpointPolicy(local_directory="/dev/shm/ckpt").local_tier
  policy = ofx.CheckpointPolicy(local_directory="/dev/shm/ckpt", local_save_interval_steps=10)
  assert policy.local_tier
  # The local tier has no final save (the callback saves the last step persistently only).
  assert policy.plan_local(35) == [10, 20, 30]


# ---------------------------------------------------------------------------------------------
# Triggers and the schedule, through the policy's dry run and the manager.


def test_a_time_interval_beside_a_step_interval_keeps_both():
  """Kills M44 (the time trigger's None replaced the step trigger's reason)."""
  plan = ofx.CheckpointPolicy(save_interval_steps=5, save_interval_seconds=100.0,
                              save_final_step=False).plan(20)
  assert plan.saved == [(5, "interval"), (10, "interval"), (15, "interval"), (20, "interval")]


def test_a_time_interval_beside_auto_keeps_its_saves():
  """save_interval_seconds=10 with save_interval="auto" (interval 100 s here) saves every 10 s.

  Kills M43 (the auto trigger's None replaced the time trigger's reason)."""
  plan = ofx.CheckpointPolicy(save_interval_seconds=10.0, save_interval="auto", mtbf_seconds=5000.0,
                              save_final_step=False).plan(30)
  assert plan.saved == [(10, "time"), (20, "time"), (30, "time")]


def test_plan_of_a_resumed_run_times_its_interval_from_the_resume():
  """Kills M75 (the simulated clock counted from step 0, not from the resumed step)."""
  plan = ofx.CheckpointPolicy(save_interval_seconds=25.0, save_final_step=False).plan(
      160, start_step=100)
  assert plan.saved == [(125, "time"), (150, "time")]


def test_a_restore_restarts_the_time_interval(tmp_path):
  """Restoring a step restarts the interval (Schedule.saved): a step asked before the restore
  is asked afresh, not answered from before it.

  Kills M46."""
  clock = FakeClock()
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(save_interval_seconds=10.0),
                             clock=clock) as mngr:
    assert mngr.save(1, items(1), force=True)
    mngr.wait()
    clock.t += 20.0
    assert mngr.should_save(2) == "time"
    mngr.restore(1)
    assert mngr.should_save(2) is None  # 0 s since the restore
    clock.t += 10.0
    assert mngr.should_save(3) == "time"


def test_without_auto_a_save_reports_half_the_time_since_the_previous_commit(tmp_path):
  """SaveEvent.expected_loss_s: the work a failure loses on average, half the interval.

  Kills M51."""
  clock = FakeClock()
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(), clock=clock) as mngr:
    mngr.save(1, items(1), force=True)
    mngr.wait()
    clock.t += 30.0
    mngr.save(2, items(2), force=True)
    mngr.wait()
    events = mngr.pop_events()
  assert [e.step for e in events] == [1, 2]
  assert events[0].expected_loss_s is None and events[1].expected_loss_s == 15.0


def test_any_of_reads_the_clock_if_any_part_may():
  """What decides whether process 0 decides (and shares) a trigger for every process.

  Kills M19 (a trigger that does not say was taken as not reading it) M20 (all, not any)."""
  assert ofx.any_of(ofx.EveryNSteps(5), ofx.EveryNSeconds(60)).reads_clock
  assert ofx.any_of(ofx.EveryNSteps(5), lambda s: None).reads_clock
  assert not ofx.any_of(ofx.EveryNSteps(5), ofx.OnSteps({7}), ofx.FirstStep()).reads_clock


# ---------------------------------------------------------------------------------------------
# Keep rules.


def test_to_delete_takes_the_steps_in_any_order():
  """to_delete is a pure function of the steps, not of the order they are listed in.

  Kills M88 (KeepLast took the last listed) M89 (the newest was the last listed)."""
  assert ofx.to_delete(infos(3, 1, 2), [ofx.KeepLast(2)]) == [1]
  assert ofx.to_delete(infos(3, 1, 2), [ofx.KeepEvery(100)]) == [1, 2]


def test_keep_period_protects_step_zero():
  """Step 0 is a multiple of every period. Kills M22."""
  assert ofx.to_delete(infos(0, 5, 10, 15), [ofx.KeepLast(1), ofx.KeepEvery(10)]) == [5]


def test_steps_without_the_metric_fill_the_places_left_free_newest_first():
  """Kills M24 (never filled); M25 (oldest first) too."""
  steps = infos(1, 2, 3, 4, metric=[None, 0.2, None, 0.1])
  assert ofx.to_delete(steps, [ofx.KeepBest("loss", "min", 3)]) == [1]


def test_a_non_finite_metric_is_no_score():
  """A diverged step's -inf loss is not the best. Kills M28."""
  steps = infos(1, 2, 3, metric=[-math.inf, 0.5, 0.3])
  assert ofx.to_delete(steps, [ofx.KeepBest("loss", "min", 1)]) == [1, 2]
  steps = infos(1, 2, 3, metric=[math.inf, 0.5, 0.3])
  assert ofx.to_delete(steps, [ofx.KeepBest("loss", "max", 1)]) == [1]


@pytest.mark.parametrize("kwargs", [dict(keep_period=10), dict(keep_time_interval_seconds=10.0)])
def test_protecting_rules_alone_delete_nothing(tmp_path, kwargs):
  """With neither max_to_keep nor keep_best, every step is kept (docs/manager.md).

  Kills M58."""
  policy = ofx.CheckpointPolicy(save_interval_steps=5, save_final_step=False, **kwargs)
  assert policy.plan(30).kept == [5, 10, 15, 20, 25, 30]
  clock = FakeClock()
  with ofx.CheckpointManager(str(tmp_path), policy, clock=clock) as mngr:
    for step in range(1, 21):
      clock.t += 1.0
      mngr.save(step, items(step))
    mngr.wait()
  assert on_disk(tmp_path) == [5, 10, 15, 20]


# ---------------------------------------------------------------------------------------------
# What a save is given.


def test_a_numeric_string_is_not_a_metric(tmp_path):
  """A metric given as a string ("0.5", read from a log) is refused like any non-number,
  though float() parses it. Kills M35."""
  with ofx.CheckpointManager(str(tmp_path)) as mngr:
    with pytest.raises(TypeError, match=r"metric 'loss' must be a scalar number, got str"):
      mngr.save(1, items(1), force=True, metrics={"loss": "0.5"})
  assert on_disk(tmp_path) == []


def test_a_bool_is_not_a_step(tmp_path):
  """Kills M09."""
  with ofx.CheckpointManager(str(tmp_path)) as mngr:
    with pytest.raises(ValueError, match=r"step must be a non-negative int"):
      mngr.save(True, items(1), force=True)
  assert on_disk(tmp_path) == []


def test_a_typo_of_best_metric_is_refused_at_every_step_that_makes_it(tmp_path):
  """A step whose metrics lack best_metric but name one close to it raises, as the first step
  would, even after steps that reported both (check_step_metrics: looked for whenever the
  set of names differs from the last checked).

  Kills M39 (names already seen in a larger set were not checked again)."""
  policy = ofx.CheckpointPolicy(best_metric="loss", keep_best=1)
  with ofx.CheckpointManager(str(tmp_path), policy) as mngr:
    assert mngr.save(1, items(1), force=True, metrics={"loss": 0.5, "val_loss": 0.7})
    mngr.wait()
    with pytest.raises(ValueError, match=r"best_metric='loss' is not among the metrics reported"
                       r" \(val_loss\); did you mean 'val_loss'\?"):
      mngr.save(2, items(2), force=True, metrics={"val_loss": 0.6})
    mngr.wait()
  assert on_disk(tmp_path) == [1]


@pytest.mark.parametrize("reason", ["preemption", "exception"])
def test_a_preemption_or_exception_save_replaces_a_committed_step(tmp_path, reason):
  """Saves made whatever the triggers say replace a committed step of that number.

  Kills M91 ("preemption" not forced) M95 ("exception" not forced)."""
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy()) as mngr:
    assert mngr.save(5, items(5), force=True)
    mngr.wait()
    assert mngr.save(5, items(7), reason=reason)
    mngr.wait()
    assert mngr.step_info(5).reason == reason
    assert mngr.restore(5)["state"]["w"].tolist() == [7.0] * 4
  assert on_disk(tmp_path) == [5]


def test_if_busy_skip_never_skips_a_final_preemption_or_exception_save(tmp_path):
  """With if_busy="skip", a save due while the previous one writes is skipped, unless forced:
  the final, preemption and exception saves wait for it instead.

  Kills M87 M91 M95 (one of those reasons left out of policy.FORCED)."""
  big = {"w": np.random.default_rng(0).standard_normal((32 << 20) // 4, dtype=np.float32)}
  policy = ofx.CheckpointPolicy(save_interval_steps=1, if_busy="skip", save_on_preemption=False)
  with ofx.CheckpointManager(str(tmp_path), policy) as mngr:
    assert mngr.save(1, {"state": big})
    for step, reason in ((2, "final"), (3, "preemption"), (4, "exception")):
      assert mngr.save(step, {"state": big}, reason=reason), reason  # step - 1 still writing
    mngr.wait()
    assert [mngr.step_info(s).reason for s in (2, 3, 4)] == ["final", "preemption", "exception"]
  assert on_disk(tmp_path) == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------
# DEFECT found by the review (not a mutant: next to M82's check of save_on_steps).


def test_save_on_steps_takes_numpy_integers_like_every_other_integer_setting():
  """``save_on_steps=list(np.arange(1000, 5001, 1000))`` was refused ("must be a list of
  integers, got list"), and numeric ``preemption_signals`` given as numpy integers too,
  while every other integer setting, OnSteps and the step of a save take them."""
  steps = list(np.arange(1000, 3001, 1000))
  assert ofx.OnSteps(steps).steps == frozenset({1000, 2000, 3000})
  assert ofx.CheckpointPolicy(max_to_keep=np.int64(3)).max_to_keep == 3
  policy = ofx.CheckpointPolicy(save_on_steps=steps)
  assert policy.save_on_steps == (1000, 2000, 3000)
  assert all(type(s) is int for s in policy.save_on_steps)  # pylint: disable=unidiomatic-typecheck
  assert ofx.CheckpointPolicy(preemption_signals=[np.int64(15)]).preemption_signals == ("SIGTERM",)
