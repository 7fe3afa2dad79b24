"""The local tier: each process's own shards on its own fast disk, replicated to peers.

Layout, per process (``<directory>/process_<i>/``, never read by another
process):

```
<step>/
  own.blob               this process's shards: an 8-byte index length, the JSON index, the bytes
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
from orbax_flax import _multihost
from orbax_flax import _progress
from orbax_flax import _tree
from orbax_flax import errors
from orbax_flax.tiers import _exchange

log = logging.getLogger("orbax_flax")

OWN = "own.blob"
COMMITTED = "COMMITTED"
_TMP = ".ofx-tmp-local"


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
  """This process's shards of ``items``: an index and views of the shard bytes (no copy on CPU)."""
  pieces: list[np.ndarray] = []
  at = 0
  crc = 0
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
          crc = _crc.extend(crc, raw)
          entry = boxes[box] = {"box": [list(b) for b in box], "devices": [], "offset": at,
                                "nbytes": raw.nbytes}
          pieces.append(raw)
          at += raw.nbytes
        if device is not None:
          entry["devices"].append(device)
      rec["boxes"] = list(boxes.values())
      recs.append(rec)
    out_items[item] = {"structure": structure, "leaves": recs}
  index = json.dumps({
      "step": step, "process_index": jax.process_index(), "process_count": jax.process_count(),
      "devices": sorted(d.id for d in jax.local_devices()), "crc32c": crc,
      "items": out_items}).encode()
  return Blob(struct.pack("<Q", len(index)) + index, pieces)


_WRITERS = 8


def write_parts(path: str, parts: list[np.ndarray]) -> None:
  """Writes ``parts`` one after another into ``path`` with parallel pwrites, then fsyncs."""
  offsets, at = [], 0
  for part in parts:
    offsets.append(at)
    at += part.nbytes
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  try:
    os.ftruncate(fd, at)

    def put(k: int) -> None:
      view = memoryview(parts[k]).cast("B")
      done = 0
      while done < len(view):
        done += os.pwrite(fd, view[done:done + (64 << 20)], offsets[k] + done)
    with concurrent.futures.ThreadPoolExecutor(_WRITERS) as pool:
      list(pool.map(put, range(len(parts))))
    os.fsync(fd)
  finally:
    os.close(fd)


def read_file(path: str) -> np.ndarray:
  """A whole file into one fresh buffer (``readinto``: no intermediate copy)."""
  size = os.path.getsize(path)
  out = np.empty(size, np.uint8)
  with open(path, "rb", buffering=0) as f:
    view, got = memoryview(out), 0
    while got < size:
      n = f.readinto(view[got:])
      if not n:
        raise errors.CheckpointCorruptedError(f"{path}: shorter than expected")
      got += n
  return out


def decode(blob: np.ndarray, where: str) -> tuple[dict[str, Any], np.ndarray]:
  """The index and the bytes of a blob (a uint8 array); CheckpointCorruptedError if damaged."""
  if blob.nbytes < 8:
    raise errors.CheckpointCorruptedError(f"{where}: truncated local checkpoint")
  (n,) = struct.unpack("<Q", blob[:8].tobytes())
  try:
    index = json.loads(blob[8:8 + n].tobytes())
  except ValueError as e:
    raise errors.CheckpointCorruptedError(f"{where}: damaged index ({e})") from e
  payload = blob[8 + n:]
  if _crc.value(payload) != index["crc32c"]:
    raise errors.CheckpointCorruptedError(f"{where}: checksum mismatch; the local copy is damaged")
  return index, payload


def build(index: dict[str, Any], payload: np.ndarray, target: Mapping[str, Any]) -> dict[str, Any]:
  """The items of a blob as jax/numpy values laid out as ``target`` wants.

  Raises:
    LayoutChanged: the target's shardings (or this process's devices) are not
      the ones the blob was saved with.
  """
  out = {}
  for item, tree in target.items():
    saved = index["items"].get(item)
    if saved is None:
      raise LayoutChanged(f"item {item!r} is not in the local checkpoint")
    if tree is None:  # the item as saved (host values only, e.g. data iterator states)
      values = [_one(r, None, payload, f"{item}/{_tree.path_str(tuple(r['path']))}")
                for r in saved["leaves"]]
      out[item] = _tree.decode_structure(saved["structure"], values)
      continue
    recs = {tuple(r["path"]): r for r in saved["leaves"]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = []
    for kp, want in flat:
      path = tuple(_tree.key_part(k) for k in kp)
      rec = recs.get(path)
      if rec is None:
        raise LayoutChanged(f"{item}/{_tree.path_str(path)} is not in the local checkpoint")
      leaves.append(_one(rec, want, payload, f"{item}/{_tree.path_str(path)}"))
    out[item] = jax.tree_util.tree_unflatten(treedef, leaves)
  return out


class LayoutChanged(ValueError):
  """The local checkpoint was written with another process layout or other shardings."""


def _one(rec: dict[str, Any], want: Any, payload: np.ndarray, where: str) -> Any:
  if rec["kind"] == "value":
    return _tree.decode_value(rec["value"])
  dtype = _tree.dtype_from_name(rec["dtype"])
  shape = tuple(rec["shape"])

  def data(entry):  # a view of the blob: device_put copies it (or adopts it, on CPU)
    raw = payload[entry["offset"]:entry["offset"] + entry["nbytes"]]
    return raw.view(dtype).reshape(_layout.box_shape(tuple(map(tuple, entry["box"]))))

  if rec["kind"] == "numpy":
    return data(rec["boxes"][0])
  if not isinstance(want, (jax.Array, jax.ShapeDtypeStruct)) or want.sharding is None:
    raise LayoutChanged(f"{where}: the target is not a sharded array as saved")
  sharding = want.sharding
  data_shape = shape
  if rec.get("key_impl"):
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
        *sharding.spec, None)) if isinstance(sharding, jax.sharding.NamedSharding) else sharding
  by_device = {d: e for e in rec["boxes"] for d in e["devices"]}
  arrays = []
  for device, index in sharding.addressable_devices_indices_map(data_shape).items():
    entry = by_device.get(device.id)
    box = _layout.slices_to_box(index, data_shape)
    if entry is None or tuple(map(tuple, entry["box"])) != box:
      raise LayoutChanged(f"{where}: device {device.id} needs box {box}, which the local"
                          " checkpoint does not hold as one shard (another mesh or sharding)")
    arrays.append(jax.device_put(data(entry), device))
  out = jax.make_array_from_single_device_arrays(data_shape, sharding, arrays)
  if rec.get("key_impl"):
    out = jax.random.wrap_key_data(out, impl=rec["key_impl"])
  return out


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


class LocalTier:
  """Saves and restores this process's shards in ``directory/process_<i>``.

  Args:
    directory: a fast local directory (e.g. ``/dev/shm/ckpt``); each process
      uses its own ``process_<i>`` below it.
    replicas: how many other processes hold a copy of each process's shards
      (losing any ``replicas`` local directories loses no local step).
    max_to_keep: committed local steps kept (the newest ones).
    timeout_seconds: how long a process waits for the others.
  """

  def __init__(self, directory: str, *, replicas: int = 1, max_to_keep: int = 1,
               timeout_seconds: float = _multihost.DEFAULT_TIMEOUT_S):
    n = jax.process_count()
    if replicas < 0:
      raise ValueError(f"replicas={replicas}: must be >= 0")
    if n > 1 and replicas > n - 1:
      raise ValueError(f"replicas={replicas} with {n} processes: at most {n - 1} other processes"
                       " can hold a copy; lower replicas")
    if max_to_keep < 1:
      raise ValueError(f"local_max_to_keep={max_to_keep}: keep at least 1 local step")
    self.root = os.path.join(directory, f"process_{jax.process_index()}")
    self.replicas = replicas if n > 1 else 0
    self.max_to_keep = max_to_keep
    self.timeout = timeout_seconds
    self._key = _multihost.namespace("local_tier")
    self._calls = 0
    os.makedirs(self.root, exist_ok=True)

  def _next_key(self, what: str) -> str:
    """A coordination key unique to this call: every process makes the same calls in order."""
    self._calls += 1
    return f"{self._key}/{self._calls}-{what}"

  def _dir(self, step: int) -> str:
    return os.path.join(self.root, str(step))

  def save(self, step: int, items: Mapping[str, Any]) -> float:
    """Saves ``step`` to the local tier on every process; returns the seconds it took.

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
    _write(os.path.join(self._dir(step), COMMITTED), b"1")
    self._prune()
    return time.perf_counter() - start

  def _prune(self) -> None:
    steps = self.holdings().own
    for old in steps[:-self.max_to_keep]:
      shutil.rmtree(self._dir(old), ignore_errors=True)
    for name in os.listdir(self.root):
      if _TMP in name:
        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

  def holdings(self) -> Holdings:
    """Committed local steps here, and the peers' replicas held here."""
    own, replicas = [], {}
    n = jax.process_count()
    for name in os.listdir(self.root) if os.path.isdir(self.root) else []:
      d = os.path.join(self.root, name)
      if not name.isdigit() or not os.path.exists(os.path.join(d, COMMITTED)):
        continue
      step = int(name)
      if os.path.exists(os.path.join(d, OWN)):
        own.append(step)
      for f in os.listdir(d):
        if f.startswith("replica-") and f.endswith(".blob"):
          replicas.setdefault(int(f[len("replica-"):-len(".blob")]), []).append(step)
    layout_n = self._saved_process_count(own)
    return Holdings(sorted(own), {k: sorted(v) for k, v in replicas.items()},
                    layout_n if layout_n is not None else n)

  def _saved_process_count(self, own: list[int]) -> int | None:
    if not own:
      return None
    with open(os.path.join(self._dir(max(own)), OWN), "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      return json.loads(f.read(n))["process_count"]

  def restore(self, target: Mapping[str, Any], newer_than: int | None = None
              ) -> tuple[int, dict[str, Any], str] | None:
    """The newest local step every process can assemble, if newer than ``newer_than``.

    Collective. Returns ``(step, items, source)`` (``source`` says where this
    process's shards came from), or None when the local tier has nothing newer
    or was written by another layout; every process gets the same answer.
    """
    me, n = jax.process_index(), jax.process_count()
    key = self._next_key("restore")
    mine = self.holdings()
    reports = _multihost.all_gather(f"{key}/holdings", mine.to_json(), self.timeout,
                                    what="report its local steps")
    holdings = [Holdings.from_json(r) for r in reports]
    if any(h.process_count != n for h in holdings if h.own or h.replicas):
      _progress.say("local tier: written by a job of another process count; it is tied to the process"
               " layout, so the persistent tier is used")
      return None
    plan = plan_restore(holdings, newer_than)
    if plan is None:
      held = sorted({s for h in holdings for s in h.own})
      _progress.say("local tier: no step that every process can get (own copy or a peer's replica)%s;"
               " steps held: %s", "" if newer_than is None else f" newer than step {newer_than}",
               held or "none")
      return None
    blob, where = None, "nowhere"
    if plan.source[me] == me:
      blob = read_file(os.path.join(self._dir(plan.step), OWN))
      where = "its own local copy"
    # Replica holders send to the processes that lost their copy, one shift at a time.
    for shift in sorted({(p - s) % n for p, s in enumerate(plan.source) if s != p}):
      send: list[np.ndarray] = []
      target_p = (me + shift) % n
      if plan.source[target_p] == me and target_p != me:
        send = [read_file(os.path.join(self._dir(plan.step), f"replica-{target_p}.blob"))]
      got = _exchange.shift_parts(send, shift, f"{key}/x{shift}",
                                  self.timeout)
      if plan.source[me] == (me - shift) % n and plan.source[me] != me:
        blob = got
        where = f"the replica held by process {plan.source[me]}"
    index, payload = decode(blob, f"local step {plan.step} of process {me}")
    try:
      items = build(index, payload, target)
      error = ""
    except LayoutChanged as e:
      items, error = None, str(e)
    verdicts = _multihost.all_gather(f"{key}/ok", error, self.timeout,
                                     what="assemble the local step")
    bad = [f"process {p}: {v}" for p, v in enumerate(verdicts) if v]
    if bad:
      _progress.say("local tier: step %d does not fit this job's layout (%s); the persistent tier is"
               " used", plan.step, "; ".join(bad))
      return None
    return plan.step, items, where


def _write(path: str, data: bytes) -> None:
  with open(path, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
