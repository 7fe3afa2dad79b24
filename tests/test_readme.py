"""The README's examples run as written (each block marked ``<!-- readme-test -->``)."""

import contextlib
import io
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _blocks():
  text = open(README).read()
  return re.findall(r"<!-- readme-test -->\n```python\n(.*?)```", text, re.S)


def _run(code):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(code, README, "exec"), {"__name__": "readme"})  # pylint: disable=exec-used
  return out.getvalue()


def test_readme_has_runnable_examples():
  assert len(_blocks()) >= 3


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_example_runs(tmp_path, monkeypatch, index):
  monkeypatch.chdir(tmp_path)
  code = _blocks()[index]
  out = _run(code)
  if "nnx.Optimizer" in code:  # the own-loop example: a second run resumes at 30, done
    assert out.strip() == "None False [20, 30]", out
    assert _run(code).strip() == "30 False [20, 30]"
  if "CheckpointManager(\"steps\"" in code:
    assert out.strip() == "500 [300, 400, 500] 500", out
