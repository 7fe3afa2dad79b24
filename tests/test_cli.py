"""The command-line tool: its main() in this process (every command, exit code and output),
and the real command line, `python -m orbax_flax` in a subprocess, where the process matters
(the entry point, help without heavy imports, a package not installed)."""

import contextlib
import io
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jobs
import orbax_flax as ofx
from orbax_flax import cli

CLI = [sys.executable, "-m", "orbax_flax"]


def run(*args):
  """``python -m orbax_flax ARGS`` as its main() runs it, in this process: (exit code, output)."""
  out, err = io.StringIO(), io.StringIO()
  cwd = os.getcwd()
  os.chdir(jobs.ROOT)  # (paths such as configs/default.py are the repository's)
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      try:
        rc = cli.main(list(args), out=out)
      except SystemExit as e:  # argparse's refusals and --help
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
  finally:
    os.chdir(cwd)
  return rc, out.getvalue() + err.getvalue()


def run_process(*args):
  """``python -m orbax_flax ARGS`` in a subprocess, the real command line: (exit code, output)."""
  # One device: reading metadata and verifying need no particular device count.
  r = subprocess.run([*CLI, *args], capture_output=True, text=True, env=jobs.env_for(1), cwd=jobs.ROOT,
                     check=False)
  return r.returncode, r.stdout + r.stderr


def make_run_dir(d):
  policy = ofx.CheckpointPolicy(save_interval_steps=10, max_to_keep=2)
  with ofx.CheckpointManager(d, policy) as mngr:
    for step in range(1, 31):
      mngr.save(step, {"state": {"w": np.full((256, 256), step, np.float32), "lr": 0.1},
                       "extra": {"epoch": step // 10}}, metrics={"loss": 1.0 / step})


def test_list_show_verify(tmp_path):
  d = str(tmp_path / "run")
  make_run_dir(d)
  os.makedirs(os.path.join(d, "40.ofx-tmp-0011223344556677"))
  rc, out = run_process("list", d)
  assert rc == 0, out
  lines = out.splitlines()
  assert lines[0].split() == ["STEP", "SAVED", "REASON", "SIZE", "PROCS/DEVS", "METRICS"]
  assert lines[2].split()[0] == "20" and "interval" in lines[2] and "256.0 KiB" in lines[2]
  assert "loss=0.03333" in lines[3]
  assert "2 committed step(s)" in out and "latest 30" in out
  assert "40.ofx-tmp-0011223344556677" in out

  rc, out = run_process("show", os.path.join(d, "30"))
  assert rc == 0, out
  assert "item state: 1 arrays, 256.0 KiB" in out
  assert "w  float32[256, 256]" in out
  assert "state/lr = 0.1" in out and "extra/epoch = 3" in out
  assert "reason=interval" in out

  rc, out = run_process("verify", os.path.join(d, "30"))
  assert rc == 0 and out.startswith("OK"), out


_NO_FLAX_PROBE = """
import runpy, sys
for args in (["list", sys.argv[1]], ["show", sys.argv[2]], ["verify", sys.argv[2]]):
  sys.argv = ["orbax_flax", *args]
  try:
    runpy.run_module("orbax_flax", run_name="__main__", alter_sys=True)
  except SystemExit as e:
    assert not e.code, (args, e.code)
print("FLAX", sorted(m for m in sys.modules if m == "flax" or m.startswith("flax.")))
"""


def test_list_show_and_verify_start_without_importing_flax(tmp_path):
  """Reading a checkpoint from the shell needs no flax (0.4 s of start-up),
  also for a state saved with Linen boxes: a box's value is stored at its own path."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  d = str(tmp_path / "run")
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(save_interval_steps=1)) as mngr:
    mngr.save(1, {"state": {"w": nn.Partitioned(np.ones((4, 4), np.float32), ("x", None))}})
  r = subprocess.run([sys.executable, "-c", _NO_FLAX_PROBE, d, os.path.join(d, "1")],
                     capture_output=True, text=True, env=jobs.env_for(1), cwd=jobs.ROOT, check=False)
  out = r.stdout + r.stderr
  assert r.returncode == 0, out
  assert "w  float32[4, 4]" in out and "FLAX []" in out, out


def test_verify_reports_corruption_and_missing_steps(tmp_path):
  d = str(tmp_path / "run")
  make_run_dir(d)
  data = max((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(d, "30")) for f in fs
              if "/d/" in os.path.join(r, f)), key=os.path.getsize)
  with open(data, "r+b") as f:
    f.seek(1000)
    b = f.read(1)
    f.seek(1000)
    f.write(bytes([b[0] ^ 0xFF]))
  rc, out = run("verify", os.path.join(d, "30"))
  assert rc == 1, out
  assert "CORRUPTED" in out and "state" in out and data in out
  rc, out = run("verify", os.path.join(d, "20"))
  assert rc == 0, out
  rc, out = run("verify", os.path.join(d, "25"))
  assert rc == 2 and "no orbax_flax checkpoint at" in out and "does not exist" in out
  rc, out = run("show", os.path.join(d, "25"))
  assert rc == 2
  rc, out = run("list", str(tmp_path / "nothing"))
  assert rc == 2 and "no checkpoints" in out
  # A damaged manifest: the listing still shows every step, and exits 1.
  manifest = os.path.join(d, "20", "_CHECKPOINT")
  raw = bytearray(open(manifest, "rb").read())
  raw[30] ^= 0x01
  open(manifest, "wb").write(bytes(raw))
  rc, out = run("list", d)
  assert rc == 1 and "CORRUPTED" in out and "latest 30" in out, out
  # A step directory without a manifest (made by hand) is reported, not a crash.
  os.makedirs(os.path.join(d, "50"))
  rc, out = run("list", d)
  assert rc == 1 and "NO MANIFEST" in out and "Traceback" not in out, out
  (tmp_path / "file").write_text("x")
  rc, out = run("list", str(tmp_path / "file"))
  assert rc == 2 and "is a file" in out and "Traceback" not in out, out


def test_plan_with_config_overrides():
  rc, out = run("plan", "--config=configs/default.py", "--steps=200",
                "--config.checkpoint.save_interval_steps=20", "--config.checkpoint.max_to_keep=2")
  assert rc == 0, out
  assert "saves 10 step(s):" in out
  assert "interval       10  20, 40, 60, 80, 100, 120, 140, 160, 180, 200" in out
  assert "keeps 2 step(s) at the end: 180, 200" in out
  rc, out = run("plan", "--config=configs/default.py", "--config.checkpoint.max_to_kep=2")
  assert rc != 0 and "max_to_kep" in out
  rc, out = run("plan", "--config=configs/default.py", "--config.checkpoint.save_interval_steps=-5")
  assert rc == 2 and "save_interval_steps=-5: must be >= 0" in out and "Traceback" not in out
  rc, out = run("plan", "--config=configs/missing.py")
  assert rc == 2 and "missing.py" in out and "Traceback" not in out
  rc, out = run("plan", "--config=configs/default.py", "--steps=10", "--start_step=20")
  assert rc == 2 and "--start_step=20 leaves nothing to plan" in out


def test_variant_configs_load_from_any_directory(tmp_path):
  for name in ("large", "preemptible"):
    r = subprocess.run([*CLI, "plan", f"--config={os.path.join(jobs.ROOT, 'configs', name + '.py')}"],
                       capture_output=True, text=True, env=jobs.env_for(1), cwd=tmp_path, check=False)
    assert r.returncode == 0 and "saves" in r.stdout, r.stdout + r.stderr


def test_dataclass_config_with_overrides():
  r = subprocess.run([sys.executable, os.path.join(jobs.HERE, "dataclass_config_main.py"),
                      "--config.checkpoint.max_to_keep=5",
                      "--config.checkpoint.preemption_signals=('SIGTERM','SIGUSR1')"],
                     capture_output=True, text=True, env=jobs.env_for(1), check=False)
  assert r.returncode == 0, r.stderr
  assert "POLICY 100 5 SIGTERM,SIGUSR1" in r.stdout


def test_list_on_a_workdir_lists_its_checkpoints_with_a_note(tmp_path):
  workdir = tmp_path / "run"
  with ofx.CheckpointManager(str(workdir / "checkpoints")) as mngr:  # CheckpointCallback's layout
    mngr.save(7, {"state": {"w": np.ones(4)}}, force=True)
  rc, out = run("list", str(workdir))
  assert rc == 0, out
  assert out.startswith(f"note: {workdir} is a workdir; listing its checkpoints directory,"
                        f" {workdir}/checkpoints"), out
  assert f"1 committed step(s) in {workdir}/checkpoints; latest 7" in out, out
  rc, out = run("list", str(tmp_path))  # no steps here nor in its checkpoints/: advice, exit 2
  assert rc == 2 and f"no checkpoints in {tmp_path}" in out, out
  out = io.StringIO()  # one checkpoint, not a directory of steps (in this process: faster)
  assert cli.main(["list", str(workdir / "checkpoints" / "7")], out=out) == 2
  assert f"python -m orbax_flax show {workdir}/checkpoints/7" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("command, says", [
    ("list", "Lists the committed steps"), ("show", "Shows one checkpoint"),
    ("verify", "Re-reads every chunk")])
def test_list_show_verify_help_says_what_each_does_with_an_example(command, says):
  out = io.StringIO()
  with pytest.raises(SystemExit) as e, contextlib.redirect_stdout(out):
    cli.main([command, "--help"])
  assert e.value.code == 0
  text = out.getvalue()
  assert says in text and f"python -m orbax_flax {command} /tmp/ofx_run" in text, text
  assert "exit status: 0" in text, text


# What `--help` may import: nothing that takes seconds (JAX, tensorstore).
_HELP_PROBE = """
import runpy, sys
sys.argv = ["orbax_flax", *sys.argv[1:]]
try:
  runpy.run_module("orbax_flax", run_name="__main__", alter_sys=True)
except SystemExit as e:
  code = e.code
print("EXIT", code, "HEAVY", sorted(m for m in ("jax", "tensorstore") if m in sys.modules))
"""


def test_help_is_instant_it_imports_neither_jax_nor_tensorstore():
  for args in (["--help"], ["list", "--help"], ["show", "-h"], ["verify", "--help"],
               ["plan", "--help"], ["convert", "--help"], []):
    r = subprocess.run([sys.executable, "-c", _HELP_PROBE, *args], capture_output=True, text=True,
                       env=jobs.env_for(1), cwd=jobs.ROOT, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "usage: python -m orbax_flax" in out, (args, out)
    assert f"EXIT {2 if not args else 0} HEAVY []" in r.stdout, (args, out)
  rc, out = run_process("--help")  # and the real command line
  assert rc == 0 and "python -m orbax_flax list DIR" in out, out


def test_list_beside_a_job_whose_keep_rule_deletes_a_step_is_no_corruption(tmp_path,
                                                                          monkeypatch):
  """`list` beside a training job: a step the job's keep rule deleted between the listing
  and the read of its manifest was shown as NO MANIFEST, and `list` exited 1 ("corruption
  found") for a healthy run (76 of ~1,340 runs on S3 in a reviewer's loop)."""
  import shutil  # pylint: disable=g-import-not-at-top
  from orbax_flax.engine import restoring  # pylint: disable=g-import-not-at-top
  with ofx.CheckpointManager(str(tmp_path)) as m:
    for step in (1, 2, 3):
      m.save(step, {"s": {"w": np.full(3, step)}}, force=True)
  read = restoring.read_summary

  def deleted_first(loc):  # the job's keep rule deletes step 1 just then
    if loc.name == "1":
      shutil.rmtree(loc.local_path)
    return read(loc)

  monkeypatch.setattr(restoring, "read_summary", deleted_first)
  out = io.StringIO()
  assert cli.cmd_list(str(tmp_path), out) == 0, out.getvalue()
  text = out.getvalue()
  assert "deleted while listed" in text and "latest 3" in text and "NO MANIFEST" not in text


@pytest.mark.parametrize("fmt", ["orbax_flax", "safetensors", "orbax"])
def test_convert_onto_a_step_others_borrow_from_keeps_their_data(tmp_path, fmt):
  """`convert DIR/0 DIR/0 --overwrite` onto a step that later differential steps borrow from:
  to safetensors or orbax the old step was deleted, and steps 1 and 2, still listed, no longer
  restored. Its data is retired (``0.ofx-base-<generation>``), as the engine's overwrite does."""
  root = str(tmp_path / "run")
  w = np.random.default_rng(5).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB: chunked
  with ofx.CheckpointManager(root, ofx.CheckpointPolicy(differential=True, async_save=False)) as m:
    for step in range(3):
      m.save(step, {"s": {"w": w, "c": np.full(64, step, np.int32)}}, force=True)
  step0 = os.path.join(root, "0")
  rc, out = run("convert", step0, step0, f"--format={fmt}", "--overwrite")
  assert rc == 0, out
  assert [x.tobytes() for x in jax.tree.leaves(ofx.restore(step0)) if np.shape(x) == w.shape] \
      == [w.tobytes()]  # step 0 is the converted one
  for step in (1, 2):
    got = ofx.restore(os.path.join(root, str(step)))["s"]
    assert got["w"].tobytes() == w.tobytes() and got["c"].tolist() == [step] * 64, step
  aside = [n for n in os.listdir(root) if ".ofx-" in n]
  assert len(aside) == 1 and aside[0].startswith("0.ofx-base-"), aside
  assert os.path.exists(os.path.join(root, aside[0], "_RETIRED"))


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_convert_overwrite_onto_a_run_directory_is_refused_naming_the_flag(tmp_path, fmt):
  """`convert STEP RUN --format safetensors|orbax --overwrite` (RUN for RUN/export, a typo)
  deleted the whole run directory; it is refused, as --format orbax_flax refuses it, and the
  messages name the flag --overwrite, not the library's overwrite=True."""
  run_dir = str(tmp_path / "run")
  with ofx.CheckpointManager(run_dir, ofx.CheckpointPolicy(save_interval_steps=1)) as mngr:
    for step in (1, 2):
      mngr.save(step, {"s": {"w": np.full(4, step, np.float32)}})
  rc, out = run("convert", os.path.join(run_dir, "2"), run_dir, f"--format={fmt}", "--overwrite")
  assert rc == 2 and f"{run_dir} exists and is not an earlier" in out, out
  assert "even with --overwrite" in out and "overwrite=True" not in out, out
  assert sorted(os.listdir(run_dir)) == ["1", "2"]
  assert ofx.restore(os.path.join(run_dir, "1"))["s"]["w"].tolist() == [1.0] * 4
  rc, out = run("convert", os.path.join(run_dir, "2"), os.path.join(run_dir, "1"),
                f"--format={fmt}")
  assert rc == 2 and "exists; pass --overwrite to replace it" in out, out


def test_list_calls_a_step_whose_manifest_was_cut_short_corrupted(tmp_path):
  """`list` read each manifest's summary only: a `_CHECKPOINT` cut in half after its summary
  line was listed as a fine step, the latest, and list exited 0, while show, verify and
  restore call it corrupted. Now each manifest is hashed whole."""
  d = str(tmp_path / "run")
  layers = {f"layer_{i}": {"kernel": np.ones((4, 4), np.float32)} for i in range(24)}
  with ofx.CheckpointManager(d, ofx.CheckpointPolicy(save_interval_steps=1)) as mngr:
    for step in (1, 2):
      mngr.save(step, {"params": layers}, metrics={"loss": 1 / step})
  manifest = os.path.join(d, "2", "_CHECKPOINT")
  with open(manifest, "r+b") as f:
    f.truncate(os.path.getsize(manifest) // 2)
  rc, out = run("list", d)
  assert rc == 1, out
  rows = {line.split()[0]: line for line in out.split("\n\n")[0].splitlines()[2:]}
  assert "loss=1" in rows["1"] and "CORRUPTED" not in rows["1"], out
  assert "CORRUPTED" in rows["2"] and "checksum mismatch" in rows["2"], out
  assert "1 step(s) cannot be read" in out, out


def test_list_shows_an_orbax_checkpoint_run_as_steps_not_damage(tmp_path):
  """`list` on an intact orbax-checkpoint CheckpointManager run marked every step NO MANIFEST
  and exited 1 ("a step cannot be read"), while `verify` reads each fine. Its committed steps
  are listed, with the time orbax recorded, and list exits 0."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  d = str(tmp_path / "ocp_run")
  with ocp.CheckpointManager(d) as mgr:
    for step in (10, 20):
      mgr.save(step, args=ocp.args.StandardSave({"w": np.full(4, step, np.float32)}))
    mgr.wait_until_finished()
  rc, out = run("list", d)
  assert rc == 0, out
  rows = {line.split()[0]: line for line in out.split("\n\n")[0].splitlines()[2:]}
  assert sorted(rows) == ["10", "20"], out
  assert all("orbax-checkpoint" in row for row in rows.values()), out
  assert "NO MANIFEST" not in out and "cannot be read" not in out and "latest 20" in out, out


@pytest.mark.parametrize("flag, says", [
    ("--start_step=-5", "--start_step=-5: steps are numbered from 0"),
    ("--seconds_per_step=-1", "--seconds_per_step=-1: give the wall time one step takes, more"
     " than 0"),
    ("--save_cost_seconds=-2", "--save_cost_seconds=-2: give what a save takes"),
    ("--local_save_cost_seconds=-2", "--local_save_cost_seconds=-2: give what a save takes"),
])
def test_plan_refuses_negative_steps_and_seconds(flag, says):
  """`plan --start_step=-5` planned a save of step 0 (which a manager refuses) and
  `--seconds_per_step=-1` a run whose time rules never fire, both exiting 0; a negative save
  cost was taken as 0. Each is a usage error (exit 2) naming the flag and what to give."""
  rc, out = run("plan", "--config=configs/default.py", "--steps=100", flag)
  assert rc == 2 and says in out and "policy over steps" not in out, out


def test_list_shows_a_directory_named_like_a_step_apart_from_the_steps(tmp_path):
  """A directory `5/` without a manifest (someone's files) beside committed step 1 was counted
  among the committed steps and called the latest, exit 1; alone, it was "no checkpoints"
  and not shown (review of 23029af)."""
  d = str(tmp_path / "run")
  ofx.save(os.path.join(d, "1"), {"p": np.zeros(4, np.float32)})
  os.makedirs(os.path.join(d, "5"))
  rc, out = run("list", d)
  assert rc == 0 and "1 committed step(s)" in out and "latest 1" in out, out
  assert "NO MANIFEST, not steps: 5" in out, out
  alone = str(tmp_path / "alone")
  os.makedirs(os.path.join(alone, "7"))
  rc, out = run("list", alone)
  assert rc == 0 and "NO MANIFEST, not steps: 7" in out and "no checkpoints" not in out, out
