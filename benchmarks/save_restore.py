"""Save and restore speed: orbax_flax against orbax-checkpoint, torch DCP and the hardware.

    python benchmarks/save_restore.py --size=2gb --reps=3
    python benchmarks/save_restore.py --size=50mb --reps=5

One run measures every contender on the same state, interleaved (rep 1 of
each, then rep 2 of each, ...), and reports medians. Each trial starts from
the same state: previous checkpoints deleted, freed memory handed back
(malloc_trim), fresh device arrays, then a fixed pause (this VM returns freed
memory to its host within seconds, and pages it must hand back are slow to
touch again). Cold reads drop the page cache first (root only).

Contenders:
  * limit: numpy writes with fsync spread over 8 threads (buffered, and
    O_DIRECT), numpy reads of those files, one memcpy of the state into
    touched memory (and into fresh memory).
  * orbax_flax: save, save_async (blocking / total), restore warm / cold,
    restore onto another mesh.
  * orbax-checkpoint StandardCheckpointer (defaults: OCDBT, zstd): save
    (blocking / total), restore warm / cold, onto another mesh.
  * torch.distributed.checkpoint: save, async_save (blocking / total), load
    warm / cold, on CPU tensors of the same shapes and dtype.

Requires the bench extra: pip install -e '.[bench]'.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_flax as ofx  # noqa: E402

SIZES = {
    # LLaMA-like: 12 layers, Adam (params, mu, nu): 334 leaves.
    "2gb": dict(vocab=32000, d=896, ff=2368, layers=12),
    "50mb": dict(vocab=4096, d=144, ff=384, layers=12),
}


def llama_shapes(vocab, d, ff, layers):
  shapes = {"embed": (vocab, d), "final_norm": (d,), "lm_head": (d, vocab)}
  for i in range(layers):
    for n in ("wq", "wk", "wv", "wo"):
      shapes[f"layer_{i:02d}/attn/{n}"] = (d, d)
    shapes[f"layer_{i:02d}/mlp/w1"] = (d, ff)
    shapes[f"layer_{i:02d}/mlp/w3"] = (d, ff)
    shapes[f"layer_{i:02d}/mlp/w2"] = (ff, d)
    shapes[f"layer_{i:02d}/attn_norm"] = (d,)
    shapes[f"layer_{i:02d}/mlp_norm"] = (d,)
  return shapes


def host_state(size, seed=0):
  """Random float32 params + Adam moments as nested dicts of numpy arrays."""
  rng = np.random.default_rng(seed)
  shapes = llama_shapes(**SIZES[size])
  out = {}
  for group in ("params", "mu", "nu"):
    out[group] = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
  out["count"] = np.zeros((), np.int32)
  return out


def spec_for(x):
  if x.ndim == 2:
    return P("data", "model")  # large matrices fully sharded over 2 x 4 devices
  return P()                    # norms and the step count replicated


def device_state(host, mesh):
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec_for(x))), host)


def abstract(state, mesh=None):
  def f(x):
    sharding = x.sharding if mesh is None else NamedSharding(mesh, P("model") if x.ndim == 2 else P())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(f, state)


def fresh(state):
  """New device buffers with no cached host copy (jax caches device_get)."""
  return jax.block_until_ready(jax.tree.map(jnp.copy, state))


def release_memory():
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except OSError:
    pass


def drop_caches():
  subprocess.run(["sync"], check=False)
  try:
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return True
  except OSError:
    return False


def unique_shards(state):
  out = []
  for x in jax.tree.leaves(state):
    seen = set()
    for s in x.addressable_shards:
      key = tuple((sl.start, sl.stop) for sl in s.index)
      if key not in seen:
        seen.add(key)
        out.append(np.asarray(s.data))
  return out


# ----------------------------------------------------------------------------- limits

_THREADS = 8


def _spread(items, n=_THREADS):
  buckets = [[] for _ in range(n)]
  loads = [0] * n
  for a in sorted(items, key=lambda a: -a.nbytes):
    i = loads.index(min(loads))
    buckets[i].append(a)
    loads[i] += a.nbytes
  return buckets


def limit_write(state, root, direct=False):
  shards = unique_shards(state)
  os.makedirs(root)

  def write(args):
    j, bucket = args
    path = os.path.join(root, f"f{j}")
    if direct:
      total = sum(a.nbytes for a in bucket)
      aligned = -(-total // 4096) * 4096
      buf = np.empty(aligned + 4096, np.uint8)
      off = (-buf.ctypes.data) % 4096
      view = buf[off:off + aligned]
      pos = 0
      for a in bucket:
        view[pos:pos + a.nbytes] = a.reshape(-1).view(np.uint8)
        pos += a.nbytes
      t0 = time.perf_counter()
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
      try:
        os.write(fd, view)
        os.fsync(fd)
      finally:
        os.close(fd)
      return time.perf_counter() - t0
    with open(path, "wb") as f:
      for a in bucket:
        f.write(memoryview(a.reshape(-1)).cast("B"))
      f.flush()
      os.fsync(f.fileno())
    return 0.0

  with concurrent.futures.ThreadPoolExecutor(_THREADS) as ex:
    return list(ex.map(write, enumerate(_spread(shards))))


def limit_read(root):
  def read(name):
    path = os.path.join(root, name)
    with open(path, "rb") as f:
      buf = np.empty(os.fstat(f.fileno()).st_size, np.uint8)
      f.readinto(memoryview(buf))
    return buf
  with concurrent.futures.ThreadPoolExecutor(_THREADS) as ex:
    return list(ex.map(read, sorted(os.listdir(root))))


def limit_memcpy(shards, dests):
  def copy(pair):
    np.copyto(pair[1], pair[0])
  with concurrent.futures.ThreadPoolExecutor(_THREADS) as ex:
    list(ex.map(copy, zip(shards, dests)))


# ----------------------------------------------------------------------------- runner


class Bench:

  def __init__(self, size, reps, pause, root):
    self.size, self.reps, self.pause, self.root = size, reps, pause, root
    self.results: dict[str, list[float]] = {}
    self.mesh = jax.make_mesh((2, 4), ("data", "model"))
    self.other_mesh = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4])
    self.host = host_state(size)
    self.state = device_state(self.host, self.mesh)
    self.nbytes = sum(x.nbytes for x in jax.tree.leaves(self.host))
    self.leaves = len(jax.tree.leaves(self.host))
    self.can_drop = drop_caches()

  def record(self, name, seconds):
    self.results.setdefault(name, []).append(seconds)

  def path(self, name):
    return os.path.join(self.root, name)

  def clean(self, *names):
    for n in names:
      shutil.rmtree(self.path(n), ignore_errors=True)
    release_memory()

  def settle(self):
    time.sleep(self.pause)

  # Each contender writes its checkpoint, then reads it back.

  def run_limit(self):
    self.clean("np")
    state = fresh(self.state)
    self.settle()
    t0 = time.perf_counter()
    limit_write(state, self.path("np"))
    self.record("limit: numpy write+fsync, 8 threads", time.perf_counter() - t0)
    self.clean("np_direct")
    self.settle()
    t0 = time.perf_counter()
    io = limit_write(state, self.path("np_direct"), direct=True)
    del io
    self.record("limit: O_DIRECT write+fsync, 8 threads", time.perf_counter() - t0)
    self.clean("np_direct")
    self.settle()
    t0 = time.perf_counter()
    bufs = limit_read(self.path("np"))
    self.record("limit: numpy read, warm", time.perf_counter() - t0)
    del bufs
    if self.can_drop:
      release_memory()
      drop_caches()
      self.settle()
      t0 = time.perf_counter()
      bufs = limit_read(self.path("np"))
      self.record("limit: numpy read, cold", time.perf_counter() - t0)
      del bufs
    shards = unique_shards(state)
    dests = [np.ones_like(s) for s in shards]  # touched pages
    self.settle()
    t0 = time.perf_counter()
    limit_memcpy(shards, dests)
    self.record("limit: memcpy of the state (touched memory)", time.perf_counter() - t0)
    del dests
    release_memory()
    self.settle()
    t0 = time.perf_counter()
    copies = [np.array(s) for s in shards]
    self.record("limit: memcpy of the state (fresh memory, 1 thread)", time.perf_counter() - t0)
    del copies, shards, state
    self.clean("np")

  def run_ours(self):
    self.clean("ofx")
    state = fresh(self.state)
    self.settle()
    t0 = time.perf_counter()
    ofx.save(self.path("ofx"), {"state": state})
    self.record("orbax_flax: save", time.perf_counter() - t0)
    self.clean("ofx")
    state = fresh(self.state)
    self.settle()
    t0 = time.perf_counter()
    handle = ofx.save_async(self.path("ofx"), {"state": state})
    self.record("orbax_flax: async blocking", time.perf_counter() - t0)
    handle.wait()
    self.record("orbax_flax: async total", time.perf_counter() - t0)
    del state
    target = {"state": abstract(self.state)}
    self._restore("orbax_flax: restore warm", lambda: ofx.restore(self.path("ofx"), target))
    if self.can_drop:
      self._restore("orbax_flax: restore cold", lambda: ofx.restore(self.path("ofx"), target), cold=True)
    other = {"state": abstract(self.state, self.other_mesh)}
    self._restore("orbax_flax: restore onto 4-device mesh, warm",
                  lambda: ofx.restore(self.path("ofx"), other))
    self.clean("ofx")

  def _restore(self, name, fn, cold=False):
    release_memory()
    if cold:
      drop_caches()
    self.settle()
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    self.record(name, time.perf_counter() - t0)
    del out
    release_memory()

  def run_orbax(self):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    self.clean("orbax")
    state = fresh(self.state)
    ckptr = ocp.StandardCheckpointer()
    self.settle()
    t0 = time.perf_counter()
    ckptr.save(self.path("orbax"), state)
    self.record("orbax-checkpoint: async blocking", time.perf_counter() - t0)
    ckptr.wait_until_finished()
    self.record("orbax-checkpoint: save (total)", time.perf_counter() - t0)
    del state
    target = abstract(self.state)
    self._restore("orbax-checkpoint: restore warm", lambda: ckptr.restore(self.path("orbax"), target))
    if self.can_drop:
      self._restore("orbax-checkpoint: restore cold", lambda: ckptr.restore(self.path("orbax"), target),
                    cold=True)
    other = abstract(self.state, self.other_mesh)
    self._restore("orbax-checkpoint: restore onto 4-device mesh, warm",
                  lambda: ckptr.restore(self.path("orbax"), other))
    ckptr.close()
    self.clean("orbax")

  def run_dcp(self):
    import torch  # pylint: disable=g-import-not-at-top
    import torch.distributed.checkpoint as dcp  # pylint: disable=g-import-not-at-top
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(self.host)[0]}
    sd = {k: torch.from_numpy(np.array(v)) for k, v in flat.items()}
    self.clean("dcp")
    self.settle()
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=self.path("dcp"))
    self.record("DCP: save", time.perf_counter() - t0)
    self.clean("dcp")
    self.settle()
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, checkpoint_id=self.path("dcp"))
    self.record("DCP: async blocking", time.perf_counter() - t0)
    fut.result()
    self.record("DCP: async total", time.perf_counter() - t0)
    del sd

    def load():
      target = {k: torch.empty(v.shape, dtype=torch.float32 if v.dtype == np.float32 else torch.int32)
                for k, v in flat.items()}
      dcp.load(target, checkpoint_id=self.path("dcp"))
      return target

    self._restore("DCP: load warm", load)
    if self.can_drop:
      self._restore("DCP: load cold", load, cold=True)
    self.clean("dcp")

  def run(self, contenders):
    runners = {"limit": self.run_limit, "orbax_flax": self.run_ours, "orbax": self.run_orbax,
               "dcp": self.run_dcp}
    for rep in range(self.reps):
      for c in contenders:
        t0 = time.perf_counter()
        runners[c]()
        print(f"  rep {rep + 1}/{self.reps} {c}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return {k: statistics.median(v) for k, v in self.results.items()}


# ----------------------------------------------------------------------------- report


def _fmt(x):
  return "-" if x is None else f"{x:.3f}"


def _ratio(a, b):
  return "-" if a is None or b is None else f"{a / b:.2f}x"


def report(b: Bench, med: dict[str, float]) -> str:
  gb = b.nbytes / 1e9
  g = med.get
  lines = [f"### {b.size}: {gb:.2f} GB, {b.leaves} leaves, 8 CPU devices (mesh 2x4), "
           f"median of {b.reps} interleaved runs", ""]
  lines += ["| measurement | seconds | GB/s |", "|---|---:|---:|"]
  for k, v in med.items():
    lines.append(f"| {k} | {v:.3f} | {gb / v:.2f} |")
  limit_w = g("limit: numpy write+fsync, 8 threads")
  rows = [
      ("blocking save", g("orbax_flax: save"), limit_w, g("orbax-checkpoint: save (total)"), g("DCP: save")),
      ("async: blocking time", g("orbax_flax: async blocking"),
       g("limit: memcpy of the state (touched memory)"), g("orbax-checkpoint: async blocking"),
       g("DCP: async blocking")),
      ("async: total", g("orbax_flax: async total"), limit_w, g("orbax-checkpoint: save (total)"),
       g("DCP: async total")),
      ("restore warm", g("orbax_flax: restore warm"), g("limit: numpy read, warm"),
       g("orbax-checkpoint: restore warm"), g("DCP: load warm")),
      ("restore cold", g("orbax_flax: restore cold"), g("limit: numpy read, cold"),
       g("orbax-checkpoint: restore cold"), g("DCP: load cold")),
      ("restore onto 4-device mesh (warm)", g("orbax_flax: restore onto 4-device mesh, warm"),
       g("orbax_flax: restore warm"), g("orbax-checkpoint: restore onto 4-device mesh, warm"), None),
  ]
  lines += ["", "| orbax_flax | seconds | vs its limit | orbax-checkpoint / ours | DCP / ours |",
            "|---|---:|---:|---:|---:|"]
  for name, ours, limit, orbax, dcp in rows:
    lines.append(f"| {name} | {_fmt(ours)} | {_ratio(ours, limit)} | {_ratio(orbax, ours)} | {_ratio(dcp, ours)} |")
  lines += ["", "Limits: save vs numpy write+fsync; async blocking vs one memcpy into touched memory;"
            " restore vs numpy read (warm/cold); other mesh vs our same-mesh warm restore."]
  return "\n".join(lines)


def machine() -> str:
  mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    pass
  import importlib.metadata as md  # pylint: disable=g-import-not-at-top
  vers = ", ".join(f"{p} {md.version(p)}" for p in ("jax", "tensorstore", "orbax-checkpoint", "torch"))
  return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}; {vers}"


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", choices=sorted(SIZES), default="50mb")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--pause", type=float, default=3.0, help="seconds of rest before each trial")
  p.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp's disk)")
  p.add_argument("--contenders", default="limit,orbax_flax,orbax,dcp")
  a = p.parse_args()
  root = a.dir or tempfile.mkdtemp(prefix="ofx-bench-", dir="/var/tmp")
  os.makedirs(root, exist_ok=True)
  try:
    b = Bench(a.size, a.reps, a.pause, root)
    med = b.run(a.contenders.split(","))
    print(f"Machine: {machine()}; writing to {root}" + ("" if b.can_drop else " (cannot drop caches: no cold reads)"))
    print()
    print(report(b, med))
  finally:
    if a.dir is None:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
