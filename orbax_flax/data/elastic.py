"""ElasticIterator: one shard of a grain MapDataset, resumable exactly on any shard count.

Shard ``k`` of ``n`` reads every ``n``-th position of the global order (see
:mod:`orbax_flax.data.order`) through grain: a slice of the user's
``MapDataset`` per range of the order, concatenated, read a batch's worth of
positions at a time by grain's prefetch threads (``read_options``), and
batched by grain's own batch function once the records a ``filter`` dropped
are skipped. Its state is the order (O(shards) ranges, the same on every
shard) and how many of its positions the shard has handed out, with the
dataset's length and the lengths of the finite datasets under a ``repeat()``
(whose own length is endless whatever they hold): a resume over a dataset of
other lengths is refused.

A finite pass gives every shard as many batches as the shard with the fewest
positions has, so that without a filter every process ends at the same step
(a train step with a collective would otherwise wait on a process that has
ended); the at most ``shard_count - 1`` positions past that are not delivered
in the pass, and stay in the order: a resume on another count delivers them.

At a resume, :meth:`ElasticIterator.set_state_from_shards` gets every old
process's state; processes that read one shard (the data replicated across
processes) saved replicas of its state, which must agree and count once. On
the same shard count each shard continues from its own place: bitwise the
batches of an uninterrupted run. On another count the old places become a new
order (the positions no shard read first, then the rest) and every new shard
starts at its beginning: every record of the global order is delivered
exactly once across any sequence of shard counts.
"""

from __future__ import annotations

import collections
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

try:
  import grain
except ImportError as e:  # pragma: no cover
  raise ImportError("orbax_flax.data needs grain: pip install 'orbax-flax[data]'") from e
# grain's own batching (what MapDataset.batch uses), so that batches are grain's batches.
from grain._src.python.dataset.transformations import batch as batch_lib

from orbax_flax.data import order as order_lib

_KEYS = ("shard_index", "shard_count", "position", "order", "length")
# What a refusal of another dataset suggests.
_SAME_DATASET = ("resume with the same dataset (same sources, steps and seeds); or start the data"
                 " afresh, a new order, and keep checkpointing its position: restore_or_init(state,"
                 " data_iterator=it, restore_data=False)")

# How many positions in a row a filter may drop before next() gives up: the larger of this and
# 1000 batches. A filter keeping a share p of a shuffled order drops n in a row with probability
# (1 - p)**n: for one record kept in a thousand, 100,000 in a row is e**-100, and scanning them
# takes seconds, not a hang. Scaled to a thousand batches so that a shard of big batches, which
# reads a batch of positions at a time, still scans a thousand reads before it gives up. A run
# longer than that is a filter that keeps nothing of this shard's stride (a dataset periodic in
# it: MapDataset.mix without a shuffle) or nothing at all: an error, not an endless scan.
_DROPPED_IN_A_ROW = 100_000


class ElasticIterator:
  """This process's batches of a grain ``MapDataset``, resumable on any process count.

  ``dataset`` is the whole, unbatched and unsharded dataset with any
  random-access steps (``shuffle``, ``map``, ``random_map``, ``filter``,
  ``MapDataset.mix`` of several sources, ``repeat``, and ``batch`` then
  ``map`` to pack a fixed number of records into one example). Each
  ``next()`` returns this shard's share of ``global_batch_size`` records,
  ``global_batch_size // shard_count`` of them, batched by grain (a global
  batch that ``shard_count`` does not divide is refused: shards taking
  different shares would read the order at different rates).

  With :class:`orbax_flax.CheckpointCallback` its position is saved with every
  checkpoint and restored by ``restore_or_init(state, data_iterator=it)`` on
  any process count: the callback hands every old process's state to
  :meth:`set_state_from_shards` (``checkpoint_state_is_elastic``).

  A finite pass ends at the same step on every shard when no filter drops
  records: each shard reads no more batches than the shard with the fewest
  positions (the last); the positions past that (at most ``shard_count - 1``
  without ``drop_remainder``) are not delivered in this pass, as
  ``drop_remainder`` drops a short batch,
  and stay in the order, so that a resume on another count delivers them. A
  filter drops records unevenly, so shards may still end a pass at different
  steps: a multi-process job with a filter repeats its dataset (``repeat()``)
  and stops at a fixed step.

  Shard ``k`` of ``n`` reads every ``n``-th position, so a dataset periodic
  in that stride gives each shard a part of it: ``MapDataset.mix`` without a
  shuffle interleaves its sources in a fixed period, and with a ``filter``
  the shards then train on other mixtures, or a shard finds nothing to keep
  (``next()`` raises ``ValueError`` after 100,000 positions in a row, or 1000
  batches' worth, dropped). Shuffle after mixing.

  Iterator-side steps with buffers (grain's ``FirstFitPackIterDataset`` and
  other packing, ``interleave``, ``mp_prefetch``) are refused: records
  waiting in their buffers could not be handed back to the order.

  Args:
    dataset: a ``grain.MapDataset`` (random access).
    global_batch_size: records per step over all shards, a multiple of
      ``shard_count`` (another one may be used at a resume).
    shard_index: this shard (default ``jax.process_index()``).
    shard_count: how many shards read the order (default ``jax.process_count()``).
    read_options: grain's ``ReadOptions`` (prefetch threads and buffer).
    drop_remainder: drop a last batch shorter than this shard's batch size
      (the records in it are then not delivered); a pass then has as many
      steps as the shard with the fewest positions has whole batches.
    batch_fn: grain's ``batch_fn`` (default: stack each leaf into an array).

  Raises:
    TypeError: ``dataset`` is not a ``grain.MapDataset``.
    ValueError: from ``next()``, a filter dropped 100,000 positions in a row
      (or 1000 batches' worth) of this shard's.
    ValueError: a shard that does not fit, or a ``global_batch_size`` that
      is not a positive multiple of ``shard_count``.

  Example:
    >>> import grain
    >>> ds = grain.MapDataset.range(12).filter(lambda x: x % 5 != 0)
    >>> shards = [ElasticIterator(ds, 4, shard_index=k, shard_count=2) for k in range(2)]
    >>> [next(s).tolist() for s in shards]
    [[2, 4], [1, 3]]
    >>> saved = [s.get_state() for s in shards]
    >>> one = ElasticIterator(ds, 4, shard_index=0, shard_count=1)
    >>> one.set_state_from_shards(saved)   # resume the two shards' order on one
    >>> [b.tolist() for b in one]
    [[6, 7, 8, 9], [11]]
  """

  checkpoint_state_is_elastic = True

  def __init__(self, dataset: grain.MapDataset, global_batch_size: int, *,
               shard_index: int | None = None, shard_count: int | None = None,
               read_options: grain.ReadOptions | None = None, drop_remainder: bool = False,
               batch_fn: Callable[[Sequence[Any]], Any] | None = None):
    if not isinstance(dataset, grain.MapDataset):
      raise TypeError(
          f"ElasticIterator reads a grain.MapDataset (random access); got a"
          f" {type(dataset).__name__}. Steps on an IterDataset (packing such as"
          " FirstFitPackIterDataset, interleave, mp_prefetch) hold records in buffers that"
          " cannot be handed back to the order when the shard count changes, so they are not"
          " supported. Supported: the random-access steps of a MapDataset (shuffle, map,"
          " random_map, filter, MapDataset.mix, repeat; pack a fixed number of records with"
          " .batch(k).map(pack)), given unbatched and unsharded.")
    if shard_index is None or shard_count is None:
      import jax  # pylint: disable=g-import-not-at-top  # only for the defaults
      shard_index = jax.process_index() if shard_index is None else shard_index
      shard_count = jax.process_count() if shard_count is None else shard_count
    if type(shard_count) is not int or shard_count < 1:
      raise ValueError(f"shard_count must be an int >= 1; got {shard_count!r}")
    if type(shard_index) is not int or not 0 <= shard_index < shard_count:
      raise ValueError(f"shard_index must be an int in [0, {shard_count}); got {shard_index!r}")
    if (type(global_batch_size) is not int or global_batch_size < 1
        or global_batch_size % shard_count):
      below = (global_batch_size // shard_count * shard_count
               if type(global_batch_size) is int else 0)
      near = " or ".join(str(b) for b in (below, below + shard_count) if b >= shard_count)
      raise ValueError(
          f"global_batch_size={global_batch_size!r} is not a positive multiple of shard_count="
          f"{shard_count}: every shard takes an equal share of each global batch, since shares that"
          " differ read the order at different rates and drift apart in it (records trained on"
          f" unequally often); use global_batch_size={near}")
    self._dataset = dataset
    self._length = len(dataset)
    self._inner_lengths = _inner_lengths(dataset)
    self._index, self._count = shard_index, shard_count
    self._batch_size = global_batch_size // shard_count
    self._read_options = read_options
    self._drop_remainder = drop_remainder
    self._batch_fn = batch_lib.make_batch if batch_fn is None else batch_fn
    self._order = order_lib.initial(self._length)
    self._order_lists = order_lib.to_lists(self._order)
    self._place = 0                   # how many of this shard's positions it has handed out
    self._dropped = 0                 # positions a filter dropped since the last record kept
    self._max_dropped = max(_DROPPED_IN_A_ROW, 1000 * self._batch_size)
    self._pending = collections.deque()  # the read chunk's positions not handed out yet
    self._chunks = None               # grain's iterator of chunks, started by the first next()

  @property
  def batch_size(self) -> int:
    """Records in each of this shard's batches: ``global_batch_size // shard_count`` (the last
    one of a finite pass may be shorter)."""
    return self._batch_size

  def __iter__(self) -> ElasticIterator:
    return self

  def __next__(self) -> Any:
    if self._chunks is None:
      self._chunks = self._read()
    records = []
    while len(records) < self._batch_size:
      if not self._pending:
        chunk = next(self._chunks, None)
        if chunk is None:
          break
        self._pending.extend(chunk)
      record = self._pending.popleft()
      self._place += 1
      if record is not None:  # None: a record a filter dropped
        records.append(record)
        self._dropped = 0
        continue
      self._dropped += 1
      if self._dropped >= self._max_dropped:
        raise ValueError(
            f"shard {self._index} of {self._count} read {self._dropped} positions in a row that"
            f" the filter dropped (its positions {self._place - self._dropped} to"
            f" {self._place - 1}), with no record to return: the filter keeps nothing of this"
            " shard's positions. Shard k of n reads every n-th position of the order, so a"
            " dataset periodic in that stride gives a shard a part of it only: MapDataset.mix"
            " without a shuffle interleaves its sources in a fixed period (a, b, a, b...), and"
            " shard 0 of 2 reads only a. Shuffle after mixing (MapDataset.mix(...).shuffle(seed)"
            " before the filter), or use a filter that keeps records of every source.")
    if not records or (self._drop_remainder and len(records) < self._batch_size):
      raise StopIteration
    return self._batch_fn(records)

  def _read(self):
    """grain's iterator over this shard's positions from its place on, a chunk at a time.

    Each chunk is one batch's worth of positions (a filter makes some None),
    read by grain's prefetch threads as the chunks of a ``MapDataset.batch``
    are (grain refuses that ``batch`` after a ``filter``): the threads work a
    chunk at a time, and this shard's place stays exact to the record.
    """
    ranges = order_lib.shard_ranges(self._order, self._index, self._count)
    views = [self._dataset[r.start:r.stop:r.step] for r in ranges] or [self._dataset[0:0]]
    view = views[0] if len(views) == 1 else grain.MapDataset.concatenate(views)
    stop = self._pass_length()
    starts = grain.MapDataset.range(self._place, stop, self._batch_size)
    chunks = starts.map(functools.partial(_chunk, view, self._batch_size, stop))
    return iter(chunks.to_iter_dataset(self._read_options))

  def _pass_length(self) -> int:
    """How many of its positions this shard reads in this order: no more batches than the shard
    with the fewest positions (the last) has left, so that without a filter every shard ends at
    the same step; the at most one position past that stays in the order.

    Counted from the place it is at, which every shard shares without a filter (counted from
    the order's start, a resume with another batch size, at a place no multiple of it, would
    leave the shards different numbers of steps).
    """
    fewest = order_lib.shard_length(self._order, self._count - 1, self._count)
    left = max(0, fewest - self._place)
    steps = (left // self._batch_size if self._drop_remainder
             else -(-left // self._batch_size))
    mine = order_lib.shard_length(self._order, self._index, self._count)
    return min(mine, self._place + steps * self._batch_size)

  def get_state(self) -> dict[str, Any]:
    """This shard's state: the order (the same on every shard) and its place in it."""
    return {"shard_index": self._index, "shard_count": self._count, "position": self._place,
            "order": [list(t) for t in self._order_lists], "length": self._length,
            "inner_lengths": list(self._inner_lengths)}

  def set_state(self, state: dict[str, Any]) -> None:
    """Moves this shard to ``state``, a state this same shard (index and count) saved.

    Raises:
      ValueError: ``state`` is malformed, or was saved by another shard or
        shard count (hand every old process's state to
        :meth:`set_state_from_shards` instead).
    """
    order = self._check(state, state.get("shard_count") if isinstance(state, dict) else None,
                        state.get("shard_index") if isinstance(state, dict) else None)
    if (state["shard_index"], state["shard_count"]) != (self._index, self._count):
      raise ValueError(
          f"this state was saved by shard {state['shard_index']} of {state['shard_count']}, and"
          f" this is shard {self._index} of {self._count}: pass every old process's state, in"
          " any order, to set_state_from_shards(states) (CheckpointCallback does so).")
    self._restart(order, state["position"])

  def set_state_from_shards(self, states: Sequence[dict[str, Any]]) -> None:
    """Resumes from the states every old process saved at one step, one state a process.

    The old shard count is the states' own ``shard_count``: several processes
    may have read replicas of one shard (the data replicated across processes
    whose model is split), so the states are grouped by ``shard_index``, in
    any order, and replicas of a shard count once. On the same shard count
    this shard continues from its own state; on another one, the positions no
    old shard read come first, then the rest of the order, and every record is
    delivered exactly once.

    Raises:
      ValueError: the states are malformed, name different shard counts, lack
        a shard, hold replicas of one shard that differ, or hold different
        orders or other dataset lengths (the dataset's, or those of the finite
        datasets under its ``repeat()``).
    """
    if not isinstance(states, (list, tuple)) or not states:
      raise ValueError(f"set_state_from_shards needs the list of every old process's state; got"
                       f" {states!r:.200}")
    for state in states:
      self._check_keys(state)
    counts = sorted({repr(s["shard_count"]) for s in states})
    count = states[0]["shard_count"]
    if len(counts) > 1 or type(count) is not int or count < 1:
      raise ValueError(f"the states name different shard counts [{', '.join(counts)}] (one int"
                       " >= 1 expected): they were not saved at one step of one run")
    by_shard: dict[Any, list[dict[str, Any]]] = {}
    for state in states:
      by_shard.setdefault(state["shard_index"], []).append(state)
    stray = [k for k in by_shard if type(k) is not int or not 0 <= k < count]
    if stray:
      raise ValueError(f"shard_index {stray[0]!r} is outside the shards [0, {count}) of {count}")
    missing = [k for k in range(count) if k not in by_shard]
    if missing:
      raise ValueError(f"the states are the states of shards {sorted(by_shard)} of {count}:"
                       f" shard(s) {missing} missing; pass the state of every old process (the"
                       " checkpoint's data item holds them all)")
    differ = sorted(k for k, replicas in by_shard.items()
                    if any(r != replicas[0] for r in replicas))
    if differ:
      raise ValueError(f"the states of replicas of shard(s) {differ} differ: processes reading"
                       " one shard read its positions in step, so these were not saved at one"
                       " step of one run over one dataset")
    mine = [by_shard[k][0] for k in range(count)]
    orders = [self._check(s, count, k) for k, s in enumerate(mine)]
    if any(o != orders[0] for o in orders):
      raise ValueError("the shards' states hold different data orders: they were not saved at the"
                       " same step of one run")
    if count == self._count:
      self._restart(orders[0], mine[self._index]["position"])
    else:
      self._restart(order_lib.resume_order(orders[0], [s["position"] for s in mine]), 0)

  def _check_keys(self, state: Any) -> None:
    if not isinstance(state, dict) or any(k not in state for k in _KEYS):
      raise ValueError(f"an ElasticIterator state is a dict with keys {list(_KEYS)}; got"
                       f" {state!r:.200}")

  def _check(self, state: Any, count: Any, index: Any) -> order_lib.Order:
    """The order of ``state`` after checking every field (a state file is hostile input)."""
    self._check_keys(state)
    if state["length"] != self._length:
      raise ValueError(f"the state was saved over a dataset of {state['length']} records and this"
                       f" one has {self._length}: an elastic position is a place in one dataset's"
                       " order; " + _SAME_DATASET)
    if "inner_lengths" in state and state["inner_lengths"] != self._inner_lengths:
      raise ValueError(f"the state was saved over a dataset whose datasets under repeat() hold"
                       f" {state['inner_lengths']!r:.200} records and this one's"
                       f" {self._inner_lengths}: an elastic position is a place in one dataset's"
                       " order, and under repeat() its length is endless whatever the sources"
                       " hold; " + _SAME_DATASET)
    if state["shard_count"] != count or state["shard_index"] != index:
      raise ValueError(f"expected the state of shard {index} of {count}; got shard"
                       f" {state['shard_index']!r} of {state['shard_count']!r}")
    order = order_lib.from_lists(state["order"])
    if any(r and r[-1] >= self._length for r in order):
      raise ValueError(f"the state's order names positions past the dataset's {self._length}")
    limit = order_lib.shard_length(order, index, count)
    if type(state["position"]) is not int or not 0 <= state["position"] <= limit:
      raise ValueError(f"shard {index} of {count}: position {state['position']!r} is outside"
                       f" [0, {limit}]")
    return order

  def _restart(self, order: order_lib.Order, place: int) -> None:
    self.close()
    self._order, self._order_lists, self._place = order, order_lib.to_lists(order), place
    self._dropped = 0

  def close(self) -> None:
    """Stops grain's prefetch threads (the next ``next()`` starts them again where it stood)."""
    if self._chunks is not None:
      self._chunks.close()
      self._chunks = None
    self._pending.clear()  # read ahead, not counted in the place: read again after a restart


def _inner_lengths(dataset: grain.MapDataset) -> list[int]:
  """The lengths of the finite datasets that an endless one (``repeat()``) reads, in the order of
  a walk of grain's ``parents`` from ``dataset``: what an endless length hides."""
  lengths, seen, todo = [], set(), [dataset]
  while todo:
    ds = todo.pop()
    if id(ds) in seen:
      continue
    seen.add(id(ds))
    parents = [p for p in getattr(ds, "parents", ()) if isinstance(p, grain.MapDataset)]
    if len(ds) >= sys.maxsize:
      lengths += [len(p) for p in parents if len(p) < sys.maxsize]
    todo += reversed(parents)
  return lengths


def _chunk(view: grain.MapDataset, size: int, stop: int, start: int) -> list[Any]:
  """Positions ``start``... of ``view``, ``size`` of them (fewer at ``stop``); None: filtered."""
  return [view[i] for i in range(start, min(start + size, stop))]
