"""Planning over a chunk grid in numpy gives the plan the chunk-by-chunk planner gave.

The planner used to walk every chunk of every array in Python (13 s a process at
8,192 devices); it now works over the chunk grid in numpy and assigns owners in
closed form where holder sets are disjoint. The manifest must not change by a
byte: these tests plan simulated multi-process layouts (stand-in shardings that
answer what planning asks, as ``benchmarks/manifest_scaling.py`` does) with the
library and with a copy of the old chunk-by-chunk code kept here, for every
process, and compare the records, the encoded manifest and each process's pieces.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest

from orbax_flax.format import _layout
from orbax_flax.format import _manifest
from orbax_flax.engine import _planning


@dataclasses.dataclass(frozen=True)
class Device:
  id: int
  process_index: int


class GridSharding:
  """A sharding over a ``mesh`` of devices whose processes are ``procs`` (same shape).

  ``spec`` names, per array dimension, the mesh axis it is split over (or None).
  Seen from process ``me``: its addressable devices are those of ``me``.
  """

  def __init__(self, procs: np.ndarray, spec: tuple, me: int):
    self.procs, self.spec, self.me = procs, spec, me
    self.devices = [Device(i, int(p)) for i, p in enumerate(procs.reshape(-1))]
    self._key = (procs.tobytes(), procs.shape, spec, me)

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, GridSharding) and self._key == other._key

  def __str__(self):
    return f"grid{self.procs.shape} spec{self.spec}"

  def _spec(self, shape):
    return tuple(self.spec) + (None,) * (len(shape) - len(self.spec))

  def shard_shape(self, shape):
    return tuple(s // (1 if a is None else self.procs.shape[a])
                 for s, a in zip(shape, self._spec(shape)))

  def _index(self, device, shape):
    pos = np.unravel_index(device.id, self.procs.shape)
    n = self.shard_shape(shape)
    return tuple(slice(0 if a is None else pos[a] * k, (1 if a is None else pos[a] + 1) * k)
                 if a is not None else slice(0, s)
                 for s, k, a in zip(shape, n, self._spec(shape)))

  def devices_indices_map(self, shape):
    return {d: self._index(d, shape) for d in self.devices}

  def addressable_devices_indices_map(self, shape):
    return {d: self._index(d, shape) for d in self._addressable_device_assignment}

  @property
  def _addressable_device_assignment(self):
    return [d for d in self.devices if d.process_index == self.me]


@dataclasses.dataclass(frozen=True)
class Leaf:
  shape: tuple
  dtype: np.dtype
  sharding: GridSharding
  is_fully_addressable: bool = False


def old_plan_array(item, name, path, leaf, kind, me, load, pack_sizes, packed, pieces, ref):
  """``_planning.plan_array`` as it was before the chunk grid went to numpy (chunk by chunk)."""
  rec, leaf = _planning.array_record(path, leaf, kind)
  sharding = leaf.sharding
  shape, dtype, nbytes = tuple(rec["shape"]), np.dtype(leaf.dtype), rec["nbytes"]
  rec["name"] = name
  rec.setdefault("sharding", _planning.describe_sharding(sharding))
  if nbytes == 0:
    rec.update(chunk_shape=list(shape), owners=[])
    return rec
  holders_by_start = {}
  for device, index in sharding.devices_indices_map(shape).items():
    holders_by_start.setdefault(tuple(s.start or 0 for s in index), set()).add(device.process_index)
  procs = set().union(*holders_by_start.values())
  full_holders = frozenset(p for p in procs if all(p in h for h in holders_by_start.values()))
  holders_by_start = {k: frozenset(v) for k, v in holders_by_start.items()}
  distinct = list(_planning._distinct_shards(sharding, shape))  # pylint: disable=protected-access
  if nbytes <= _planning.PACK_MAX_BYTES and full_holders:
    owner = _planning.assign_owners([full_holders], nbytes, load)[0]
    offset = pack_sizes[owner]
    pack_sizes[owner] = offset + -(-nbytes // _planning._PACK_ALIGN) * _planning._PACK_ALIGN  # pylint: disable=protected-access
    rec.update(owners=[owner], packed_offset=offset)
    if owner == me:
      for k, index in distinct:
        packed.append(_planning.Source(ref(k), None, offset, shape, dtype, index))
    return rec
  shard_shape = tuple(sharding.shard_shape(shape))
  sharers = max(len(h) for h in holders_by_start.values())
  shard_bytes = math.prod(shard_shape) * dtype.itemsize
  chunk_limit = min(_layout.DEFAULT_MAX_CHUNK_BYTES, -(-shard_bytes // sharers))
  chunk_shape = _layout.choose_chunk_shape(shard_shape, dtype.itemsize, chunk_limit)
  chunking = _layout.Chunking(shape, chunk_shape)
  chunk_boxes = [chunking.chunk_box(c) for c in range(chunking.num_chunks)]
  starts = [tuple((lo // s) * s for (lo, _), s in zip(b, shard_shape)) for b in chunk_boxes]
  holders = [holders_by_start[s] for s in starts]
  owners = _planning.assign_owners(holders, math.prod(chunk_shape) * dtype.itemsize, load)
  rec.update(chunk_shape=list(chunk_shape), owners=owners)
  if me not in owners:
    return rec
  array = _planning.StoredArray(item, name, shape, rec["stored_dtype"], chunk_shape)
  local = {tuple(s.start or 0 for s in index): k for k, index in distinct}
  for box, start, owner in zip(chunk_boxes, starts, owners):
    if owner != me:
      continue
    within = None
    if chunk_shape != shard_shape:
      within = _layout.relative(box, tuple((s, s + n) for s, n in zip(start, shard_shape)))
    pieces.append(_planning.Piece(array, _layout.box_to_slices(box), chunk_shape, dtype,
                                  [_planning.Source(ref(local[start]), within)]))
  return rec


def plan(planner, leaves, nproc, me):
  """Records, pieces (as comparable tuples) and the encoded manifest of one process's plan."""
  load, pack_sizes, packed, pieces, records = [0] * nproc, [0] * nproc, [], [], []
  for i, leaf in enumerate(leaves):
    records.append(planner("state", f"a{i}", (f"l{i}",), leaf, "jax", me, load, pack_sizes,
                           packed, pieces, lambda k, i=i: (i, k)))
  if pack_sizes[me]:
    pieces.extend(_planning.pack_pieces("state", pack_sizes[me], packed))
  manifest = {"format": _manifest.FORMAT, "version": _manifest.VERSION, "library_version": "t",
              "created": 0.0, "process_count": nproc, "device_count": 1, "all_chunks_stored": True,
              "generation": "0123456789abcdef", "custom": {},
              "items": {"state": {"leaves": records,
                                  "packed": {str(p): s for p, s in enumerate(pack_sizes) if s}}}}
  got_pieces = [(p.array, p.slices, p.shape, p.dtype.str,
                 [(s.value, s.within, s.offset, s.leaf_shape, s.index) for s in p.sources])
                for p in pieces]
  return records, got_pieces, json.dumps(manifest, sort_keys=True), load


MESHES = {
    # name: device -> process over a mesh, as a numpy array of process indices
    "one_holder_per_shard": np.arange(16).reshape(8, 2) // 2,   # 8 processes, 2 devices each
    "replicas_across_processes": np.array([[0, 1], [2, 3], [0, 1], [2, 3]]),
    "overlapping_holders": np.array([[0, 1, 2], [1, 2, 0], [2, 0, 1]]),
    "one_process": np.zeros((2, 4), dtype=np.int64),
    "interleaved": np.arange(24).reshape(4, 6) % 5,
}
SPECS = [(0, 1), (1, 0), (0, None), (None, 1), (), (1,), (None, 0)]
SHAPES = [(512, 1024), (96, 4096), (1 << 10, 1 << 11), (600, 1200), (64, 8), (1 << 20,), ()]


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_numpy_planning_gives_the_chunk_by_chunk_plan_for_every_process(mesh, monkeypatch):
  # Small chunks, so that arrays of a few MB have hundreds of chunks and owners to balance.
  monkeypatch.setattr(_layout, "DEFAULT_MAX_CHUNK_BYTES", 64 << 10)
  procs = MESHES[mesh]
  nproc = int(procs.max()) + 1
  rng = random.Random(mesh)
  cases = [(shape, spec) for shape in SHAPES for spec in SPECS
           if len(spec) <= len(shape) and all(
               a is None or shape[d] % procs.shape[a] == 0 for d, a in enumerate(spec))]
  rng.shuffle(cases)
  dtypes = [rng.choice(["float32", "int8", "float64"]) for _ in cases]
  checked_chunks = 0
  for me in range(nproc):
    leaves = [Leaf(shape, np.dtype(dtype), GridSharding(procs, spec, me))
              for (shape, spec), dtype in zip(cases, dtypes)]
    new = plan(_planning.plan_array, leaves, nproc, me)
    old = plan(old_plan_array, leaves, nproc, me)
    assert new[0] == old[0]   # records: chunk shapes, owners, packed offsets
    assert new[2] == old[2]   # the manifest, byte for byte
    assert new[3] == old[3]   # bytes each process writes
    assert new[1] == old[1]   # this process's pieces: stored array, region, source shard
    checked_chunks += sum(len(r["owners"]) for r in new[0])
  assert checked_chunks > 1000  # the layouts really are chunked


def test_closed_form_owners_equal_the_greedy_ones_on_random_holder_sets():
  rng = random.Random(0)
  for _ in range(2000):
    n = rng.randint(1, 9)
    if rng.random() < 0.6:  # a partition of the processes (closed form)
      order = rng.sample(range(n), n)
      cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
      sets = [frozenset(order[a:b]) for a, b in zip([0] + cuts, cuts + [n])]
    else:  # overlapping sets (chunk by chunk)
      sets = [frozenset(rng.sample(range(n), rng.randint(1, n))) for _ in range(rng.randint(1, 4))]
    group = np.array([rng.randrange(len(sets)) for _ in range(rng.randint(0, 80))], dtype=np.int64)
    chunk_bytes = rng.choice([1, 7, 4096])
    load = [rng.choice([0, rng.randint(0, 50), rng.randint(0, 10 ** 6)]) for _ in range(n)]
    old_load, new_load = list(load), list(load)
    old = _planning.assign_owners([sets[g] for g in group.tolist()], chunk_bytes, old_load)
    new = _planning.assign_owners_grid(group, sets, chunk_bytes, new_load)
    assert new.tolist() == old and new_load == old_load, (sets, group, chunk_bytes, load)
