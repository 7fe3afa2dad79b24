"""Holes a mutation review of the data-iterator layer (orbax_flax/data/elastic.py, order.py and
orbax_flax/training/prefetching.py) found: behaviour the docs promise that no test pinned.

Each test names what it pins; all go through the public API on real grain pipelines."""

import collections
import time

import grain
import numpy as np
import pytest

import orbax_flax as ofx
import test_data
from orbax_flax.data import ElasticIterator


def _filtered(n=400):
  """A shuffled, filtered dataset: shards read their strides at different rates and a chunk of
  positions gives fewer records than a batch, so records wait in the iterator between batches."""
  return grain.MapDataset.range(n).shuffle(seed=7).filter(lambda i: i % 3 != 0)


def _ids(batches):
  return [b.tolist() for b in batches]


# ------------------------------------------------------------ set_state: resume at the next batch


def test_set_state_of_the_same_shard_continues_at_the_next_batch():
  """ElasticIterator.set_state(state) (what Prefetched calls on its source at every restart):
  the batches after the state, not the order's start."""
  ds = _filtered()
  whole = ElasticIterator(ds, 6, shard_index=1, shard_count=2)
  want = _ids(next(whole) for _ in range(8))
  first = ElasticIterator(ds, 6, shard_index=1, shard_count=2)
  for _ in range(3):
    next(first)
  fresh = ElasticIterator(ds, 6, shard_index=1, shard_count=2)
  fresh.set_state(first.get_state())
  assert _ids(next(fresh) for _ in range(5)) == want[3:]


def test_moving_an_iterator_that_has_read_ahead_back_rereads_from_the_state():
  """set_state / set_state_from_shards on an iterator that has already read: the records of a
  chunk it read but had not handed out (a filter leaves some waiting) are from the old place
  and must not be handed out after the move."""
  ds = _filtered()
  it = ElasticIterator(ds, 4, shard_index=0, shard_count=1,
                       read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
  for _ in range(2):
    next(it)
  saved = it.get_state()
  want = _ids(next(it) for _ in range(4))
  it.set_state(saved)
  assert _ids(next(it) for _ in range(4)) == want
  it.set_state_from_shards([saved])
  assert _ids(next(it) for _ in range(4)) == want
  it.close()


def test_prefetched_over_an_elastic_source_resumes_on_the_same_count_at_the_next_batch():
  """docs/training.md: an elastic source read ahead through ofx.Prefetched resumes exactly; on
  the same shard count, bitwise the uninterrupted batches."""
  def ahead(batches):
    queue = collections.deque()
    for b in batches:
      queue.append(b)
      if len(queue) > 2:
        yield queue.popleft()
    yield from queue
  ds = _filtered()
  whole = [ElasticIterator(ds, 6, shard_index=k, shard_count=2) for k in range(2)]
  want = [_ids(next(it) for _ in range(7)) for it in whole]
  old = [ofx.Prefetched(ElasticIterator(ds, 6, shard_index=k, shard_count=2), ahead)
         for k in range(2)]
  for data in old:
    for _ in range(3):
      next(data)
  states = [data.get_state() for data in old]
  for k in range(2):
    new = ofx.Prefetched(ElasticIterator(ds, 6, shard_index=k, shard_count=2), ahead)
    new.set_state_from_shards(states)
    assert _ids(next(new) for _ in range(4)) == want[k][3:]
    again = ofx.Prefetched(ElasticIterator(ds, 6, shard_index=k, shard_count=2), ahead)
    again.set_state(states[k])
    assert _ids(next(again) for _ in range(4)) == want[k][3:]


# ------------------------------------------------------------ a filter's bounded scan


def test_a_filter_that_keeps_a_few_records_reads_to_the_end_however_many_it_drops():
  """The scan gives up after 100,000 positions dropped *in a row*: a filter keeping one record
  in ten drops more than that over 120,000 positions, never that many in a row."""
  ds = grain.MapDataset.range(120_000).filter(lambda i: i % 10 == 0)
  it = ElasticIterator(ds, 100, shard_index=0, shard_count=1)
  got = [x for b in it for x in b.tolist()]
  assert got == list(range(0, 120_000, 10))


def test_a_shard_of_big_batches_scans_a_thousand_batches_of_drops():
  """The bound is the larger of 100,000 positions and 1000 batches' worth: a shard of 200
  records a batch reads 150,000 dropped positions in a row before its first record."""
  ds = grain.MapDataset.range(150_400).filter(lambda i: i >= 150_000)
  it = ElasticIterator(ds, 200, shard_index=0, shard_count=1)
  assert next(it).tolist() == list(range(150_000, 150_200))


# ------------------------------------------------------------ states that do not fit are refused


def test_states_holding_different_orders_are_refused():
  """set_state_from_shards: the shards' states hold one order (saved at one step of one run);
  states of other orders (another run's, or one resumed on another count) are refused."""
  ds = grain.MapDataset.range(60)
  a, b = (ElasticIterator(ds, 4, shard_index=k, shard_count=2) for k in range(2))
  next(a), next(b)
  s0, s1 = a.get_state(), b.get_state()
  one = ElasticIterator(ds, 2, shard_index=0, shard_count=1)
  one.set_state_from_shards([s0, s1])  # another order: the holes, then the rest
  other = dict(s1, order=one.get_state()["order"])
  it = ElasticIterator(ds, 4, shard_index=0, shard_count=2)
  with pytest.raises(ValueError, match="different data orders"):
    it.set_state_from_shards([s0, other])
  with pytest.raises(ValueError, match="different data orders"):
    ElasticIterator(ds, 6, shard_index=0, shard_count=3).set_state_from_shards([s0, other])


@pytest.mark.parametrize("field,value,message", [
    ("order", [[0, 30, 1]], "names positions past the dataset's 20"),
    ("order", [[-4, 20, 1]], r"start >= 0"),
    ("position", -2, r"position -2 is outside \[0, 20\]"),
])
def test_a_hostile_state_is_refused_before_it_is_read(field, value, message):
  """A state file is hostile input (elastic.py): positions outside the dataset, a negative
  start, a negative place are refused with a ValueError, not read as other records."""
  ds = grain.MapDataset.range(20)
  it = ElasticIterator(ds, 2, shard_index=0, shard_count=1)
  bad = dict(it.get_state(), **{field: value})
  with pytest.raises(ValueError, match=message):
    it.set_state(bad)
  with pytest.raises(ValueError, match=message):
    it.set_state_from_shards([bad])


# ------------------------------------------------------------ Prefetched's positions


def test_a_counted_source_moved_by_set_state_counts_on_from_there():
  """A source without get_state() is counted: its position after a set_state(n) and one batch
  is n + 1 (the next resume skips n + 1 batches, not 1)."""
  data = ofx.Prefetched(lambda: iter(range(100)), lambda it: it)
  data.set_state(5)
  assert next(data) == 5 and data.get_state() == 6
  next(data)
  data.set_state(data.get_state())  # a restore at the position it had
  assert next(data) == 7 and data.get_state() == 8


class _LiveSource:
  """Hands out its own live state dict; ``keeps`` (set_state keeps the dict it is given) or
  updates its dict in place: both common in hand-written loaders."""

  def __init__(self, keeps):
    self.state, self.keeps = {"i": 0}, keeps

  def __iter__(self):
    return self

  def __next__(self):
    self.state["i"] += 1
    return self.state["i"] - 1

  def get_state(self):
    return self.state

  def set_state(self, state):
    if self.keeps:
      self.state = state
    else:
      self.state.update(state)


def _ahead(it):
  queue = collections.deque()
  for x in it:
    queue.append(x)
    if len(queue) > 3:
      yield queue.popleft()


@pytest.mark.parametrize("keeps", [True, False])
def test_prefetched_positions_stay_where_they_were_taken(keeps):
  """docs/training.md: get_state() is a copy of what the source said then; a position taken,
  and a position handed to set_state, are not moved by the read-ahead that follows."""
  data = ofx.Prefetched(_LiveSource(keeps), _ahead)
  start = data.get_state()  # before the first batch
  assert [next(data) for _ in range(2)] == [0, 1]
  assert start == {"i": 0}
  saved = data.get_state()
  assert saved == {"i": 2}
  data.set_state(saved)
  assert [next(data) for _ in range(3)] == [2, 3, 4]
  data.set_state(saved)  # the same position again: where it was, not where the source went
  assert next(data) == 2
  data.set_state(start)
  assert next(data) == 0


def test_the_run_of_dropped_positions_starts_again_at_a_move():
  """The bound counts positions dropped *in a row*: a pass that ended in a long run of drops,
  then moved back (set_state) to read that run again, counts it afresh; it reads 99,900 in a
  row, not 100,000, and ends (StopIteration), with no ValueError a hundred positions in."""
  ds = grain.MapDataset.range(100_000).filter(lambda i: i < 100)
  it = ElasticIterator(ds, 100, shard_index=0, shard_count=1)
  assert next(it).tolist() == list(range(100))
  saved = it.get_state()
  with pytest.raises(StopIteration):
    next(it)  # 99,900 dropped to the end of the pass
  it.set_state(saved)
  with pytest.raises(StopIteration):
    next(it)


def test_a_resume_on_another_count_reads_the_oldest_hole_first():
  """order.py: at a resume on another count the holes come first, oldest first. Shards 0, 1, 2
  of 3 read 1, 0 and 3 of their positions of range(12): positions 1, 3, 4, 6, 7 were not read
  below the furthest place (9); the new order starts at the oldest of them, 1."""
  ds = grain.MapDataset.range(12)
  states = []
  for k, place in enumerate([1, 0, 3]):
    it = ElasticIterator(ds, 3, shard_index=k, shard_count=3)
    states.append(dict(it.get_state(), position=place))
  one = ElasticIterator(ds, 1, shard_index=0, shard_count=1)
  one.set_state_from_shards(states)
  rest = [x for b in one for x in b.tolist()]
  assert sorted(rest) == [1, 3, 4, 6, 7, 9, 10, 11]  # each unread position once
  assert rest[0] == 1 and rest[-3:] == [9, 10, 11]  # the oldest hole first, the frontier last


class _ElasticCounter:
  """A user's elastic source (docs/training.md, the protocol), a few ms a batch."""

  checkpoint_state_is_elastic = True

  def __init__(self):
    self.i = 0

  def __iter__(self):
    return self

  def __next__(self):
    i = self.i
    time.sleep(0.005)
    self.i = i + 1
    return i

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    self.i = state["i"]

  def set_state_from_shards(self, states):
    self.i = min(s["i"] for s in states)
    time.sleep(0.01)  # more work after the move (ElasticIterator's stops grain's threads)


def _background(it):
  """An unbounded background queue (the read-ahead the docs describe)."""
  return test_data.background_read_ahead(it, maxsize=0)


def test_set_state_from_shards_waits_for_a_threaded_read_ahead_s_read_in_flight():
  """Prefetched.set_state_from_shards while a background read-ahead is inside the source's
  next(): the move must wait for that read, after which the old read-ahead reads no more;
  else the read lands on the moved source and the resume starts a batch (or more) late."""
  for _ in range(3):
    data = ofx.Prefetched(_ElasticCounter(), _background)
    assert next(data) == 0
    time.sleep(0.02)  # the thread reads on
    data.set_state_from_shards([{"i": 50}, {"i": 40}])
    assert [next(data) for _ in range(3)] == [40, 41, 42]
    assert data.get_state() == {"i": 43}


@pytest.mark.parametrize("steps_before", [2, 12])  # mid-pass, and after the pass ended
def test_a_resume_with_another_global_batch_on_the_same_shards_ends_the_pass_at_the_same_step(
    steps_before):
  """docs/training.md: a finite pass without a filter ends at the same step on every process,
  and changing the global batch size on a resume is exact. Resumed on the same two shards
  with global batch 10 after batches of 8, shards had [9, 8] steps left ([1, 0] after the
  pass had ended): a data-parallel step's collective then waits for ever on the shard with
  one batch more. Every record of the pass is still read once."""
  ds = grain.MapDataset.range(97)  # shards of 49 and 48 positions
  old = [ElasticIterator(ds, 8, shard_index=k, shard_count=2) for k in range(2)]
  read = []
  for it in old:
    for _ in range(steps_before):
      read += next(it).tolist()
  states = [it.get_state() for it in old]
  new = [ElasticIterator(ds, 10, shard_index=k, shard_count=2) for k in range(2)]
  for it in new:
    it.set_state_from_shards(states)
  rest = [[b.tolist() for b in it] for it in new]
  assert len(rest[0]) == len(rest[1]), [len(r) for r in rest]
  read += [i for batches in rest for b in batches for i in b]
  assert len(read) == len(set(read)), "a record read twice"
  assert len(read) >= 96, len(read)  # at most the one position past the shortest shard stays
