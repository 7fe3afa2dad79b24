"""The position of the batches a training loop consumed, around a prefetching iterator.

``flax.jax_utils.prefetch_to_device(source, 2)`` (or any loader that reads
ahead into a queue) takes batches from ``source`` before the loop uses them. A
checkpoint that forwards ``source.get_state()`` then records a position a few
batches *past* the last one trained on, and a resume silently skips them.
:class:`Prefetched` wraps the source and the prefetching: its ``get_state()``
is the source's position right after the last batch the loop took out, and
``set_state`` moves the source there and starts the read-ahead again (at the next
``next()``). A source
without ``get_state`` is counted: its position is the number of batches
consumed, and ``set_state`` skips that many batches of a fresh source.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from orbax_flax.training import resume


class Prefetched:
  """An iterator over ``prefetch(source)`` whose state is what the loop consumed.

  Args:
    source: the iterator the batches come from: with ``get_state()`` /
      ``set_state(state)`` (grain's, your own), or a function returning a
      fresh iterator (then the position is a count of batches, and a resume
      skips that many of a fresh one).
    prefetch: turns an iterator into the reading-ahead one, e.g.
      ``lambda it: flax.jax_utils.prefetch_to_device(it, 2)``.

  Hand the :class:`Prefetched` (not the source) to the checkpoint callback as
  the data iterator, and train on what it yields.

  Example:
    >>> class Source:
    ...   def __init__(self): self.i = 0
    ...   def __next__(self): self.i += 1; return self.i
    ...   def __iter__(self): return self
    ...   def get_state(self): return {"i": self.i}
    ...   def set_state(self, s): self.i = s["i"]
    >>> def ahead(it):                 # reads 3 batches ahead, like prefetch_to_device
    ...   queue = collections.deque()
    ...   for x in it:
    ...     queue.append(x)
    ...     if len(queue) > 3: yield queue.popleft()
    >>> data = Prefetched(Source(), ahead)
    >>> next(data), next(data), data.get_state()     # the source has read 6
    (1, 2, {'i': 2})
    >>> data.set_state({"i": 1}); next(data)
    2
  """

  def __init__(self, source: Any, prefetch: Callable[[Iterator[Any]], Iterable[Any]]):
    self._stateful = hasattr(source, "get_state") and hasattr(source, "set_state")
    if not self._stateful and not callable(source):
      raise TypeError(
          f"Prefetched(source=...): a {type(source).__name__} has no get_state()/set_state(),"
          " so its position cannot be restored; pass an iterator that has them (grain's), or"
          " a function returning a fresh iterator (the position is then a count of batches)")
    self._source = source
    self._prefetch = prefetch
    # A copy of each state the source gives: its get_state() may hand out its own live dict,
    # which the read-ahead's next batches would change under the position recorded.
    self._state = copy.deepcopy(source.get_state()) if self._stateful else 0
    self._it: Iterator[Any] | None = None  # the read-ahead, started by the first next()
    self._after: collections.deque = collections.deque()  # source state after each batch read
    self._generation = 0  # of the read-ahead: one that a set_state replaced reads no more
    # Held around each read from the source and each move of it: a read-ahead on a thread
    # of its own that a set_state replaced may be inside the source's next() at that moment;
    # the move waits for that read, after which the old read-ahead reads no more.
    self._lock = threading.RLock()

  def _start(self) -> None:
    """Reads ahead from ``self._state``: the source there, and a new prefetching iterator.

    Started by the first ``next()``, not when built or restored: a read-ahead that runs on
    a thread of its own (a background queue) cannot be stopped, and one started before
    ``set_state`` would move the source under the restored position.
    """
    with self._lock:
      self._generation += 1
      self._after = collections.deque()
      if self._stateful:
        self._source.set_state(copy.deepcopy(self._state))
    if self._stateful:
      it = self._source
    else:
      it = iter(self._source())
      for _ in range(self._state):
        next(it)
    self._it = iter(self._prefetch(self._reading(it, self._after, self._generation)))

  def _reading(self, it: Iterator[Any], after: collections.deque,
               generation: int) -> Iterator[Any]:
    """The source's batches, each with its position in ``after``; ends once a ``set_state``
    started another read-ahead (then its source position belongs to the new one)."""
    count = self._state if not self._stateful else None
    while True:
      with self._lock:
        if generation != self._generation:
          return
        try:
          batch = next(it)
        except StopIteration:
          return
        if self._stateful:
          after.append(copy.deepcopy(self._source.get_state()))
        else:
          count += 1
          after.append(count)
      yield batch

  def __iter__(self) -> Prefetched:
    return self

  def __next__(self) -> Any:
    if self._it is None:
      self._start()
    batch = next(self._it)
    self._state = self._after.popleft()  # the position right after the batch handed out
    return batch

  @property
  def checkpoint_state_is_global(self) -> bool:
    """The source's answer: its position is one for every process (see ``DataPosition``)."""
    return self._stateful and resume.state_is_global(self._source)

  @property
  def checkpoint_state_is_elastic(self) -> bool:
    """The source's answer: it resumes from every old process's state on any process count
    (:meth:`set_state_from_shards`; e.g. :class:`orbax_flax.data.ElasticIterator`)."""
    return self._stateful and resume.state_is_elastic(self._source)

  def set_state_from_shards(self, states: list[Any]) -> None:
    """Hands every old process's state to the source (an elastic one), then reads ahead from
    where the source then stands.

    Raises:
      TypeError: the source is not elastic (no ``set_state_from_shards``).
    """
    if not self.checkpoint_state_is_elastic:
      raise TypeError(f"Prefetched.set_state_from_shards: the source"
                      f" ({type(self._source).__name__}) is not elastic (it does not set"
                      " checkpoint_state_is_elastic = True); use set_state(state)")
    with self._lock:  # (a replaced read-ahead's read in flight ends first)
      self._generation += 1
      self._source.set_state_from_shards(list(states))
      self._restart_at(copy.deepcopy(self._source.get_state()))

  def get_state(self) -> Any:
    """The source's position after the last batch this iterator handed out."""
    return self._state

  def set_state(self, state: Any) -> None:
    """Continues after the batch ``state`` was taken at; the read-ahead starts again there."""
    if not self._stateful and (isinstance(state, bool) or not isinstance(state, int) or state < 0):
      raise ValueError(f"Prefetched.set_state({state!r}): a counted source's state is the"
                       " number of batches consumed (an int >= 0)")
    self._restart_at(state)

  def _restart_at(self, state: Any) -> None:
    """The next ``next()`` reads ahead from ``state``; the current read-ahead reads no more."""
    with self._lock:
      self._generation += 1
      self._it = None
      self._state = state
