"""Paths as users spell them: file:// URLs, '~', relative and symlinked directories, long names."""

import logging
import os

import numpy as np
import pytest

import orbax_flax as ofx


@pytest.fixture(autouse=True)
def _quiet():
  logger = logging.getLogger("orbax_flax")
  level = logger.level
  logger.setLevel(logging.ERROR)
  yield
  logger.setLevel(level)


def test_a_relative_local_directory_is_fixed_when_the_run_starts(tmp_path, monkeypatch):
  a, b = tmp_path / "a", tmp_path / "b"
  a.mkdir()
  b.mkdir()
  monkeypatch.chdir(a)
  policy = ofx.CheckpointPolicy(local_directory="fast", local_save_interval_steps=1,
                                local_max_to_keep=1)
  with ofx.CheckpointCallback(str(tmp_path / "wd"), policy) as ckpt:
    ckpt.restore_or_init({"w": np.zeros(3)})
    ckpt.on_step_end(1, {"w": np.ones(3)})
    os.chdir(b)  # a library or a notebook cell changes directory mid-run
    ckpt.on_step_end(2, {"w": np.full(3, 2.0)})
  assert os.listdir(b) == []
  (run,) = os.listdir(a / "fast")
  # One directory holds the run's local steps, so local_max_to_keep applies to all of them.
  assert os.listdir(a / "fast" / run / "process_0") == ["2"]
