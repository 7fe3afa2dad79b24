"""Tables, targets and a chart from the JSON of save_restore.py runs.

    python benchmarks/report.py --runs 2gb=results/2gb-run1.json,results/2gb-run2.json \\
        --runs 50mb=results/50mb-run1.json,results/50mb-run2.json --chart results/chart.png

Prints markdown for benchmarks/README.md: per size, the latest run's timings
(medians), peak host memory per contender and phase, the multi-process table,
and one targets table with both runs' numbers and met / not met.
"""

from __future__ import annotations

import argparse
import json

PHASES = [  # (label, orbax_flax key, orbax-checkpoint key, DCP key, limit key)
    ("blocking save", "orbax_flax: save", None, "DCP: save", "limit: numpy write+fsync, 8 threads"),
    ("async save: caller blocked", "orbax_flax: async save, blocking",
     "orbax-checkpoint: async save, blocking", "DCP: async save, blocking",
     "limit: memcpy of the state (touched memory)"),
    ("first async save of a job (ours prepared): caller blocked", "orbax_flax: first async save, prepared, blocking",
     None, "DCP: first async save, blocking", "limit: memcpy of the state (touched memory)"),
    ("async save: total", "orbax_flax: async save, total", "orbax-checkpoint: async save, total",
     "DCP: async save, total", None),
    ("restore warm", "orbax_flax: restore warm", "orbax-checkpoint: restore warm", "DCP: load warm",
     "limit: numpy read, warm"),
    ("restore cold", "orbax_flax: restore cold", "orbax-checkpoint: restore cold", "DCP: load cold",
     "limit: numpy read, cold"),
    ("restore onto another mesh (warm)", "orbax_flax: restore onto 4-device mesh, warm",
     "orbax-checkpoint: restore onto 4-device mesh, warm", None, None),
]


def _load(path):
  with open(path) as f:
    return json.load(f)


def _f(x, fmt="{:.3f}"):
  return "-" if x is None else fmt.format(x)


def timing_table(run) -> list[str]:
  t = run["times"]
  gb = run["nbytes"] / 1e9
  lines = [f"{gb:.2f} GB, {run['leaves']} leaves, median of {run['reps']} interleaved runs; "
           f"{run['machine']}; {run['date']}.", "",
           "| phase | orbax_flax | orbax-checkpoint | DCP | limit | orbax-checkpoint / ours | DCP / ours |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for label, ours, orbax, dcp, limit in PHASES:
    o, ob, d, li = (t.get(k) if k else None for k in (ours, orbax, dcp, limit))
    lines.append(f"| {label} | {_f(o)} | {_f(ob)} | {_f(d)} | {_f(li)} | "
                 f"{_f(ob / o if o and ob else None, '{:.2f}x')} | {_f(d / o if o and d else None, '{:.2f}x')} |")
  interop = [
      ("restore of an orbax-checkpoint checkpoint (warm)",
       "orbax_flax: restore of the orbax-checkpoint checkpoint, warm", "orbax-checkpoint: restore warm"),
      ("restore of a safetensors file (warm)", "orbax_flax: restore of the safetensors file, warm",
       "safetensors: load_file + device_put, warm"),
  ]
  if any(t.get(k) for _, k, _ in interop):
    lines += ["", "| other formats | orbax_flax | the format's own reader | theirs / ours |",
              "|---|---:|---:|---:|"]
    for label, ours, theirs in interop:
      o, th = t.get(ours), t.get(theirs)
      lines.append(f"| {label} | {_f(o)} | {_f(th)} | {_f(th / o if o and th else None, '{:.2f}x')} |")
    if t.get("orbax_flax: export_safetensors"):
      lines.append(f"| export_safetensors of the state | {_f(t['orbax_flax: export_safetensors'])} | - | - |")
    lines += ["", "(the format's own reader: orbax-checkpoint's `StandardCheckpointer.restore`;"
              " `safetensors.numpy.load_file` then `jax.device_put` onto the target shardings.)"]
  first = t.get("orbax_flax: first async save, blocking")
  prepared = t.get("orbax_flax: first async save, prepared, blocking")
  if first:
    lines += ["", f"orbax_flax's first async save of a run (staging memory not yet touched): "
              f"blocked {first:.3f} s, total {t['orbax_flax: first async save, total']:.3f} s"
              + (f"; prepared first (`Checkpointer.prepare`, touched in the background in"
                 f" {_f(t.get('orbax_flax: prepare (background)'))} s): blocked {prepared:.3f} s"
                 if prepared else "") + ". "
              f"Other limits: O_DIRECT write {_f(t.get('limit: O_DIRECT write+fsync, 8 threads'))} s, "
              f"memcpy into fresh memory {_f(t.get('limit: memcpy of the state (fresh memory, 1 thread)'))} s."]
  return lines


def memory_table(run) -> list[str]:
  m = run.get("memory")
  if not m:
    return []
  lines = ["", "Peak host memory above what the process held before the call, in multiples of the"
           " state (VmHWM after clear_refs, each case in a fresh process after a warm-up on a tiny"
           " checkpoint; a restore counts the memory of the restored state):", "",
           "| phase | orbax_flax | orbax-checkpoint | DCP |", "|---|---:|---:|---:|"]
  for phase in ("save", "save_async", "restore"):
    row = [m.get(f"{c}: {phase}") for c in ("orbax_flax", "orbax", "dcp")]
    lines.append(f"| {phase} | " + " | ".join(_f(x, "{:.2f}x") for x in row) + " |")
  return lines


def mp_table(run) -> list[str]:
  rows = run.get("multiprocess")
  if not rows:
    return []
  lines = ["", "The same state saved and restored by N local processes (8/N simulated devices"
           " each) on this 2-core machine; round trips are coordination-service calls of the"
           " process that made the most:", "",
           "| processes | save s | save GB/s | restore s | restore GB/s | round trips / save | round trips / restore |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['processes']} | {r['save_s']:.3f} | {r['save_gbps']:.2f} | {r['restore_s']:.3f} |"
                 f" {r['restore_gbps']:.2f} | {r['save_round_trips']} | {r['restore_round_trips']} |")
  if any("local_save_r0_s" in r for r in rows):
    where = rows[0].get("local_on", "the same disk")
    lines += ["", f"Tiers on the same state and processes (the slowest process, median): the local"
              f" tier (on {where}) without and with one peer replica (sent with a jitted ppermute over gloo),"
              " its restore, and a data-parallel restore (matrices replicated over the `data`"
              " axis) read by every replica or once (`read_once=True`), with the bytes all"
              " processes read from storage:", "",
              "| processes | persistent save s | local save s | local save + replica s |"
              " local restore s | DP restore s | read-once DP restore s | DP bytes read | read-once bytes read |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
      rep = r.get("local_save_r1_s")
      lines.append(f"| {r['processes']} | {r['save_s']:.3f} | {r['local_save_r0_s']:.3f} |"
                   f" {_f(rep)} | {_f(r.get('local_restore_r1_s', r.get('local_restore_r0_s')))} |"
                   f" {r['dp_restore_once0_s']:.3f} | {r['dp_restore_once1_s']:.3f} |"
                   f" {r['dp_bytes_once0'] / 1e9:.2f} GB | {r['dp_bytes_once1'] / 1e9:.2f} GB |")
  return lines


def _ratio(t, a, b):
  return t[a] / t[b] if a in t and b in t else None


def targets(runs_by_size) -> list[str]:
  """(target, per-size runs) -> rows with each run's number and met / not met."""
  specs = []

  def add(size, name, fn, ok):
    specs.append((size, name, fn, ok))

  for size in runs_by_size:
    add(size, "async: caller blocked <= 1.5x one memcpy into touched memory",
        lambda t: _ratio(t, "orbax_flax: async save, blocking", "limit: memcpy of the state (touched memory)"),
        lambda x: x <= 1.5)
    add(size, "async: caller blocked >= 1.3x shorter than the faster peer",
        lambda t: min(t[k] for k in ("orbax-checkpoint: async save, blocking", "DCP: async save, blocking")
                      if k in t) / t["orbax_flax: async save, blocking"], lambda x: x >= 1.3)
    add(size, "async: total <= 1.15x our blocking save",
        lambda t: _ratio(t, "orbax_flax: async save, total", "orbax_flax: save"), lambda x: x <= 1.15)
    add(size, "first async save, prepared: caller blocked <= 1.5x one memcpy into touched memory",
        lambda t: _ratio(t, "orbax_flax: first async save, prepared, blocking",
                         "limit: memcpy of the state (touched memory)"), lambda x: x <= 1.5)
    add(size, "first async save, prepared: caller blocked >= 1.3x shorter than DCP's first",
        lambda t: _ratio(t, "DCP: first async save, blocking",
                         "orbax_flax: first async save, prepared, blocking"), lambda x: x >= 1.3)
    add(size, f"restore peak host memory <= {1.2 if size == '50mb' else 1.1}x the state",
        lambda t, m=None: None, (lambda x: x <= 1.2) if size == "50mb" else (lambda x: x <= 1.1))
  for size in runs_by_size:
    if size == "50mb":
      add(size, "50 MB: blocking save no slower than DCP", lambda t: _ratio(t, "orbax_flax: save", "DCP: save"),
          lambda x: x <= 1.0)
      add(size, "50 MB: async blocking no slower than DCP",
          lambda t: _ratio(t, "orbax_flax: async save, blocking", "DCP: async save, blocking"), lambda x: x <= 1.0)
      add(size, "50 MB: blocking save <= 1.5x the numpy write",
          lambda t: _ratio(t, "orbax_flax: save", "limit: numpy write+fsync, 8 threads"), lambda x: x <= 1.5)
    else:
      add(size, "restore warm >= 1.5x faster than DCP",
          lambda t: _ratio(t, "DCP: load warm", "orbax_flax: restore warm"), lambda x: x >= 1.5)
      add(size, "restore cold >= 1.5x faster than DCP",
          lambda t: _ratio(t, "DCP: load cold", "orbax_flax: restore cold"), lambda x: x >= 1.5)
      add(size, "restore warm <= 1.3x the numpy read",
          lambda t: _ratio(t, "orbax_flax: restore warm", "limit: numpy read, warm"), lambda x: x <= 1.3)
      add(size, "restore cold <= 1.15x the numpy read",
          lambda t: _ratio(t, "orbax_flax: restore cold", "limit: numpy read, cold"), lambda x: x <= 1.15)
      add(size, "restore onto another mesh <= 1.2x the same-mesh restore",
          lambda t: _ratio(t, "orbax_flax: restore onto 4-device mesh, warm", "orbax_flax: restore warm"),
          lambda x: x <= 1.2)
      add(size, "blocking save <= 1.3x the parallel fsync'd numpy write (earlier target)",
          lambda t: _ratio(t, "orbax_flax: save", "limit: numpy write+fsync, 8 threads"), lambda x: x <= 1.3)
      add(size, "blocking save >= 1.5x faster than DCP (earlier target)",
          lambda t: _ratio(t, "DCP: save", "orbax_flax: save"), lambda x: x >= 1.5)
      add(size, "warm restore >= 3x faster than orbax-checkpoint (earlier target)",
          lambda t: _ratio(t, "orbax-checkpoint: restore warm", "orbax_flax: restore warm"), lambda x: x >= 3)
  lines = ["| size | target | run 1 | run 2 | met? |", "|---|---|---:|---:|---|"]
  for size, name, fn, ok in specs:
    vals = []
    for run in runs_by_size[size]:
      if name.startswith("restore peak"):
        v = run.get("memory", {}).get("orbax_flax: restore")
      else:
        try:
          v = fn(run["times"])
        except (KeyError, ValueError):  # a contender missing from the run
          v = None
      vals.append(v)
    known = [v for v in vals if v is not None]
    verdict = "-" if not known else ("yes" if all(ok(v) for v in known) else
                                     ("**no**" if not any(ok(v) for v in known) else "**one run of two**"))
    cells = [_f(v, "{:.2f}x") for v in vals] + ["-"] * (2 - len(vals))
    lines.append(f"| {size} | {name} | {cells[0]} | {cells[1]} | {verdict} |")
  mp_rows = [r for runs in runs_by_size.values() for run in runs for r in run.get("multiprocess", [])]
  if mp_rows:
    trips = {}
    for r in mp_rows:
      trips.setdefault(r["processes"], set()).add(r["save_round_trips"])
    multi = {n: max(v) for n, v in trips.items() if n > 1}
    # Constant up to one call: the busiest process is not always the same one.
    flat = not multi or max(multi.values()) - min(multi.values()) <= 1
    lines.append(f"| 2gb | coordination round trips per save do not grow with processes |"
                 f" {', '.join(f'{n}p: {t}' for n, t in sorted(multi.items()))} | | {'yes' if flat else '**no**'} |")
  return lines


def chart(runs_by_size, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  sizes = list(runs_by_size)
  fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 4.8), squeeze=False)
  who = [("orbax_flax", 1, "#1f77b4"), ("orbax-checkpoint", 2, "#ff7f0e"), ("DCP", 3, "#2ca02c"),
         ("limit", 4, "#7f7f7f")]
  for ax, size in zip(axes[0], sizes):
    t = runs_by_size[size][-1]["times"]  # the latest run, as in the tables
    labels = [p[0].replace(" (warm)", "").replace("async save: ", "async ") for p in PHASES]
    width = 0.2
    for j, (name, col, color) in enumerate(who):
      vals = [t.get(p[col]) if p[col] else None for p in PHASES]
      xs = [i + (j - 1.5) * width for i in range(len(PHASES))]
      ax.bar([x for x, v in zip(xs, vals) if v], [v for v in vals if v], width, label=name, color=color)
    ax.set_xticks(range(len(PHASES)))
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("seconds (lower is better)")
    ax.set_title(f"{size}: {runs_by_size[size][-1]['nbytes'] / 1e9:.2f} GB, 334 leaves, 8 CPU devices")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--runs", action="append", required=True, help="SIZE=run1.json[,run2.json]")
  p.add_argument("--chart", default=None)
  a = p.parse_args()
  runs_by_size = {}
  for spec in a.runs:
    size, files = spec.split("=", 1)
    runs_by_size[size] = [_load(f) for f in files.split(",")]
  out = []
  for size, runs in runs_by_size.items():
    out += [f"### {size}", ""] + timing_table(runs[-1]) + memory_table(runs[-1]) + mp_table(runs[-1]) + [""]
  out += ["### Targets", ""] + targets(runs_by_size)
  print("\n".join(out))
  if a.chart:
    chart(runs_by_size, a.chart)


if __name__ == "__main__":
  main()
