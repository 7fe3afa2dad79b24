"""Differential saves (issue 19): unchanged chunks are referenced, retention keeps them.

Real files, the public API: a LoRA-style run on a frozen base, restores of
every kept step after retention deleted the steps they borrow from, another
mesh, two processes, a flipped element, every dtype, and manifests whose
references point outside the checkpoint or at steps that do not exist.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import disks
import engine_worker
import jobs
import orbax_flax as ofx
from orbax_flax import cli
from orbax_flax import errors

_RNG = np.random.default_rng(19)
_FROZEN = {
    "embed": _RNG.standard_normal((2048, 512)).astype(np.float32),     # 4 MiB, sharded rows
    "proj": _RNG.standard_normal((1024, 1024)).astype(np.float32),     # 4 MiB, replicated
    "head": _RNG.standard_normal((1024, 512)).astype(ml_dtypes.bfloat16),  # 1 MiB, sharded cols
    "quant": _RNG.integers(-128, 127, (1536, 1024), dtype=np.int8),     # 1.5 MiB, numpy
    "norms": [_RNG.standard_normal((512,)).astype(np.float32) for _ in range(8)],  # packed
}


def _mesh(shape=None, names=("data",)):
  """A mesh of ``shape``, by default one axis over every device (the 8 CPU devices here, or the
  chips of an accelerator: conftest.py)."""
  return jax.make_mesh(shape or (len(jax.devices()),), names)


def lora_state(step, mesh):
  """A frozen base (90%+ of the bytes) and small adapters that change every step."""
  names = mesh.axis_names
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  frozen = {"embed": put(_FROZEN["embed"], P(names[0], None)),
            "proj": put(_FROZEN["proj"], P()),
            "head": put(_FROZEN["head"], P(None, names[-1])),
            "quant": _FROZEN["quant"],
            "norms": [put(n, P()) for n in _FROZEN["norms"]]}
  rng = np.random.default_rng(1000 + step)
  lora = {"a": put(rng.standard_normal((512, 16)).astype(np.float32), P()),
          "b": put(rng.standard_normal((16, 512)).astype(np.float32), P())}
  return {"frozen": frozen, "lora": lora, "step": step}


def _nbytes(tree):
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def _disk_bytes(root):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def _target(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, state)


def _assert_bitwise(got, want):
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.shape == w.shape, path
    assert g.tobytes() == w.tobytes(), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  """Ten differential saves of a LoRA-style run, max_to_keep=3 (async saves)."""
  root = str(tmp_path_factory.mktemp("lora") / "ckpt")
  mesh = _mesh()
  policy = ofx.CheckpointPolicy(max_to_keep=3, differential=True)
  with ofx.CheckpointManager(root, policy) as mngr:
    for step in range(10):
      mngr.save(step, {"state": lora_state(step, mesh)}, force=True)
    mngr.wait()
    events = mngr.pop_events()
    steps = mngr.all_steps()
  return root, steps, events


def test_lora_frozen_base_ten_saves_take_under_twice_one_state(lora_run):
  root, steps, events = lora_run
  full = _nbytes(lora_state(0, _mesh()))
  assert steps == [7, 8, 9]
  assert _disk_bytes(root) <= 2 * full, (_disk_bytes(root), full)
  assert events[0].bytes_written == full and events[0].bytes_reused == 0
  for e in events[1:]:
    assert e.bytes_written <= 0.12 * full, (e.step, e.bytes_written, full)
    assert e.bytes_written + e.bytes_reused == full
  # The base (step 0) was deleted by retention: not a step any more, its data retired in place.
  assert os.path.exists(os.path.join(root, "0", "_RETIRED"))
  assert sorted(os.listdir(root)) == ["0", "7", "8", "9"]


def test_every_kept_step_restores_bitwise_after_its_bases_were_deleted(lora_run):
  root, steps, _ = lora_run
  mesh = _mesh()
  for step in steps:
    path = os.path.join(root, str(step))
    want = lora_state(step, mesh)
    _assert_bitwise(ofx.restore(path, {"state": _target(want)})["state"], want)
    _assert_bitwise(ofx.restore(path)["state"], want)  # host numpy, the tensorstore-free path too
    assert ofx.verify(path) == _nbytes(want)
    meta = ofx.metadata(path)
    assert meta.items["state"].nbytes == _nbytes(want)


def test_restore_onto_another_mesh(lora_run):
  root, steps, _ = lora_run
  mesh = _mesh((2, 4), ("x", "y"))
  want = lora_state(steps[-1], mesh)
  got = ofx.restore(os.path.join(root, str(steps[-1])), {"state": _target(want)})["state"]
  _assert_bitwise(got, want)
  assert got["frozen"]["embed"].sharding == want["frozen"]["embed"].sharding


def test_show_and_list_print_own_and_borrowed_bytes(lora_run):
  root, steps, _ = lora_run
  out = io.StringIO()
  assert cli.main(["show", os.path.join(root, str(steps[-1]))], out) == 0
  assert "borrowed" in out.getvalue() and "own" in out.getvalue(), out.getvalue()
  out = io.StringIO()
  assert cli.main(["list", root], out) == 0
  assert "BORROWED" in out.getvalue() and "retired, not steps: 0:" in out.getvalue(), out.getvalue()


def _flip(x, index):
  bits = np.ascontiguousarray(x).copy()
  flat = bits.reshape(-1).view(np.uint8)
  flat[index] ^= 1
  return bits


def test_a_changed_chunk_is_never_reused(tmp_path):
  """One bit of one element differs: exactly the block holding it is written."""
  root = str(tmp_path / "ckpt")
  big = _RNG.standard_normal((1024, 1024)).astype(np.float32)  # a chunk per shard: 8 of 512 KiB
  small = [_RNG.standard_normal((64,)).astype(np.float32) for _ in range(4)]  # one packed piece
  mesh = _mesh()
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None)))  # noqa: E731
  ckptr = ofx.Checkpointer(differential=True)
  ckptr.save(os.path.join(root, "0"), {"s": {"big": put(big), "small": small}})
  flipped = _flip(big, 3 * 1024 * 4 + 2)       # row 3: the first shard's chunk
  ckptr.save(os.path.join(root, "1"), {"s": {"big": put(flipped), "small": small}})
  small2 = [small[0], _flip(small[1], 5), small[2], small[3]]
  ckptr.save(os.path.join(root, "2"), {"s": {"big": put(flipped), "small": small2}})
  ckptr.close()
  s1 = ofx.metadata(os.path.join(root, "1")).custom  # noqa: F841  (metadata reads through)
  for step, want_big, want_small in ((1, flipped, small), (2, flipped, small2)):
    got = ofx.restore(os.path.join(root, str(step)))["s"]
    assert got["big"].tobytes() == want_big.tobytes()
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got["small"], want_small))
  summaries = [json.loads(open(os.path.join(root, str(s), "_CHECKPOINT"), "rb").read()
                          .split(b"\n")[1]) for s in range(3)]
  shard = big.nbytes // len(jax.devices())  # the chunk that holds the flipped bit
  assert summaries[1]["stored_bytes"] == {"own": shard, "borrowed": big.nbytes - shard + 1024}
  assert summaries[2]["stored_bytes"]["own"] == 1024  # the packed piece only


def test_every_dtype_is_referenced_and_restored_exactly(tmp_path):
  mesh = _mesh()
  rng = np.random.default_rng(3)
  arrays = {
      "bool": rng.integers(0, 2, (64, 40000)).astype(bool),
      "int4": rng.integers(-8, 7, (256, 8192)).astype(ml_dtypes.int4),
      "f8": rng.standard_normal((64, 40000)).astype(ml_dtypes.float8_e4m3fn),
      "c64": (rng.standard_normal((256, 1024)) + 1j).astype(np.complex64),
      "u16": rng.integers(0, 1 << 16, (512, 2048)).astype(np.uint16),
      "i64": rng.integers(-(1 << 60), 1 << 60, (8, 32)),  # packed
  }
  state = {k: jax.device_put(v, NamedSharding(mesh, P("data" if v.shape[0] % 8 == 0 else None)))
           for k, v in arrays.items()}
  state["keys"] = jax.random.split(jax.random.key(1), 8)
  root = str(tmp_path / "ckpt")
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(differential=True)) as mngr:
    for step in range(2):
      mngr.save(step, {"s": state}, force=True)
    mngr.wait()
    assert mngr.pop_events()[-1].bytes_written == 0
    got = mngr.restore(1, {"s": _target(state)})["s"]
  for k in arrays:
    assert np.asarray(got[k]).tobytes() == np.asarray(state[k]).tobytes(), k
  assert np.array_equal(jax.random.key_data(got["keys"]), jax.random.key_data(state["keys"]))


def _edit_manifest(path, edit):
  with open(os.path.join(path, "_CHECKPOINT"), "rb") as f:
    _, line, body = f.read().split(b"\n", 2)
  summary, doc = json.loads(line), json.loads(body)
  edit(summary, doc)
  import test_hostile_files  # pylint: disable=g-import-not-at-top
  with open(os.path.join(path, "_CHECKPOINT"), "wb") as f:
    f.write(test_hostile_files._rehash(summary, doc))  # pylint: disable=protected-access


def _array_leaf(doc, name):
  return next(r for r in doc["items"]["s"]["leaves"] if r["path"] == [name])


@pytest.mark.parametrize("case", ["outside", "missing_step", "own_generation", "base_index",
                                  "packed_tiling", "hash_length"])
def test_hostile_references_are_refused(tmp_path, case):
  root = str(tmp_path / "ckpt")
  big = _RNG.standard_normal((512, 1024)).astype(np.float32)
  ckptr = ofx.Checkpointer(differential=True)
  for step in range(2):
    ckptr.save(os.path.join(root, str(step)), {"s": {"big": big, "small": big[0] + step}})
  ckptr.close()
  path = os.path.join(root, "1")

  def edit(summary, doc):
    if case == "outside":
      summary["bases"][0]["dir"] = "../../etc"
    elif case == "missing_step":
      summary["bases"][0]["dir"] = "77"
    elif case == "own_generation":
      summary["bases"][0]["generation"] = summary["generation"]
    elif case == "base_index":
      _array_leaf(doc, "big")["chunk_base"][0] = 5
    elif case == "packed_tiling":
      doc["items"]["s"]["packed_pieces"]["0"][0][1] -= 16
    elif case == "hash_length":
      _array_leaf(doc, "big")["chunk_hash"][0] = "00"

  _edit_manifest(path, edit)
  with pytest.raises(errors.CheckpointFormatError, match="77|crafted|retired"):
    ofx.restore(path)
  if case != "missing_step":  # the manifest itself is refused, before any data is read
    with pytest.raises(errors.CheckpointFormatError):
      ofx.metadata(path)


def test_sweep_removes_retired_data_once_nothing_references_it(tmp_path):
  root = str(tmp_path / "ckpt")
  big = _RNG.standard_normal((512, 1024)).astype(np.float32)
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(max_to_keep=1, differential=True)) as m:
    for step in range(3):
      m.save(step, {"s": {"big": big, "step": step}}, force=True)
    m.wait()
    assert m.all_steps() == [2] and os.path.exists(os.path.join(root, "0", "_RETIRED"))
  # The run goes on without differential saves: the old base is referenced by nobody.
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(max_to_keep=1)) as m:
    for step in range(3, 5):
      m.save(step, {"s": {"big": big + 1, "step": step}}, force=True)
    m.wait()
  assert sorted(os.listdir(root)) == ["4"]
  assert ofx.restore(os.path.join(root, "4"))["s"]["big"].tobytes() == (big + 1).tobytes()


def test_multiprocess_differential_saves_restore_on_another_mesh(tmp_path):
  path = str(tmp_path / "ckpt")
  res = jobs.run("diff_worker.py", [f"--path={path}", "--mesh=2,4"], 2, 4).check()
  lines = [l for out in res.outputs for l in out.splitlines() if l.startswith("DIFF")]
  assert len(lines) == 2, res.outputs
  written = json.loads(lines[0].split("written=")[1].split(" reused")[0])
  reused = json.loads(lines[0].split("reused=")[1])
  assert reused[0] == 0 and all(r > 0 for r in reused[1:]) and written[1] < written[0] / 4
  # One process, 8 devices, another mesh: every kept step reads through its references.
  mesh = engine_worker.make_mesh((4, 2))
  import diff_worker  # pylint: disable=g-import-not-at-top
  for step in (2, 3):
    want = diff_worker.state_at(mesh, step)
    got = ofx.restore(os.path.join(path, str(step)), {"state": engine_worker.target_for(want)})
    engine_worker.check_shards(got["state"], want)
    assert ofx.verify(os.path.join(path, str(step))) > 0


def test_replacing_a_referenced_step_or_reusing_a_retired_number_keeps_the_borrowers(tmp_path):
  root = str(tmp_path / "ckpt")
  a, b, c = (_RNG.standard_normal((512, 1024)).astype(np.float32) for _ in range(3))
  # 1 borrows v from 0; 2 borrows w from 1 and v from 0.
  states = {0: {"w": a, "v": c, "n": 0}, 1: {"w": b, "v": c, "n": 1}, 2: {"w": b, "v": c, "n": 2}}
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(max_to_keep=2, differential=True)) as m:
    for step, s in states.items():
      m.save(step, {"s": s}, force=True)
    m.wait()
    assert m.pop_events()[-1].bytes_reused == 2 * a.nbytes
    assert m.all_steps() == [1, 2] and os.path.exists(os.path.join(root, "0", "_RETIRED"))
  new = {1: {"w": a + 1, "v": c, "n": 10}, 0: {"w": a, "v": c + 1, "n": 20}}
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(max_to_keep=3, differential=True)) as m:
    m.save(1, {"s": new[1]}, force=True)  # replaces step 1, which step 2 references
    m.wait()
    m.restore(1)  # a rollback: only its run may save a new step below the newest (2)
    m.save(0, {"s": new[0]}, force=True)  # the number of step 0, retired but referenced
    m.wait()
    assert m.all_steps() == [0, 1]  # 2, of the abandoned run, goes at 0's commit
  aside = [n for n in os.listdir(root) if ".ofx-base-" in n]
  assert len(aside) == 1  # old 0, moved aside: new 1 borrows it (old 1 went with 2, its borrower)
  assert not any(os.path.exists(os.path.join(root, n, "_CHECKPOINT")) for n in aside)  # retired
  for step, want in ((1, new[1]), (0, new[0])):
    got = ofx.restore(os.path.join(root, str(step)))["s"]
    assert got["w"].tobytes() == want["w"].tobytes() and got["v"].tobytes() == want["v"].tobytes()
    assert got["n"] == want["n"] and ofx.verify(os.path.join(root, str(step))) == 2 * a.nbytes


def _borrowed_pair(root):
  """Steps 1 and 2 of a differential run under ``root``, 2 borrowing ``w`` (2 MiB) from 1."""
  w = np.random.default_rng(7).standard_normal((512, 1024)).astype(np.float32)
  states = {1: {"w": w, "b": np.full(4, 1.0)}, 2: {"w": w, "b": np.full(4, 2.0)}}
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(differential=True)) as m:
    for step, state in states.items():
      m.save(step, {"s": state}, force=True)
    m.wait()
    assert m.pop_events()[-1].bytes_reused == w.nbytes
  return states


def _assert_kept(root, states):
  """Steps 1 and 2 are committed and restore bitwise, listed by a manager started now."""
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(differential=True)) as m:
    assert m.all_steps() == [1, 2]
    for step, want in states.items():
      got = m.restore(step)["s"]
      assert got["w"].tobytes() == want["w"].tobytes() and got["b"].tolist() == want["b"].tolist()
  assert not [n for n in os.listdir(root) if ".ofx-" in n], os.listdir(root)


@pytest.mark.parametrize("async_save", [True, False])
def test_a_refused_resave_of_a_referenced_step_keeps_it(tmp_path, async_save):
  """Bad input for a forced re-save of step 1, which step 2 borrows from: step 1 was moved
  aside before the items were checked, and was gone (a helper's review reproduced it)."""
  root = str(tmp_path / "ckpt")
  states = _borrowed_pair(root)
  policy = ofx.CheckpointPolicy(differential=True, async_save=async_save)
  with ofx.CheckpointManager(root, policy) as m:
    with pytest.raises(errors.UnsupportedLeafError, match="s/bad"):
      m.save(1, {"s": {"w": states[1]["w"] + 1, "bad": object()}}, force=True)
    assert m.all_steps() == [1, 2]
    assert m.restore(1)["s"]["b"].tolist() == [1.0] * 4
  _assert_kept(root, states)


def test_a_resave_of_a_referenced_step_that_fills_the_disk_keeps_it(tmp_path):
  with disks.small_disk(str(tmp_path / "disk"), "5m") as disk:
    root = os.path.join(disk, "ckpt")
    states = _borrowed_pair(root)  # about 2 MiB
    with ofx.CheckpointManager(root, ofx.CheckpointPolicy(differential=True)) as m:
      new = np.random.default_rng(8).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
      m.save(1, {"s": {"w": new, "b": np.full(4, 9.0)}}, force=True)
      with pytest.raises(errors.StorageError):
        m.wait()
      assert m.all_steps() == [1, 2]
    _assert_kept(root, states)


def test_a_cancelled_resave_of_a_referenced_step_keeps_it(tmp_path, monkeypatch):
  """A re-save cancelled (a second Ctrl-C, a grace period run out) said "nothing was
  committed", and step 1 was gone."""
  from orbax_flax.engine import saving  # pylint: disable=g-import-not-at-top
  root = str(tmp_path / "ckpt")
  states = _borrowed_pair(root)
  written, go_on = threading.Event(), threading.Event()
  sync = saving.SaveRun._sync  # pylint: disable=protected-access

  def held_sync(run):  # the data is written; the save checks for a cancel next
    written.set()
    go_on.wait(60)
    sync(run)

  monkeypatch.setattr(saving.SaveRun, "_sync", held_sync)
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(differential=True)) as m:
    m.save(1, {"s": {"w": states[1]["w"] + 1, "b": np.full(4, 9.0)}}, reason="exception")
    assert written.wait(60)
    assert ".ofx-base-" in " ".join(os.listdir(root))  # parked for the save
    m.abandon_inflight()
    go_on.set()
    m.wait()  # an abandoned save's end is logged, not raised
    assert m.all_steps() == [1, 2]
  monkeypatch.undo()
  _assert_kept(root, states)


_KILLED_RESAVE = """
import os, sys, time, numpy as np, orbax_flax as ofx
from orbax_flax.engine import saving
def held_sync(run):
  print("WRITTEN", flush=True)
  time.sleep(600)
saving.SaveRun._sync = held_sync
m = ofx.CheckpointManager(sys.argv[1], ofx.CheckpointPolicy(differential=True))
m.save(1, {"s": {"w": np.zeros((512, 1024), np.float32), "b": np.full(4, 9.0)}}, force=True)
m.wait()
"""


def test_a_resave_of_a_referenced_step_killed_midway_keeps_it(tmp_path):
  """SIGKILL while the re-save of step 1 writes: the next manager on the directory puts the
  parked step 1 back."""
  root = str(tmp_path / "ckpt")
  states = _borrowed_pair(root)
  child = subprocess.Popen([sys.executable, "-c", _KILLED_RESAVE, root], stdout=subprocess.PIPE,
                           text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))  # (a chip: ours)
  try:
    assert child.stdout.readline().strip() == "WRITTEN"
    assert sorted(n.split(".")[0] for n in os.listdir(root) if n[0].isdigit()) == ["1", "1", "2"]
  finally:
    child.kill()
    child.wait()
  assert not os.path.exists(os.path.join(root, "1"))  # parked: the kill left it aside
  _assert_kept(root, states)


def test_training_callback_reports_bytes_written_and_reused_to_the_metric_writer(tmp_path):
  frozen = jax.device_put(_FROZEN["embed"], NamedSharding(_mesh(), P("data", None)))

  def step(state, batch):  # a frozen base, an adapter that trains
    return {"base": state["base"], "adapter": state["adapter"] + batch, "step": state["step"] + 1}, \
        {"loss": float(batch)}

  writer = jobs.RecordingWriter()
  ckpt = ofx.CheckpointCallback(str(tmp_path), {"save_interval_steps": 2, "differential": True},
                                writer=writer)
  state = {"base": frozen, "adapter": np.zeros((64, 64), np.float32), "step": 0}
  ofx.Trainer(step, [ckpt]).fit(state, iter([1.0] * 10), 6)
  events = [d for _, d in writer.scalars if "checkpoint/bytes_written" in d]
  assert len(events) == 3, writer.scalars
  assert events[0]["checkpoint/bytes_reused"] == 0
  assert all(e["checkpoint/bytes_reused"] == frozen.nbytes for e in events[1:]), events
  assert all(e["checkpoint/bytes_written"] < frozen.nbytes / 100 for e in events[1:]), events


@pytest.mark.parametrize("budget", [1 << 20, 0])
def test_async_saves_in_rounds_under_a_host_budget_reuse_exactly(tmp_path, budget):
  """With max_host_bytes the state is staged and written in rounds; each round decides."""
  mesh = _mesh()
  big = jax.device_put(_FROZEN["proj"], NamedSharding(mesh, P("data", None)))  # 8 chunks
  root = str(tmp_path / "ckpt")
  with ofx.Checkpointer(differential=True, max_host_bytes=budget) as ckptr:
    for step in range(3):
      small = np.full((128, 128), step, np.float32)
      ckptr.save_async(os.path.join(root, str(step)), {"s": {"big": big, "small": small}}).wait()
  for step in range(3):
    got = ofx.restore(os.path.join(root, str(step)))["s"]
    assert got["big"].tobytes() == _FROZEN["proj"].tobytes() and (got["small"] == step).all()
  with open(os.path.join(root, "2", "_CHECKPOINT"), "rb") as f:
    stored = json.loads(f.read().split(b"\n")[1])["stored_bytes"]
  assert stored == {"own": 128 * 128 * 4, "borrowed": big.nbytes}


def test_a_changed_small_array_rewrites_about_one_packed_chunk_not_the_buffer(tmp_path):
  """Small arrays are packed together; reuse is per segment (about one 4 MiB chunk)."""
  rng = np.random.default_rng(7)
  smalls = [rng.standard_normal(1 << 18).astype(np.float32) for _ in range(12)]  # 12 x 1 MiB
  root = str(tmp_path / "ckpt")
  states = [list(smalls)]
  states.append([x if i != 5 else x + 1 for i, x in enumerate(states[-1])])   # segment 1
  states.append([x if i != 10 else x + 1 for i, x in enumerate(states[-1])])  # segment 2
  with ofx.Checkpointer(differential=True) as ckptr:
    for step, state in enumerate(states):
      ckptr.save(os.path.join(root, str(step)), {"s": {"smalls": state}})
  for step, state in enumerate(states):
    path = os.path.join(root, str(step))
    got = ofx.restore(path)["s"]["smalls"]
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, state)), step
    assert ofx.verify(path) == 12 << 20
    with open(os.path.join(path, "_CHECKPOINT"), "rb") as f:
      stored = json.loads(f.read().split(b"\n")[1])["stored_bytes"]
    assert stored["own"] == (12 << 20 if step == 0 else 4 << 20), (step, stored)


def _retired_dirs(root):
  """The retired data beside the checkpoints in ``root`` (``<name>.ofx-base-<gen>``), each
  checked to be retired (its manifest ``_RETIRED``, no ``_CHECKPOINT``)."""
  aside = sorted(n for n in os.listdir(root) if ".ofx-base-" in n)
  for n in aside:
    assert os.path.exists(os.path.join(root, n, "_RETIRED")), n
    assert not os.path.exists(os.path.join(root, n, "_CHECKPOINT")), n
  return aside


def test_an_overwrite_keeps_what_siblings_of_any_name_and_the_new_checkpoint_borrow(tmp_path):
  """Checkpointer(differential=True) saving a, b, then a again (overwrite=True): b and the new
  a borrow w from the old a. Its borrowers were looked for among all-digit names only, so the
  overwrite deleted the old a, and neither a nor b restored."""
  root = str(tmp_path)
  w = np.random.default_rng(3).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB: chunked
  states = {"a": {"w": w, "c": np.full(64, 2)}, "b": {"w": w, "c": np.full(64, 1)}}
  with ofx.Checkpointer(differential=True) as ck:
    ck.save(os.path.join(root, "a"), {"s": {"w": w, "c": np.full(64, 0)}})
    ck.save(os.path.join(root, "b"), {"s": states["b"]})
    ck.save(os.path.join(root, "a"), {"s": states["a"]}, overwrite=True)  # base b
  for name, want in states.items():
    path = os.path.join(root, name)
    got = ofx.restore(path)["s"]
    assert got["w"].tobytes() == w.tobytes() and got["c"].tolist() == want["c"].tolist(), name
    assert ofx.verify(path) > 0
  assert [n.split(".")[0] for n in _retired_dirs(root)] == ["a"]  # the old a, retired


@pytest.mark.parametrize("names", [("ckpt.1", "ckpt.2"), ("run:1", "run:2"), ("a b", "ü")])
def test_a_sibling_whose_name_a_reference_cannot_hold_is_never_a_base(tmp_path, names, caplog):
  """The format references a base by a plain name (letters, digits, ``_``, ``-``): a save next
  to ``ckpt.1`` borrowed from it anyway and committed a manifest the reader refuses, and a
  ``:`` in the name broke the base's token (ValueError on every later save). Such a save is
  full, and says why."""
  root = str(tmp_path)
  w = np.random.default_rng(4).standard_normal((512, 1024)).astype(np.float32)
  with ofx.Checkpointer(differential=True) as ck:
    ck.save(os.path.join(root, names[0]), {"s": {"w": w, "c": np.full(64, 0)}})
    with caplog.at_level("INFO", logger="orbax_flax"):
      ck.save(os.path.join(root, names[1]), {"s": {"w": w, "c": np.full(64, 1)}})
  assert any("saving in full" in r.getMessage() and names[0] in r.getMessage()
             for r in caplog.records if r.levelname == "INFO"), caplog.text
  for i, name in enumerate(names):
    got = ofx.restore(os.path.join(root, name))["s"]
    assert got["w"].tobytes() == w.tobytes() and got["c"].tolist() == [i] * 64
  with open(os.path.join(root, names[1], "_CHECKPOINT"), "rb") as f:
    assert json.loads(f.read().split(b"\n")[1])["stored_bytes"]["borrowed"] == 0


def test_a_retired_step_is_named_retired_by_restore_and_show(tmp_path):
  """Restoring or showing a step that retention retired (kept only for the bytes later steps
  borrow) said "a save in progress or interrupted?"."""
  root = str(tmp_path / "ckpt")
  w = np.random.default_rng(9).standard_normal((512, 1024)).astype(np.float32)
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(max_to_keep=1, differential=True)) as m:
    for step in range(2):
      m.save(step, {"s": {"w": w, "step": step}}, force=True)
    m.wait()
  assert os.path.exists(os.path.join(root, "0", "_RETIRED"))
  with pytest.raises(errors.CheckpointNotFoundError, match="is retired data") as e:
    ofx.restore(os.path.join(root, "0"))
  assert "in progress" not in str(e.value) and "for them (now: 1)" in str(e.value)
  out = io.StringIO()
  with contextlib.redirect_stderr(out):
    assert cli.main(["show", os.path.join(root, "0")], out=out) == 2
  assert "is retired data" in out.getvalue(), out.getvalue()


def test_a_differential_manifest_is_one_a_reader_from_before_differential_saves_refuses(
    tmp_path, monkeypatch):
  """A differential step's manifest said format version 1 (or 2): an orbax_flax from before
  differential saves read its borrowed packed arrays as zeros, and its verify said OK (the
  own database holds the shared chunk with zeros where the step borrows; its CRC is valid).
  It is version 3 now, which such a reader refuses, naming a newer orbax_flax; a full save
  stays version 1, readable by every orbax_flax."""
  from orbax_flax.format import _manifest  # pylint: disable=g-import-not-at-top
  frozen = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
  with ofx.CheckpointManager(str(tmp_path), ofx.CheckpointPolicy(differential=True)) as m:
    for step in (1, 2):
      m.save(step, {"state": {"frozen": frozen, "w": np.full(8, step, np.float32)}}, force=True)
    m.wait()
  def version(step):
    with open(os.path.join(tmp_path, str(step), "_CHECKPOINT"), "rb") as f:
      _, summary, body = f.read().split(b"\n", 2)
    return json.loads(summary)["version"], json.loads(body)["version"], json.loads(summary).get(
        "bases")
  assert version(1)[:2] == (1, 1) and not version(1)[2]
  v2, b2, bases = version(2)
  assert (v2, b2) == (3, 3) and bases, version(2)
  np.testing.assert_array_equal(ofx.restore(str(tmp_path / "2"))["state"]["frozen"], frozen)
  monkeypatch.setattr(_manifest, "READS", (1, 2))  # what an orbax_flax before version 3 reads
  monkeypatch.setattr(_manifest, "VERSION", 2)
  with pytest.raises(errors.CheckpointFormatError, match=r"format version 3 \(by a newer"
                                                         r" orbax_flax\).*Upgrade orbax_flax"):
    ofx.restore(str(tmp_path / "2"))
  ofx.restore(str(tmp_path / "1"))


def test_a_job_restarted_with_differential_off_retires_the_abandoned_base_a_kept_step_borrows(
    tmp_path):
  """A differential run rolls back (restore(2), save 3: the new step 3 borrows the bytes of
  the abandoned step 4) while an evaluator reads step 4, so step 4 is left for the next
  writer. Restarted with differential=False, that writer deleted step 4 through the plain
  retention, chosen before it learned the directory holds references (a race: about one run
  in two), and the kept step 3 no longer restored. Five runs: each keeps step 3 whole."""
  base = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)

  def state(step, k):
    return {"state": {"base": base + k, "adapter": np.full(16, step, np.float32)}}

  for run in range(5):
    d = str(tmp_path / str(run))
    m = ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=True))
    for s in (1, 2, 3):
      m.save(s, state(s, 0), force=True)
    for s in (4, 5):
      m.save(s, state(s, 1), force=True)  # a new base array from step 4 on
    m.wait()
    holding, release = threading.Event(), threading.Event()

    def evaluate(d=d, holding=holding, release=release):
      for _ in ofx.checkpoints_iterator(d, start_after=3, timeout=10, poll_interval=0.1):
        holding.set()
        release.wait()
        break

    reader = threading.Thread(target=evaluate)
    reader.start()
    assert holding.wait(30)
    m.restore(2)
    m.save(3, state(33, 1), force=True)   # borrows step 4's base
    m.close()
    release.set()
    reader.join()
    assert "4" in os.listdir(d)           # abandoned, kept for the next writer
    with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=False)) as again:
      again.save(6, state(6, 1), force=True)
    with ofx.CheckpointManager(d) as listing:
      assert listing.all_steps() == [1, 2, 3, 6]
    got = ofx.restore(os.path.join(d, "3"))
    _assert_bitwise(got, state(33, 1))


def test_differential_saves_on_an_object_store_are_refused_when_the_callback_is_made(tmp_path):
  """A run on an object store restarted with differential=True was refused at its first
  save, after a whole save interval of training (a preemption's save too). The manager, so
  the callback, refuses it when made, naming the directory and the fix, with nothing written
  (tensorstore's memory:// store takes the object stores' path)."""
  policy = ofx.CheckpointPolicy.from_config(
      {"differential": True, "save_interval_steps": 50, "directory": "memory://run/ckpts/"})
  with pytest.raises(ValueError, match=r"differential=True: .*run/ckpts.* is not on a local"
                                       r" file system.*differential=False"):
    ofx.CheckpointCallback(str(tmp_path), policy)
  assert os.listdir(tmp_path) == []
  with pytest.raises(ValueError, match="is not on a local file system"):
    ofx.CheckpointManager("memory://run/ckpts/", ofx.CheckpointPolicy(differential=True))


def test_a_forced_resave_of_a_step_with_a_long_summary_keeps_what_later_steps_borrow(tmp_path):
  """A step whose manifest summary is longer than 16 MiB (custom_metadata: accepted up to
  128 MiB) has its generation read past the summary's first bytes: a read capped at 16 MiB
  (this session's bounded reads, before the review) left it unknown, and a forced re-save
  of the step then removed the data step 2 borrows, as if nothing referenced it."""
  d = str(tmp_path)
  big = {"blob": "x" * (17 << 20)}
  w = np.arange(1 << 20, dtype=np.float32)
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=True)) as m:
    m.save(1, {"state": {"w": w, "v": np.ones(4, np.float32)}}, force=True, custom_metadata=big)
    m.wait()
    m.save(2, {"state": {"w": w, "v": np.full(4, 2, np.float32)}}, force=True)  # borrows w
    m.wait()
    m.save(1, {"state": {"w": w + 1, "v": np.ones(4, np.float32)}}, force=True,
           custom_metadata=big)
    m.wait()
  np.testing.assert_array_equal(ofx.restore(os.path.join(d, "2"))["state"]["w"], w)
  np.testing.assert_array_equal(ofx.restore(os.path.join(d, "1"))["state"]["w"], w + 1)


def test_a_forced_resave_of_a_step_whose_manifest_is_damaged_keeps_what_later_steps_borrow(
    tmp_path):
  """Step 1's manifest damaged on disk (its data intact), step 2 borrowing step 1's data, then
  a forced re-save of step 1: its generation, unreadable from the manifest, was taken for
  "nothing of ours", so the re-save neither parked step 1 nor kept its data, and step 2 lost
  its base. The databases' names say the generation: the data stays for step 2."""
  d = str(tmp_path)
  w = np.arange(1 << 20, dtype=np.float32)
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=True)) as m:
    m.save(1, {"state": {"w": w, "v": np.ones(4, np.float32)}}, force=True)
    m.wait()
    m.save(2, {"state": {"w": w, "v": np.full(4, 2, np.float32)}}, force=True)  # borrows w
    m.wait()
  manifest = os.path.join(d, "1", "_CHECKPOINT")
  with open(manifest, "r+b") as f:  # bit rot in its header: it no longer decodes
    f.seek(8)
    b = f.read(1)
    f.seek(8)
    f.write(bytes([b[0] ^ 0xFF]))
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(differential=True)) as m:
    m.save(1, {"state": {"w": w + 1, "v": np.ones(4, np.float32)}}, force=True)
    m.wait()
  np.testing.assert_array_equal(ofx.restore(os.path.join(d, "2"))["state"]["w"], w)
  np.testing.assert_array_equal(ofx.restore(os.path.join(d, "1"))["state"]["w"], w + 1)


def test_a_sweep_keeps_a_replaced_step_stranded_under_a_temporary_name_while_a_step_borrows_it(
    tmp_path):
  """An overwrite by exchange whose retirement of what it replaced did not happen (a kill in
  that instant, a failed rename) leaves the replaced data whole under ``<step>.ofx-tmp-*``,
  where the borrowers' references find it. A manager's sweep took it for an interrupted
  save's debris and removed it: step 2, which borrows from it, no longer restored."""
  frozen = np.random.default_rng(5).standard_normal((512, 1024)).astype(np.float32)  # chunked
  d = str(tmp_path / "run")
  policy = ofx.CheckpointPolicy(differential=True, async_save=False)
  with ofx.CheckpointManager(d, policy) as m:
    m.save(1, {"s": {"w": frozen, "n": np.full(4, 1)}}, force=True)
    m.save(2, {"s": {"w": frozen, "n": np.full(4, 2)}}, force=True)  # borrows w from 1
  # The state an overwrite of 1 whose retirement failed leaves: the old 1, manifest and all,
  # under the overwrite's temporary name (here without a new 1 in its place).
  os.rename(os.path.join(d, "1"), os.path.join(d, "1.ofx-tmp-0123456789abcdef"))
  np.testing.assert_array_equal(ofx.restore(os.path.join(d, "2"))["s"]["w"], frozen)
  with ofx.CheckpointManager(d, policy) as m:  # sweeps at its start and after each commit
    assert [l.name for l in m.leftovers()] == ["1.ofx-tmp-0123456789abcdef"]
    m.save(3, {"s": {"w": frozen + 1, "n": np.full(4, 3)}}, force=True)
    np.testing.assert_array_equal(m.restore(2)["s"]["w"], frozen)
  assert os.path.isdir(os.path.join(d, "1.ofx-tmp-0123456789abcdef"))
