"""Restart time: from process start to the first train step done on the restored state.

    .venv/bin/python benchmarks/restart.py --reps=5 --size-mb=1536 --json=benchmarks/results/restart-runN.json

Two jobs, each restarted again and again from its checkpoint, every run a fresh process:

* **example**: ``examples/train.py`` (the README's example, 5.6 MB state) started,
  SIGTERMed once its first step is done (it saves that step and exits), and started
  again; each run's parts are read from the callback's restart line ("process start
  to restore X s, restore Y s, first train step Z s"). Modes: compile cache off,
  cache cold (its directory emptied first), cache warm, and onto another mesh (4
  devices instead of 8) with a cold and a warm cache.
* **large**: a hand-written loop over a ~``--size-mb`` state (16 sharded matrices
  and a small MLP whose step compiles in seconds), sized so that its restore and
  its compile are of the same order. Modes: sequential (``restore_or_init``, then
  the first step compiles), overlap (``restore_or_init_async``, the step compiled
  while the bytes land, then ``join``), cache (warm), both (overlap and a warm
  cache), and cache cold. Each run times, from the process's start (``/proc``):
  start-up (imports of jax and orbax_flax, and JAX's devices), model init, the restore call,
  and the first step done.

Every mode runs once per rep, interleaved (rep 1 of every mode, then rep 2 ...);
medians over the reps. The targets of issue 30 are computed from the same run:
a cold restart with the overlap <= 1.15x max(restore alone, compile alone) +
start-up, a warm-cache restart <= (start-up + restore) x 1.2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LINE = re.compile(r"restart from step (\d+): process start to restore ([\d.]+) s .*?restore ([\d.]+) s"
                  r".*?first train step ([\d.]+) s .*?([\d.]+) s in all")


# ---------------------------------------------------------------------------- the large job


def child(args) -> int:
  """One run of the large job (in its own process); prints RESULT <json>."""
  from orbax_flax.training import resume  # pylint: disable=g-import-not-at-top
  started = resume.process_start_time()  # the process's start, read from /proc
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  ofx.CheckpointCallback  # pylint: disable=pointless-statement  (its lazy imports: flax, optax)
  jax.devices()
  t_jax = time.time()
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("d",))
  rows = max(n, (args.size_mb << 20) // (16 * 4 * 4096) // n * n)
  big, small = NamedSharding(mesh, P("d", None)), NamedSharding(mesh, P())

  def init():
    return {"big": [jnp.full((rows, 4096), i, jnp.float32) for i in range(16)],
            "w": jnp.eye(256, dtype=jnp.float32), "step": jnp.int32(0)}

  shapes = jax.eval_shape(init)
  shardings = jax.tree.map(lambda s: big if s.ndim == 2 and s.shape[1] == 4096 else small, shapes)
  state = jax.jit(init, out_shardings=shardings)()
  jax.block_until_ready(state)
  t_init = time.time()

  def step(s):
    x, w = s["w"], s["w"]
    for i in range(args.ops):  # a program that takes seconds to compile, as a model's does
      x = jnp.tanh(x @ w) * (1.0 + 0.01 * i) + jnp.sin(x) * 0.1
    m = x.mean()
    return {"big": [b * 0.999 + m for b in s["big"]], "w": w + 1e-3 * x, "step": s["step"] + 1}

  train_step = jax.jit(step, out_shardings=shardings, donate_argnums=0)
  policy = ofx.CheckpointPolicy(save_on_steps=(1,) if args.setup else (), save_final_step=False,
                                save_on_exception=False, compilation_cache=args.cache)
  with ofx.CheckpointCallback(args.workdir, policy) as ckpt:
    if args.overlap:
      pending = ckpt.restore_or_init_async(state)
      compiled = train_step.lower(state).compile()
      state = pending.join()
    else:
      state = ckpt.restore_or_init(state)
      compiled = train_step
    t_restored = time.time()
    restored_from = int(state["step"])
    state = compiled(state)
    ckpt.on_step_end(restored_from + 1, state)  # waits for the step, logs the restart line
    t_first = time.time()
  print("RESULT " + json.dumps({
      "jax_startup": t_jax - started, "init": t_init - t_jax, "restore_call": t_restored - t_init,
      "first_step": t_first - t_restored, "total": t_first - started,
      "state_bytes": sum(x.nbytes for x in jax.tree.leaves(state))}), flush=True)
  return 0


def run_large(workdir: str, mode: str, args, devices: int = 8) -> dict:
  overlap = mode in ("overlap", "both")
  cache = mode in ("cache", "both", "cache_cold")
  cmd = [sys.executable, os.path.abspath(__file__), "--child", f"--workdir={workdir}",
         f"--size-mb={args.size_mb}", f"--ops={args.ops}"] + (["--overlap"] if overlap else []) + (
             ["--cache"] if cache else [])
  r = subprocess.run(cmd, env=_env(devices), capture_output=True, text=True, timeout=900)
  if r.returncode:
    raise RuntimeError(f"{mode}: rc={r.returncode}\n{r.stderr[-3000:]}")
  out = json.loads(r.stdout.split("RESULT ", 1)[1])
  hits = re.search(r"compile cache: (\d+) hit", r.stderr)
  out["cache_hits"] = int(hits.group(1)) if hits else None
  return out


# ---------------------------------------------------------------------------- the example


def run_example(workdir: str, cache: bool, devices: int = 8) -> dict:
  """Starts the example, waits for its restart line (its first step done), SIGTERMs it."""
  cmd = [sys.executable, os.path.join(ROOT, "examples", "train.py"), f"--workdir={workdir}",
         "--config.num_steps=1000000", "--config.checkpoint.save_interval_steps=0",
         "--config.log_every=1000000",
         f"--config.checkpoint.compilation_cache={cache}"]
  env = _env(devices)
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  found, lines = None, []
  deadline = time.time() + 600
  for text in proc.stdout:
    lines.append(text)
    if "first train step" in text:
      found = text
      proc.send_signal(signal.SIGTERM)
      break
    if time.time() > deadline:
      break
  rest, _ = proc.communicate(timeout=600)
  if found is None or proc.returncode not in (0, 143, -signal.SIGTERM):  # 143: stopped by SIGTERM
    raise RuntimeError(f"example: rc={proc.returncode}\n{''.join(lines)[-3000:]}{rest[-3000:]}")
  m = LINE.search(found)
  hits = re.search(r"compile cache: (\d+) hit", found)
  if m is None:  # the first run of a workdir: nothing to resume yet
    return {"line": found.strip()}
  return {"step": int(m.group(1)), "startup": float(m.group(2)), "restore": float(m.group(3)),
          "first_step": float(m.group(4)), "total": float(m.group(5)),
          "cache_hits": int(hits.group(1)) if hits else None, "line": found.strip()}


# ---------------------------------------------------------------------------- driver


PLATFORM = ["cpu"]  # --platform: "cpu" simulates the devices; another runs on the machine's own


def _env(devices: int) -> dict:
  env = dict(os.environ)
  if PLATFORM[0] != "cpu":  # an accelerator: its own devices (one mesh only)
    env["JAX_PLATFORMS"] = PLATFORM[0]
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _clear_cache(workdir: str, devices: int) -> None:
  base = os.path.join(workdir, "compilation_cache")
  if os.path.isdir(base):
    for d in os.listdir(base):
      if PLATFORM[0] != "cpu" or d.endswith(f"-{devices}dev-1proc"):  # one mesh on an accelerator
        shutil.rmtree(os.path.join(base, d))


def median(rows: list[dict], key: str) -> float:
  vals = [r[key] for r in rows if r.get(key) is not None]
  return statistics.median(vals) if vals else float("nan")


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--setup", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--cache", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--workdir", default=None)
  p.add_argument("--size-mb", type=int, default=1024, help="the large job's state")
  # JAX writes to its cache only programs that took >= 1 s to compile
  # (jax_persistent_cache_min_compile_time_secs): with fewer ops the "cache" modes measure
  # nothing. 80 ops compile in 1.7 s on a quiet 2-core machine, the order of a 1.5 GB restore.
  p.add_argument("--ops", type=int, default=80, help="the large job's step: ops (compile time)")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--jobs", default="example,large")
  p.add_argument("--json", default=None)
  p.add_argument("--platform", default="cpu",
                 help="cpu (8 simulated devices, and 4 for 'another mesh'), or e.g. tpu: the"
                      " machine's own devices, without the other-mesh modes")
  a = p.parse_args()
  PLATFORM[0] = a.platform
  if a.child:
    return child(a)
  base = a.workdir or tempfile.mkdtemp(prefix="ofx-restart-", dir="/var/tmp")
  jobs = a.jobs.split(",")
  results: dict[str, dict[str, list]] = {"example": {}, "large": {}}
  ex_dir, large_dir = os.path.join(base, "example"), os.path.join(base, "large")
  if "example" in jobs:
    print(run_example(ex_dir, cache=False)["line"], file=sys.stderr)  # the first checkpoint
  if "large" in jobs:
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--setup",
                    f"--workdir={large_dir}", f"--size-mb={a.size_mb}", f"--ops={a.ops}"],
                   env=_env(8), check=True, capture_output=True, timeout=900)
  ex_modes = [("sequential", False, 8, False), ("cache_cold", True, 8, True), ("cache_warm", True, 8, False),
              ("other_mesh_cache_cold", True, 4, True), ("other_mesh_cache_warm", True, 4, False)]
  if a.platform != "cpu":
    ex_modes = [m for m in ex_modes if not m[0].startswith("other_mesh")]
  large_modes = ["sequential", "overlap", "cache_cold", "cache", "both"]
  for rep in range(a.reps):
    if "example" in jobs:
      for name, cache, devices, clear in ex_modes:
        if clear:
          _clear_cache(ex_dir, devices)
        r = run_example(ex_dir, cache, devices)
        results["example"].setdefault(name, []).append(r)
        print(f"rep {rep} example {name}: {r['line']}", file=sys.stderr, flush=True)
    if "large" in jobs:
      for mode in large_modes:
        if mode == "cache_cold":
          _clear_cache(large_dir, 8)
        r = run_large(large_dir, mode, a)
        results["large"].setdefault(mode, []).append(r)
        print(f"rep {rep} large {mode}: {json.dumps(r)}", file=sys.stderr, flush=True)
  print(report(results))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"results": results, "reps": a.reps, "size_mb": a.size_mb, "ops": a.ops}, f, indent=1)
  return 0


def report(results: dict) -> str:
  out = []
  ex = results.get("example") or {}
  if ex:
    out.append("| example (5.6 MB) | process start to restore | restore | first train step | total | cache hits |")
    out.append("|---|---:|---:|---:|---:|---:|")
    for name, rows in ex.items():
      out.append(f"| {name} | {median(rows, 'startup'):.2f} | {median(rows, 'restore'):.3f} |"
                 f" {median(rows, 'first_step'):.2f} | {median(rows, 'total'):.2f} |"
                 f" {median(rows, 'cache_hits'):.0f} |")
  if "sequential" in ex and "cache_warm" in ex:
    out.append("")
    out.append(example_ratios(ex))
  lg = results.get("large") or {}
  if lg:
    gb = lg[next(iter(lg))][0]["state_bytes"] / 1e9
    out.append("")
    out.append(f"| large ({gb:.2f} GB) | start-up (imports, JAX) | model init | restore call | first step done"
               " after it | total from process start | cache hits |")
    out.append("|---|---:|---:|---:|---:|---:|---:|")
    for name, rows in lg.items():
      out.append(f"| {name} | {median(rows, 'jax_startup'):.2f} | {median(rows, 'init'):.2f} |"
                 f" {median(rows, 'restore_call'):.2f} | {median(rows, 'first_step'):.2f} |"
                 f" {median(rows, 'total'):.2f} | {median(rows, 'cache_hits'):.0f} |")
    if "sequential" in lg:
      out.append("")
      out.append(per_rep_ratios(lg))
      seq = lg["sequential"]
      start = median(seq, "jax_startup") + median(seq, "init")
      restore, compile_ = median(seq, "restore_call"), median(seq, "first_step")
      out.append("")
      if "overlap" in lg:
        cold = median(lg["overlap"], "total")
        out.append(f"* cold restart with the overlap: {cold:.2f} s against max(restore {restore:.2f},"
                   f" compile and first step {compile_:.2f}) + start-up {start:.2f} ="
                   f" {max(restore, compile_) + start:.2f} s: after start-up"
                   f" {(cold - start) / max(restore, compile_):.2f}x the max (target <= 1.15x);"
                   f" sequential {median(seq, 'total'):.2f} s")
      if "cache" in lg:
        warm = median(lg["cache"], "total")
        out.append(f"* warm-cache restart: {warm:.2f} s against start-up + restore ="
                   f" {start + restore:.2f} s: {warm / (start + restore):.2f}x (target <= 1.2x)")
      if "both" in lg:
        both = median(lg["both"], "total")
        out.append(f"* both: {both:.2f} s, {both / (start + restore):.2f}x start-up + restore")
  return "\n".join(out)


def example_ratios(ex: dict) -> str:
  """The example's ratios within each rep, then their medians."""
  def own(r):  # a warm restart against its own start-up + restore
    return r["total"] / (r["startup"] + r["restore"])
  rows = [("warm-cache restart / (its own start-up + restore)", "cache_warm", own, 1.2),
          ("another mesh, warm cache / (its own start-up + restore)", "other_mesh_cache_warm", own, 1.2),
          ("first train step: cache off / warm cache", "cache_warm",
           None, None)]
  out = ["| example ratio (per rep, then the median) | reps | median | target | met? |",
         "|---|---|---:|---:|---|"]
  for name, mode, f, target in rows:
    if mode not in ex:
      continue
    if f is None:
      vals = [s["first_step"] / o["first_step"] for s, o in zip(ex["sequential"], ex[mode])]
    else:
      vals = [f(o) for o in ex[mode]]
    m = statistics.median(vals)
    met = "-" if target is None else ("yes" if m <= target else "**no**")
    out.append(f"| {name} | {', '.join(f'{v:.2f}' for v in vals)} | {m:.2f}x |"
               f" {'-' if target is None else f'<= {target}x'} | {met} |")
  return "\n".join(out)


def per_rep_ratios(lg: dict) -> str:
  """The targets as ratios within each rep, then their medians: steadier on a loaded machine
  than ratios of medians. Start-up (imports, JAX, model init) is each run's own: it varies
  between processes more than anything measured here; restore alone and compile alone
  come from the same rep's sequential run."""
  seq = lg["sequential"]
  rows = {"cold restart with the overlap, after start-up / max(restore, compile + first step)":
          ("overlap", lambda s, o: (o["total"] - o["jax_startup"] - o["init"])
           / max(s["restore_call"], s["first_step"]), 1.15),
          "cold restart, sequential / with the overlap": ("overlap", lambda s, o: s["total"] / o["total"], None),
          "warm-cache restart / (its own start-up + restore)":
          ("cache", lambda s, o: o["total"] / (o["jax_startup"] + o["init"] + o["restore_call"]), 1.2),
          "both / (its own start-up + restore)":
          ("both", lambda s, o: o["total"] / (o["jax_startup"] + o["init"] + o["restore_call"]), 1.2),
          "sequential / warm cache": ("cache", lambda s, o: s["total"] / o["total"], None),
          "sequential / both": ("both", lambda s, o: s["total"] / o["total"], None)}
  out = ["| ratio (per rep, then the median) | reps | median | target | met? |", "|---|---|---:|---:|---|"]
  for name, (mode, f, target) in rows.items():
    if mode not in lg:
      continue
    vals = [f(s, o) for s, o in zip(seq, lg[mode])]
    m = statistics.median(vals)
    met = "-" if target is None else ("yes" if m <= target else "**no**")
    out.append(f"| {name} | {', '.join(f'{v:.2f}' for v in vals)} | {m:.2f}x |"
               f" {'-' if target is None else f'<= {target}x'} | {met} |")
  return "\n".join(out)


if __name__ == "__main__":
  sys.exit(main())
