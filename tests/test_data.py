"""orbax_flax.data: a grain pipeline resumed exactly on any number of shards, and the protocol
by which CheckpointCallback hands a data iterator every old process's state."""

import ast
import collections
import logging
import os
import queue
import re
import shutil
import threading
import time

import grain
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_flax as ofx
from orbax_flax.training import resume
from orbax_flax.data import ElasticIterator
from orbax_flax.data import order as order_lib

READ = grain.ReadOptions(num_threads=4, prefetch_buffer_size=16)


def keep(record) -> bool:
  """Drops about a third of the records, in runs, so that shards read at different rates."""
  return record["id"] % 7 != 3 and (record["id"] // 5) % 3 != 1


def pipeline(n_a=300, n_b=200):
  """filter + shuffle + mix of two sources; each record carries its id."""
  a = grain.MapDataset.range(0, n_a).map(lambda i: {"id": i, "x": np.full(3, i, np.int32)})
  b = grain.MapDataset.range(10_000, 10_000 + n_b).map(lambda i: {"id": i, "x": np.full(3, -i, np.int32)})
  return grain.MapDataset.mix([a, b], weights=[0.6, 0.4]).shuffle(seed=3).filter(keep)


def all_ids(ds):
  return sorted(r["id"] for r in ds if r is not None)


def shards(ds, count, batch=12, states=None):
  its = [ElasticIterator(ds, batch, shard_index=k, shard_count=count, read_options=READ)
         for k in range(count)]
  if states is not None:
    for it in its:
      it.set_state_from_shards(states)
  return its


# ------------------------------------------------------------------------ the order, pure


@hypothesis.given(length=st.integers(0, 80), data=st.data())
@hypothesis.settings(max_examples=200, deadline=None)
def test_any_sequence_of_shard_counts_reads_every_position_once(length, data):
  order, read = order_lib.initial(length), collections.Counter()
  for _ in range(data.draw(st.integers(1, 5))):
    count = data.draw(st.integers(1, 6))
    places = []
    for k in range(count):
      mine = [p for r in order_lib.shard_ranges(order, k, count) for p in r]
      assert len(mine) == order_lib.shard_length(order, k, count)
      place = data.draw(st.integers(0, len(mine)))
      read.update(mine[:place])
      places.append(place)
    before, order = order, order_lib.resume_order(order, places)
    assert order == order_lib.from_lists(order_lib.to_lists(order))
    assert len(order) <= count * len(before) + 1  # ranges per shard, never one per record
  rest = [p for r in order for p in r]
  read.update(rest)
  assert sorted(read.elements()) == list(range(length))  # each position exactly once


def test_the_state_stays_small_however_far_the_shards_read():
  order = order_lib.initial(10**12)
  for count, places in [(4, [10**9, 10**9 - 5, 10**9 + 17, 10**9 - 3]), (2, [3, 10**8]),
                        (3, [10**7, 1, 10**7 + 2])]:
    order = order_lib.resume_order(order, places)
  assert len(order) <= 3 * 4 + 1 and order_lib.size(order) > 10**12 - 10**9 * 5


# ------------------------------------------------------------------------ real grain pipelines


def test_filter_shuffle_mix_resume_exactly_once_on_4_2_3_4_shards():
  ds = pipeline()
  seen, states, uneven = collections.Counter(), None, False
  for count, steps in [(4, 5), (2, 7), (3, 4), (4, None), (1, None)]:
    its = shards(ds, count, states=states)
    if steps is None:  # one pass over the rest of the order (then one shard reads what the
      for it in its:   # 4 shards' pass left past its last common step)
        for batch in it:
          seen.update(batch["id"].tolist())
    for _ in range(steps or 0):  # one batch per shard per step, as processes do
      for it in its:
        batch = next(it)
        assert len(batch["id"]) == it.batch_size == 12 // count
        np.testing.assert_array_equal(batch["x"][:, 0], np.where(batch["id"] < 10_000, 1, -1)
                                      * batch["id"])
        seen.update(batch["id"].tolist())
    states = [it.get_state() for it in its]
    uneven |= len({s["position"] for s in states}) > 1
    for it in its:
      it.close()
  assert uneven  # the filter made the shards read their strides at different rates
  assert sorted(seen.elements()) == all_ids(ds)  # every record once: none skipped, none twice


def test_same_shard_count_resume_gives_bitwise_the_uninterrupted_batches():
  ds = pipeline().map(lambda r: {**r, "y": np.random.default_rng(r["id"]).random(4)})
  whole = [[next(it) for _ in range(9)] for it in shards(ds, 3)]
  first = shards(ds, 3)
  for it in first:
    for _ in range(4):
      next(it)
  saved = [it.get_state() for it in first]
  again = shards(ds, 3, states=saved)
  for k, it in enumerate(again):
    for want in whole[k][4:]:
      got = next(it)
      assert jax.tree.all(jax.tree.map(np.array_equal, got, want))
      assert jax.tree.all(jax.tree.map(lambda a, b: a.dtype == b.dtype, got, want))


def test_a_global_batch_the_shards_do_not_divide_is_refused_with_the_nearest_that_fit():
  """Global batch 8 on 3 shards was read 3, 3 and 2 records a step: over a repeated dataset the
  shards drifted apart by epochs and records were trained on unequally often."""
  ds = grain.MapDataset.range(96).shuffle(seed=0).repeat()
  with pytest.raises(ValueError, match=r"global_batch_size=8 is not a positive multiple of"
                                       r" shard_count=3: .*use global_batch_size=6 or 9"):
    ElasticIterator(ds, 8, shard_index=2, shard_count=3)
  its = shards(ds, 3, batch=9)
  seen = collections.Counter(x for _ in range(30 * 96 // 9) for it in its
                             for x in next(it).tolist())
  assert set(seen.values()) == {30}  # 30 epochs of steps: every record 30 times


def test_the_global_batch_may_change_at_a_resume():
  ds = grain.MapDataset.range(10).repeat(3)
  its = shards(ds, 3, batch=6)
  assert [it.batch_size for it in its] == [2, 2, 2]
  seen = [x for it in its for _ in range(2) for x in next(it).tolist()]
  rest = shards(ds, 2, batch=4, states=[it.get_state() for it in its])
  seen += [x for it in rest for b in it for x in b.tolist()]
  assert sorted(seen) == sorted(list(range(10)) * 3)


def test_packing_and_bad_states_are_refused_with_what_is_supported():
  ds = grain.MapDataset.range(20)
  packed = grain.experimental.FirstFitPackIterDataset(
      ds.map(lambda i: {"t": np.arange(i % 4 + 1)}).to_iter_dataset(), length_struct={"t": 8},
      num_packing_bins=2)
  with pytest.raises(TypeError, match=r"(?s)FirstFitPackIterDataset.*Supported: .*batch\(k\)"):
    ElasticIterator(packed, 4, shard_index=0, shard_count=1)
  with pytest.raises(ValueError, match="global_batch_size=2 is not a positive multiple of"
                                       " shard_count=4: .*use global_batch_size=4$"):
    ElasticIterator(ds, 2, shard_index=0, shard_count=4)
  with pytest.raises(ValueError, match=r"shard_index must be an int in \[0, 2\)"):
    ElasticIterator(ds, 4, shard_index=2, shard_count=2)
  a, b = shards(ds, 2, batch=4)
  next(a)
  with pytest.raises(ValueError, match="set_state_from_shards"):
    b.set_state(a.get_state())  # another shard's state
  with pytest.raises(ValueError, match="dataset of 20 records and this one has 30"):
    ElasticIterator(grain.MapDataset.range(30), 4, shard_index=0,
                    shard_count=1).set_state_from_shards([a.get_state(), b.get_state()])
  bad = dict(b.get_state(), position=99)
  with pytest.raises(ValueError, match=r"position 99 is outside \[0, 10\]"):
    a.set_state_from_shards([a.get_state(), bad])
  with pytest.raises(ValueError, match=r"\[start, stop, step\] integer triples"):
    a.set_state_from_shards([dict(a.get_state(), order=[[0, 20, 0]]), b.get_state()])


def test_shards_replicated_on_several_processes_resume_in_any_layout():
  """4 processes reading 2 shards (each shard on 2 processes): the callback hands the 4 states,
  one per process; each shard's replicas count once, on the same shard count or another."""
  ds = pipeline()
  its = shards(ds, 2)
  seen = collections.Counter()
  for _ in range(5):
    for it in its:
      seen.update(next(it)["id"].tolist())
  a, b = (it.get_state() for it in its)
  saved = {"processes": [b, a, b, a], "global": False}  # processes 0 and 2 read shard 1
  same = [ElasticIterator(ds, 12, shard_index=k, shard_count=2) for k in range(2)]
  for it in same:
    resume.DataPosition(it, "doc").set(5, saved)
  for old, new in zip(its, same):
    assert jax.tree.all(jax.tree.map(np.array_equal, next(new), next(old)))
  three = [ElasticIterator(ds, 12, shard_index=k, shard_count=3) for k in range(3)]
  for it in three:
    resume.DataPosition(it, "doc").set(5, saved)
    seen.update(x for batch in it for x in batch["id"].tolist())
  rest = ElasticIterator(ds, 12, shard_index=0, shard_count=1)
  rest.set_state_from_shards([it.get_state() for it in three])
  seen.update(x for batch in rest for x in batch["id"].tolist())
  assert sorted(seen.elements()) == all_ids(ds)  # every record once


def test_states_of_shards_that_do_not_fit_together_are_refused_naming_the_shards():
  ds = grain.MapDataset.range(40)
  its = shards(ds, 3, batch=6)
  next(its[0]), next(its[1])
  s0, s1, s2 = (it.get_state() for it in its)
  it = ElasticIterator(ds, 4, shard_index=0, shard_count=2)
  with pytest.raises(ValueError, match=r"replicas of shard\(s\) \[0\] .*differ"):
    it.set_state_from_shards([s0, s1, s2, dict(s0, position=0)])
  with pytest.raises(ValueError, match=r"states of shards \[0, 2\] of 3: shard\(s\) \[1\] missing"):
    it.set_state_from_shards([s2, s0])
  one = ElasticIterator(ds, 4, shard_index=0, shard_count=1).get_state()
  with pytest.raises(ValueError, match=r"name different shard counts \[1, 3\]"):
    it.set_state_from_shards([s0, s1, s2, one])
  with pytest.raises(ValueError, match=r"shard_index 3 .* of 3"):
    it.set_state_from_shards([s0, s1, s2, dict(s2, shard_index=3)])


# ------------------------------------------------------------------------ the protocol


class UserLoader:
  """A user's own elastic loader: records the states it was handed."""

  checkpoint_state_is_elastic = True

  def __init__(self):
    self.pos, self.handed = 0, None

  def __iter__(self):
    return self

  def __next__(self):
    self.pos += 1
    return self.pos

  def get_state(self):
    return {"pos": self.pos}

  def set_state_from_shards(self, states):
    self.handed = states
    self.pos = sum(s["pos"] for s in states)


def test_an_elastic_iterator_gets_every_old_process_state_in_order():
  data = resume.DataPosition(UserLoader(), "doc")
  data.set(4, {"processes": [{"pos": 1}, {"pos": 2}, {"pos": 4}], "global": False})
  assert data.iterator.handed == [{"pos": 1}, {"pos": 2}, {"pos": 4}] and data.iterator.pos == 7
  class NoMethod:
    checkpoint_state_is_elastic = True
    get_state = set_state = None
  with pytest.raises(TypeError, match="no set_state_from_shards"):
    resume.DataPosition(NoMethod(), "doc").set(4, {"processes": [{}], "global": False})


def test_grains_elastic_iterator_resumes_on_another_process_count():
  ds = grain.MapDataset.range(64)
  old = [grain.experimental.ElasticIterator(ds, 8, grain.sharding.ShardOptions(k, 2))
         for k in range(2)]
  for it in old:
    next(it), next(it)
  saved = {"processes": [it.get_state() for it in old], "global": False}  # saved before we knew
  new = grain.experimental.ElasticIterator(ds, 8, grain.sharding.ShardOptions(0, 1))
  data = resume.DataPosition(new, "doc")
  assert data.is_global
  data.set(2, saved)  # 2 saved processes onto this one: no refusal
  assert next(new).tolist() == list(range(16, 24))


def linen_free_step(state, batch):
  return {"w": state["w"] + jnp.sum(batch["x"], dtype=jnp.float32)}


def test_checkpoint_callback_resumes_the_elastic_iterator(tmp_path):
  """One process (shard 0 of 1) through restore_or_init: bitwise the uninterrupted batches,
  then trains on."""
  ds = pipeline()
  step = jax.jit(linen_free_step)
  whole = ElasticIterator(ds, 6, read_options=READ)
  want = [next(whole) for _ in range(8)]
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 5})
  it = ElasticIterator(ds, 6, read_options=READ)
  state = ckpt.restore_or_init({"w": jnp.zeros(())}, data_iterator=it)
  for s in range(1, 6):
    state = step(state, next(it))
    ckpt.on_step_end(s, state)
  ckpt.close()
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 5})
  it = ElasticIterator(ds, 6, read_options=READ)
  restored = ckpt.restore_or_init({"w": jnp.zeros(())}, data_iterator=it)
  assert ckpt.restored_step == 5 and float(restored["w"]) == float(state["w"])
  for w in want[5:]:
    batch = next(it)
    assert jax.tree.all(jax.tree.map(np.array_equal, batch, w))
    restored = step(restored, batch)
  ckpt.close()
  assert float(restored["w"]) == float(sum(np.sum(b["x"]) for b in want))


def test_the_data_package_imports_no_other_orbax_flax_layer():
  root = os.path.join(os.path.dirname(ofx.__file__), "data")
  for name in os.listdir(root):
    if name.endswith(".py"):
      tree = ast.parse(open(os.path.join(root, name)).read())
      mods = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
      mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
      assert all(m == "orbax_flax.data" or m.startswith("orbax_flax.data.")
                 for m in mods if m.startswith("orbax_flax")), (name, mods)
  src = open(resume.__file__).read()
  assert "orbax_flax.data" not in src.replace("orbax_flax.data.ElasticIterator", "")


# ------------------------------------------------------------------------ real processes


def _job(workdir, n, run, steps, sigterm_after=None, extra=()):
  """elastic_worker.py as ``n`` processes through ``python -m orbax_flax.launch``; with
  ``sigterm_after``, SIGTERM goes to the launcher once process 0 has taken that many steps."""
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  import jobs  # pylint: disable=g-import-not-at-top
  env = jobs.env_for(1)
  env.pop("XLA_FLAGS")
  cmd = [sys.executable, "-m", "orbax_flax.launch", "-n", str(n), "--devices_per_process=1",
         "--", os.path.join(jobs.HERE, "elastic_worker.py"), f"--workdir={workdir}",
         f"--run={run}", f"--steps={steps}", *extra]
  p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                       cwd=jobs.ROOT)
  out = ""
  if sigterm_after is not None:
    out = "".join(jobs.read_until(p, rf"\[0\] STEP {sigterm_after}$", timeout=300))
    p.send_signal(signal.SIGTERM)
  rest, _ = p.communicate(timeout=300)
  out += rest
  assert p.returncode == 0, out[-5000:]
  return out


def _resumed(out):
  import re  # pylint: disable=g-import-not-at-top
  return {int(s) for s in re.findall(r"RESUMED (\d+)", out)}


def _ended(out, word):
  import re  # pylint: disable=g-import-not-at-top
  return {int(s) for s in re.findall(rf"{word} (\d+)", out)}


def test_processes_2_1_3_with_sigterm_between_deliver_every_record_once(tmp_path):
  """Real jobs through orbax_flax.launch, each resumed by restore_or_init(state,
  data_iterator=it) on another process count; every record id of the pipeline counted once."""
  import elastic_worker  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / "run"
  outs = [_job(workdir, 2, 0, 10_000, sigterm_after=4)]
  outs.append(_job(workdir, 1, 1, 10_000, sigterm_after=_ended(outs[0], "PREEMPTED").pop() + 3))
  last = _ended(outs[1], "PREEMPTED").pop() + 4
  outs.append(_job(workdir, 3, 2, last))
  (p1,), (p2,), (done,) = (_ended(o, w) for o, w in zip(outs, ["PREEMPTED", "PREEMPTED", "DONE"]))
  assert _resumed(outs[0]) == {0} and _resumed(outs[1]) == {p1} and _resumed(outs[2]) == {p2}
  assert done == last and outs[0].count("PREEMPTED") == 2 and outs[2].count("DONE") == 3
  # The records each run trained on, up to the step the next run resumed from.
  seen = collections.Counter()
  for run, (first, upto, n) in enumerate([(0, p1, 2), (p1, p2, 1), (p2, last, 3)]):
    for proc in range(n):
      lines = (workdir / "ledger" / f"run{run}-p{proc}.txt").read_text().split("\n")
      steps = [[int(x) for x in line.split()] for line in lines if line]
      assert [s[0] for s in steps if s[0] <= upto] == list(range(first + 1, upto + 1))
      for s in steps:
        if s[0] <= upto:
          assert len(s) - 1 == 12 // n  # this process's share of the global batch
          seen.update(s[1:])
  # The rest of the order, from the last job's final checkpoint, read on one shard here.
  saved = ofx.CheckpointManager(str(workdir / "checkpoints")).restore(last, {"data": None})["data"]
  assert len(saved["processes"]) == 3
  rest = ElasticIterator(elastic_worker.pipeline(), 12, shard_index=0, shard_count=1)
  rest.set_state_from_shards(saved["processes"])
  for batch in rest:
    seen.update(batch["id"].tolist())
  assert max(seen.values()) == 1  # none twice
  assert sorted(seen) == all_ids(elastic_worker.pipeline())  # none skipped


def test_an_elastic_source_read_ahead_through_prefetched_resumes_on_another_process_count(
    tmp_path):
  """docs/training.md: wrap a source read ahead (prefetch_to_device) in ofx.Prefetched. The
  wrapper hid the source's elasticity (checkpoint_state_is_elastic, set_state_from_shards),
  so a 2-process run's positions were refused on 1 process as per-process ones."""
  workdir = tmp_path / "run"
  first = _job(workdir, 2, 0, 6, extra=["--prefetched", "--pace=0"])
  second = _job(workdir, 1, 1, 9, extra=["--prefetched", "--pace=0"])
  assert _ended(first, "DONE") == {6} and _resumed(second) == {6} and _ended(second, "DONE") == {9}
  seen = collections.Counter()
  for run, procs in ((0, 2), (1, 1)):
    for proc in range(procs):
      for line in (workdir / "ledger" / f"run{run}-p{proc}.txt").read_text().split("\n"):
        seen.update(int(x) for x in line.split()[1:])
  assert max(seen.values()) == 1 and sum(seen.values()) == 9 * 12  # none twice, none lost


def test_an_unfiltered_finite_pass_ends_at_the_same_step_on_every_process(tmp_path):
  """97 records, no filter, global batch 8 on 2 processes, a collective in every step: shard 0
  read 49 positions and took a 13th batch into the step's collective, where it waited for a
  process that had ended after 12 (the other waited out the coordination timeout). Now both
  end after 12 steps; the one position past that (96, shard 0's 49th) stays in the order."""
  import elastic_worker  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / "run"
  out = _job(workdir, 2, 0, 100, extra=["--finite"])
  ends = re.findall(r"\[(\d)\] DONE (\d+) (\d+)", out)
  assert sorted((p, int(s)) for p, s, _ in ends) == [("0", 12), ("1", 12)], out[-3000:]
  assert all(int(t) < 15 for _, _, t in ends), ends  # told at once, not after a timeout
  seen = collections.Counter()
  for proc in range(2):
    for line in (workdir / "ledger" / f"run0-p{proc}.txt").read_text().split("\n"):
      if line:
        step, *ids = map(int, line.split())
        assert len(ids) == 4 and 1 <= step <= 12
        seen.update(ids)
  assert elastic_worker.FINITE == 97 and sorted(seen.elements()) == list(range(96))
  saved = ofx.CheckpointManager(str(workdir / "checkpoints")).restore(12, {"data": None})["data"]
  rest = ElasticIterator(grain.MapDataset.range(97), 8, shard_index=0, shard_count=1)
  rest.set_state_from_shards(saved["processes"])
  assert [b.tolist() for b in rest] == [[96]]  # delivered by a resume on another count


@pytest.mark.parametrize("length,count,batch,drop,steps", [
    (97, 2, 8, False, 12),   # shards of 49 and 48 positions, 4 a step
    (95, 2, 8, False, 12),   # 48 and 47: the last batches 4 and 3 records
    (95, 2, 8, True, 11),    # 47 has 11 whole batches: shard 0 stops there too
    (10, 4, 8, False, 1),    # 3, 3, 2, 2 positions, 2 a step
    (3, 4, 4, False, 0),     # fewer positions than shards: none delivered in this pass
])
def test_every_shard_of_an_unfiltered_pass_takes_the_same_number_of_steps(
    length, count, batch, drop, steps):
  ds = grain.MapDataset.range(length).map(lambda i: i * 10)
  its = [ElasticIterator(ds, batch, shard_index=k, shard_count=count, drop_remainder=drop)
         for k in range(count)]
  got = [list(it) for it in its]
  assert [len(g) for g in got] == [steps] * count
  delivered = sorted(x for g in got for b in g for x in b.tolist())
  ranges = [range(k, length, count) for k in range(count)]  # shard k's positions, its stride
  per_step = batch // count
  want = sorted(10 * p for r in ranges for p in r[:steps * per_step])
  assert delivered == want
  if not drop:
    assert length - len(delivered) <= count - 1  # at most one position past the cap a shard


def test_processes_reading_replicas_of_one_shard_resume(tmp_path):
  """Every process of a 2-process job reads shard 0 of 1 (the data replicated, the model split
  across the processes): its saves held two states of shard 0 of 1, and the resume on the same
  2 processes was refused ("expected the state of shard 0 of 2; got shard 0 of 1")."""
  import elastic_worker  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / "run"
  first = _job(workdir, 2, 0, 4, extra=["--replicated", "--pace=0"])
  second = _job(workdir, 2, 1, 7, extra=["--replicated", "--pace=0"])
  assert _ended(first, "DONE") == {4} and _resumed(second) == {4}, second[-3000:]
  assert _ended(second, "DONE") == {7}
  whole = ElasticIterator(elastic_worker.pipeline(), 12, shard_index=0, shard_count=1)
  want = [" ".join(map(str, next(whole)["id"].tolist())) for _ in range(7)]
  for run, steps in ((0, range(1, 5)), (1, range(5, 8))):
    for proc in range(2):  # both processes: the uninterrupted run's batches
      lines = (workdir / "ledger" / f"run{run}-p{proc}.txt").read_text().split("\n")
      assert [line for line in lines if line] == [f"{s} {want[s - 1]}" for s in steps]


def test_a_filter_that_keeps_nothing_of_a_shards_stride_raises_naming_the_fix():
  """MapDataset.mix without a shuffle interleaves its sources a, b, a, b: shard 0 of 2 reads
  only a, and a filter that drops every record of a made its next() scan for ever (here, until
  the dataset ended). Now it stops after a bounded run of dropped positions and says why."""
  n = 110_000
  a = grain.MapDataset.range(n)
  b = grain.MapDataset.range(10**6, 10**6 + n)
  mixed = grain.MapDataset.mix([a, b], weights=[0.5, 0.5])
  ds = mixed.filter(lambda x: x >= 10**6)
  it = ElasticIterator(ds, 200, shard_index=0, shard_count=2, read_options=READ)
  with pytest.raises(ValueError, match=r"(?s)shard 0 of 2 read 100000 positions in a row that"
                     r" the filter dropped.*MapDataset.mix.*Shuffle after mixing"):
    next(it)
  assert next(ElasticIterator(ds, 4, shard_index=1, shard_count=2)).tolist() == [10**6, 10**6 + 1]
  shuffled = mixed.shuffle(seed=0).filter(lambda x: x >= 10**6)  # the fix: both shards read b
  assert [len(next(ElasticIterator(shuffled, 4, shard_index=k, shard_count=2))) for k in (0, 1)] \
      == [2, 2]


def test_a_source_that_changed_length_under_repeat_is_refused():
  """repeat() makes the length sys.maxsize whatever the source holds: a source grown from 1000
  to 1200 records was accepted, and the saved positions named other records (105 read twice
  and 105 never in the resumed epoch)."""
  def pipeline(n):
    return grain.MapDataset.range(n).shuffle(seed=1).map(lambda i: i).repeat()
  old = shards(pipeline(1000), 2, batch=10)
  for it in old:
    next(it)
  states = [it.get_state() for it in old]
  with pytest.raises(ValueError, match=r"under repeat\(\) hold \[1000\] records and this one's"
                                       r" \[1200\]"):
    shards(pipeline(1200), 2, batch=10, states=states)
  assert shards(pipeline(1000), 2, batch=10, states=states)  # the same source: resumed
  old_run = [{k: v for k, v in s.items() if k != "inner_lengths"} for s in states]
  assert shards(pipeline(1200), 2, batch=10, states=old_run)  # a state from before: not known
  def mixed(n):  # finite on top (the mix), a repeated source inside
    return grain.MapDataset.mix([grain.MapDataset.range(10**6), pipeline(n)], [0.5, 0.5])
  saved = ElasticIterator(mixed(300), 4, shard_index=0, shard_count=1).get_state()
  with pytest.raises(ValueError, match=r"\[300\] records and this one's \[301\]"):
    ElasticIterator(mixed(301), 4, shard_index=0, shard_count=1).set_state_from_shards([saved])


def test_restore_data_false_starts_the_data_afresh_and_keeps_checkpointing_it(tmp_path):
  """A dataset that grew between runs is refused at the resume; the way through was
  data_iterator=None, after which no checkpoint held a data position, and the next restart
  replayed the fresh order from its start."""
  def run(n, last, **kw):
    it = ElasticIterator(grain.MapDataset.range(n), 4, shard_index=0, shard_count=1)
    cb = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2})
    got = []
    try:
      state = cb.restore_or_init({"w": np.zeros((), np.float32)}, data_iterator=it, **kw)
      for step in range((cb.restored_step or 0) + 1, last + 1):
        got.append(next(it).tolist())
        cb.on_step_end(step, state)
    finally:
      cb.close()
    return got
  run(100, 4)
  with pytest.raises(ValueError, match=r"(?s)dataset of 100 records and this one has 120.*"
                                       r"restore_or_init\(state, data_iterator=it,"
                                       r" restore_data=False\)"):
    run(120, 6)
  assert run(120, 6, restore_data=False) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the fresh order
  assert run(120, 8) == [[8, 9, 10, 11], [12, 13, 14, 15]]  # its position was checkpointed
  class PerProcess:
    def get_state(self):
      return {"i": 0}
    def set_state(self, state):
      pass
  with pytest.raises(ValueError, match=r"restore_or_init\(state, data_iterator=it,"
                                       r" restore_data=False\)"):
    resume.DataPosition(PerProcess(), "doc").set(4, {"processes": [{"i": 1}] * 2, "global": False})


def test_a_data_position_saved_by_another_kind_of_iterator_is_refused_naming_the_options(
    tmp_path):
  """Saved with ofx.data.ElasticIterator, resumed with grain's own iterator: a bare
  KeyError('next_index') from inside grain; the other way round, ElasticIterator's own error
  with no word of the step, the item or what to do."""
  ds = grain.MapDataset.range(100)
  def run(workdir, it, steps):
    cb = ofx.CheckpointCallback(str(workdir), {"save_interval_steps": 2})
    try:
      state = cb.restore_or_init({"w": np.zeros(())}, data_iterator=it)
      for step in range((cb.restored_step or 0) + 1, steps + 1):
        next(it)
        cb.on_step_end(step, state)
    finally:
      cb.close()
  options = (r"Resume with the same kind of iterator; or start the data afresh and keep saving"
             r" its position: restore_or_init\(state, data_iterator=it, restore_data=False\); or"
             r" pass data_iterator=None")
  run(tmp_path / "a", ElasticIterator(ds, 4, shard_index=0, shard_count=1), 2)
  with pytest.raises(ValueError, match=r"(?s)step 2's data position \(the checkpoint's item"
                     r" 'data'\) cannot be restored into the data iterator \(\w+\): KeyError: .*"
                     r"saved by an orbax_flax.data.ElasticIterator \(keys \[.*'shard_count',"
                     r" 'shard_index'\]\)\. " + options) as e:
    run(tmp_path / "a", iter(ds.batch(4).to_iter_dataset()), 4)
  assert isinstance(e.value.__cause__, KeyError)
  run(tmp_path / "b", iter(ds.batch(4).to_iter_dataset()), 2)
  with pytest.raises(ValueError, match=r"(?s)step 2's data position .* into the data iterator"
                     r" \(ElasticIterator\): ValueError: an ElasticIterator state is .*saved by"
                     r" another kind of iterator than orbax_flax.data.ElasticIterator \(keys"
                     r" \[.*'next_index'.*\]\)\. " + options):
    run(tmp_path / "b", ElasticIterator(ds, 4, shard_index=0, shard_count=1), 4)


# ---------------------------------------------------------------- where a save leaves the data
# A resume continues the data exactly where the job stopped: no batch trained twice, none
# skipped. The stops below are a failing train step (save_on_exception, the default) and a
# read-ahead (Prefetched).


def background_read_ahead(it, maxsize=64):
  """A read-ahead on a thread of its own through a queue (docs/training.md: "a background
  queue"), as users write one."""
  q, end = queue.Queue(maxsize), object()

  def work():
    for x in it:
      q.put(x)
    q.put(end)
  threading.Thread(target=work, daemon=True).start()
  while (x := q.get()) is not end:
    yield x


class _Counter:
  """A loader whose batches are their ids; ``live`` hands out its own state dict, as many
  loaders do (the next batch changes it)."""

  def __init__(self, live=False, delay=0.0, setter=True):
    self.state, self.live, self.delay = {"i": 0}, live, delay
    if not setter:
      self.set_state = None

  def __iter__(self):
    return self

  def __next__(self):
    if self.delay:
      time.sleep(self.delay)
    self.state["i"] += 1
    return self.state["i"] - 1

  def get_state(self):
    return self.state if self.live else dict(self.state)

  def set_state(self, state):
    self.state = dict(state)


def _fit(workdir, data, num_steps, fail_at=None, trained=None, policy=None):
  """Trainer.fit over ``data`` (batch ids), failing at batch ``fail_at``; the batches trained."""
  trained = [] if trained is None else trained
  def train_step(state, batch):
    if batch == fail_at:
      raise FloatingPointError("loss is NaN")
    trained.append(int(batch))
    return {"w": state["w"] + 1, "step": state["step"] + 1}, {}
  ckpt = ofx.CheckpointCallback(str(workdir), policy or {"save_interval_steps": 100})
  ofx.Trainer(train_step, [ckpt]).fit({"w": jnp.zeros(2), "step": 0}, data, num_steps)
  return trained


@pytest.mark.parametrize("live", [False, True])
@pytest.mark.parametrize("fail_at", [0, 3])
def test_an_exception_save_resumes_at_the_failing_batch(tmp_path, live, fail_at):
  """The exception save holds the position after the last good step, not after the batch the
  failing step took. Two ways it held the latter: a fresh run's first step failing (its
  initial state saved as step 0, with batch 0 taken), and a loader whose get_state() hands
  out its live dict (the position marked at step N became N+1's when step N+1 read)."""
  trained = []
  with pytest.raises(FloatingPointError):
    _fit(tmp_path, _Counter(live), 6, fail_at=fail_at, trained=trained)
  _fit(tmp_path, _Counter(live), 6, trained=trained)
  assert trained == list(range(6)), trained


def test_prefetched_positions_are_copies_of_the_source_state():
  """A source whose get_state() is its live dict: every position Prefetched recorded was that
  one dict, so get_state() gave the read-ahead's position, and a resume skipped the batches
  read ahead (the very skip Prefetched exists to prevent)."""
  def ahead(it):
    queue = collections.deque()
    for x in it:
      queue.append(x)
      if len(queue) > 2:
        yield queue.popleft()
  data = ofx.Prefetched(_Counter(live=True), ahead)
  assert [next(data) for _ in range(3)] == [0, 1, 2]
  assert data.get_state() == {"i": 3}
  data.set_state({"i": 1})
  assert next(data) == 1


def test_a_resume_restarts_a_threaded_read_ahead_after_its_last_read(tmp_path):
  """A background-thread read-ahead (the docs' queue) started before the restore (a batch
  taken for shapes): the restore moved the source back while the old thread was inside the
  source's next(), which then moved it on by one, and the resumed run skipped a batch."""
  background = background_read_ahead
  trained = _fit(tmp_path, ofx.Prefetched(_Counter(delay=0.02), background), 10,
                 policy={"save_interval_steps": 5})
  data = ofx.Prefetched(_Counter(delay=0.02), background)
  next(data)  # a look at one batch before the restore
  _fit(tmp_path, data, 20, trained=trained, policy={"save_interval_steps": 5})
  assert trained == list(range(20)), trained


_UNSAVEABLE = {  # a data state a save cannot write -> what the refusal says
    "array": ({"rng": np.random.RandomState(0).get_state()},
              r"data iterator state leaf rng/1 is a ndarray; get_state\(\) must return dicts,"
              r" lists, str, bytes and numbers"),
    "mixed keys": ({"shards": {"a": 1, 2: 3}},  # (a bare ValueError from jax's key sort)
                   r"data iterator state dict at shards has keys of several types"),
}


@pytest.mark.parametrize("kind", sorted(_UNSAVEABLE))
@pytest.mark.parametrize("save_on_exception", [True, False])
def test_an_unsaveable_data_state_is_refused_at_the_first_step(tmp_path, save_on_exception,
                                                                kind):
  """numpy's RandomState.get_state() in the data state: refused only at the first periodic
  save, a save interval of training later (and the exception save the same, so nothing was
  committed)."""
  extra, message = _UNSAVEABLE[kind]
  class Shuffled(_Counter):
    def get_state(self):
      return {**self.state, **extra}
  steps = []
  def train_step(state, batch):
    steps.append(batch)
    return state, {}
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 200,
                                                "save_on_exception": save_on_exception})
  with pytest.raises(TypeError, match=message):
    ofx.Trainer(train_step, [ckpt]).fit({"w": jnp.zeros(2)}, Shuffled(), 400)
  assert len(steps) <= 1, len(steps)


def test_an_iterator_without_set_state_is_not_checkpointed_and_a_warning_says_so(tmp_path,
                                                                               caplog):
  """get_state() without set_state(): its position was saved without a word, and the restart
  then failed in restore_or_init, saying it "was saved by another kind of iterator"."""
  with caplog.at_level(logging.WARNING, logger="orbax_flax"):
    _fit(tmp_path, _Counter(setter=False), 10, policy={"save_interval_steps": 5})
  assert "has no set_state(): its position is not checkpointed" in caplog.text
  assert _fit(tmp_path, _Counter(setter=False), 12) == [0, 1]  # resumed at 10, data afresh
  assert resume.DATA_ITEM not in ofx.restore(f"{tmp_path}/checkpoints/10")


def test_a_first_step_failure_after_a_resume_from_the_local_tier_saves_where_it_resumed(
    tmp_path):
  """Resumed from a step only the local tier held, the first train step fails: the exception
  save of that step (the persistent tier lacks it) was refused, the log blaming a failed
  get_state(); it is saved, with the position the restore set."""
  policy = {"save_interval_steps": 100, "save_final_step": False,
            "local_directory": str(tmp_path / "local"), "local_save_interval_steps": 5}
  trained = _fit(tmp_path, _Counter(), 7, policy=policy)  # local step 5; persistent: none
  with pytest.raises(FloatingPointError):
    _fit(tmp_path, _Counter(), 9, fail_at=5, trained=trained, policy=policy)
  assert ofx.CheckpointManager(str(tmp_path / "checkpoints")).all_steps() == [5]
  shutil.rmtree(tmp_path / "local")  # (a replaced host): the persistent step 5 it is
  _fit(tmp_path, _Counter(), 9, trained=trained, policy=policy)
  assert trained == list(range(7)) + list(range(5, 9)), trained
