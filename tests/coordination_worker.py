"""One process of a 3-process job in which process ``--stopped`` is stopped (SIGSTOP, by the
test) while the others call into the coordination service.

Every other process makes each call of :mod:`orbax_flax.core._multihost` with a 1 s
deadline, all at once from threads of their own, once the test says the process is
stopped (it creates ``--go``), and
prints one line per call: ``CALL <name> <outcome> missing=<list> | <message>``,
then ``DONE``. The test resumes the stopped process (SIGCONT) once
every other process is done: a call without a deadline would hang until then.
Process 0 hosts the coordination service: with it stopped every call gets no
answer; with another process stopped, the waits for that process time out.
"""

import argparse
import concurrent.futures
import os
import time

import jax

import jobs
from orbax_flax.core import _multihost

T = 1.0  # each call's deadline (coordination_timeout_seconds), seconds


def calls(stopped: int) -> dict:
  """The calls to make, by name: each must raise CoordinationTimeoutError naming ``stopped``."""
  me = jax.process_index()
  if stopped != 0:  # the service answers: only the waits for the stopped process time out
    def gather_after_arrive():
      _multihost.arrive("w/gather", "x", timeout_s=T)
      return _multihost.gather("w/gather", T)
    return {
        "fetch": lambda: _multihost.fetch(f"w/only-from/{stopped}", T, missing=[stopped]),
        "gather": gather_after_arrive,
        "all_gather": lambda: _multihost.all_gather("w/all_gather", "x", T),
    }
  return {  # process 0 is stopped: the service itself does not answer
      "namespace": lambda: _multihost.namespace("kind", "/some/dir", T),
      "publish": lambda: _multihost.publish(f"w/publish/{me}", "x", timeout_s=T),
      "claim": lambda: _multihost.claim("w/claim", f"{me}", timeout_s=T),
      "arrive": lambda: _multihost.arrive("w/arrive", "x", timeout_s=T),
      "leave": lambda: _multihost.leave("w/leave", timeout_s=T),
      "dir_get": lambda: _multihost.dir_get("w/dir", timeout_s=T),
      "try_fetch": lambda: _multihost.try_fetch("w/try", timeout_s=T),
      "delete": lambda: _multihost.delete("w/delete", timeout_s=T),
      "absent": lambda: _multihost.absent("w/absent", timeout_s=T),
      "fetch": lambda: _multihost.fetch("w/fetch", T, missing=[0]),
      "broadcast": lambda: _multihost.broadcast("w/broadcast", None, T),
      "decide_per_step": lambda: _multihost.decide_per_step("w/decide", 5, lambda: "x",
                                                            timeout_s=T),
      "gather": lambda: _multihost.gather("w/gather0", T),
      "all_gather": lambda: _multihost.all_gather("w/all_gather0", "x", T),
  }


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--stopped", type=int)
  p.add_argument("--go")
  a = jobs.join(p, heartbeat_timeout_seconds=120)  # stopped for about 15 s
  _multihost.all_gather("w/ready", "1", 60)
  # No call of this process is in flight from here on: the test stops process --stopped
  # only once every process has said so (a process stopped while the service it hosts
  # answers another's call would hold that call).
  print(f"P{jax.process_index()} READY pid={os.getpid()}", flush=True)
  while not os.path.exists(a.go):  # the test creates it once the process is stopped
    time.sleep(0.02)
  if jax.process_index() != a.stopped:
    def make(name, call):
      start = time.monotonic()
      try:
        call()
        return f"CALL {name} returned"
      except Exception as e:  # pylint: disable=broad-except
        return (f"CALL {name} {type(e).__name__} missing={getattr(e, 'missing', None)}"
                f" after={time.monotonic() - start:.1f} | {e}")
    # Every call at once, each from its own thread (as a save, a lease refresh and the
    # preemption watcher call at once): each still ends within its own deadline.
    todo = calls(a.stopped)
    with concurrent.futures.ThreadPoolExecutor(len(todo)) as pool:
      for line in pool.map(lambda item: make(*item), todo.items()):
        print(line, flush=True)
    print("DONE", flush=True)
  jobs.exit_together(60)


if __name__ == "__main__":
  main()
