"""One process of a job running the training callback with the local tier (for tests/test_tier_holes.py).

--spy: records the fsyncs, renames and replaces under the local directory and prints them (SPY <json>).
"""
import argparse, json, os
import numpy as np
import jobs


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir"); p.add_argument("--policy"); p.add_argument("--last", type=int)
  p.add_argument("--tag", type=float); p.add_argument("--spy", action="store_true")
  p.add_argument("--fail_replica_on", type=int, default=-1)
  a = jobs.join(p)
  import jax  # noqa: E402
  import orbax_flax as ofx  # noqa: E402
  policy = json.loads(a.policy)
  events = []
  if a.spy:
    import disks  # noqa: E402
    for name, spy in disks.durability_spies(events).items():
      setattr(os, name, spy)
  if a.fail_replica_on == jax.process_index():  # a write error (EIO) on the replica file only
    import errno  # noqa: E402
    from orbax_flax.tiers import _blob  # noqa: E402
    real_pwrite = _blob.pwrite

    def pwrite(fd, data, offset):
      if "replica-" in os.readlink(f"/proc/self/fd/{fd}"):
        raise OSError(errno.EIO, "injected write error")
      return real_pwrite(fd, data, offset)
    _blob.pwrite = pwrite
  with ofx.CheckpointCallback(a.workdir, ofx.CheckpointPolicy(**policy)) as ckpt:
    state = ckpt.restore_or_init({"w": np.zeros(3), "run": np.zeros(1)})
    print("RESTORED", ckpt.restored_step, float(state["run"][0]), flush=True)
    for step in range((ckpt.restored_step or 0) + 1, a.last + 1):
      state = {"w": np.full(3, float(step)), "run": np.full(1, a.tag)}
      ckpt.on_step_end(step, state)
  if a.spy:
    local = os.path.realpath(policy["local_directory"])
    print("SPY", json.dumps([e for e in events if any(str(x).startswith(local) for x in e[1:])]),
          flush=True)
  print("DONE", flush=True)


if __name__ == "__main__":
  main()
