"""Edges of ``export_orbax`` and ``export_safetensors``, read back by the real readers.

Each export here is read back by the package it is written for: orbax-checkpoint 0.12's
``StandardCheckpointer`` / ``CheckpointManager`` (what ``docs/interop.md`` promises restores
an ``export_orbax`` onto any mesh) and the ``safetensors`` package.
"""

import io
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_flax as ofx
from orbax_flax import cli


def _convert_to_orbax(src, dst, capsys):
  code = cli.main(["convert", src, dst, "--format", "orbax"], io.StringIO())
  return code, capsys.readouterr().err


def test_export_orbax_refuses_a_string_leaf_standard_checkpointer_cannot_restore(tmp_path,
                                                                                 capsys):
  """A string leaf was written (``_strings.json``) into an item labelled
  StandardCheckpointHandler, which can neither save nor restore strings: orbax's
  StandardCheckpointer then failed for every target ("Unsupported type: <class 'str'>" with
  the string, "tree structures do not match" without). It is refused before anything is
  written, naming each string leaf and the way around (leave it out with select=)."""
  state = {"params": {"w": np.arange(4, dtype=np.float32)}, "step": 7,
           "model_name": "lm-small", "cfg": {"act": "gelu"}}
  for step in (None, 7):
    with pytest.raises(ValueError, match=r"(?s)cfg/act: a string.*model_name: a string.*select="):
      ofx.export_orbax(str(tmp_path / "out"), state, step=step)
  assert not os.listdir(tmp_path)
  # convert --format orbax of a checkpoint holding a string: bad input (exit 2), naming it.
  src = str(tmp_path / "ckpt")
  ofx.save(src, {"state": state})
  code, err = _convert_to_orbax(src, str(tmp_path / "conv"), capsys)
  assert code == cli.EXIT_MISSING and "model_name: a string" in err, err
  assert "selector" in err and "StorageError" not in err, err
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]
  # The way around the message names; what is written restores with a target, as promised.
  item = ofx.export_orbax(str(tmp_path / "item"), state, select="params,step")
  run = str(tmp_path / "run")
  ofx.export_orbax(run, state, select="params,step", step=7)
  on = NamedSharding(jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]), P("x"))
  target = {"params": {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=on)}, "step": 0}
  with ocp.StandardCheckpointer() as c:
    got = c.restore(item, target)
  assert got["params"]["w"].tobytes() == state["params"]["w"].tobytes() and got["step"] == 7
  with ocp.CheckpointManager(run) as mgr:
    got = mgr.restore(7, args=ocp.args.StandardRestore(target))
  assert got["params"]["w"].tobytes() == state["params"]["w"].tobytes() and got["step"] == 7


def test_export_orbax_refuses_a_python_int_beyond_64_bits_naming_it_before_writing(tmp_path,
                                                                                   capsys):
  """``tokens_seen = 2**64 + 1`` (ofx.save keeps it) became a numpy object array, which failed
  in tensorstore as a StorageError after the temporary directory was made, naming neither the
  leaf nor the fix. It is a ValueError naming the leaf, before anything is written; ints that
  fit int64 or uint64 are written and restore through orbax as the same numbers."""
  for big in (2**64 + 1, -2**63 - 1):
    tree = {"params": {"w": np.ones(2, np.float32)}, "tokens_seen": big}
    with pytest.raises(ValueError, match=r"tokens_seen: the int .* 64 bits.*select="):
      ofx.export_orbax(str(tmp_path / "out"), tree)
    assert not os.listdir(tmp_path)
  src = str(tmp_path / "ckpt")
  ofx.save(src, {"state": {"params": {"w": np.ones(2, np.float32)}, "tokens_seen": 2**64 + 1}})
  code, err = _convert_to_orbax(src, str(tmp_path / "conv"), capsys)
  assert code == cli.EXIT_MISSING and "tokens_seen: the int" in err, err
  assert "StorageError" not in err and "failed (layout)" not in err, err
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]
  edges = {"w": np.ones(2, np.float32), "hi": 2**64 - 1, "lo": -2**63}
  path = ofx.export_orbax(str(tmp_path / "edges"), edges)
  with ocp.StandardCheckpointer() as c:
    got = c.restore(path, edges)
  assert got["hi"] == 2**64 - 1 and got["lo"] == -2**63
