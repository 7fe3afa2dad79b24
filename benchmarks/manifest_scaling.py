"""How the commit manifest scales with the job: a simulated layout through the real code.

    python benchmarks/manifest_scaling.py                      # 1,024 and 8,192 devices
    python benchmarks/manifest_scaling.py --devices=1024 --json=out.json

No such job fits on one machine, but the manifest depends only on the layout:
shapes, dtypes, and which process holds which shard. This builds that layout
for N devices on N/8 hosts (8 devices each, mesh ``("data", "model") = (N/8,
8)``) over a LLaMA-like state of 334 leaves (12 layers at d=8192, ff=28672,
vocab=128000, plus Adam moments, float32; matrices sharded ``P("data",
"model")``, norms replicated), with stand-in device and sharding objects that
answer what planning asks (device -> shard index, ``process_index``). The
records are then made by the engine's own planning (``_planning.plan_array``,
``_pack_pieces``: chunk grid, owner of every chunk, packed small arrays), and
the manifest is encoded and decoded by ``_manifest.encode`` / ``decode``
(SHA-256 of summary and body, JSON, full validation), as process 0's commit
and every restore do.

Measured per layout: the manifest's bytes (what a restore reads), process 0's
encode time (the commit), decode time and peak memory (every restore, on every
process), the planning time (every process, at its first save of a layout),
and what listing steps reads: ``step_info`` reads the first
``SUMMARY_READ_BYTES`` of each manifest; on an object store ``list_steps``
lists the step index (one key a step, ``<dir>/_steps/<step>``), and the full
listing that finds leftovers (a manager's start-up, and its sweep after a
deletion) lists every key under the directory (estimated from the databases a
step has: one per item and process, each at least a manifest and one data file).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from orbax_flax.format import _manifest  # noqa: E402
from orbax_flax.engine import _planning  # noqa: E402
from orbax_flax.core import _tree  # noqa: E402
import hostmem  # noqa: E402
from save_restore import llama_shapes  # noqa: E402  (the benchmark state's layout, one copy)

PER_HOST = 8
DIMS = dict(vocab=128000, d=8192, ff=28672, layers=12)
GOAL = {"manifest_mb": 64, "decode_s": 1.0, "listing_kb": 4}


@dataclasses.dataclass(frozen=True)
class Device:
  id: int
  process_index: int


class MeshSharding:
  """``NamedSharding(Mesh((hosts, 8), ("data", "model")), P(*spec))`` over stand-in devices.

  Device ``h * 8 + j`` belongs to process ``h`` and sits at mesh position
  ``(h, j)``; it answers the questions planning asks of a sharding.
  """

  def __init__(self, hosts: int, spec: tuple[str | None, ...]):
    self.hosts, self.spec = hosts, spec
    self.devices = [Device(h * PER_HOST + j, h) for h in range(hosts) for j in range(PER_HOST)]

  def __hash__(self):
    return hash((self.hosts, self.spec))

  def __eq__(self, other):
    return isinstance(other, MeshSharding) and (self.hosts, self.spec) == (other.hosts, other.spec)

  def __str__(self):
    return f"mesh{{'data': {self.hosts}, 'model': {PER_HOST}}} specPartitionSpec{self.spec}"

  def _parts(self, axis: str | None) -> int:
    return {"data": self.hosts, "model": PER_HOST, None: 1}[axis]

  def shard_shape(self, shape):
    return tuple(s // self._parts(a) for s, a in zip(shape, self._spec(shape)))

  def _spec(self, shape):
    return tuple(self.spec) + (None,) * (len(shape) - len(self.spec))

  def _index(self, device: Device, shape) -> tuple[slice, ...]:
    pos = {"data": device.process_index, "model": device.id % PER_HOST, None: 0}
    out = []
    for s, a in zip(shape, self._spec(shape)):
      n = s // self._parts(a)
      out.append(slice(pos[a] * n, (pos[a] + 1) * n))
    return tuple(out)

  def devices_indices_map(self, shape):
    return {d: self._index(d, shape) for d in self.devices}

  def addressable_devices_indices_map(self, shape):
    return {d: self._index(d, shape) for d in self.devices if d.process_index == 0}

  @property
  def _addressable_device_assignment(self):
    return [d for d in self.devices if d.process_index == 0]


@dataclasses.dataclass(frozen=True)
class Leaf:
  """A global jax.Array as planning sees it: shape, dtype, sharding (never addressable whole)."""
  shape: tuple[int, ...]
  dtype: np.dtype
  sharding: MeshSharding
  is_fully_addressable: bool = False


def state(hosts: int) -> dict:
  matrix, replicated = MeshSharding(hosts, ("data", "model")), MeshSharding(hosts, ())
  f32 = np.dtype(np.float32)
  shapes = llama_shapes(**DIMS)
  out = {g: {k: Leaf(s, f32, matrix if len(s) == 2 else replicated) for k, s in shapes.items()}
         for g in ("params", "mu", "nu")}
  out["count"] = Leaf((), np.dtype(np.int32), replicated)
  return out


def plan_items(tree: dict, nproc: int, me: int = 0) -> tuple[dict, int]:
  """The manifest items of ``{"state": tree}`` and this process's piece count, as
  ``_planning._Template.build`` makes them (for leaves that are all jax arrays)."""
  load = [0] * nproc
  structure, leaves = _tree.encode_structure(tree)
  records, pieces, packed = [], [], []
  pack_sizes = [0] * nproc
  for i, (path, leaf) in enumerate(leaves):
    records.append(_planning.plan_array(
        "state", f"a{i}", path, leaf, "jax", me, load, pack_sizes, packed, pieces,
        lambda k: None))
  if pack_sizes[me]:
    pieces.extend(_planning.pack_pieces("state", pack_sizes[me], packed))
  items = {"state": {"structure": structure, "leaves": records,
                     "packed": {str(p): s for p, s in enumerate(pack_sizes) if s}}}
  return items, len(pieces)


def measure(devices: int) -> dict:
  hosts = devices // PER_HOST
  tree = state(hosts)
  t0 = time.perf_counter()
  items, my_pieces = plan_items(tree, hosts)
  plan_s = time.perf_counter() - t0
  manifest = {"format": _manifest.FORMAT, "version": _manifest.VERSION, "library_version": "bench",
              "created": time.time(), "process_count": hosts, "device_count": devices,
              "all_chunks_stored": True, "generation": "0123456789abcdef",
              "custom": {"step": 1000, "reason": "interval", "time": time.time(),
                         "metrics": {"loss": 1.5}, "mesh": {"data": hosts, "model": PER_HOST},
                         "user": {}}, "items": items}
  before = hostmem.reset_peak()
  t0 = time.perf_counter()
  data = _manifest.encode(manifest)
  encode_s = time.perf_counter() - t0
  encode_peak = hostmem.status("VmHWM") - before
  del manifest, items
  before = hostmem.reset_peak()
  t0 = time.perf_counter()
  decoded = _manifest.decode(data, "simulated")
  decode_s = time.perf_counter() - t0
  decode_peak = hostmem.status("VmHWM") - before
  t0 = time.perf_counter()
  summary = _manifest.decode_summary(data[:_manifest.SUMMARY_READ_BYTES], "simulated")
  summary_s = time.perf_counter() - t0
  assert summary is not None and decoded.process_count == hosts
  recs = [r for r in decoded.items["state"].leaves if r.kind != "value"]
  chunks = sum(len(r.owners) for r in recs)
  header_and_summary = len(data.split(b"\n", 2)[0]) + len(data.split(b"\n", 2)[1]) + 2
  # Object-store listing: every key under the directory. A step holds, per item and
  # process, one OCDBT database of at least a manifest and one data file (keys such as
  # "1000/state/p517-0123456789abcdef/d/<32 hex>"), plus _CHECKPOINT.
  key = len(f"1000/state/p{hosts - 1}-0123456789abcdef/d/{'0' * 32}") + 8  # + listing framing
  listed = (1 + 2 * hosts * 1) * key  # one item ("state"); a callback adds "data" and "meta"
  indexed = len("_steps/1000") + 8  # the step index: one key a step, whatever the hosts
  return {
      "devices": devices, "hosts": hosts, "leaves": len(decoded.items["state"].leaves),
      "arrays_chunked": sum(1 for r in recs if not r.is_packed), "chunks": chunks,
      "pieces_of_process_0": my_pieces,
      "manifest_bytes": len(data), "summary_bytes": header_and_summary,
      "plan_s": plan_s, "encode_s": encode_s, "encode_peak_bytes": encode_peak,
      "decode_s": decode_s, "decode_peak_bytes": decode_peak, "summary_decode_s": summary_s,
      "step_info_reads_bytes": min(len(data), _manifest.SUMMARY_READ_BYTES),
      "object_store_listing_bytes_per_step": indexed,
      "object_store_full_listing_bytes_per_step": listed,
  }


def table(rows: list[dict]) -> str:
  head = ("| devices (hosts) | chunks | manifest | encode (process 0, commit) | decode (every"
          " restore) | decode peak memory | planning (every process, first save) | step_info"
          " reads per step | object-store listing per step (step index) | object-store full"
          " listing per step (start-up, sweeps) |")
  lines = [head, "|" + "---|" * 10]
  for r in rows:
    lines.append(
        f"| {r['devices']:,} ({r['hosts']:,}) | {r['chunks']:,} | {r['manifest_bytes'] / 1e6:.1f} MB |"
        f" {r['encode_s']:.2f} s | {r['decode_s']:.2f} s | {r['decode_peak_bytes'] / 1e6:.0f} MB |"
        f" {r['plan_s']:.2f} s | {r['step_info_reads_bytes'] / 1e3:.0f} KB (summary:"
        f" {r['summary_bytes'] / 1e3:.1f} KB) | >= {r['object_store_listing_bytes_per_step']} B |"
        f" >= {r['object_store_full_listing_bytes_per_step'] / 1e3:.0f} KB |")
  return "\n".join(lines)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--devices", default="1024,8192")
  p.add_argument("--json", default=None)
  a = p.parse_args()
  rows = []
  for n in (int(x) for x in a.devices.split(",")):
    rows.append(measure(n))
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  print(table(rows))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"rows": rows, "goal": GOAL, "dims": DIMS}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
