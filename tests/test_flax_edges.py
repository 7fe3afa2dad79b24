"""Flax users' edge cases at the edges of the library: exports a zarr3 store cannot hold, a
failed export's leftovers, fine-tuning from a Flax NNX run, a pmap-replicated state.

Each test goes through the public API on real files with real tensorstore.
"""

import os
import time

import numpy as np
import pytest

import orbax_flax as ofx


def test_a_failed_export_orbax_leaves_no_temporary_directory_behind(tmp_path):
  # A key too long for a file name: its array's create fails while the creates of the arrays
  # after it are in flight; the failed export must wait for them before it removes its
  # unfinished directory, or they write their zarr.json into a new one.
  tree = {"a" * 300: np.ones(4, np.float32), "b": np.ones((256, 256), np.float32),
          "c": np.ones((256, 256), np.float32)}
  for i in range(3):
    with pytest.raises(ofx.errors.StorageError, match="nothing was committed"):
      ofx.export_orbax(str(tmp_path / f"out{i}"), tree)
  time.sleep(0.5)  # anything still in flight lands
  assert not os.listdir(tmp_path)
