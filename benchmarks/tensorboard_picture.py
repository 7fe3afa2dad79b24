"""Renders what a user sees in TensorBoard after the example run: loss and checkpoint timings.

    .venv/bin/python examples/train.py --workdir=/tmp/ofx_tb --config=configs/default.py \\
        --config.num_steps=200 --config.checkpoint.save_interval_steps=20
    .venv/bin/python benchmarks/tensorboard_picture.py /tmp/ofx_tb/tensorboard docs/tensorboard.png

Reads the event file with tensorboard's own reader (the same data the TensorBoard UI
plots) and draws each scalar the example writes.
"""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402


def main(logdir: str, out: str) -> None:
  ea = event_accumulator.EventAccumulator(logdir)
  ea.Reload()
  tags = [t for t in ("loss", "checkpoint/blocking_s", "checkpoint/total_s", "checkpoint/bytes")
          if t in ea.Tags()["scalars"]]
  fig, axes = plt.subplots(1, len(tags), figsize=(4.2 * len(tags), 3.2), squeeze=False)
  for ax, tag in zip(axes[0], tags):
    events = ea.Scalars(tag)
    ax.plot([e.step for e in events], [e.value for e in events],
            marker="o" if tag.startswith("checkpoint") else None, markersize=3, label="whole wait")
    if tag == "checkpoint/blocking_s":  # with its main parts
      for part, label in (("ready", "train step still computing"), ("copy", "snapshot")):
        part_tag = f"checkpoint/blocking_{part}_s"
        if part_tag in ea.Tags()["scalars"]:
          part_events = ea.Scalars(part_tag)
          ax.plot([e.step for e in part_events], [e.value for e in part_events], marker=".",
                  markersize=3, linestyle="--", label=label)
      ax.legend(fontsize=7)
    ax.set_title(tag, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  fig.suptitle(f"TensorBoard scalars of {logdir} (no TensorFlow installed by orbax_flax)",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(out, dpi=100)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
