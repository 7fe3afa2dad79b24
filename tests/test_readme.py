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


def _call_row(name):
  """The parameter names a README table row ``| `name(...)` | ... |`` shows."""
  m = re.search(r"^\| `" + name + r"\((.*?)\)[^`]*` \|", open(README).read(), re.M)
  assert m, f"the README's table has no row for {name}()"
  return [p.split("=")[0].strip() for p in m.group(1).split(",") if p.strip() not in ("*", "...")]


@pytest.mark.parametrize("name", ["save", "restore"])
def test_engine_table_lists_every_argument(name):
  import inspect  # pylint: disable=g-import-not-at-top
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  assert _call_row(name) == list(inspect.signature(getattr(ofx, name)).parameters)


def test_exception_save_wait_is_the_one_the_code_uses():
  from orbax_flax import checkpoint_callback  # pylint: disable=g-import-not-at-top
  m = re.search(r"if the others have not failed within (\d+(?:\.\d+)?) s", open(README).read())
  assert m, "the README no longer says how long an exception save waits for the others"
  assert float(m.group(1)) == checkpoint_callback._FAILED_AGREEMENT_S  # pylint: disable=protected-access
