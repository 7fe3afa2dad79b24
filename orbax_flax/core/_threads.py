"""Work spread over a few threads, or done in the calling thread once the interpreter exits.

Large saves and restores copy, hash, read and write on a short-lived pool of threads (the work
releases the GIL): :func:`parallel_map`, the one place where orbax_flax hands work to a pool.

Once the interpreter has begun to exit, no pool takes new work: threading's exit step runs
before every ``atexit`` hook, and ``concurrent.futures`` refuses from then on ("cannot schedule
new futures after interpreter shutdown", or "can't register atexit after shutdown" where its
thread pool module was never imported). A job that saves its last checkpoint in an ``atexit``
hook (``atexit.register(manager.close)``, a save in flight when the script ends) would lose it;
so at exit :func:`parallel_map` makes the same calls one after the other in the calling thread:
slower, the same result.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")


def exiting() -> bool:
  """True once the interpreter has begun to exit (an ``atexit`` hook runs): no pool takes work.

  Threading's exit step marks the main thread ended before the ``atexit`` hooks run;
  ``concurrent.futures`` stops taking work in that same step.
  """
  return sys.is_finalizing() or not threading.main_thread().is_alive()


def parallel_map(fn: Callable[[_T], _R], items: Iterable[_T], threads: int, *,
                 name: str = "orbax_flax", wake: Callable[[], None] | None = None) -> list[_R]:
  """``[fn(x) for x in items]``, the calls spread over up to ``threads`` threads.

  The first call to fail ends the run: calls not begun are dropped, ``wake`` (if given)
  is called so that those still running can stop early (they watch what it sets), and
  the first error is raised once they have ended. An interrupt of the calling thread
  ends it the same way. With one item or one thread, or once the interpreter has begun
  to exit (:func:`exiting`), the calls are made in order in the calling thread, and the
  first error ends them.

  Args:
    fn: called once per item; its errors are raised here, never swallowed.
    items: the arguments, one per call.
    threads: the most threads to use.
    name: the threads' name prefix.
    wake: called when the run ends with calls still running.

  Returns:
    The results, in the order of ``items``.

  Example:
    >>> parallel_map(lambda x: x * x, [1, 2, 3], threads=2)
    [1, 4, 9]
  """
  items = list(items)
  n = min(threads, len(items))
  if n <= 1 or exiting():
    return [fn(x) for x in items]
  pool = None
  futures: list[concurrent.futures.Future] = []
  try:
    try:
      pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix=name)
      for x in items:
        futures.append(pool.submit(fn, x))
    except RuntimeError as e:
      if not _refused_at_exit(e):
        raise
      # The interpreter began to exit since the check above: the rest are done here, below.
    for f in concurrent.futures.as_completed(futures):
      f.result()  # the first to fail raises (what fails after it follows from it)
    rest = [fn(x) for x in items[len(futures):]]
  finally:
    if wake is not None and not all(f.done() for f in futures):
      wake()
    if pool is not None:
      pool.shutdown(wait=True, cancel_futures=True)
  return [f.result() for f in futures] + rest


def _refused_at_exit(e: RuntimeError) -> bool:
  """Whether a pool refused work because the interpreter exits.

  The pool module's first import (which the ``concurrent.futures`` package makes lazily,
  at the first pool) and ``submit`` raise it. A thread other than the main one may ask
  while the main thread is between threading's exit steps, before :func:`exiting` says
  so: the message is the only sign then.
  """
  return exiting() or "shutdown" in str(e)
