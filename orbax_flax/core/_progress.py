"""Progress of long work, shown on a terminal and watched by a watchdog, and its words.

A :class:`Progress` is what a save, restore, verify or conversion updates as
it goes (phase, bytes done of bytes total). :class:`Monitor` watches one in a
daemon thread:

* on a terminal (stderr is a TTY), once the work has taken more than a few
  seconds, it draws one line with bytes done, GB/s and the time left; in logs
  and CI (no terminal) it draws nothing;
* as a watchdog, once the work has taken longer than ``watchdog_seconds``,
  it logs the phase, bytes done and RSS, and the Python stacks of every thread
  (once), then the phase and bytes again every ``watchdog_seconds``: a stuck
  job explains itself instead of sitting silent for hours.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("orbax_flax")

SHOW_AFTER_S = float(os.environ.get("ORBAX_FLAX_PROGRESS_AFTER", "3"))  # shorter work: no line


def human_bytes(n: float) -> str:
  """Bytes for a person, as every log line and listing writes them.

  >>> human_bytes(1536)
  '1.5 KiB'
  """
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"


def say(message: str, *args) -> None:
  """Logs an event a user expects to see (a resume, a preemption save) at INFO, and prints it
  to stderr too when logging is not set up (Python then shows only warnings).

  Example (without logging set up, stderr gets ``orbax_flax: restored step 10``):
    >>> say("restored step %d", 10)
  """
  log.info(message, *args)
  if not log.hasHandlers():  # logging not set up: print what a user expects to see
    print("orbax_flax: " + (message % args if args else message), file=sys.stderr, flush=True)


def once_per_job_level() -> int:
  """The level of a line every process of a job logs alike (a step committed): INFO on
  process 0, DEBUG on the others, so that a job of N processes shows it once, not N times.

  Example:
    >>> import logging
    >>> once_per_job_level() == logging.INFO  # one process: process 0
    True
  """
  jax = sys.modules.get("jax")  # not imported here: the CLI's --help stays light
  if jax is None or jax.process_index() == 0:
    return logging.INFO
  return logging.DEBUG


class Progress:
  """Mutable progress of one piece of work; updated by the worker threads."""

  def __init__(self, what: str, total: int = 0, clock: Callable[[], float] = time.monotonic):
    self.what, self.total, self.done, self.phase = what, total, 0, "starting"
    self._clock = clock
    self.start = clock()
    self._lock = threading.Lock()

  def add(self, n: int) -> None:
    with self._lock:
      self.done += n

  def elapsed(self) -> float:
    return self._clock() - self.start

  def line(self) -> str:
    """``what: phase, 1.20 of 4.00 GiB (30%), 0.8 GB/s, 4 s left``."""
    elapsed = max(self.elapsed(), 1e-9)
    rate = self.done / elapsed
    parts = [f"{self.what}: {self.phase}"]
    unit, div = ("GiB", 2**30) if max(self.total, self.done) >= 2**30 else ("MiB", 2**20)
    if self.total:
      pct = 100 * self.done / self.total
      parts.append(f"{self.done / div:.2f} of {self.total / div:.2f} {unit} ({pct:.0f}%)")
      if rate > 0 and self.done < self.total:
        parts.append(f"{rate / 1e9:.2f} GB/s, {(self.total - self.done) / rate:.0f} s left")
    elif self.done:
      parts.append(f"{self.done / div:.2f} {unit}, {rate / 1e9:.2f} GB/s")
    return ", ".join(parts)


def _rss() -> str:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return f"{int(line.split()[1]) / 2**20:.2f} GiB"
  except OSError:
    pass
  return "unknown"


def thread_stacks() -> str:
  """The Python stack of every thread of this process, as text."""
  names = {t.ident: t.name for t in threading.enumerate()}
  out = []
  for ident, frame in sys._current_frames().items():  # pylint: disable=protected-access
    out.append(f"--- thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
  return "\n".join(out)


class Monitor:
  """Shows ``progress`` on a terminal and logs it (with thread stacks) if it runs long.

  Use as a context manager around the work. ``terminal`` None: draw only when
  stderr is a TTY and ``ORBAX_FLAX_PROGRESS`` is not "0".

  Example:
    >>> p = Progress("restore", total=100)
    >>> with Monitor(p, watchdog_seconds=0, terminal=False):
    ...   p.add(100)
    >>> p.done
    100
  """

  def __init__(self, progress: Progress, watchdog_seconds: float = 0.0,
               terminal: bool | None = None, interval: float = 0.5, stream=None):
    self.progress, self.watchdog_seconds = progress, watchdog_seconds
    if terminal is None:
      terminal = (os.environ.get("ORBAX_FLAX_PROGRESS", "1") != "0"
                  and getattr(sys.stderr, "isatty", lambda: False)())
    self.terminal, self.interval = terminal, interval
    self.stream = stream if stream is not None else sys.stderr
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._drawn = False

  def __enter__(self) -> Monitor:
    if self.terminal or self.watchdog_seconds:
      self._thread = threading.Thread(target=self._watch, name="orbax_flax-progress", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    if self.terminal and not self._drawn and self.progress.elapsed() >= SHOW_AFTER_S:
      self.stream.write(self.progress.line())  # finished before the first tick: show it once
      self._drawn = True
    if self._drawn:
      self.stream.write("\r\033[K")
      self.stream.flush()

  def _watch(self) -> None:
    next_watch = self.watchdog_seconds or None
    stacks_logged = False
    while not self._stop.wait(self.interval):
      elapsed = self.progress.elapsed()
      if self.terminal and elapsed >= SHOW_AFTER_S:
        self.stream.write("\r\033[K" + self.progress.line())
        self.stream.flush()
        self._drawn = True
      if next_watch is not None and elapsed >= next_watch:
        log.warning("WATCHDOG: %s still running after %.0f s (watchdog_seconds=%g): %s; RSS %s",
                    self.progress.what, elapsed, self.watchdog_seconds, self.progress.line(), _rss())
        if not stacks_logged:
          log.warning("WATCHDOG: Python stacks of every thread:\n%s", thread_stacks())
          stacks_logged = True
        next_watch += self.watchdog_seconds
