"""A restart in the least time: the compile cache, the background restore, the restart's clock.

What a preempted job loses is the whole restart, from process start to its
first train step done on the restored state, and the restore is often the
smallest part of it (start-up and compiling the train step again are the rest).
Three pieces shorten and measure it; :class:`orbax_flax.CheckpointCallback`
uses them:

* :func:`enable_compilation_cache` points JAX's persistent compilation cache
  at ``<workdir>/compilation_cache/<key>/``, the key naming the JAX version, the
  backend, the device kind and the device and process counts, so that a
  restarted job loads its compiled train step instead of compiling it, and a
  run on another mesh or JAX version never reads another's programs (JAX's own
  cache key also covers the program and its shardings).
* :class:`PendingRestore` runs a restore on a thread while the caller compiles
  its train step, so a cold restart costs about max(restore, compile).
* :class:`RestartClock` times the restart's parts: process start to the
  restore's start (imports, JAX start-up, model init), the restore, and the
  first train step (compile and run), with the compile cache's hits.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from orbax_flax.core import _progress
from orbax_flax.core._location import Location

log = logging.getLogger("orbax_flax")

CACHE_DIR = "compilation_cache"  # under the workdir


def compilation_cache_dir(workdir: str) -> str:
  """Where :func:`enable_compilation_cache` puts this job's cache under ``workdir``.

  One directory per JAX version, backend, device kind and device and process
  count: programs compiled by one never meet another (JAX would miss on them
  anyway, but its cache directory is also pruned by size, and a run on another
  mesh would evict this one's).

  Example:
    >>> compilation_cache_dir("/runs/a").startswith("/runs/a/compilation_cache/jax-")
    True
  """
  kind = re.sub(r"[^A-Za-z0-9.]+", "_", jax.devices()[0].device_kind).strip("_")
  key = (f"jax-{jax.__version__}-{jax.default_backend()}-{kind}"
         f"-{jax.device_count()}dev-{jax.process_count()}proc")
  return os.path.join(workdir, CACHE_DIR, key)


def enable_compilation_cache(workdir: str) -> str:
  """Points JAX's persistent compilation cache at this job's directory under ``workdir``.

  The setting is process-wide: every program compiled from now on is looked up
  there (and written there, by process 0 only, as JAX does, if it took at least
  ``jax_persistent_cache_min_compile_time_secs`` to compile, 1 s by default).
  A cache directory the user set already (``JAX_COMPILATION_CACHE_DIR`` or
  ``jax.config``) is kept, with a WARNING, and returned.

  Returns:
    The cache directory in use.

  Raises:
    ValueError: ``workdir`` is not on a filesystem (an object store URL): JAX's
      cache is a directory of files.
  """
  loc = Location.parse(workdir)
  if not loc.is_local:
    raise ValueError(
        f"compilation_cache=True needs a workdir on a filesystem (local, or a shared mount such"
        f" as NFS or GCSFuse), not {workdir!r}: JAX's compilation cache is a directory of files"
        f" that every process reads. Set compilation_cache=False, or point JAX at a filesystem"
        f" cache yourself with the JAX_COMPILATION_CACHE_DIR environment variable.")
  path = compilation_cache_dir(loc.local_path)
  current = jax.config.jax_compilation_cache_dir
  if current and os.path.abspath(current) != os.path.abspath(path):
    log.warning(
        "compilation_cache=True: JAX's compilation cache is already set to %s (by"
        " JAX_COMPILATION_CACHE_DIR or jax.config); keeping it, not using %s", current, path)
    return current
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  return path


class PendingRestore:
  """A restore running on a thread; :meth:`join` returns its result or raises its error.

  Built by :meth:`orbax_flax.CheckpointCallback.restore_or_init_async`. Until
  :meth:`join` returns, the state and the data iterator passed in belong to
  the restore: compile against their shapes (``train_step.lower(state,
  batch).compile()``), but do not run or donate them.

  Example:
    >>> pending = PendingRestore(lambda: 41 + 1)
    >>> pending.join()
    42
  """

  def __init__(self, run: Callable[[], Any], on_done: Callable[[Any], Any] | None = None,
               clock: RestartClock | None = None):
    self._run, self._on_done, self._clock = run, on_done, clock
    self._result: Any = None
    self._error: BaseException | None = None
    self._joined = False
    self._thread = threading.Thread(target=self._work, name="ofx-restore", daemon=True)
    self._thread.start()

  def _work(self) -> None:
    try:
      self._result = self._run()
      if self._clock is not None:  # when the bytes landed, not when the caller joins
        self._clock.restored()
    except BaseException as e:  # pylint: disable=broad-except  # re-raised by join()
      self._error = e

  def done(self) -> bool:
    """Whether the restore has finished (successfully or not)."""
    return not self._thread.is_alive()

  def join(self, timeout: float | None = None) -> Any:
    """Waits for the restore and returns the state (the restored one, or the one passed in).

    Args:
      timeout: seconds to wait (None: as long as it takes).

    Raises:
      TimeoutError: the restore did not finish within ``timeout``.
      Exception: the restore's own error, re-raised here.
    """
    self._thread.join(timeout)
    if self._thread.is_alive():
      raise TimeoutError(f"the restore is still running after {timeout} s")
    if self._error is not None:
      raise self._error
    if not self._joined:
      self._joined = True
      if self._on_done is not None:
        self._result = self._on_done(self._result)
    return self._result


_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits",
                 "/jax/compilation_cache/compile_requests_use_cache": "requests"}


class RestartClock:
  """The parts of a start or restart: start-up, restore, first train step.

  ``started`` is the process's start (from ``/proc``; None where unknown),
  :meth:`restore_began` and :meth:`restored` bracket the restore, and
  :meth:`first_step_done` ends the clock (the first train step computed).
  The compile cache's hits and misses in between are counted from JAX's
  monitoring events (every compile that asks the cache, and every hit).

  Example:
    >>> clock = RestartClock(started=None, clock=iter([1.0, 3.0, 10.0]).__next__)
    >>> clock.restore_began(); clock.joined(5); clock.first_step_done()
    >>> clock.line()
    'restart from step 5: restore 2.00 s, first train step 7.00 s (compile and run); process start to restore not measured'
    >>> sorted(clock.scalars())
    ['restart/first_step_s', 'restart/restore_s', 'restart/total_s']
  """

  def __init__(self, started: float | None = None, clock: Callable[[], float] = time.time):
    self._clock = clock
    self.started = started
    self.began: float | None = None
    self.restored_at: float | None = None
    self.joined_at: float | None = None
    self.background = False
    self.step: int | None = None
    self.finished_at: float | None = None
    # Whether the next train step ends the clock (a restore returned, no step seen yet): a
    # plain field, read at every step.
    self.timing_first_step = False
    self.cache_dir: str | None = None
    self.counts = {"hits": 0, "requests": 0}  # misses: requests - hits
    self._listening = False

  @classmethod
  def start(cls, workdir: str, compilation_cache: bool) -> RestartClock:
    """The clock of this process (from its start), with the compile cache on if asked."""
    clock = cls(started=process_start_time())
    if compilation_cache:
      clock.cache_dir = enable_compilation_cache(workdir)
    return clock

  def restore_began(self, background: bool = False) -> None:
    """The restore starts (``background``: on a thread, joined later by the caller)."""
    self.began, self.background = self._clock(), background
    if self.cache_dir is not None and not self._listening:
      jax.monitoring.register_event_listener(self._on_event)
      self._listening = True

  def restored(self) -> None:
    """The restore's bytes landed (a background restore; otherwise :meth:`joined` says it)."""
    self.restored_at = self._clock()

  def joined(self, step: int | None) -> None:
    """The caller has the state, restored from ``step`` (None: nothing to resume)."""
    self.joined_at, self.step = self._clock(), step
    if self.restored_at is None:
      self.restored_at = self.joined_at
    self.timing_first_step = self.finished_at is None

  def first_step_done(self, step: int | None = None, wait_for: Any = None,
                      writer: Any = None) -> None:
    """Ends the clock once ``wait_for`` (the first step's state and metrics) is computed; logs
    :meth:`line` and gives ``writer`` (a clu ``MetricWriter``) the :meth:`scalars` at ``step``."""
    jax.block_until_ready(wait_for)
    self.finished_at = self._clock()
    self.timing_first_step = False
    self._stop_listening()
    if step is None:
      return
    _progress.say("%s", self.line())
    if writer is not None:
      writer.write_scalars(step, self.scalars())

  def _on_event(self, event: str, **kwargs: Any) -> None:
    del kwargs
    name = _CACHE_EVENTS.get(event)
    if name is not None:
      self.counts[name] += 1

  def _stop_listening(self) -> None:
    if self._listening:
      self._listening = False
      try:
        jax.monitoring.unregister_event_listener(self._on_event)
      except (AssertionError, ValueError):  # already gone
        pass

  def close(self) -> None:
    self._stop_listening()

  @property
  def complete(self) -> bool:
    return None not in (self.began, self.restored_at, self.finished_at)

  def parts(self) -> dict[str, float]:
    """Seconds of each part measured: ``startup`` (process start to the restore's start),
    ``restore``, ``joined`` (a background restore: its start to the caller's ``join()``
    returning), ``first_step`` (the caller had the state to the first step computed) and
    ``total``."""
    out = {}
    if self.started is not None and self.began is not None:
      out["startup"] = self.began - self.started
    if self.began is not None and self.restored_at is not None:
      out["restore"] = self.restored_at - self.began
    if self.background and self.joined_at is not None:
      out["joined"] = self.joined_at - self.began  # a background restore: the caller's wait
    if self.joined_at is not None and self.finished_at is not None:
      out["first_step"] = self.finished_at - self.joined_at
    if self.finished_at is not None:
      out["total"] = self.finished_at - (self.started if self.started is not None else self.began)
    return out

  def line(self) -> str:
    """One line for the log, e.g. ``restart from step 50: process start to restore 4.1 s
    (imports, JAX, model init), restore 0.02 s, first train step 3.2 s (compile and run;
    compile cache: 1 hit), 7.3 s in all``."""
    p = self.parts()
    what = f"restart from step {self.step}" if self.step is not None else "start (nothing to resume)"
    bits = []
    if "startup" in p:
      bits.append(f"process start to restore {p['startup']:.2f} s (imports, JAX, model init)")
    bits.append(f"restore {p.get('restore', 0.0):.2f} s" + (
        f" (in the background, joined after {p['joined']:.2f} s)" if "joined" in p else ""))
    cache = ""
    if self.cache_dir is not None:
      hits = self.counts["hits"]
      misses = max(0, self.counts["requests"] - hits)
      cache = (f"; compile cache: {hits} hit{'s' * (hits != 1)}, {misses}"
               f" miss{'es' * (misses != 1)}")
    bits.append(f"first train step {p.get('first_step', 0.0):.2f} s (compile and run{cache})")
    tail = f", {p['total']:.2f} s in all" if "startup" in p else (
        "; process start to restore not measured")
    return f"{what}: " + ", ".join(bits) + tail

  def scalars(self) -> dict[str, float]:
    """The parts as TensorBoard scalars (``restart/startup_s``, ``restart/restore_s``, ...)."""
    out = {f"restart/{k}_s": v for k, v in self.parts().items()}
    if self.cache_dir is not None:
      out["restart/compile_cache_hits"] = float(self.counts["hits"])
    return out


def process_start_time() -> float | None:
  """This process's start, in ``time.time()`` seconds (10 ms resolution); None off Linux.

  Example:
    >>> t = process_start_time()
    >>> t is None or 0 <= time.time() - t < 10 ** 6
    True
  """
  try:
    with open("/proc/self/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
    with open("/proc/uptime", "rb") as f:
      uptime = float(f.read().split()[0])
    ticks = os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return None
  age = uptime - int(fields[19]) / ticks  # field 22 (starttime); fields[0] is field 3
  return time.time() - age
