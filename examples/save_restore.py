"""Save a sharded Flax/Optax train state asynchronously, then restore it onto another mesh.

    python examples/save_restore.py --workdir=/tmp/ofx_example

On a CPU-only machine it simulates 8 devices.
"""

import os
import shutil
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_flax as ofx  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/ofx_example", "Where to write the checkpoint.")


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(1024)(x))
    return nn.Dense(256)(x)


def sharded_state(mesh):
  """A TrainState whose matrices are sharded over the mesh's "model" axis."""
  model = MLP()
  params = model.init(jax.random.key(0), jnp.ones((1, 512)))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

  def shard(x):
    spec = P(None, "model") if x.ndim == 2 else P()
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree.map(shard, state.replace(step=jnp.int32(0)))


def main(argv):
  del argv
  path = os.path.join(_WORKDIR.value, "ckpt")
  shutil.rmtree(path, ignore_errors=True)
  mesh = jax.make_mesh((1, jax.device_count()), ("data", "model"))
  state = sharded_state(mesh)

  start = time.perf_counter()
  handle = ofx.save_async(path, {"state": state, "extra": {"epoch": 3, "note": "example"}})
  print(f"save_async returned after {time.perf_counter() - start:.3f} s; training could go on")
  handle.wait()
  print(f"committed {path} in {handle.total_s:.3f} s")
  print(ofx.metadata(path))

  # Restore onto another mesh: half the devices, sharded along the other axis.
  other = jax.make_mesh((jax.device_count() // 2,), ("x",), devices=jax.devices()[: jax.device_count() // 2])
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
          other, P("x") if x.ndim == 2 else P())), state)  # an abstract TrainState
  restored = ofx.restore(path, {"state": target, "extra": {"epoch": 0, "note": ""}})
  for a, b in zip(jax.tree.leaves(restored["state"]), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  kernel = restored["state"].params["params"]["Dense_0"]["kernel"]
  print(f"restored onto {kernel.sharding}; values identical; extra = {restored['extra']}")

  # Inference needs the parameters only: read just those.
  params = ofx.restore(path, {"state": {"params": target.params}}, partial=True)["state"]["params"]
  print(f"params-only restore: {sum(x.size for x in jax.tree.leaves(params))} parameters")
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
