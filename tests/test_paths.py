"""Paths as users spell them: file:// URLs, '~', relative and symlinked directories, long names."""

import hashlib
import logging
import os
import re

import numpy as np
import pytest

import orbax_flax as ofx
from orbax_flax.core import _location
from orbax_flax.format import _manifest
from orbax_flax.format import step_dir
from orbax_flax.tiers import local


@pytest.fixture(autouse=True)
def _quiet():
  logger = logging.getLogger("orbax_flax")
  level = logger.level
  logger.setLevel(logging.ERROR)
  yield
  logger.setLevel(level)


def _tree():
  return {"w": np.arange(4, dtype=np.float32)}


def test_file_urls_are_percent_decoded_and_take_an_empty_host_or_localhost(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  p = tmp_path / "my run#1"
  uri = p.as_uri()  # file:///.../my%20run%231, as pathlib writes it
  assert "%20" in uri and "%23" in uri
  ofx.save(uri, {"s": _tree()})
  assert (p / "_CHECKPOINT").is_file(), sorted(os.listdir(tmp_path))
  assert ofx.restore(str(p))["s"]["w"].tolist() == [0, 1, 2, 3]
  assert ofx.restore(uri)["s"]["w"].tolist() == [0, 1, 2, 3]
  q = tmp_path / "lh"
  ofx.save(f"file://localhost{q}", {"s": _tree()})
  assert (q / "_CHECKPOINT").is_file()
  assert not (tmp_path / "localhost").exists()  # not a directory named localhost in the cwd
  # Another host is not this machine's file system: refused, naming the URL.
  other = f"file://otherhost{tmp_path}/x"
  with pytest.raises(ValueError, match="otherhost"):
    ofx.save(other, {"s": _tree()})
  assert sorted(os.listdir(tmp_path)) == ["lh", "my run#1"]
  # Exports take the same URLs as the file-system paths they are.
  st = tmp_path / "st dir"
  ofx.export_safetensors(st.as_uri(), _tree())
  assert any(n.endswith(".safetensors") for n in os.listdir(st))
  assert ofx.restore(str(st))["params"]["w"].tolist() == [0, 1, 2, 3]
  with pytest.raises(ValueError, match="otherhost"):
    ofx.export_safetensors(f"file://otherhost{tmp_path}/e", _tree())


def test_tilde_is_the_home_directory_for_exports_convert_and_local_directory(tmp_path, monkeypatch):
  home, cwd = tmp_path / "home", tmp_path / "cwd"
  home.mkdir()
  cwd.mkdir()
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.chdir(cwd)
  ofx.export_safetensors("~/st", _tree())
  ofx.export_orbax("~/ob", _tree())
  ofx.save("~/ck", {"params": _tree()})
  ofx.convert("~/ck", "~/conv", format="safetensors")
  policy = ofx.CheckpointPolicy(local_directory="~/fast", local_save_interval_steps=1)
  with ofx.CheckpointCallback(str(home / "wd"), policy) as ckpt:
    ckpt.restore_or_init({"w": np.zeros(3)})
    ckpt.on_step_end(1, {"w": np.ones(3)})
  assert os.listdir(cwd) == []  # no directory named '~' here
  assert sorted(os.listdir(home)) == ["ck", "conv", "fast", "ob", "st", "wd"]
  assert ofx.restore("~/st")["params"]["w"].tolist() == [0, 1, 2, 3]
  assert ofx.restore("~/conv")["params"]["w"].tolist() == [0, 1, 2, 3]
  (run,) = os.listdir(home / "fast")
  assert run == local.run_dir(str(home / "wd" / "checkpoints"))


def test_a_relative_local_directory_is_fixed_when_the_run_starts(tmp_path, monkeypatch):
  a, b = tmp_path / "a", tmp_path / "b"
  a.mkdir()
  b.mkdir()
  monkeypatch.chdir(a)
  policy = ofx.CheckpointPolicy(local_directory="fast", local_save_interval_steps=1,
                                local_max_to_keep=1)
  with ofx.CheckpointCallback(str(tmp_path / "wd"), policy) as ckpt:
    ckpt.restore_or_init({"w": np.zeros(3)})
    ckpt.on_step_end(1, {"w": np.ones(3)})
    os.chdir(b)  # a library or a notebook cell changes directory mid-run
    ckpt.on_step_end(2, {"w": np.full(3, 2.0)})
  assert os.listdir(b) == []
  (run,) = os.listdir(a / "fast")
  # One directory holds the run's local steps, so local_max_to_keep applies to all of them.
  assert os.listdir(a / "fast" / run / "process_0") == ["2"]


def test_the_local_tier_finds_its_steps_through_any_spelling_of_the_workdir(tmp_path):
  real = tmp_path / "disk" / "workdir"
  real.mkdir(parents=True)
  link = tmp_path / "wlink"
  link.symlink_to(real)
  fast = tmp_path / "fast"
  policy = ofx.CheckpointPolicy(local_directory=str(fast), local_save_interval_steps=5,
                                save_interval_steps=20, save_final_step=False)
  restored = []
  for wd, last in ((real, 12), (link, 17)):  # the first run stops at 12: local 10, persistent none
    with ofx.CheckpointCallback(str(wd), policy) as ckpt:
      state = ckpt.restore_or_init({"w": np.zeros(3)})
      for step in range((ckpt.restored_step or 0) + 1, last + 1):
        state = {"w": state["w"] + 1}
        ckpt.on_step_end(step, state)
      restored.append((ckpt.restored_step, None if ckpt.restored_step is None
                       else float(np.asarray(state["w"])[0])))
  assert restored == [(None, None), (10, 17.0)]
  assert len(os.listdir(fast)) == 1  # one run, not one per spelling
  # Where no link is on the way, the digest is the one of the path as spelled: runs that
  # exist keep their local steps.
  plain = str(real / "checkpoints")
  assert local.run_dir(plain) == "run-" + hashlib.sha256(plain.encode()).hexdigest()[:16]
  assert local.run_dir(str(link / "checkpoints")) == local.run_dir(plain)
  assert local.run_dir("s3://bucket/run") == (
      "run-" + hashlib.sha256(b"s3://bucket/run").hexdigest()[:16])


def test_a_name_too_long_for_the_save_s_temporary_sibling_names_the_limit(tmp_path):
  # What a save puts beside a checkpoint's name: <name>.ofx-tmp-<gen>, <name>.ofx-base-<gen>.
  gen = "0123456789abcdef"
  assert _manifest._GENERATION.match(gen)
  suffix = max(len(step_dir.TMP_MARKER + gen), len(step_dir.retired_name("", gen)))
  limit = os.pathconf(tmp_path, "PC_NAME_MAX") - suffix  # 229 where names have 255 bytes
  parent = tmp_path / "p"
  parent.mkdir()
  with pytest.raises(ofx.StorageError) as e:
    ofx.save(str(parent / ("x" * (limit + 11))), {"s": _tree()})
  text = str(e.value)
  assert f"at most {limit} bytes" in text and "writable" not in text, text
  assert os.listdir(parent) == []
  ok = parent / ("y" * limit)
  ofx.save(str(ok), {"s": _tree()})
  assert ofx.restore(str(ok))["s"]["w"].tolist() == [0, 1, 2, 3]
  assert _location.SIBLING_SUFFIX_BYTES == suffix  # the limit the message computes


def test_a_file_url_as_local_directory_is_refused_naming_the_path_it_means():
  """The refusal of local_directory='file:///a%20b/c' suggested '/a%20b/c', not the path the
  URL names."""
  with pytest.raises(ValueError, match=re.escape("give the path itself, '/a b/c'")):
    ofx.CheckpointPolicy(local_directory="file:///a%20b/c", local_save_interval_steps=1)
