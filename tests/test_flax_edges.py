"""Flax users' edge cases at the edges of the library: exports a zarr3 store cannot hold, a
failed export's leftovers, fine-tuning from a Flax NNX run, a pmap-replicated state.

Each test goes through the public API on real files with real tensorstore.
"""

import io
import os
import time

import jax.numpy as jnp
import numpy as np
import pytest

import orbax_flax as ofx
from orbax_flax import cli


@pytest.mark.parametrize("dtype", [jnp.uint4, jnp.uint2, jnp.float8_e4m3])
def test_export_orbax_refuses_a_dtype_zarr3_lacks_naming_the_key_path_before_writing(
    tmp_path, dtype):
  state = {"params": {"w": np.ones(2, np.float32)}, "quant": {"q": jnp.arange(4).astype(dtype)}}
  dst = str(tmp_path / "out")
  with pytest.raises(ValueError, match=r"quant/q: dtype \w+ .*zarr3.*cast.*select="):
    ofx.export_orbax(dst, state)
  assert not os.listdir(tmp_path)
  # the fixes the message names: leave the leaf out, or cast it
  ofx.export_orbax(dst, state, select="params")
  assert sorted(os.listdir(dst))[:2] == ["_CHECKPOINT_METADATA", "_METADATA"]
  wider = jnp.uint8 if jnp.issubdtype(dtype, jnp.integer) else jnp.bfloat16
  ofx.export_orbax(str(tmp_path / "cast"), {"q": state["quant"]["q"].astype(wider)})


def test_convert_to_orbax_refuses_a_dtype_zarr3_lacks_as_bad_input(tmp_path, capsys):
  src = str(tmp_path / "ckpt")
  ofx.save(src, {"params": {"w": np.ones(2, np.float32), "q": jnp.arange(4, dtype=jnp.uint4)}})
  code = cli.main(["convert", src, str(tmp_path / "out"), "--format", "orbax"], io.StringIO())
  err = capsys.readouterr().err
  assert code == cli.EXIT_MISSING
  assert "q: dtype uint4" in err and "select=" in err and "StorageError" not in err
  assert not os.path.exists(tmp_path / "out") and not os.path.exists(
      str(tmp_path / "out") + ".ofx-tmp-export")


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
