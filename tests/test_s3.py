"""The engine on a real S3-compatible object store (SeaweedFS on loopback)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx
from orbax_flax import saving


def _state(seed):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(seed)
  return {"w": jax.device_put(rng.standard_normal((512, 1024), dtype=np.float32),
                              NamedSharding(mesh, P("data", "model"))),
          "b": rng.standard_normal((16,), dtype=np.float32), "step": seed}


def _keys(server, bucket, prefix=""):
  resp = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
  return sorted(o["Key"] for o in resp.get("Contents", []))


def test_save_restore_metadata_on_s3(s3_server, s3_bucket):
  url = f"s3://{s3_bucket}/runs/1/ckpt"
  state = _state(1)
  ofx.save(url, {"state": state, "extra": {"epoch": 3}})
  target = {"state": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
      jax.make_mesh((8,), ("x",)), P(None, "x"))) if isinstance(x, jax.Array) else x, state)}
  restored = ofx.restore(url, target)
  np.testing.assert_array_equal(np.asarray(restored["state"]["w"]), np.asarray(state["w"]))
  np.testing.assert_array_equal(restored["state"]["b"], state["b"])
  assert ofx.restore(url, {"extra": {"epoch": 0}}) == {"extra": {"epoch": 3}}
  meta = ofx.metadata(url)
  assert meta.items["state"].arrays[-1].shape == (512, 1024)
  keys = _keys(s3_server, s3_bucket, "runs/1/ckpt/")
  assert "runs/1/ckpt/_CHECKPOINT" in keys and len(keys) <= 8, keys


def test_kvstore_spec_dict(s3_server, s3_bucket):
  spec = {"driver": "s3", "bucket": s3_bucket, "path": "spec/ckpt", "endpoint": s3_server.endpoint,
          "aws_region": "us-east-1"}
  ofx.save(spec, {"state": {"x": np.arange(5)}})
  np.testing.assert_array_equal(ofx.restore(spec)["state"]["x"], np.arange(5))


def test_overwrite_replaces_generation_and_cleans_up(s3_server, s3_bucket):
  url = f"s3://{s3_bucket}/ow"
  ofx.save(url, {"state": _state(1)})
  old_keys = _keys(s3_server, s3_bucket)
  with pytest.raises(ofx.CheckpointExistsError, match="overwrite=True"):
    ofx.save(url, {"state": _state(2)})
  assert _keys(s3_server, s3_bucket) == old_keys
  ofx.save(url, {"state": _state(2)}, overwrite=True)
  assert ofx.restore(url)["state"]["step"] == 2
  new_keys = _keys(s3_server, s3_bucket)
  gen = ofx.restoring.read_manifest(ofx._location.Location.parse(url))["generation"]
  assert all(k == "ow/_CHECKPOINT" or gen in k for k in new_keys), new_keys


def test_uncommitted_data_is_invisible(s3_server, s3_bucket):
  url = f"s3://{s3_bucket}/unc"
  ofx.save(url, {"state": _state(1)})
  s3_server.client().delete_object(Bucket=s3_bucket, Key="unc/_CHECKPOINT")
  assert _keys(s3_server, s3_bucket, "unc/")  # data is still there, but no marker
  with pytest.raises(ofx.CheckpointNotFoundError):
    ofx.restore(url)
  ofx.save(url, {"state": _state(3)})  # a new save may use the prefix
  assert ofx.restore(url)["state"]["step"] == 3


def test_unreachable_store_names_it_and_the_fix(s3_server, s3_bucket):
  del s3_bucket
  spec = {"driver": "s3", "bucket": "nobucket", "path": "x", "endpoint": "http://127.0.0.1:9",
          "aws_region": "us-east-1",
          "context": {"s3_request_retries": {"max_retries": 1, "initial_delay": "0.01s"}}}
  with pytest.raises(ofx.StorageError, match=r"s3://nobucket/x/.*endpoint"):
    ofx.save(spec, {"state": {"x": np.arange(3)}})
  with pytest.raises(ofx.StorageError, match="nobucket"):
    ofx.restore(spec)


def test_two_processes_save_to_s3(s3_server, s3_bucket):
  url = f"s3://{s3_bucket}/mp/ckpt"
  jobs.run("engine_worker.py", ["--mode=save", f"--path={url}", "--mesh=2,4"], 2, 4,
           env=s3_server.env()).check()
  res = jobs.run("engine_worker.py", ["--mode=restore", f"--path={url}", "--mesh=4,2"], 4, 2,
                 env=s3_server.env()).check()
  assert all("RESTORED" in o for o in res.outputs)


def test_checkpoint_appearing_during_a_save_is_kept_on_s3(s3_server, s3_bucket, monkeypatch):
  url = f"s3://{s3_bucket}/race"
  commit = saving.SaveRun._commit  # pylint: disable=protected-access

  def someone_else_commits_first(run):
    monkeypatch.setattr(saving.SaveRun, "_commit", commit)
    ofx.save(url, {"state": {"who": "someone else", "x": np.ones(3)}})
    commit(run)

  monkeypatch.setattr(saving.SaveRun, "_commit", someone_else_commits_first)
  with pytest.raises(ofx.CheckpointExistsError, match="appeared .* during the save"):
    ofx.save(url, {"state": _state(2)})
  assert ofx.restore(url)["state"]["who"] == "someone else"
  gens = {k.split("/")[2] for k in _keys(s3_server, s3_bucket, "race/state/")}
  assert len(gens) == 1, gens  # our data was removed again
