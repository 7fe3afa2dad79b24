"""The local tier under faults: SIGKILL at random points, every file of a step damaged.

A killed job's restart resumes a step that restores bitwise, at least as new as
the last step every process reported committed; a damaged local step is refused
(the restore falls back) or restores exactly: never a wrong value, never an
error other than the library's. CI runs a few cases; ``ORBAX_FLAX_FAULTS=long``
runs 100+ kill points and many more damaged bytes.
"""

import os
import random
import re
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jobs
import orbax_flax as ofx
from orbax_flax.tiers import _blob
from orbax_flax.tiers import local

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_kills  # noqa: E402  pylint: disable=wrong-import-position

LONG = os.environ.get("ORBAX_FLAX_FAULTS") == "long"
KILLS = 110 if LONG else 1
DAMAGES = 200 if LONG else 4  # damaged copies per file and kind


@pytest.mark.timeout(3600 if LONG else 600)  # the long run: about 11 s per kill point here
def test_sigkill_during_local_saves_with_replicas_and_retention(tmp_path):
  rng = random.Random(5)
  d = str(tmp_path / "local")
  checked, last = 0, 0
  for kill in range(KILLS + 1):
    procs = jobs.start(os.path.join("faults", "local_worker.py"), [d], 4, 2)
    first = [jobs.read_until(p, r"^(CHECKED|NONE|WRONG)", 240) for p in procs]
    text = "".join("".join(f) for f in first)
    assert "WRONG" not in text, text[-3000:]
    resumed = {int(m) for m in re.findall(r"^CHECKED (\d+)", text, re.M)}
    if last:  # what every process reported committed before the kill is there
      assert len(resumed) == 1 and resumed.pop() >= last, (resumed, last, text[-3000:])
      checked += 1
    if kill == KILLS:
      for p in procs:
        p.kill()
        p.communicate()
      break
    outs = test_kills._kill_at_random(rng, procs, first)  # pylint: disable=protected-access
    saved = [[int(s) for s in re.findall(r"^SAVED (\d+)", "".join(o), re.M)] for o in outs]
    last = min((max(s) if s else 0) for s in saved) or last
  test_kills._tally("local tier: saves with replicas and retention", KILLS, checked)  # pylint: disable=protected-access


def _state(step=3):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(step)
  big = rng.standard_normal((512, 256), dtype=np.float32)
  return {"big": jax.device_put(big, NamedSharding(mesh, P("data", "model"))),
          "small": jax.device_put(rng.standard_normal(64, dtype=np.float32), NamedSharding(mesh, P())),
          "key": jax.random.key(step), "host": np.arange(10, dtype=np.int64), "n": step}


def _like(state):
  return {"state": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                if isinstance(x, jax.Array) else x, state)}


def _same(got, want):
  for k, v in want.items():
    r = got[k]
    if isinstance(v, jax.Array):
      if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
        v, r = jax.random.key_data(v), jax.random.key_data(r)
      if r.shape != v.shape or not np.array_equal(np.asarray(r), np.asarray(v)):
        return False
    elif not np.array_equal(np.asarray(r), np.asarray(v)):
      return False
  return True


def _damaged(raw, kind, rng):
  raw = bytearray(raw)
  if kind == "truncate":
    return raw[:rng.randrange(len(raw))]
  if kind == "zero":
    lo = rng.randrange(len(raw))
    n = rng.randint(1, 4096)
    raw[lo:lo + n] = bytes(len(raw[lo:lo + n]))
    return raw
  at = rng.randrange(len(raw))
  raw[at] ^= 1 << rng.randrange(8)
  return raw


@pytest.mark.parametrize("name", [local.OWN, local.COMMITTED])
@pytest.mark.parametrize("kind", ["truncate", "zero", "flip"])
def test_every_file_of_a_local_step_damaged_never_restores_wrong_values(tmp_path, name, kind):
  rng = random.Random(f"{name}{kind}")
  state = _state()
  tier = local.LocalTier(str(tmp_path / "shm"), run="r", max_to_keep=1)
  tier.save(3, {"state": state})
  path = os.path.join(tier.root, "3", name)
  original = open(path, "rb").read()
  refused = 0
  for _ in range(DAMAGES):
    raw = _damaged(original, kind, rng)
    if raw == original:
      continue
    with open(path, "wb") as f:
      f.write(raw)
    got = tier.restore(_like(state))  # a damaged copy falls back: None, never wrong values
    if got is None:
      refused += 1
    else:
      assert got[0] == 3 and _same(got[1]["state"], state), "a damaged local step restored wrong"
    if name == local.OWN:  # the same bytes received as a peer's replica (decoded in memory)
      try:
        index, payload = _blob.decode(np.frombuffer(bytes(raw), np.uint8), "replica")
        m = _blob.match(index, _like(state))
        assert _same(_blob.build(m, index, payload)["state"], state), "a replica restored wrong"
      except ofx.errors.CheckpointCorruptedError:
        pass
  with open(path, "wb") as f:
    f.write(original)
  assert tier.restore(_like(state))[0] == 3
  assert refused >= DAMAGES // 2, refused  # almost every change is damage that is refused
