"""The local tier: each process's own shards on its own fast disk, replicated to peers.

Layout, per process (``<directory>/process_<i>/``, never read by another
process):

```
<step>/
  own.blob               this process's shards: an 8-byte index length, the JSON index
                         (with a CRC-32C per 16 MiB of each shard), the bytes
  replica-<q>.blob       the same blob of process q (received with a JAX collective)
  COMMITTED              written once every process reported its part durable
```

A step counts only once ``COMMITTED`` exists: every process (and its replicas)
wrote its part, agreed through the coordination service, so a restore never
mixes steps. A local step is tied to the process layout that wrote it (the
same process count, the same devices per process, the same shardings): a job
with another layout ignores the local tier and reads the persistent one.

Restore: every process reports what it holds; each computes, from the same
reports, the newest step every process can get (its own blob, else a peer's
replica of it), and the processes whose own copy is missing receive it from a
replica holder with the same collective. See :meth:`LocalTier.plan_restore`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from orbax_flax import _crc
from orbax_flax import _layout
from orbax_flax import _manifest
from orbax_flax import _multihost
from orbax_flax import _progress
from orbax_flax import _staging
from orbax_flax import _tree
from orbax_flax import errors
from orbax_flax.formats import _cbytes
from orbax_flax.tiers import _exchange

log = logging.getLogger("orbax_flax")

OWN = "own.blob"
COMMITTED = "COMMITTED"
_TMP = ".ofx-tmp-local"
_DAMAGED = "damaged own copy: "


def _is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass
class Blob:
  """A local checkpoint of one process: ``header`` (length + JSON index), then ``pieces``."""
  header: bytes
  pieces: list[np.ndarray]  # uint8 views of the shards, in payload order

  @property
  def nbytes(self) -> int:
    return len(self.header) + sum(p.nbytes for p in self.pieces)

  def parts(self) -> list[np.ndarray]:
    return [np.frombuffer(self.header, np.uint8)] + self.pieces


def encode(step: int, items: Mapping[str, Any]) -> Blob:
  """This process's shards of ``items``: an index and views of the shard bytes (no copy on CPU).

  Each shard's bytes carry one CRC-32C per :data:`SEGMENT` bytes, computed in
  parallel, so that a restore checks each segment as it reads it, in parallel.
  """
  pieces: list[np.ndarray] = []
  entries: list[dict[str, Any]] = []
  at = 0
  out_items = {}
  for item, tree in items.items():
    structure, leaves = _tree.encode_structure(tree)
    recs = []
    for path, leaf in leaves:
      kind = _tree.leaf_kind(leaf)
      if kind is None:
        raise _tree.unsupported_leaf_error(item, path, leaf)
      if kind == "value":
        recs.append({"path": list(path), "kind": "value", "value": _tree.encode_value(leaf)})
        continue
      rec: dict[str, Any] = {"path": list(path), "kind": kind}
      data = leaf
      if kind == "jax" and _is_key(leaf):
        rec["key_impl"] = getattr(getattr(leaf.dtype, "_impl", None), "name", None)
        data = jax.random.key_data(leaf)
      rec.update(shape=list(data.shape), dtype=np.dtype(data.dtype).name)
      boxes: dict[tuple, dict[str, Any]] = {}
      shards = ([(_layout.slices_to_box(sh.index, data.shape), sh.device.id, sh.data)
                 for sh in data.addressable_shards] if kind == "jax"
                else [(tuple((0, n) for n in data.shape), None, data)])
      for box, device, value in shards:
        entry = boxes.get(box)
        if entry is None:
          raw = np.ascontiguousarray(np.asarray(value)).reshape(-1).view(np.uint8)
          entry = boxes[box] = {"box": [list(b) for b in box], "devices": [], "offset": at,
                                "nbytes": raw.nbytes}
          pieces.append(raw)
          entries.append(entry)
          at += raw.nbytes
        if device is not None:
          entry["devices"].append(device)
      rec["boxes"] = list(boxes.values())
      recs.append(rec)
    out_items[item] = {"structure": structure, "leaves": recs}
  segments = [(k, lo) for k, p in enumerate(pieces) for lo in range(0, p.nbytes, SEGMENT)]
  with concurrent.futures.ThreadPoolExecutor(_WRITERS) as pool:  # ctypes CRC: no GIL
    crcs = list(pool.map(lambda t: _crc.value(pieces[t[0]][t[1]:t[1] + SEGMENT]), segments))
  for entry in entries:
    entry["crc32c"] = []
  for (k, _), crc in zip(segments, crcs):
    entries[k]["crc32c"].append(crc)
  index = json.dumps({
      "step": step, "process_index": jax.process_index(), "process_count": jax.process_count(),
      "devices": sorted(d.id for d in jax.local_devices()), "segment": SEGMENT,
      "items": out_items}).encode()
  return Blob(struct.pack("<Q", len(index)) + index, pieces)


_WRITERS = 8
SEGMENT = 16 << 20  # bytes per checksum, and per parallel read


def write_parts(path: str, parts: list[np.ndarray]) -> None:
  """Writes ``parts`` one after another into ``path`` with parallel pwrites, then fsyncs."""
  offsets, at = [], 0
  for part in parts:
    offsets.append(at)
    at += part.nbytes
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  try:
    os.ftruncate(fd, at)

    def put(task: tuple[int, int]) -> None:  # one segment of a part (a large part is many)
      k, lo = task
      view = memoryview(parts[k]).cast("B")[lo:lo + SEGMENT]
      done = 0
      while done < len(view):
        done += os.pwrite(fd, view[done:], offsets[k] + lo + done)
    _parallel(put, [(k, lo) for k, p in enumerate(parts) for lo in range(0, p.nbytes, SEGMENT)])
    os.fsync(fd)
  finally:
    os.close(fd)


@dataclasses.dataclass
class Payload:
  """A blob's shard bytes: ``data``, with each shard at ``at[its offset in the blob]``.

  Read from a file, every shard starts 64-byte aligned in one fresh mapping,
  so that JAX's CPU client adopts it without a copy; in memory (a received
  replica), ``at`` is None and shards lie as in the blob.
  """
  data: np.ndarray
  at: dict[int, int] | None = None

  def pos(self, offset: int) -> int:
    return offset if self.at is None else self.at[offset]

  def box(self, offset: int, nbytes: int) -> np.ndarray:
    if not nbytes:
      return np.empty(0, np.uint8)
    lo = self.pos(offset)
    return self.data[lo:lo + nbytes]


def read_blob(path: str, where: str) -> tuple[dict[str, Any], Payload]:
  """The index and shard bytes of a blob file, read by parallel preads.

  Every segment's CRC-32C is checked by the thread that read it, while the
  bytes are in its cache; CheckpointCorruptedError names the array if not.
  """
  fd = os.open(path, os.O_RDONLY)
  try:
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
      raise errors.CheckpointCorruptedError(f"{where}: truncated local checkpoint ({path})")
    (n,) = struct.unpack("<Q", head)
    index = _parse_index(os.pread(fd, n, 8), where)
    size = max(os.fstat(fd).st_size - 8 - n, 0)
    segments = _segments(index, size)
    if "segment" in index:
      ends: dict[int, int] = {}
      for lo, length, _, _, base in segments:
        ends[base] = max(ends.get(base, 0), lo + length - base)
      at, total = {}, 0
      for base in sorted(ends):
        at[base] = total
        total += -(-ends[base] // 64) * 64
      payload = Payload(_staging.fresh_arrays([((total,), np.dtype(np.uint8))])[0], at)
    else:
      payload = Payload(np.empty(size, np.uint8))
    view = memoryview(payload.data)

    def read(t: tuple[int, int, str, int | None, int]) -> None:
      lo, length, _, _, base = t
      dst = payload.pos(base) + lo - base
      _pread_into(fd, view[dst:dst + length], 8 + n + lo,
                  f"{where}: {path} is shorter than its index says")
      _check(payload, t, where)
    _parallel(read, segments)
  finally:
    os.close(fd)
  return index, payload


def read_bytes(path: str) -> np.ndarray:
  """A whole file into one fresh buffer, by parallel preads."""
  fd = os.open(path, os.O_RDONLY)
  try:
    size = os.fstat(fd).st_size
    out = np.empty(size, np.uint8)
    view = memoryview(out)

    _parallel(lambda lo: _pread_into(fd, view[lo:lo + SEGMENT], lo,
                                     f"{path}: shorter than expected"),
              list(range(0, size, SEGMENT)))
  finally:
    os.close(fd)
  return out


def _pread_into(fd: int, view: memoryview, offset: int, short: str) -> None:
  """Fills ``view`` from ``fd`` at ``offset``; CheckpointCorruptedError(``short``) at end of file."""
  try:
    _cbytes.pread_exact(fd, view, offset)
  except EOFError as e:
    raise errors.CheckpointCorruptedError(short) from e


def decode(blob: np.ndarray, where: str) -> tuple[dict[str, Any], Payload]:
  """The index and the bytes of a blob in memory; CheckpointCorruptedError if damaged."""
  if blob.nbytes < 8:
    raise errors.CheckpointCorruptedError(f"{where}: truncated local checkpoint")
  (n,) = struct.unpack("<Q", blob[:8].tobytes())
  index = _parse_index(blob[8:8 + n].tobytes(), where)
  payload = Payload(blob[8 + n:])
  _parallel(lambda t: _check(payload, t, where), _segments(index, payload.data.nbytes))
  return index, payload


def _parse_index(data: bytes, where: str) -> dict[str, Any]:
  try:
    return json.loads(data)
  except ValueError as e:
    raise errors.CheckpointCorruptedError(f"{where}: damaged index ({e})") from e


def _segments(index: dict[str, Any], size: int) -> list[tuple[int, int, str, int | None, int]]:
  """(blob offset, length, array name, its CRC-32C, its shard's offset) of every segment."""
  if "crc32c" in index:  # written before per-segment checksums: one over the whole payload
    return [(0, size, "the local checkpoint", index["crc32c"], 0)]
  seg = index["segment"]
  out = []
  for item, saved in index["items"].items():
    for rec in saved["leaves"]:
      for entry in rec.get("boxes", ()):
        name = f"{item}/{_tree.path_str(tuple(rec['path']))} box {entry['box']}"
        for k, crc in enumerate(entry["crc32c"]):
          lo = entry["offset"] + k * seg
          out.append((lo, min(seg, entry["nbytes"] - k * seg), name, crc, entry["offset"]))
  if sum(t[1] for t in out) != size:
    raise errors.CheckpointCorruptedError(f"the local checkpoint holds {size} bytes of data,"
                                          f" its index {sum(t[1] for t in out)}")
  return out


def _check(payload: Payload, t: tuple[int, int, str, int | None, int], where: str) -> None:
  lo, length, name, crc, base = t
  dst = payload.pos(base) + lo - base
  if crc is not None and _crc.value(payload.data[dst:dst + length]) != crc:
    raise errors.CheckpointCorruptedError(
        f"{where}: checksum mismatch in {name}; the local copy is damaged")


def _parallel(fn, tasks: list) -> None:
  if len(tasks) <= 1:
    for t in tasks:
      fn(t)
    return
  with concurrent.futures.ThreadPoolExecutor(min(_WRITERS, len(tasks))) as pool:
    for f in [pool.submit(fn, t) for t in tasks]:
      f.result()


def build(index: dict[str, Any], payload: Payload, target: Mapping[str, Any]) -> dict[str, Any]:
  """The items of a blob as jax/numpy values laid out as ``target`` wants.

  Every device shard is placed with one batched ``device_put``; the first
  device of each shard adopts the aligned host buffer (no copy on CPU).

  Raises:
    LayoutChanged: the target's shardings (or this process's devices) are not
      the ones the blob was saved with.
  """
  placing = _Placing()
  out = {}
  for item, tree in target.items():
    saved = index["items"].get(item)
    if saved is None:
      raise LayoutChanged(f"item {item!r} is not in the local checkpoint")
    if tree is None:  # the item as saved (host values only, e.g. data iterator states)
      values = [_one(r, None, payload, f"{item}/{_tree.path_str(tuple(r['path']))}", placing)
                for r in saved["leaves"]]
      out[item] = (saved["structure"], values, None)
      continue
    recs = {tuple(r["path"]): r for r in saved["leaves"]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = []
    for kp, want in flat:
      path = tuple(_tree.key_part(k) for k in kp)
      rec = recs.get(path)
      if rec is None:
        raise LayoutChanged(f"{item}/{_tree.path_str(path)} is not in the local checkpoint")
      leaves.append(_one(rec, want, payload, f"{item}/{_tree.path_str(path)}", placing))
    out[item] = (None, leaves, treedef)
  placed = placing.place()
  result = {}
  for item, (structure, leaves, treedef) in out.items():
    leaves = [placed[id(x)] if isinstance(x, _Pending) else x for x in leaves]
    result[item] = (_tree.decode_structure(structure, leaves) if treedef is None
                    else jax.tree_util.tree_unflatten(treedef, leaves))
  return result


class LayoutChanged(ValueError):
  """The local checkpoint was written with another process layout or other shardings."""


@dataclasses.dataclass(eq=False)
class _Pending:
  """A device array to assemble once its shards are placed."""
  shape: tuple[int, ...]
  sharding: Any
  shards: int
  key_impl: str | None


class _Placing:
  """Collects every shard of a restore for one batched ``device_put``."""

  def __init__(self):
    self.values, self.devices, self.alias, self.pending = [], [], [], []
    self._adopted: set[int] = set()

  def add(self, pending: _Pending, shards: list[tuple[np.ndarray, Any, int]]) -> _Pending:
    for data, device, box_offset in shards:
      self.values.append(data)
      self.devices.append(device)
      # One device per shard adopts the buffer; the others get copies, so that
      # donating one array cannot change another.
      self.alias.append(box_offset not in self._adopted)
      self._adopted.add(box_offset)
    self.pending.append(pending)
    return pending

  def place(self) -> dict[int, Any]:
    placed = jax.device_put(self.values, self.devices, may_alias=self.alias) if self.values else []
    out, k = {}, 0
    for p in self.pending:
      array = jax.make_array_from_single_device_arrays(p.shape, p.sharding, placed[k:k + p.shards])
      k += p.shards
      out[id(p)] = jax.random.wrap_key_data(array, impl=p.key_impl) if p.key_impl else array
    return out


def _one(rec: dict[str, Any], want: Any, payload: Payload, where: str, placing: _Placing) -> Any:
  if rec["kind"] == "value":
    return _tree.decode_value(rec["value"])
  dtype = _tree.dtype_from_name(rec["dtype"])
  shape = tuple(rec["shape"])

  def data(entry):  # a view of the payload
    raw = payload.box(entry["offset"], entry["nbytes"])
    return raw.view(dtype).reshape(_layout.box_shape(tuple(map(tuple, entry["box"]))))

  if rec["kind"] == "numpy":
    return data(rec["boxes"][0])
  if not isinstance(want, (jax.Array, jax.ShapeDtypeStruct)) or want.sharding is None:
    raise LayoutChanged(f"{where}: the target is not a sharded array as saved")
  sharding = want.sharding
  if rec.get("key_impl"):
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
        *sharding.spec, None)) if isinstance(sharding, jax.sharding.NamedSharding) else sharding
  by_device = {d: e for e in rec["boxes"] for d in e["devices"]}
  shards = []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    entry = by_device.get(device.id)
    box = _layout.slices_to_box(index, shape)
    if entry is None or tuple(map(tuple, entry["box"])) != box:
      raise LayoutChanged(f"{where}: device {device.id} needs box {box}, which the local"
                          " checkpoint does not hold as one shard (another mesh or sharding)")
    shards.append((data(entry), device, entry["offset"]))
  return placing.add(_Pending(shape, sharding, len(shards), rec.get("key_impl")), shards)


@dataclasses.dataclass
class Holdings:
  """What one process holds in its local directory."""
  own: list[int]
  replicas: dict[int, list[int]]  # process -> steps of its blob held here
  process_count: int

  def to_json(self) -> str:
    return json.dumps({"own": self.own, "replicas": {str(k): v for k, v in self.replicas.items()},
                       "n": self.process_count})

  @classmethod
  def from_json(cls, text: str) -> "Holdings":
    d = json.loads(text)
    return cls(d["own"], {int(k): v for k, v in d["replicas"].items()}, d["n"])


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  """Where each process gets step ``step`` from: its own copy or a replica holder."""
  step: int
  source: tuple[int, ...]  # source[p]: the process whose local directory holds p's blob


def plan_restore(holdings: list[Holdings], newer_than: int | None) -> RestorePlan | None:
  """The newest step every process can get, if newer than ``newer_than``; pure.

  Example:
    >>> h = [Holdings([10, 20], {1: [20]}, 2), Holdings([10], {0: [10, 20]}, 2)]
    >>> plan_restore(h, None)       # process 1 lost step 20; process 0 holds its replica
    RestorePlan(step=20, source=(0, 0))
    >>> plan_restore(h, 20) is None
    True
  """
  n = len(holdings)
  if any(h.process_count != n for h in holdings):
    return None
  candidates = sorted({s for h in holdings for s in h.own} |
                      {s for h in holdings for v in h.replicas.values() for s in v}, reverse=True)
  for step in candidates:
    if newer_than is not None and step <= newer_than:
      return None
    source = []
    for p in range(n):
      if step in holdings[p].own:
        source.append(p)
        continue
      holder = next((r for r in range(n) if step in holdings[r].replicas.get(p, [])), None)
      if holder is None:
        break
      source.append(holder)
    if len(source) == n:
      return RestorePlan(step, tuple(source))
  return None


def run_dir(run: str) -> str:
  """The subdirectory of the local directory that holds the steps of ``run``.

  A digest of the run's persistent directory: two jobs that share a
  ``local_directory`` (``/dev/shm/ckpt`` on one host) but save to different
  places never see nor delete each other's local steps.

  Example:
    >>> run_dir("/tmp/exp1/checkpoints") != run_dir("/tmp/exp2/checkpoints")
    True
    >>> run_dir("/tmp/exp1/checkpoints")
    'run-c948a8532e42830d'
  """
  return "run-" + hashlib.sha256(run.encode()).hexdigest()[:16]


_RECORD_MAGIC = b"orbax_flax local step v1"


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """What a local step's ``COMMITTED`` file records (sealed with a SHA-256)."""
  step: int
  run: str               # the persistent directory of the run that saved it
  timeline: str          # the manager's timeline when it was saved (see CheckpointManager.timeline)
  seq: int               # commit order in this directory: retention keeps the newest commits
  process_count: int

  def encode(self) -> bytes:
    return _manifest.seal(_RECORD_MAGIC, json.dumps(dataclasses.asdict(self)).encode())

  @classmethod
  def decode(cls, data: bytes, where: str) -> "StepRecord":
    body = _manifest.unseal(_RECORD_MAGIC, data, where)
    try:
      d = json.loads(body)
      return cls(int(d["step"]), str(d["run"]), str(d["timeline"]), int(d["seq"]),
                 int(d["process_count"]))
    except (ValueError, KeyError, TypeError) as e:
      raise errors.CheckpointCorruptedError(f"{where}: not a local step record ({e})") from None


class LocalTier:
  """Saves and restores this process's shards in ``directory/run-<digest>/process_<i>``.

  Args:
    directory: a fast local directory (e.g. ``/dev/shm/ckpt``), which jobs
      may share: each run uses its own ``run-<digest>`` below it
      (:func:`run_dir`), each process its own ``process_<i>`` below that.
    run: what identifies the run, the persistent tier's directory (the
      callback passes its manager's): a local step of another run is never
      read, listed or deleted.
    replicas: how many other processes hold a copy of each process's shards
      (losing any ``replicas`` local directories loses no local step).
    max_to_keep: committed local steps kept (the newest commits).
    timeout_seconds: how long a process waits for the others.
  """

  def __init__(self, directory: str, *, run: str, replicas: int = 1, max_to_keep: int = 1,
               timeout_seconds: float = _multihost.DEFAULT_TIMEOUT_S):
    n = jax.process_count()
    if replicas < 0:
      raise ValueError(f"replicas={replicas}: must be >= 0")
    if n > 1 and replicas > n - 1:
      raise ValueError(f"replicas={replicas} with {n} processes: at most {n - 1} other processes"
                       " can hold a copy; lower replicas")
    if max_to_keep < 1:
      raise ValueError(f"local_max_to_keep={max_to_keep}: keep at least 1 local step")
    self.run = run
    self.root = os.path.join(directory, run_dir(run), f"process_{jax.process_index()}")
    self.replicas = replicas if n > 1 else 0
    self.max_to_keep = max_to_keep
    self.timeout = timeout_seconds
    self._key = _multihost.namespace("local_tier")
    self._calls = 0

  def _next_key(self, what: str) -> str:
    """A coordination key unique to this call: every process makes the same calls in order."""
    self._calls += 1
    return f"{self._key}/{self._calls}-{what}"

  def _dir(self, step: int) -> str:
    return os.path.join(self.root, str(step))

  def save(self, step: int, items: Mapping[str, Any], *, timeline: str = "") -> float:
    """Saves ``step`` of ``timeline`` to the local tier on every process; returns the seconds.

    Collective: every process calls it with the same step. Raises if any
    process failed (then nobody marks the step committed).
    """
    start = time.perf_counter()
    me, n = jax.process_index(), jax.process_count()
    key = self._next_key(f"save{step}")
    tmp = self._dir(step) + _TMP
    error = ""
    parts: list[np.ndarray] = []
    try:
      parts = encode(step, items).parts()
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(tmp)
      write_parts(os.path.join(tmp, OWN), parts)
    except (OSError, ValueError, TypeError) as e:
      error = f"{type(e).__name__}: {e}"
    for k in range(1, self.replicas + 1):  # every process takes part, even after a failure
      got = _exchange.shift_parts(parts, k, f"{key}/x{k}", self.timeout)
      if not error:
        try:
          write_parts(os.path.join(tmp, f"replica-{(me - k) % n}.blob"), [got])
        except OSError as e:
          error = f"{type(e).__name__}: {e}"
    if not error:
      try:
        shutil.rmtree(self._dir(step), ignore_errors=True)
        os.rename(tmp, self._dir(step))
      except OSError as e:
        error = f"{type(e).__name__}: {e}"
    verdicts = _multihost.all_gather(f"{key}/done", error, self.timeout,
                                     what=f"finish local step {step}")
    failed = [f"process {p}: {v}" for p, v in enumerate(verdicts) if v]
    if failed:
      shutil.rmtree(tmp, ignore_errors=True)
      raise errors.StorageError(f"local save of step {step} failed; it does not count:\n  "
                                + "\n  ".join(failed))
    try:
      records, _ = self._records()
      seq = 1 + max((r.seq for r in records.values()), default=0)
      _write(os.path.join(self._dir(step), COMMITTED),
             StepRecord(step, self.run, timeline, seq, n).encode())
      self._prune()
    except OSError as e:  # this process's copy does not count: a restore finds it uncommitted
      raise errors.StorageError(f"local save of step {step}: process {me} could not commit it"
                                f" ({type(e).__name__}: {e})") from e
    return time.perf_counter() - start

  def _records(self) -> tuple[dict[int, StepRecord], list[str]]:
    """The committed steps here (this run's, by their records), and the damaged ones, why."""
    out, damaged = {}, []
    for name in os.listdir(self.root) if os.path.isdir(self.root) else []:
      path = os.path.join(self.root, name, COMMITTED)
      if not name.isdigit() or not os.path.exists(path):
        continue
      try:
        with open(path, "rb") as f:
          record = StepRecord.decode(f.read(1 << 16), path)
      except (OSError, errors.CheckpointCorruptedError) as e:
        damaged.append(f"step {name}: {e}")
        continue
      if record.run != self.run or record.step != int(name):
        damaged.append(f"step {name}: its record names run {record.run!r} step {record.step}")
        continue
      out[record.step] = record
    return out, damaged

  def _prune(self) -> None:
    """Keeps the ``max_to_keep`` newest commits (not the highest step numbers: after a
    rollback the new timeline's steps are the lower ones) and removes everything else."""
    records, _ = self._records()
    keep = {r.step for r in sorted(records.values(), key=lambda r: r.seq)[-self.max_to_keep:]}
    for name in os.listdir(self.root):
      if (name.isdigit() and int(name) not in keep) or _TMP in name:
        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

  def holdings(self, timeline: str | None = None) -> Holdings:
    """Committed local steps here (of ``timeline``, if given), and the peers' replicas held
    here; the steps left out, and why, are logged."""
    own, replicas = [], {}
    n = jax.process_count()
    records, ignored = self._records()
    for step, record in sorted(records.items()):
      if timeline is not None and record.timeline != timeline:
        ignored.append(f"step {step}: of timeline {record.timeline or '(the first)'!r}, which"
                       f" a rollback abandoned; this run continues timeline"
                       f" {timeline or '(the first)'!r}")
        continue
      d = self._dir(step)
      if os.path.exists(os.path.join(d, OWN)):
        own.append(step)
      for f in os.listdir(d):
        if f.startswith("replica-") and f.endswith(".blob") and f[8:-5].isdigit():
          replicas.setdefault(int(f[len("replica-"):-len(".blob")]), []).append(step)
    if ignored:
      _progress.say("local tier (%s): ignoring %s", self.root, "; ".join(ignored))
    counts = [records[s].process_count for s in own]
    return Holdings(sorted(own), {k: sorted(v) for k, v in replicas.items()},
                    counts[-1] if counts else n)

  def restore(self, target: Mapping[str, Any], newer_than: int | None = None, *,
              timeline: str | None = None) -> tuple[int, dict[str, Any], str] | None:
    """The newest local step of ``timeline`` every process can assemble, if newer than
    ``newer_than``.

    Collective. Returns ``(step, items, source)`` (``source`` says where this
    process's shards came from), or None when the local tier has nothing newer
    or was written by another layout; every process gets the same answer.
    """
    n = jax.process_count()
    key = self._next_key("restore")
    mine = self.holdings(timeline)
    reports = _multihost.all_gather(f"{key}/holdings", mine.to_json(), self.timeout,
                                    what="report its local steps")
    holdings = [Holdings.from_json(r) for r in reports]
    if any(h.process_count != n for h in holdings if h.own or h.replicas):
      _progress.say("local tier: written by a job of another process count; it is tied to the process"
               " layout, so the persistent tier is used")
      return None
    for attempt in range(n + 1):
      plan = plan_restore(holdings, newer_than)
      if plan is None:
        held = sorted({s for h in holdings for s in h.own})
        _progress.say("local tier: no step that every process can get (own copy or a peer's"
                      " replica)%s; steps held: %s",
                      "" if newer_than is None else f" newer than step {newer_than}", held or "none")
        return None
      got, verdicts = self._assemble(plan, target, f"{key}/{attempt}")
      damaged = [p for p, v in enumerate(verdicts) if v.startswith(_DAMAGED)]
      bad = [f"process {p}: {v.removeprefix(_DAMAGED)}" for p, v in enumerate(verdicts) if v]
      if not bad:
        return got
      if len(damaged) == len(bad):  # damaged own copies: try their peers' replicas of them
        _progress.say("local tier: step %d: %s; trying the peers' replicas", plan.step,
                      "; ".join(bad))
        for p in damaged:
          holdings[p].own = [s for s in holdings[p].own if s != plan.step]
        continue
      _progress.say("local tier: step %d cannot be used (%s); the persistent tier is used",
                    plan.step, "; ".join(bad))
      return None
    return None

  def _assemble(self, plan: RestorePlan, target: Mapping[str, Any], key: str
                ) -> tuple[tuple[int, dict[str, Any], str] | None, list[str]]:
    """Every process gets its blob of ``plan.step`` and builds it; collective.

    Returns this process's result and every process's verdict ("" when it
    succeeded; prefixed with ``_DAMAGED`` when its own copy is damaged).
    """
    me, n = jax.process_index(), jax.process_count()
    blob, decoded, where, error = None, None, "nowhere", ""
    what = f"local step {plan.step} of process {me}"
    if plan.source[me] == me:
      try:
        decoded = read_blob(os.path.join(self._dir(plan.step), OWN), what)
      except (OSError, errors.CheckpointCorruptedError) as e:  # the others still exchange
        error = f"{_DAMAGED}{type(e).__name__}: {e}"
      where = "its own local copy"
    # Replica holders send to the processes that lost their copy, one shift at a time.
    for shift in sorted({(p - s) % n for p, s in enumerate(plan.source) if s != p}):
      send: list[np.ndarray] = []
      target_p = (me + shift) % n
      if plan.source[target_p] == me and target_p != me:
        try:
          send = [read_bytes(os.path.join(self._dir(plan.step), f"replica-{target_p}.blob"))]
        except OSError as e:  # the receiver gets nothing and says so
          error = f"{type(e).__name__}: {e}"
      got = _exchange.shift_parts(send, shift, f"{key}/x{shift}", self.timeout)
      if plan.source[me] == (me - shift) % n and plan.source[me] != me:
        blob = got
        where = f"the replica held by process {plan.source[me]}"
    items = None
    if not error:
      try:
        index, payload = decoded if decoded is not None else decode(blob, what)
        items = build(index, payload, target)
      except (LayoutChanged, errors.CheckpointCorruptedError) as e:
        error = str(e)
    verdicts = _multihost.all_gather(f"{key}/ok", error, self.timeout,
                                     what="assemble the local step")
    return (plan.step, items, where) if not any(verdicts) else None, verdicts


def _write(path: str, data: bytes) -> None:
  with open(path, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
