r"""Train a small transformer language model with checkpointing, preemption handling and resume.

    python examples/train.py --workdir=/tmp/run --config=configs/default.py
    python examples/train.py --workdir=/tmp/run --config=configs/default.py --config.num_steps=200
    python -m orbax_flax.launch -n 2 --devices_per_process=4 -- examples/train.py --workdir=/tmp/run

Kill it (SIGTERM, or the signals in config.checkpoint.preemption_signals) and
start it again as often as you like: it resumes from the latest committed
step, on whatever devices and processes the new run has, and ends with the
same model an uninterrupted run would have. A preempted run saves, then exits
with status 143 (ofx.PREEMPTED_EXIT_CODE, 128 + SIGTERM), which schedulers
restart on; a finished run exits 0:

    until python examples/train.py --workdir=/tmp/run; do :; done To make Ctrl-C save and stop the
same way, add SIGINT:

    python examples/train.py --workdir=/tmp/run --config.checkpoint.preemption_signals="('SIGTERM','SIGINT')"

On a CPU-only machine it simulates 8 devices unless XLA_FLAGS says otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # lm.py, and configs/ for config files

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from orbax_flax import launch  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and logs.", required=True)
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(_HERE), "configs", "default.py"), "Training config file.")


def params_digest(params) -> str:
  """A short fingerprint of the parameters' exact bytes (same on every process)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256()
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    h.update(jax.tree_util.keystr(path).encode())
    h.update(np.asarray(multihost_utils.process_allgather(x, tiled=True)).tobytes())
  return h.hexdigest()[:16]


def metric_writer(workdir: str):
  """TensorBoard scalars in <workdir>/tensorboard, from process 0 (no TensorFlow needed)."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  if jax.process_index() > 0:
    return None
  return ofx.TensorBoardWriter(os.path.join(workdir, "tensorboard"))


class RecordLedger:
  """The ids of the records each step trained on, for the record check at the end of a run.

  Every process appends ``<run> <step> <ids...>`` lines to
  ``<workdir>/records/p<process>.txt``; ``<run>`` is the same on every process
  of a run. A step trained again after a resume counts from its latest run.
  """

  def __init__(self, workdir: str):
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    self.directory = os.path.join(workdir, "records")
    os.makedirs(self.directory, exist_ok=True)
    self.run = int(multihost_utils.broadcast_one_to_all(np.int64(time.time_ns())))
    self.step = 0
    self.file = open(os.path.join(self.directory, f"p{jax.process_index()}.txt"), "a")

  def start(self, step: int) -> None:
    self.step = step  # the next batch is for step + 1

  def __call__(self, ids) -> None:
    self.step += 1
    self.file.write(f"{self.run} {self.step} {' '.join(map(str, ids))}\n")
    self.file.flush()

  def check(self, last_step: int, batch_size: int) -> str:
    """Whether steps 1..last_step trained records 0..last_step x batch_size - 1, each once."""
    steps: dict[int, dict[int, list[int]]] = {}
    for name in sorted(os.listdir(self.directory)):
      with open(os.path.join(self.directory, name)) as f:
        for line in f:
          run, step, *ids = map(int, line.split())
          if step <= last_step:
            steps.setdefault(step, {}).setdefault(run, []).extend(ids)
    ids = [i for step in sorted(steps) for i in steps[step][max(steps[step])]]
    runs = len({max(runs) for runs in steps.values()})
    want = last_step * batch_size
    if sorted(steps) == list(range(1, last_step + 1)) and sorted(ids) == list(range(want)):
      return (f"RECORDS steps 1-{last_step} ({runs} run(s)): {want} records, ids 0-{want - 1},"
              " each trained on exactly once")
    twice = len(ids) - len(set(ids))
    return (f"RECORDS CHECK FAILED steps 1-{last_step}: {len(ids)} records, {twice} repeated,"
            f" {len(set(range(want)) - set(ids))} of ids 0-{want - 1} missing")


def train_and_evaluate(config, workdir: str) -> int:
  """Trains (resuming from ``workdir`` if it can); returns the process's exit status.

  0 when ``config.num_steps`` are done; ``ofx.PREEMPTED_EXIT_CODE`` when the
  run was preempted and its step committed: a restart resumes it.
  """
  import jax  # pylint: disable=g-import-not-at-top

  import lm  # pylint: disable=g-import-not-at-top
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top

  lm.check_batch_size(config)  # before anything is written to the workdir
  mesh = lm.make_mesh(config)
  logging.info("process %d/%d, %d devices, mesh %s", jax.process_index(), jax.process_count(),
               jax.device_count(), dict(mesh.shape))
  writer = metric_writer(workdir)
  # The callback first: with compilation_cache=True it turns JAX's compile cache on, so that
  # a restart loads the compiled init (1.7 s of compiling here) as well as the train step.
  ckpt = ofx.CheckpointCallback(workdir, config.checkpoint, writer=writer,
                                metadata={"config": config.to_dict()})
  state = lm.create_state(config, mesh)
  ledger = RecordLedger(workdir)
  data = lm.text_batches(config, mesh, ledger)  # ofx.data.ElasticIterator: resumes on any count

  class LogRestored(ofx.Callback):
    """Logs a fingerprint of the restored params (to compare with the saving run)."""

    def on_train_start(self, state, data):
      ledger.start(ckpt.restored_step or 0)
      if ckpt.restored_step is not None:
        logging.info("RESTORED step %d; params %s", ckpt.restored_step, params_digest(state.params))
      return state

  trainer = ofx.Trainer(lm.make_train_step(mesh, state),
                        callbacks=[ckpt, LogRestored(), ofx.LogProgress(config.log_every, writer)])
  try:
    state = trainer.fit(state, data, num_steps=config.num_steps)
  finally:
    if writer is not None:
      writer.close()
  step = int(state.step)
  digest = params_digest(state.params)
  data.close()
  if jax.process_index() == 0:
    logging.info("%s", ledger.check(step, config.batch_size))
  if ckpt.preempted:
    logging.info("PREEMPTED at step %d; params %s; restart to resume", step, digest)
    return ofx.PREEMPTED_EXIT_CODE  # not 0: a scheduler must restart the job
  logging.info("DONE at step %d; params %s", step, digest)
  return 0


def main(argv):
  del argv
  launch.initialize_from_env(heartbeat_timeout_seconds=int(os.environ.get("OFX_HEARTBEAT_S", "100")))
  logging.getLogger("orbax_flax").setLevel(logging.INFO)
  try:
    status = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except KeyboardInterrupt:
    print("interrupted (Ctrl-C); rerun the same command to resume from the last committed step"
          " (with --config.checkpoint.preemption_signals=\"('SIGTERM','SIGINT')\" Ctrl-C saves"
          " first)",
          file=sys.stderr)
    sys.exit(130)
  sys.exit(status)


if __name__ == "__main__":
  app.run(main)
