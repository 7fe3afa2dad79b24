"""Two processes at a rendezvous, where process 1's arrival is cut short after its report.

``_multihost.arrive`` sets the process's report, then counts it in (the last one also
marks the rendezvous complete). A process killed between those calls leaves its report
without the count. Process 1 does exactly that, on purpose (it sets its report alone);
process 0 arrives normally and gathers, and prints what its gather returned or raised.
"""

import argparse

import jax

import jobs
from orbax_flax.core import _multihost

KEY = "cut/rendezvous"


def main():
  a = jobs.join(argparse.ArgumentParser())
  if jax.process_index() == 1:
    _multihost.publish(f"{KEY}/v/1", "report-1", timeout_s=30)  # arrive()'s first call, alone
    _multihost.publish("cut/reported", "1", timeout_s=30)
  else:
    _multihost.fetch("cut/reported", 30)
    _multihost.arrive(KEY, "report-0", timeout_s=30)
    try:
      print(f"RESULT {_multihost.gather(KEY, 2.0)}", flush=True)
    except Exception as e:  # pylint: disable=broad-except
      print(f"RESULT {type(e).__name__}: {e}", flush=True)
  del a
  jobs.exit_together(60)


if __name__ == "__main__":
  main()
