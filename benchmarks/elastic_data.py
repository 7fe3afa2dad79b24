"""Throughput of orbax_flax.data.ElasticIterator against grain's own iterators, same pipeline.

    python benchmarks/elastic_data.py [--records=20000] [--reps=5] [--threads=8]

One shard (of 2) of a shuffled MapDataset whose map does a little numpy work per record
(a 256-float record), batched 64 a shard, read with grain's prefetch threads
(``ReadOptions(num_threads)``):

* ``grain ElasticIterator``: ``grain.experimental.ElasticIterator`` (no filter allowed);
* ``grain to_iter_dataset``: ``ds[k::n].to_iter_dataset(read_options).batch(b)``, the plain
  per-process pipeline (its position resumes only on the same process count);
* ``grain batch().to_iter_dataset``: ``ds[k::n].batch(b).to_iter_dataset(read_options)``, the
  same batched before the threads (refused by grain after a ``filter``);
* ``ofx ElasticIterator``: ours.

and the same pipeline with a ``filter`` (grain's ElasticIterator refuses it). Each variant runs
``--reps`` times, interleaved; the table holds medians of records/s and the ratio to ours. Then
``get_state()`` and a resume onto another shard count, in microseconds.
"""

import argparse
import statistics
import time
import timeit

import grain
import numpy as np

from orbax_flax.data import ElasticIterator

SHARDS, BATCH = 2, 128  # global batch: 64 records a shard


def record(i):
  x = np.random.default_rng(i).standard_normal(256).astype(np.float32)
  return {"id": i, "x": np.tanh(x) * 2.0}


def pipeline(n, with_filter):
  ds = grain.MapDataset.range(n).shuffle(seed=1).map(record)
  return ds.filter(lambda r: r["id"] % 5 != 0) if with_filter else ds


def variants(ds, ro, with_filter):
  out = {}
  if not with_filter:
    out["grain ElasticIterator"] = lambda: iter(grain.experimental.ElasticIterator(
        ds, BATCH, grain.sharding.ShardOptions(0, SHARDS), read_options=ro))
  out["grain to_iter_dataset"] = lambda: iter(ds[0::SHARDS].to_iter_dataset(ro).batch(
      BATCH // SHARDS))
  if not with_filter:  # batched before the threads, as grain's ElasticIterator does
    out["grain batch().to_iter_dataset"] = lambda: iter(
        ds[0::SHARDS].batch(BATCH // SHARDS).to_iter_dataset(ro))
  out["ofx ElasticIterator"] = lambda: ElasticIterator(ds, BATCH, shard_index=0,
                                                       shard_count=SHARDS, read_options=ro)
  return out


def rate(make, batches):
  it = make()
  next(it)  # threads started, buffer filling: not timed
  start, n = time.perf_counter(), 0
  for _ in range(batches):
    n += len(next(it)["id"])
  took = time.perf_counter() - start
  if hasattr(it, "close"):
    it.close()
  return n / took


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--records", type=int, default=40_000)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--threads", type=int, default=8)
  a = p.parse_args()
  ro = grain.ReadOptions(num_threads=a.threads, prefetch_buffer_size=256)
  print(f"| pipeline | iterator | records/s (median of {a.reps}) | ours / it |")
  print("|---|---|---:|---:|")
  for with_filter in (False, True):
    ds = pipeline(a.records, with_filter)
    batches = int(a.records / SHARDS * (0.8 if with_filter else 1.0)) // (BATCH // SHARDS) - 2
    its = variants(ds, ro, with_filter)
    runs = {name: [] for name in its}
    for _ in range(a.reps):
      for name, make in its.items():
        runs[name].append(rate(make, batches))
    ours = statistics.median(runs["ofx ElasticIterator"])
    for name, r in runs.items():
      med = statistics.median(r)
      print(f"| shuffle+map{'+filter' if with_filter else ''} | {name} | {med:,.0f} |"
            f" {ours / med:.2f}x |")
  ds = pipeline(a.records, True)
  its = [ElasticIterator(ds, BATCH, shard_index=k, shard_count=4) for k in range(4)]
  for k, it in enumerate(its):
    for _ in range(k + 1):
      next(it)
  it = its[0]
  n = 20_000
  get_us = min(timeit.repeat(it.get_state, number=n, repeat=5)) / n * 1e6
  states = [i.get_state() for i in its]
  new = ElasticIterator(ds, BATCH, shard_index=0, shard_count=3)
  resume_us = min(timeit.repeat(lambda: new.set_state_from_shards(states), number=200,
                                repeat=5)) / 200 * 1e6
  g = grain.experimental.ElasticIterator(pipeline(a.records, False), BATCH,
                                         grain.sharding.ShardOptions(0, SHARDS))
  next(g)
  grain_us = min(timeit.repeat(g.get_state, number=n, repeat=5)) / n * 1e6
  for i in its:
    i.close()
  print()
  print(f"get_state(): {get_us:.2f} us (grain ElasticIterator: {grain_us:.2f} us);"
        f" set_state_from_shards(4 states) onto 3 shards: {resume_us:.1f} us")


if __name__ == "__main__":
  main()
