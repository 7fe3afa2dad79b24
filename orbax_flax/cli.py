"""``python -m orbax_flax``: look inside checkpoints and dry-run policies.

    python -m orbax_flax list DIR          committed steps: time, reason, size, metrics; leftovers
    python -m orbax_flax show DIR/STEP     items, tree with shapes/dtypes/shardings, bytes per item
    python -m orbax_flax verify DIR/STEP   re-reads every chunk and checks its checksum
    python -m orbax_flax plan --config configs/default.py --steps 10000 [--config.checkpoint.x=y]
    python -m orbax_flax convert SRC[:SELECTOR] DST [--format orbax_flax|safetensors|orbax] [--dtype bfloat16]

show, verify and convert read every format restore reads: orbax_flax, orbax-checkpoint, safetensors.

Exit codes: 0 fine, 1 corruption found, 2 no such checkpoint, bad usage or a storage failure.
"""

# pylint: disable=g-import-not-at-top  # the commands' imports: see below

from __future__ import annotations

import argparse
import ast
import datetime
import os
import sys
import textwrap
from collections.abc import Sequence

# Only light imports here: `--help` and usage errors must not wait for JAX and
# tensorstore (seconds, more on a loaded machine). Each command imports what it uses.
from orbax_flax import errors

EXIT_OK, EXIT_CORRUPT, EXIT_MISSING = 0, 1, 2


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> str:
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
  return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _when(t: float) -> str:
  return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def cmd_list(directory: str, out) -> int:
  from orbax_flax.engine import describe as metadata_lib
  from orbax_flax.engine import verifying
  from orbax_flax.format import step_dir
  from orbax_flax.formats import orbax_checkpoint
  from orbax_flax.core._location import Location
  from orbax_flax.differential import refs
  from orbax_flax.manager import registry
  loc = Location.parse(directory)
  # Every key of an object store, not its step index: the index names committed steps
  # only, and a listing is to show the interrupted saves too. An orbax-checkpoint
  # CheckpointManager's committed steps are listed too.
  steps, leftovers = step_dir.list_steps(loc, full=True)
  theirs = orbax_checkpoint.steps(loc)
  if not steps and not leftovers and not theirs and not step_dir.unlisted_steps(loc):
    sub = loc.join("checkpoints")  # a workdir: CheckpointCallback keeps its steps there
    try:
      steps, leftovers = step_dir.list_steps(sub, full=True)
      theirs = orbax_checkpoint.steps(sub)
    except (OSError, errors.CheckpointError):
      pass
    if not steps and not leftovers and not theirs:
      print(f"no checkpoints in {loc}{_where_they_are(loc)}", file=out)
      return EXIT_MISSING
    print(f"note: {loc} is a workdir; listing its checkpoints directory, {sub}\n", file=out)
    loc = sub
  # Steps a committed rollback abandoned are no steps (their deletion may be pending).
  abandoned = sorted(set(steps) - set(registry.visible_steps(loc, steps)))
  steps = [s for s in steps if s not in abandoned]
  rows = []
  damaged = 0
  gone = []
  orbax_rows = []
  for step in sorted(set(steps) | set(theirs)):
    try:
      # The whole manifest, hashed: a summary that survived a manifest cut short is no
      # readable step. The arrays are not read (verify does that).
      s = verifying.check_manifest(loc.join(str(step)))
    except errors.CheckpointNotFoundError as e:
      if step in theirs:  # no manifest of ours: orbax-checkpoint's markers
        row = _orbax_row(loc, step)
        if row is None:
          gone.append(step)
        elif row[2] == "CORRUPTED":
          damaged += 1
          rows.append(row)
        else:
          orbax_rows.append(step)
          rows.append(row)
        continue
      # Listed a moment ago: deleted since (a keep rule of the job that writes here) if
      # it is listed no more, else a step without a manifest.
      if step not in step_dir.list_steps(loc, full=True)[0]:
        gone.append(step)
        continue
      damaged += 1
      rows.append([str(step), "?", "NO MANIFEST", "?", "?", "?", str(e)[:80]])
      continue
    except errors.CheckpointCorruptedError as e:
      damaged += 1
      rows.append([str(step), "?", "CORRUPTED", "?", "?", "?", str(e)[:80]])
      continue
    try:  # a differential step whose borrowed data is gone (a base removed by hand)
      for b in s.bases:
        refs.locate_step(loc.join(str(step)), b.dir, b.generation)
    except errors.CheckpointFormatError:
      damaged += 1
      rows.append([str(step), _when(s.created), "BASE GONE", "?", "?", "?",
                   f"borrows from step {b.dir}, which is gone"])
      continue
    custom = s.custom
    metrics = _metrics_text(custom.get("metrics", {}))
    stored = s.stored_bytes  # a differential save: bytes it holds, bytes it borrows
    rows.append([str(step), _when(s.created), custom.get("reason", "-"),
                 metadata_lib.human_bytes(sum(s.item_bytes.values())),
                 "-" if stored is None else metadata_lib.human_bytes(stored["borrowed"]),
                 f"{s.process_count}p/{s.device_count}d", metrics])
  strays = step_dir.unlisted_steps(loc)  # no steps, and no damage either
  if rows:
    header = ["STEP", "SAVED", "REASON", "SIZE", "BORROWED", "PROCS/DEVS", "METRICS"]
    if all(r[4] in ("-", "?") for r in rows):  # no differential step: no column
      header, rows = header[:4] + header[5:], [r[:4] + r[5:] for r in rows]
    print(_table(header, rows), file=out)
    print(f"\n{len(rows)} committed step(s) in {loc}; latest {rows[-1][0]}", file=out)
  if orbax_rows:
    print(f"orbax-checkpoint step(s): {', '.join(map(str, orbax_rows))} (orbax records no reason,"
          f" size or devices; `python -m orbax_flax show {loc.join('STEP')}` shows one)",
          file=out)
  if gone:
    print(f"deleted while listed (a keep rule of the job writing here): step(s)"
          f" {', '.join(map(str, gone))}", file=out)
  if abandoned:
    print(f"abandoned by a rollback, not steps: {', '.join(map(str, abandoned))} (the run"
          " went back to an older step and has committed since; the next training job here"
          " deletes them)", file=out)
  if strays:
    print(f"NO MANIFEST, not steps: {', '.join(map(str, strays))}: directories named like"
          " steps without a manifest of ours (someone's files, a copy in progress, another"
          " library's data); no keep rule deletes them.", file=out)
  retired = step_dir.retired_dirs(loc.local_path) if loc.is_local else []
  if retired:
    print(f"retired, not steps: {', '.join(retired)}: data of deleted steps that kept"
          " (differential) steps still reference; removed once none does.", file=out)
  for l in leftovers:
    print(f"not committed: {l.name}, a save in progress or an interrupted save or delete. A save"
          " in progress becomes a step when it commits; if no job writes here, it was"
          " interrupted, and the next training job here removes it.", file=out)
  if damaged:
    print(f"{damaged} step(s) cannot be read; `python -m orbax_flax verify {loc.join('STEP')}`"
          " tells more", file=out)
    return EXIT_CORRUPT
  return EXIT_OK


def _metrics_text(metrics: dict) -> str:
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                  for k, v in sorted(metrics.items()))


def _orbax_row(loc, step: int) -> list[str] | None:
  """``list``'s row for a committed orbax-checkpoint step (time and metrics as orbax
  recorded them), a CORRUPTED row if its metadata is damaged, or None if the step was
  deleted since it was listed."""
  from orbax_flax.formats import orbax_checkpoint
  where = loc.join(str(step))
  try:
    meta = orbax_checkpoint.read_step_metadata(where)
  except errors.CheckpointCorruptedError as e:
    return [str(step), "?", "CORRUPTED", "?", "?", "?", str(e)[:80]]
  if not meta.time_ns and step not in orbax_checkpoint.steps(loc):
    return None  # its metadata is gone with it (orbax's own keep rule)
  return [str(step), _when(meta.time_ns / 1e9) if meta.time_ns else "-", "orbax-checkpoint",
          "-", "-", "-", _metrics_text(meta.metrics)]


def _where_they_are(loc) -> str:
  """Where the checkpoints a user pointing at ``loc`` probably meant are, as advice."""
  from orbax_flax.engine import restoring
  from orbax_flax.format import step_dir
  try:
    restoring.read_summary(loc)
    return (f": {loc} is one checkpoint, not a directory of steps; look inside it with"
            f" `python -m orbax_flax show {loc}`")
  except errors.CheckpointError:
    pass
  # A workdir: CheckpointCallback keeps its steps in <workdir>/checkpoints. Locally,
  # any sub-directory holding steps is worth naming.
  names = ["checkpoints"]
  if loc.is_local:
    if not os.path.isdir(loc.local_path):
      return " (it does not exist)"
    try:
      names += sorted(n for n in os.listdir(loc.local_path) if n != "checkpoints"
                      and os.path.isdir(os.path.join(loc.local_path, n)))[:_MAX_SUBDIRS]
    except OSError:
      pass
  callback_layout = ""
  for name in names:
    sub = loc.join(name)
    try:
      steps, leftovers = step_dir.list_steps(sub)
    except (OSError, errors.CheckpointError):
      continue
    layout = " (the layout CheckpointCallback uses)" if name == "checkpoints" else ""
    if steps:
      return (f"; {sub} holds {len(steps)} committed step(s){layout}, latest {steps[-1]}:"
              f" `python -m orbax_flax list {sub}`")
    if layout and (leftovers or (sub.is_local and os.path.isdir(sub.local_path))):
      callback_layout = (f"; {sub} exists{layout} but holds no committed step yet:"
                         f" `python -m orbax_flax list {sub}` once a save has committed")
  return callback_layout


_MAX_SUBDIRS = 64  # sub-directories of a workdir that `list` looks into for advice


def cmd_show(path: str, out) -> int:
  from orbax_flax.engine import describe as metadata_lib
  from orbax_flax.engine import restoring
  loc, manifest = restoring.open_manifest(path)
  meta = metadata_lib.from_manifest(str(loc), manifest)
  print(meta, file=out)
  stored = manifest.stored_bytes
  if stored is not None:  # a differential save
    bases = ", ".join(b.dir for b in manifest.bases) or "none"
    print(f"  stored: own {metadata_lib.human_bytes(stored['own'])}, borrowed"
          f" {metadata_lib.human_bytes(stored['borrowed'])} from step(s) {bases}", file=out)
  custom = meta.custom
  if custom:
    print(f"  recorded: {', '.join(f'{k}={v}' for k, v in sorted(custom.items()))}", file=out)
  for item in meta.items.values():
    values = _values(item.tree)
    for path_, v in values:
      print(f"  {item.name}/{path_} = {v!r}", file=out)
  return EXIT_OK


def _values(tree, prefix=""):
  """Non-array leaves (scalars, strings) of a metadata tree."""
  from orbax_flax.engine import describe as metadata_lib
  out = []
  if isinstance(tree, dict):
    for k, v in tree.items():
      out += _values(v, f"{prefix}{k}/")
  elif isinstance(tree, (list, tuple)):
    for i, v in enumerate(tree):
      out += _values(v, f"{prefix}{i}/")
  elif tree is not None and not isinstance(tree, metadata_lib.ArrayMetadata):
    out.append((prefix.rstrip("/"), tree))
  return out


def cmd_verify(path: str, out) -> int:
  from orbax_flax.engine import describe as metadata_lib
  from orbax_flax.engine import verifying as verify_lib
  try:
    n, what = verify_lib.verify_report(path)
  except errors.CheckpointCorruptedError as e:
    print(f"CORRUPTED: {e}", file=out)
    return EXIT_CORRUPT
  print(f"OK: {path}: {what} ({metadata_lib.human_bytes(n)} of arrays read)", file=out)
  return EXIT_OK


def cmd_convert(argv: list[str], out) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m orbax_flax convert",
      description="Converts a checkpoint of any format (orbax_flax, orbax-checkpoint,"
      " safetensors) into orbax_flax, safetensors or orbax-checkpoint (a StandardCheckpointer"
      " item). SRC:SELECTOR writes only a part, as init_from names it.",
      epilog="example: python -m orbax_flax convert runs/lm/checkpoints/1000:params model"
      " --format safetensors --dtype bfloat16   (the params only: no optimizer moments, keys,"
      " data position or config)")
  parser.add_argument("src", help="the checkpoint to read; SRC:<item>/<sub/tree> takes a part"
                      " (several joined by ',', e.g. ckpt:params,train_state/batch_stats)")
  parser.add_argument("dst", help="where to write (must not exist, or be an empty directory, unless --overwrite)")
  parser.add_argument("--format", choices=["orbax_flax", "safetensors", "orbax"],
                      default="orbax_flax",
                      help="orbax: an orbax-checkpoint item that StandardCheckpointer restores")
  parser.add_argument("--dtype", default=None, help="convert floating arrays, e.g. bfloat16")
  parser.add_argument("--max_shard_bytes", type=int, default=5 << 30,
                      help="safetensors: the most bytes per file (default 5 GiB)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace DST if it is an orbax_flax checkpoint, an earlier export of"
                      " this format or an empty directory (anything else there is refused)")
  args = parser.parse_args(argv)
  from orbax_flax.engine import converting
  try:
    written = converting.convert(args.src, args.dst, format=args.format, dtype=args.dtype,
                                 max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite)
  except (ValueError, TypeError, errors.CheckpointExistsError) as e:
    # The library names its argument, overwrite=True; here it is the flag.
    print(f"error: {one_line(e).replace('overwrite=True', '--overwrite')}", file=sys.stderr)
    return EXIT_MISSING
  print(written, file=out)
  return EXIT_OK


PLAN_HELP = """usage: python -m orbax_flax plan --config=PATH [--steps=N] [--config.checkpoint.FIELD=VALUE ...]

Dry-runs a checkpoint policy: which steps a run would save, and which it would keep.

options:
  --config=PATH            a config file with a `checkpoint` block (e.g. configs/default.py),
                           or one that is itself the block
  --config.X=Y             override any config field, e.g. --config.checkpoint.max_to_keep=5
  --steps=N                run length in steps (default: the config's num_steps)
  --start_step=N           simulate a run resumed after step N (default 0)
  --seconds_per_step=S     simulated wall time per step, for time-based rules (default 1)
  --save_cost_seconds=S    what a save blocks, for save_interval=auto (default: 1 s assumed)
  --local_save_cost_seconds=S
                           what a local-tier save takes, for local_save_interval=auto
                           (default: 1 s assumed)
  --all                    list every save instead of a summary
  -h, --help               show this help
"""


def one_line(e: BaseException) -> str:
  """An exception as one readable line (no reprs, no embedded newlines).

  absl and ml_collections hand back KeyErrors whose text is the repr of a
  repr; this unwraps them.

  Example:
    >>> one_line(KeyError("'max_to_kep'\\nDid you mean \\"max_to_keep\\"?"))
    'max_to_kep: Did you mean "max_to_keep"?'
  """
  text = e.args[0] if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str) else str(e)
  for _ in range(3):  # a repr of a repr of a message
    stripped = text.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
      try:
        text = ast.literal_eval(stripped)
        continue
      except (ValueError, SyntaxError):
        pass
    break
  text = text.replace("\\n", "\n")
  lines = [l.strip().strip("'\"") for l in text.splitlines() if l.strip()]
  return ": ".join(lines) if lines else type(e).__name__


def cmd_plan(argv: list[str], out) -> int:
  if any(a in ("-h", "--help", "-help", "--helpfull") for a in argv):
    print(PLAN_HELP, file=out, end="")
    return EXIT_OK
  from absl import flags
  from ml_collections import config_flags
  from orbax_flax.manager.config import CheckpointPolicy
  fv = flags.FlagValues()
  # sys_argv: config_flags reads --config.x=y overrides from it (sys.argv by default), so
  # main(argv) called with a list honours them as `python -m orbax_flax` does.
  config_flags.DEFINE_config_file("config", None, "Config file (e.g. configs/default.py).",
                                  flag_values=fv, sys_argv=["plan"] + argv)
  flags.DEFINE_integer("steps", None, "Run length in steps (default: config.num_steps).", flag_values=fv)
  flags.DEFINE_integer("start_step", 0, "Simulate a run resumed after this step.", flag_values=fv)
  flags.DEFINE_float("seconds_per_step", 1.0, "Simulated wall time per step.", flag_values=fv)
  flags.DEFINE_bool("all", False, "List every save instead of a summary.", flag_values=fv)
  flags.DEFINE_float("local_save_cost_seconds", None,
                     "What a local-tier save takes, for local_save_interval=auto.", flag_values=fv)
  flags.DEFINE_float("save_cost_seconds", None, "What a save blocks, for save_interval=auto.",
                     flag_values=fv)
  try:
    fv(["plan"] + argv)
    if fv.config is None:
      raise ValueError("plan needs --config=PATH (e.g. configs/default.py)")
    config = fv.config
    block = config.checkpoint if "checkpoint" in config else config
    policy = CheckpointPolicy.from_config(block)
    steps = fv.steps if fv.steps is not None else int(config.get("num_steps", 0))
  except (flags.Error, ValueError, TypeError, AttributeError, KeyError, OSError,
          ImportError) as e:
    print(f"error: {one_line(e)}", file=sys.stderr)
    return EXIT_MISSING
  if steps <= 0:
    print("error: give --steps=N or set num_steps in the config", file=sys.stderr)
    return EXIT_MISSING
  if fv.start_step < 0:
    print(f"error: --start_step={fv.start_step}: steps are numbered from 0; give the last step"
          " the resumed run saved (or 0 for a new run)", file=sys.stderr)
    return EXIT_MISSING
  if not fv.seconds_per_step > 0:  # (a NaN too)
    print(f"error: --seconds_per_step={fv.seconds_per_step:g}: give the wall time one step takes,"
          " more than 0 (e.g. 0.5)", file=sys.stderr)
    return EXIT_MISSING
  for flag in ("save_cost_seconds", "local_save_cost_seconds"):
    cost = getattr(fv, flag)
    if cost is not None and not cost >= 0:
      print(f"error: --{flag}={cost:g}: give what a save takes in seconds, 0 or more (e.g."
            " 2.5), or leave it out for 1 s", file=sys.stderr)
      return EXIT_MISSING
  if fv.start_step >= steps:
    print(f"error: --start_step={fv.start_step} leaves nothing to plan in a run of {steps}"
          " steps; give a smaller --start_step or more --steps", file=sys.stderr)
    return EXIT_MISSING
  plan = policy.plan(steps, seconds_per_step=fv.seconds_per_step, start_step=fv.start_step,
                     save_cost_seconds=fv.save_cost_seconds)
  print(f"policy over steps {fv.start_step + 1}..{steps} ({fv.seconds_per_step:g} s per step):", file=out)
  if policy.save_interval == "auto":
    _print_auto("save_interval", "save cost", "save_cost_seconds", policy, fv, out)
  by_reason: dict[str, list[int]] = {}
  for step, reason in plan.saved:
    by_reason.setdefault(reason, []).append(step)
  print(f"saves {len(plan.saved)} step(s):", file=out)
  for reason, s in by_reason.items():
    shown = s if fv.all or len(s) <= 12 else s[:5] + ["..."] + s[-5:]
    print(f"  {reason:10s} {len(s):6d}  {', '.join(str(x) for x in shown)}", file=out)
  print(f"keeps {len(plan.kept)} step(s) at the end: {', '.join(str(x) for x in plan.kept)}", file=out)
  if policy.keep_best:
    print(f"(keep_best ranks by {policy.best_metric!r}, which a dry run cannot know; the plan"
          " treats every step as lacking it)", file=out)
  if policy.local_tier:
    _print_local_plan(policy, steps, fv, out)
  return EXIT_OK


def _print_auto(field: str, what: str, flag: str, policy, fv, out) -> None:
  """The interval ``field="auto"`` chooses from the cost in ``--flag`` (1 s assumed without)."""
  from orbax_flax.manager import policy as policy_lib
  cost = getattr(fv, flag)
  interval = policy_lib.YoungDaly(policy.mtbf_seconds).interval(cost)
  print(f"{field}=auto: sqrt(2 x {what} {1.0 if cost is None else cost:g} s"
        f"{f' (assumed; pass --{flag})' if cost is None else ''} x mtbf"
        f" {policy.mtbf_seconds:g} s) = every {interval:.1f} s, about every"
        f" {max(1, round(interval / fv.seconds_per_step))} step(s); a failure loses"
        f" {interval / 2:.1f} s of work on average", file=out)


def _print_local_plan(policy, steps: int, fv, out) -> None:
  """The local tier's part of ``plan``: its saves, and the auto interval it would choose."""
  local = policy.plan_local(steps, seconds_per_step=fv.seconds_per_step, start_step=fv.start_step,
                            local_save_cost_seconds=fv.local_save_cost_seconds)
  if policy.local_save_interval == "auto":
    _print_auto("local_save_interval", "local save cost", "local_save_cost_seconds", policy, fv, out)
  shown = local if fv.all or len(local) <= 12 else local[:5] + ["..."] + local[-5:]
  print(f"local tier ({policy.local_directory}) saves {len(local)} step(s):"
        f" {', '.join(str(x) for x in shown)}; keeps the newest {policy.local_max_to_keep} on each"
        " process", file=out)


# list, show, verify: (help line, what it does, examples, argument, the argument's help).
_COMMANDS = {
    "list": (
        "committed steps and leftovers of a directory",
        "Lists the committed steps of a directory of steps (a CheckpointManager's, or"
        " CheckpointCallback's <workdir>/checkpoints): when each was saved, why, its size, the"
        " processes and devices that saved it, its metrics; and leftovers of interrupted saves."
        " Given a workdir, it lists <workdir>/checkpoints (and says so). Each step's manifest is"
        " checked whole against its SHA-256s; its arrays are not read (verify reads them). The"
        " committed steps of an orbax-checkpoint CheckpointManager are listed too, with the time"
        " and metrics orbax recorded.",
        "examples:\n  python -m orbax_flax list /tmp/ofx_run/checkpoints\n"
        "  python -m orbax_flax list /tmp/ofx_run        # a workdir: lists its checkpoints/\n\n"
        "exit status: 0 fine, 1 a step cannot be read, 2 no checkpoints there",
        "directory", "a directory of steps, or a workdir"),
    "show": (
        "contents of one checkpoint",
        "Shows one checkpoint (orbax_flax, orbax-checkpoint or safetensors): its items, the tree"
        " of each with shapes, dtypes and shardings, bytes per item, and what was recorded with"
        " it (step, reason, metrics, mesh).",
        "example:\n  python -m orbax_flax show /tmp/ofx_run/checkpoints/100\n\n"
        "exit status: 0 fine, 2 no checkpoint there (a directory of steps: the error lists them)",
        "path", "one checkpoint: a step directory such as <workdir>/checkpoints/100"),
    "verify": (
        "check every checksum of one checkpoint",
        "Re-reads every chunk of one checkpoint and checks its checksum, naming every damaged"
        " array. orbax-checkpoint and safetensors checkpoints store no checksums: every chunk or"
        " byte range is checked to be present and to decode, and a damaged byte inside one that"
        " still decodes goes unseen (what convert --format orbax writes carries a CRC-32C per"
        " chunk, which is checked).",
        "example:\n  python -m orbax_flax verify /tmp/ofx_run/checkpoints/100\n\n"
        "exit status: 0 intact, 1 corruption found, 2 no checkpoint there",
        "path", "one checkpoint: a step directory such as <workdir>/checkpoints/100"),
}


def main(argv: Sequence[str] | None = None, out=None) -> int:
  out = out or sys.stdout
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(prog="python -m orbax_flax", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  for name, (short, what, example, arg, arg_help) in _COMMANDS.items():
    sub.add_parser(name, help=short, description=textwrap.fill(what, 88), epilog=example,
                   formatter_class=argparse.RawDescriptionHelpFormatter).add_argument(
                       arg, help=arg_help)
  sub.add_parser("plan", help="dry-run a checkpoint policy (python -m orbax_flax plan --help)",
                 add_help=False)
  sub.add_parser("convert", help="convert SRC[:SELECTOR] DST [--format orbax_flax|safetensors|orbax]"
                 " [--dtype D]",
                 add_help=False)
  if argv and argv[0] == "plan":
    return cmd_plan(argv[1:], out)
  args = parser.parse_args(argv) if not (argv and argv[0] == "convert") else None
  try:
    if args is None:
      return cmd_convert(argv[1:], out)
    if args.command == "list":
      return cmd_list(args.directory, out)
    if args.command == "show":
      return cmd_show(args.path, out)
    return cmd_verify(args.path, out)
  except errors.CheckpointNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_MISSING
  except errors.CheckpointCorruptedError as e:
    print(f"CORRUPTED: {e}", file=sys.stderr)
    return EXIT_CORRUPT
  except (errors.StorageError, NotADirectoryError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_MISSING
  except (ValueError, TypeError, errors.CheckpointExistsError) as e:  # bad input to convert
    print(f"error: {one_line(e)}", file=sys.stderr)
    return EXIT_MISSING
