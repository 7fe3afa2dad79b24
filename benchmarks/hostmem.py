"""Peak host memory of one call: VmHWM after resetting it with ``clear_refs``.

The one copy of this measurement, shared by the benchmarks and the memory
tests (``tests/memory_worker.py``). Run each measured case in a fresh process:
freed memory the allocator keeps would make a later case look cheaper.
"""


def status(field: str) -> int:
  """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``, ...) in bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(field)


def reset_peak() -> int:
  """Resets the high-water mark to the current RSS; returns that RSS in bytes."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  return status("VmRSS")


def measure(fn):
  """``(extra peak bytes, result)`` of ``fn()``: VmHWM during it minus VmRSS before it."""
  before = reset_peak()
  out = fn()
  return status("VmHWM") - before, out
