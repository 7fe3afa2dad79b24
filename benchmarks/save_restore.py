"""Save and restore speed and host memory: orbax_flax against orbax-checkpoint, torch DCP and the hardware.

    python benchmarks/save_restore.py --size=2gb --reps=3 --json=run.json
    python benchmarks/save_restore.py --size=50mb --reps=5 --json=run50.json
    python benchmarks/save_restore.py --size=2gb --memory         # + peak host memory per phase
    python benchmarks/save_restore.py --size=2gb --processes=1,2,4  # multi-process scaling
    python benchmarks/report.py run_a.json run_b.json             # tables, targets, chart

Timing: one run measures every contender on the same state, interleaved (rep
1 of each, then rep 2 of each, ...), and reports medians. Each trial starts
from the same state: previous checkpoints deleted, freed memory handed back
(malloc_trim), fresh device arrays, then a fixed pause (this VM returns freed
memory to its host within seconds, and pages it must hand back are slow to
touch again) and a full garbage collection: the process's collector debt
(building a state leaves ~100k objects pending) is paid by whichever call
allocates next, 45 ms at 50 MB, so it is paid before the clock starts, for
every contender alike. Cold reads drop the page cache first (root only). Savers are
built once and reused, as in a training job: orbax_flax's ``Checkpointer``
(its staging memory stays warm from the second save on), orbax-checkpoint's
``StandardCheckpointer`` and DCP with one ``DefaultStager`` (which caches its
staging copy). The first async save of a job is measured on its own, every
rep: a new ``Checkpointer`` (fresh staging memory), a new one prepared with
``Checkpointer.prepare`` as the training callback does, and DCP with a new
``DefaultStager``.

Memory (``--memory``): each contender and phase runs in a fresh process that
builds the state, warms the library up on a tiny checkpoint, resets VmHWM with
``/proc/self/clear_refs`` and reports how far VmHWM rose above VmRSS during
one call (a restore counts the memory it allocates for the restored state).

Multi-process (``--processes``): the same global state saved and restored by
N local processes joined by jax.distributed (8/N simulated devices each);
aggregate GB/s, and the coordination-service round trips of one save and one
restore (the most any process made), which must not grow with N.

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
import json
import os
import platform
import shutil
import socket
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

import hostmem  # noqa: E402  (peak host memory, one copy)
import orbax_flax as ofx  # noqa: E402

SIZES = {
    # LLaMA-like: 12 layers, Adam (params, mu, nu): 334 leaves.
    "20gb": dict(vocab=128000, d=2048, ff=5632, layers=16),
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


def mesh_for(devices=None):
  devices = devices if devices is not None else jax.devices()
  data = 2 if len(devices) % 2 == 0 else 1
  return jax.make_mesh((data, len(devices) // data), ("data", "model"), devices=devices)


def on_accelerator():
  return jax.devices()[0].platform != "cpu"


def device_random_state(size, mesh):
  """The state built on the devices themselves (an accelerator's host is not the limit)."""
  shapes = llama_shapes(**SIZES[size])
  out, key = {}, jax.random.key(0)
  for group in ("params", "mu", "nu"):
    out[group] = {}
    for k, shape in shapes.items():
      key, sub = jax.random.split(key)
      sharding = NamedSharding(mesh, P("data", "model") if len(shape) == 2 else P())
      out[group][k] = jax.jit(lambda k, s=shape: jax.random.normal(k, s, jnp.float32),
                              out_shardings=sharding)(sub)
  out["count"] = jax.device_put(np.zeros((), np.int32), NamedSharding(mesh, P()))
  return jax.block_until_ready(out)


def device_state(host, mesh):
  return jax.tree.map(lambda x: jax.make_array_from_callback(
      x.shape, NamedSharding(mesh, spec_for(x)), lambda i, x=x: x[i]), host)


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


def torch_state(host):
  """The state as torch tensors: CPU from the host arrays, or random CUDA tensors of the same shapes."""
  import torch  # pylint: disable=g-import-not-at-top
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(host)[0]}
  if on_accelerator() and torch.cuda.is_available():
    return {k: (torch.randn(tuple(v.shape), device="cuda") if v.dtype == np.float32 else
                torch.zeros(tuple(v.shape), dtype=torch.int32, device="cuda")) for k, v in flat.items()}
  return {k: torch.from_numpy(np.array(host_values(v))) for k, v in flat.items()}


def host_values(x):
  """``x`` as a numpy array; a shape alone (the state built on an accelerator: no host copy
  of it exists) as random values of that shape and dtype, for the host-side contenders."""
  if isinstance(x, np.ndarray):
    return x
  if np.issubdtype(x.dtype, np.floating):
    return np.random.default_rng(0).standard_normal(x.shape, dtype=np.float32).astype(x.dtype)
  return np.zeros(x.shape, x.dtype)


def torch_empty_like(sd):
  import torch  # pylint: disable=g-import-not-at-top
  return {k: torch.empty(v.shape, dtype=v.dtype, device=v.device) for k, v in sd.items()}


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
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
      try:
        os.write(fd, view)
        os.fsync(fd)
      finally:
        os.close(fd)
      return
    with open(path, "wb") as f:
      for a in bucket:
        f.write(memoryview(a.reshape(-1)).cast("B"))
      f.flush()
      os.fsync(f.fileno())

  with concurrent.futures.ThreadPoolExecutor(_THREADS) as ex:
    list(ex.map(write, enumerate(_spread(shards))))


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
  """One memcpy of every shard, in 8 balanced groups (one task per thread, not per shard)."""
  groups = [[] for _ in range(_THREADS)]
  loads = [0] * _THREADS
  for pair in sorted(zip(shards, dests), key=lambda p: -p[0].nbytes):
    i = loads.index(min(loads))
    groups[i].append(pair)
    loads[i] += pair[0].nbytes

  def copy(group):
    for src, dst in group:
      np.copyto(dst, src)

  with concurrent.futures.ThreadPoolExecutor(_THREADS) as ex:
    list(ex.map(copy, groups))


# ----------------------------------------------------------------------------- timing runner


class Bench:

  def __init__(self, size, reps, pause, root):
    self.size, self.reps, self.pause, self.root = size, reps, pause, root
    self.results: dict[str, list[float]] = {}
    self.mesh = mesh_for()
    self.other_mesh = (jax.make_mesh((4,), ("model",), devices=jax.devices()[:4])
                       if jax.device_count() >= 4 else None)
    if on_accelerator():
      self.state = device_random_state(size, self.mesh)
      self.host = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state)
    else:
      self.host = host_state(size)
      self.state = device_state(self.host, self.mesh)
    self.nbytes = sum(x.nbytes if hasattr(x, "nbytes") else np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                      for x in jax.tree.leaves(self.host))
    self.leaves = len(jax.tree.leaves(self.host))
    self.can_drop = drop_caches()
    self.ofx = ofx.Checkpointer()  # kept across reps, as a training job keeps its manager
    self._orbax = None
    self._dcp_stager = None
    self._sd = None

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
    gc.collect()  # the collector's debt is paid now, not inside whichever call comes next

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
    limit_write(state, self.path("np_direct"), direct=True)
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

  def _ours_save(self):
    self.clean("ofx")
    state = fresh(self.state)
    self.settle()
    t0 = time.perf_counter()
    self.ofx.save(self.path("ofx"), {"state": state})
    self.record("orbax_flax: save", time.perf_counter() - t0)

  def _ours_async(self, prefix="orbax_flax: async save", ckptr=None):
    self.clean("ofx")
    state = fresh(self.state)
    self.settle()
    ckptr = ckptr or self.ofx
    t0 = time.perf_counter()
    handle = ckptr.save_async(self.path("ofx"), {"state": state})
    self.record(f"{prefix}, blocking", time.perf_counter() - t0)
    handle.wait()
    self.record(f"{prefix}, total", time.perf_counter() - t0)

  def _ours_first(self):
    """The first save of a job, each rep: a new Checkpointer maps fresh staging memory.

    Without preparation the copy faults it in while the caller waits; with
    ``prepare`` (what the training callback does at ``restore_or_init``) it was
    touched in the background before the save.
    """
    with ofx.Checkpointer() as ckptr:
      self._ours_async("orbax_flax: first async save", ckptr)
    release_memory()
    with ofx.Checkpointer() as ckptr:
      t0 = time.perf_counter()
      ckptr.prepare({"state": self.state})
      ckptr.wait_prepared()
      self.record("orbax_flax: prepare (background)", time.perf_counter() - t0)
      self._ours_async("orbax_flax: first async save, prepared", ckptr)
    release_memory()

  def run_ours(self):
    self._ours_first()
    # Blocking and async saves alternate which goes first, so that neither always
    # follows the other's deletion of 2 GB of page cache.
    order = [self._ours_save, self._ours_async]
    for run in order if len(self.results.get("orbax_flax: save", [])) % 2 == 0 else order[::-1]:
      run()
    target = {"state": abstract(self.state)}
    self._restore("orbax_flax: restore warm", lambda: self.ofx.restore(self.path("ofx"), target))
    if self.can_drop:
      self._restore("orbax_flax: restore cold", lambda: self.ofx.restore(self.path("ofx"), target),
                    cold=True)
    if self.other_mesh is not None:
      other = {"state": abstract(self.state, self.other_mesh)}
      self._restore("orbax_flax: restore onto 4-device mesh, warm",
                    lambda: self.ofx.restore(self.path("ofx"), other))
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
    if self._orbax is None:
      self._orbax = ocp.StandardCheckpointer()
    ckptr = self._orbax
    self.clean("orbax")
    state = fresh(self.state)
    self.settle()
    t0 = time.perf_counter()
    ckptr.save(self.path("orbax"), state)
    self.record("orbax-checkpoint: async save, blocking", time.perf_counter() - t0)
    ckptr.wait_until_finished()
    self.record("orbax-checkpoint: async save, total", time.perf_counter() - t0)
    del state
    target = abstract(self.state)
    self._restore("orbax-checkpoint: restore warm", lambda: ckptr.restore(self.path("orbax"), target))
    if self.can_drop:
      self._restore("orbax-checkpoint: restore cold", lambda: ckptr.restore(self.path("orbax"), target),
                    cold=True)
    if self.other_mesh is not None:
      other = abstract(self.state, self.other_mesh)
      self._restore("orbax-checkpoint: restore onto 4-device mesh, warm",
                    lambda: ckptr.restore(self.path("orbax"), other))
    # The same orbax-checkpoint checkpoint, read by orbax_flax (interop).
    self._restore("orbax_flax: restore of the orbax-checkpoint checkpoint, warm",
                  lambda: self.ofx.restore(self.path("orbax"), {"state": target}))
    self.clean("orbax")

  def run_safetensors(self):
    """A safetensors file of the state: orbax_flax's restore against safetensors + device_put."""
    from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
    st_dir = self.path("st")
    if not os.path.exists(st_dir):
      os.makedirs(st_dir)
      flat = {".".join(p): host_values(x) for p, x in ofx.core._tree.flatten(self.host)}  # pylint: disable=protected-access
      save_file(flat, os.path.join(st_dir, "model.safetensors"))
    target = {"params": abstract(self.state)}
    shardings = {".".join(p): x.sharding
                 for p, x in ofx.core._tree.flatten(abstract(self.state))}  # pylint: disable=protected-access

    def theirs():
      loaded = load_file(os.path.join(st_dir, "model.safetensors"))
      return {k: jax.device_put(v, shardings[k]) for k, v in loaded.items()}

    self._restore("safetensors: load_file + device_put, warm", theirs)
    self._restore("orbax_flax: restore of the safetensors file, warm",
                  lambda: self.ofx.restore(st_dir, target))
    self.clean("st_export")
    state = fresh(self.state)
    self.settle()
    t0 = time.perf_counter()
    ofx.export_safetensors(self.path("st_export"), state)
    self.record("orbax_flax: export_safetensors", time.perf_counter() - t0)
    self.clean("st_export")

  def run_dcp(self):
    import torch.distributed.checkpoint as dcp  # pylint: disable=g-import-not-at-top
    from torch.distributed.checkpoint import staging  # pylint: disable=g-import-not-at-top
    if self._sd is None:
      self._sd = torch_state(self.host)
      # One stager for the run: it caches its staging copy between saves.
      self._dcp_stager = staging.DefaultStager(staging.StagingOptions(False, False, False, False))
    sd = self._sd

    def save():
      self.clean("dcp")
      self.settle()
      t0 = time.perf_counter()
      dcp.save(sd, checkpoint_id=self.path("dcp"))
      self.record("DCP: save", time.perf_counter() - t0)

    def async_save(stager=None, prefix="DCP: async save"):
      self.clean("dcp")
      self.settle()
      t0 = time.perf_counter()
      fut = dcp.async_save(sd, checkpoint_id=self.path("dcp"),
                           async_stager=stager or self._dcp_stager)
      self.record(f"{prefix}, blocking", time.perf_counter() - t0)
      fut.result()
      self.record(f"{prefix}, total", time.perf_counter() - t0)

    # The first async save of a job: a fresh stager allocates its staging copy.
    first = staging.DefaultStager(staging.StagingOptions(False, False, False, False))
    async_save(first, "DCP: first async save")
    getattr(first, "close", lambda: None)()
    del first
    release_memory()

    order = [save, async_save]
    for run in order if len(self.results.get("DCP: save", [])) % 2 == 0 else order[::-1]:
      run()

    def load():
      import torch  # pylint: disable=g-import-not-at-top
      target = torch_empty_like(sd)
      dcp.load(target, checkpoint_id=self.path("dcp"))
      if torch.cuda.is_available():
        torch.cuda.synchronize()  # CUDA copies are asynchronous: time them to the end
      return target

    self._restore("DCP: load warm", load)
    if self.can_drop:
      self._restore("DCP: load cold", load, cold=True)
    self.clean("dcp")

  def run(self, contenders):
    runners = {"limit": self.run_limit, "orbax_flax": self.run_ours, "orbax": self.run_orbax,
               "dcp": self.run_dcp, "safetensors": self.run_safetensors}
    for rep in range(self.reps):
      for c in contenders:
        t0 = time.perf_counter()
        runners[c]()
        print(f"  rep {rep + 1}/{self.reps} {c}: {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
    return {k: statistics.median(v) for k, v in self.results.items()}


# ----------------------------------------------------------------------------- memory


def memory_case(size, contender, phase, root):
  """In a fresh process: peak extra host memory of one call, as bytes."""
  mesh = mesh_for()
  host = host_state(size)
  small = {"w": np.ones((4096, 64), np.float32)}
  path = os.path.join(root, f"{contender}")
  warm = os.path.join(root, f"warm-{contender}-{phase}-{os.getpid()}")
  if contender == "orbax_flax":
    ckptr = ofx.Checkpointer()
    ckptr.save_async(warm, {"state": small}).wait()
    ckptr.restore(warm)
    ckptr.close()
    ckptr = ofx.Checkpointer()
    if phase == "restore":
      target = {"state": abstract(device_state(host, mesh))}
      del host
      release_memory()
      return hostmem.measure(lambda: jax.block_until_ready(ckptr.restore(path, target)))[0]
    state = device_state(host, mesh)
    del host
    release_memory()
    if phase == "save":
      return hostmem.measure(lambda: ckptr.save(path, {"state": state}))[0]
    return hostmem.measure(lambda: ckptr.save_async(path + "-async", {"state": state}).wait())[0]
  if contender == "orbax":
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(warm, small)
    ckptr.wait_until_finished()
    ckptr.restore(warm)
    if phase == "restore":
      target = abstract(device_state(host, mesh))
      del host
      release_memory()
      return hostmem.measure(lambda: jax.block_until_ready(ckptr.restore(path, target)))[0]
    state = device_state(host, mesh)
    del host
    release_memory()
    dest = path if phase == "save" else path + "-async"
    def save():
      ckptr.save(dest, state)
      ckptr.wait_until_finished()
    return hostmem.measure(save)[0]
  if contender == "dcp":
    import torch  # pylint: disable=g-import-not-at-top
    import torch.distributed.checkpoint as dcp  # pylint: disable=g-import-not-at-top
    from torch.distributed.checkpoint import staging  # pylint: disable=g-import-not-at-top
    tiny = {"w": torch.ones(4096, 64)}
    dcp.save(tiny, checkpoint_id=warm)
    dcp.load(torch_empty_like(tiny), checkpoint_id=warm)
    if phase == "restore":
      flat = jax.tree_util.tree_flatten_with_path(host)[0]
      shapes = {jax.tree_util.keystr(k): (v.shape, torch.from_numpy(v.reshape(-1)[:0]).dtype)
                for k, v in flat}
      del host, flat
      release_memory()

      def load():
        target = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
        dcp.load(target, checkpoint_id=path)
        return target
      return hostmem.measure(load)[0]
    sd = torch_state(host)
    del host
    release_memory()
    if phase == "save":
      return hostmem.measure(lambda: dcp.save(sd, checkpoint_id=path))[0]
    stager = staging.DefaultStager(staging.StagingOptions(False, False, False, False))
    return hostmem.measure(lambda: dcp.async_save(sd, checkpoint_id=path + "-async",
                                           async_stager=stager).result())[0]
  raise ValueError(contender)


def run_memory(size, contenders, root):
  """Every (contender, phase) in its own process; save first (its checkpoint is restored)."""
  out = {}
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(host_state(size)))
  for c in contenders:
    if c in ("limit", "safetensors"):  # no memory cases of their own
      continue
    for phase in ("save", "save_async", "restore"):
      r = subprocess.run([sys.executable, __file__, f"--size={size}", f"--memory_case={c}:{phase}",
                          f"--dir={root}"], capture_output=True, text=True, check=False)
      lines = [l for l in r.stdout.splitlines() if l.startswith("MEMORY ")]
      if r.returncode or not lines:
        print(f"memory case {c}:{phase} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}",
              file=sys.stderr)
        continue
      extra = int(lines[-1].split()[1])
      out[f"{c}: {phase}"] = extra / state_bytes
      print(f"  memory {c}:{phase}: +{extra / 2**20:.0f} MiB = {extra / state_bytes:.2f}x the state",
            file=sys.stderr, flush=True)
  for c in contenders:
    shutil.rmtree(os.path.join(root, c), ignore_errors=True)
    shutil.rmtree(os.path.join(root, c + "-async"), ignore_errors=True)
  return out


# ----------------------------------------------------------------------------- multi-process


class _CountingClient:
  """Wraps the coordination-service client and counts the calls that go to the service."""

  CALLS = ("key_value_set", "key_value_set_bytes", "blocking_key_value_get",
           "blocking_key_value_get_bytes", "key_value_try_get", "key_value_try_get_bytes",
           "key_value_dir_get", "key_value_dir_get_bytes", "key_value_delete",
           "key_value_increment", "wait_at_barrier")

  def __init__(self, inner):
    self._inner, self.count = inner, 0

  def __getattr__(self, name):
    attr = getattr(self._inner, name)
    if name in self.CALLS:
      def counted(*a, **k):
        self.count += 1
        return attr(*a, **k)
      return counted
    return attr


def mp_worker(size, root, coordinator, nproc, pid, reps):
  jax.distributed.initialize(coordinator, num_processes=nproc, process_id=pid,
                             initialization_timeout=120, heartbeat_timeout_seconds=30)
  mesh = mesh_for(jax.devices())  # starts the backend (it needs the real client)
  from jax._src.distributed import global_state  # pylint: disable=g-import-not-at-top
  counter = _CountingClient(global_state.client)
  global_state.client = counter
  host = host_state(size)
  state = device_state(host, mesh)
  del host
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  target = {"state": abstract(state)}
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  ckptr = ofx.Checkpointer()
  res = {"save": [], "restore": [], "save_trips": [], "restore_trips": []}
  for rep in range(reps):
    path = os.path.join(root, f"mp{nproc}-{rep}")
    multihost_utils.sync_global_devices(f"save{rep}")
    before = counter.count
    t0 = time.perf_counter()
    ckptr.save(path, {"state": state})
    res["save"].append(time.perf_counter() - t0)
    res["save_trips"].append(counter.count - before)
    multihost_utils.sync_global_devices(f"restore{rep}")
    release_memory()
    before = counter.count
    t0 = time.perf_counter()
    out = jax.block_until_ready(ckptr.restore(path, target))
    res["restore"].append(time.perf_counter() - t0)
    res["restore_trips"].append(counter.count - before)
    del out
    release_memory()
  res["nbytes"] = nbytes
  # The tiers below run with the same free memory: the persistent checkpoints just measured
  # would otherwise fill the page cache, and the local restore's fresh buffers would be
  # paid for in page reclaim.
  multihost_utils.sync_global_devices("persistent-done")
  if jax.process_index() == 0:
    for rep in range(reps):
      shutil.rmtree(os.path.join(root, f"mp{nproc}-{rep}"), ignore_errors=True)
  multihost_utils.sync_global_devices("persistent-deleted")
  _mp_tiers(state, root, nproc, reps, res)
  print("MP " + json.dumps(res), flush=True)
  multihost_utils.sync_global_devices("done")
  ckptr.close()


def _mp_tiers(state, root, nproc, reps, res):
  """The local tier (with and without a peer replica) and the read-once restore."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from orbax_flax.core import _progress  # pylint: disable=g-import-not-at-top
  from orbax_flax.engine import restoring
  from orbax_flax.tiers import local  # pylint: disable=g-import-not-at-top
  items = {"state": state}
  target = {"state": abstract(state)}
  # The local tier where it is meant to live: RAM (/dev/shm), else the benchmark's disk.
  local_root = "/dev/shm" if os.path.isdir("/dev/shm") else root
  for replicas in sorted({0, min(1, nproc - 1)}):
    tier = local.LocalTier(os.path.join(local_root, f"ofx-bench-local{nproc}-r{replicas}"),
                           run=os.path.join(root, "local-bench"), replicas=replicas,
                           max_to_keep=1)
    saves, restores = [], []
    for rep in range(reps):
      multihost_utils.sync_global_devices(f"local{replicas}-{rep}")
      release_memory()
      t0 = time.perf_counter()
      tier.save(rep + 1, items)
      saves.append(time.perf_counter() - t0)
      multihost_utils.sync_global_devices(f"local-restore{replicas}-{rep}")
      t0 = time.perf_counter()
      out = tier.restore(target)
      jax.block_until_ready(out[1])
      restores.append(time.perf_counter() - t0)
      del out
    res[f"local_save_r{replicas}"], res[f"local_restore_r{replicas}"] = saves, restores
    shutil.rmtree(tier.root, ignore_errors=True)
    res["local_on"] = local_root
  # Data-parallel replicas: matrices replicated over "data" (which spans the processes).
  path = os.path.join(root, f"mp{nproc}-0")
  ofx.save(path + "-dp", items)
  mesh = mesh_for(jax.devices())
  dp = {"state": jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, P(None, "model") if x.ndim == 2 else P())),
      state)}
  for once in (False, True):
    times, nbytes = [], 0
    for rep in range(reps):
      multihost_utils.sync_global_devices(f"once{once}-{rep}")
      release_memory()
      progress = _progress.Progress("restore")
      t0 = time.perf_counter()
      out = jax.block_until_ready(restoring.restore(path + "-dp", dp, progress=progress,
                                                    read_once=once))
      times.append(time.perf_counter() - t0)
      nbytes = progress.done
      del out
    res[f"dp_restore_once{int(once)}"], res[f"dp_bytes_once{int(once)}"] = times, nbytes
  multihost_utils.sync_global_devices("dp-done")
  if jax.process_index() == 0:
    shutil.rmtree(path + "-dp", ignore_errors=True)


def run_multiprocess(size, counts, root, reps):
  rows = []
  for n in counts:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    procs = []
    for i in range(n):
      env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // n}",
                 JAX_PLATFORMS="cpu")
      procs.append(subprocess.Popen(
          [sys.executable, __file__, f"--size={size}", f"--dir={root}",
           f"--mp_worker=127.0.0.1:{port},{n},{i}", f"--reps={reps}"],
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    results = []
    for i, o in enumerate(outs):
      lines = [l for l in o.splitlines() if l.startswith("MP ")]
      if not lines:
        raise RuntimeError(f"process {i} of {n} failed:\n{o[-3000:]}")
      results.append(json.loads(lines[-1][3:]))
    save = statistics.median(max(r["save"][k] for r in results) for k in range(reps))
    restore = statistics.median(max(r["restore"][k] for r in results) for k in range(reps))
    nbytes = results[0]["nbytes"]
    rows.append({"processes": n, "devices_per_process": 8 // n, "save_s": save,
                 "restore_s": restore, "save_gbps": nbytes / save / 1e9,
                 "restore_gbps": nbytes / restore / 1e9,
                 "save_round_trips": max(max(r["save_trips"]) for r in results),
                 "restore_round_trips": max(max(r["restore_trips"]) for r in results)})
    worst = lambda key: statistics.median(max(r[key][k] for r in results) for k in range(reps))  # noqa: E731
    for key in ("local_save_r0", "local_restore_r0", "local_save_r1", "local_restore_r1",
                "dp_restore_once0", "dp_restore_once1"):
      if key in results[0]:
        rows[-1][key + "_s"] = worst(key)
    if "local_on" in results[0]:
      rows[-1]["local_on"] = results[0]["local_on"]
    for key in ("dp_bytes_once0", "dp_bytes_once1"):
      if key in results[0]:
        rows[-1][key] = sum(r[key] for r in results)  # read from storage, all processes
    print(f"  {n} process(es): {rows[-1]}", file=sys.stderr, flush=True)
    for rep in range(reps):
      shutil.rmtree(os.path.join(root, f"mp{n}-{rep}"), ignore_errors=True)
  return rows


# ----------------------------------------------------------------------------- main


def machine() -> str:
  mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    pass
  import importlib.metadata as md  # pylint: disable=g-import-not-at-top
  vers = []
  for p in ("jax", "tensorstore", "orbax-checkpoint", "torch"):
    try:
      vers.append(f"{p} {md.version(p)}")
    except md.PackageNotFoundError:
      pass
  devices = f"{jax.device_count()} {jax.devices()[0].platform} devices"
  return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, {devices}; {', '.join(vers)}"


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", choices=sorted(SIZES), default="50mb")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--pause", type=float, default=3.0, help="seconds of rest before each trial")
  p.add_argument("--dir", default=None, help="where to write (default: a temp dir on /var/tmp's disk)")
  p.add_argument("--contenders", default="limit,orbax_flax,orbax,dcp,safetensors")
  p.add_argument("--memory", action="store_true", help="also measure peak host memory per phase")
  p.add_argument("--processes", default="", help="e.g. 1,2,4: multi-process mode (orbax_flax)")
  p.add_argument("--no_timing", action="store_true", help="skip the timing runs")
  p.add_argument("--json", default=None, help="write the results here (for report.py)")
  p.add_argument("--memory_case", default=None, help=argparse.SUPPRESS)
  p.add_argument("--mp_worker", default=None, help=argparse.SUPPRESS)
  a = p.parse_args()
  root = a.dir or tempfile.mkdtemp(prefix="ofx-bench-", dir="/var/tmp")
  os.makedirs(root, exist_ok=True)
  if a.memory_case:
    contender, phase = a.memory_case.split(":")
    print(f"MEMORY {memory_case(a.size, contender, phase, root)}", flush=True)
    return
  if a.mp_worker:
    coordinator, n, i = a.mp_worker.split(",")
    mp_worker(a.size, root, coordinator, int(n), int(i), a.reps)
    return
  contenders = a.contenders.split(",")
  out = {"size": a.size, "machine": machine(), "date": time.strftime("%Y-%m-%d"), "reps": a.reps}
  try:
    if not a.no_timing:
      b = Bench(a.size, a.reps, a.pause, root)
      out.update(nbytes=b.nbytes, leaves=b.leaves, can_drop=b.can_drop,
                 times=b.run(contenders), raw=b.results)
      b.ofx.close()
    if a.memory:
      out["memory"] = run_memory(a.size, contenders, root)
    if a.processes:
      out["multiprocess"] = run_multiprocess(a.size, [int(n) for n in a.processes.split(",")],
                                             root, a.reps)
  finally:
    if a.dir is None:
      shutil.rmtree(root, ignore_errors=True)
  text = json.dumps(out, indent=1)
  if a.json:
    with open(a.json, "w") as f:
      f.write(text)
  print(text)


if __name__ == "__main__":
  main()
