"""One process of a 2-process fine-tune whose ``init_from`` is a pretraining run's workdir.

``--case=race``: once every process has looked for a run to resume, process 0 goes on at
once and, a second later, the pretraining run commits step 20 beside step 10 (a rename into
place); process 1 goes on two seconds late. ``--case=refused``: process 1's init_from names a part the run does not hold
(its config differs). Prints ``VALUES <the distinct kernel values>`` or
``REFUSED <type>: <message>``, and how long the restore took.
"""

import argparse
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--root")
  p.add_argument("--case")
  a = jobs.join(p, heartbeat_timeout_seconds=30)
  model = nn.Dense(16)
  mesh = jax.make_mesh((jax.device_count(),), ("model",))
  shapes = jax.eval_shape(model.init, jax.random.key(1), jnp.ones((1, 8)))
  shardings = jax.tree.map(
      lambda x: NamedSharding(mesh, P(None, "model") if x.ndim == 2 else P()), shapes)
  params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(1), jnp.ones((1, 8)))
  fresh = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
  donor = os.path.join(a.root, "donor")
  init_from = donor if a.case == "race" or a.process_id == 0 else f"{donor}:no_such_item"
  began = time.monotonic()
  try:
    with ofx.CheckpointCallback(os.path.join(a.root, "finetune"), {"init_from": init_from}) as ck:
      if a.case == "race":  # from the moment every process has looked for a run to resume
        from orbax_flax.core import _multihost  # pylint: disable=g-import-not-at-top
        real_together = _multihost.together

        def together(key, *args, **kwargs):
          out = real_together(key, *args, **kwargs)
          if "/resume-look/" in key:
            if a.process_id == 0:
              commit = lambda: os.rename(os.path.join(a.root, "staged20"),
                                         os.path.join(donor, "checkpoints", "20"))
              threading.Timer(1.0, commit).start()
            else:
              time.sleep(2.0)
          return out
        _multihost.together = together
      state = ck.restore_or_init(fresh)
      kernel = multihost_utils.process_allgather(state.params["params"]["kernel"], tiled=True)
      print("VALUES", sorted(set(np.unique(np.asarray(kernel)).tolist())), flush=True)
  except Exception as e:  # pylint: disable=broad-except
    print(f"REFUSED {type(e).__name__}: {e}", flush=True)
  print(f"TOOK {time.monotonic() - began:.1f}", flush=True)
  jobs.exit_together()


if __name__ == "__main__":
  main()
