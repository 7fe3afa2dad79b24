"""Every code block of README.md and docs/*.md runs as written, or says why it cannot.

A fenced block of code (``python``, ``console``, ``bash``, ``sh``, ``shell``)
carries a marker on the line before its fence:

* ``<!-- doc-test -->`` (``<!-- readme-test -->`` is the same): it runs here.
  A ``python`` block runs on its own (fresh globals); a ``console`` block runs
  each ``$ python -m orbax_flax ...`` line through the CLI's ``main`` in this
  process. The blocks of one file run in order in one temporary directory
  (holding links to ``configs/`` and ``examples/``), so a console block can
  read what a python block above it saved. A ``text`` block right after a
  runnable block is its expected output (doctest rules: ``...`` matches
  anything, whitespace is normalised).
* ``<!-- not-run: REASON -->``: illustrative; REASON says why it cannot run.

An unmarked code block fails this test. Blocks without a language, or
``text``, are outputs and layouts, not code.

The config table of docs/manager.md is generated from CheckpointPolicy's
docstring by ``docs/config_table.py``; the tests below fail when they differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import glob
import importlib.util
import io
import os
import re
import shlex
import sys

import pytest

import orbax_flax as ofx
from orbax_flax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
CODE = {"python", "console", "bash", "sh", "shell"}
RUN = ("<!-- doc-test -->", "<!-- readme-test -->")
NOT_RUN = re.compile(r"<!-- not-run: (.*?) -->")


@dataclasses.dataclass
class Block:
  path: str
  line: int  # of the opening fence, 1-based
  lang: str
  code: str
  marker: str | None  # "run", "not-run" or None
  reason: str = ""
  output: str | None = None  # the text block right after it

  @property
  def where(self) -> str:
    return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def blocks(path: str) -> list[Block]:
  lines = open(path, encoding="utf-8").read().splitlines()
  out: list[Block] = []
  i, last_end = 0, -10
  while i < len(lines):
    m = re.match(r"^```([\w+-]*)\s*$", lines[i])
    if not m:
      i += 1
      continue
    start = i
    i += 1
    while i < len(lines) and lines[i].rstrip() != "```":
      i += 1
    if i == len(lines):
      raise AssertionError(f"{os.path.relpath(path, ROOT)}:{start + 1}: unclosed code fence")
    code = "\n".join(lines[start + 1:i]) + "\n"
    lang = m.group(1)
    before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
    marker, reason = None, ""
    if before in RUN:
      marker = "run"
    elif NOT_RUN.fullmatch(before):
      marker, reason = "not-run", NOT_RUN.fullmatch(before).group(1).strip()
    gap = lines[last_end + 1:start]
    if lang == "text" and out and out[-1].marker == "run" and not any(l.strip() for l in gap):
      out[-1].output = code
    out.append(Block(path, start + 1, lang, code, marker, reason))
    last_end = i
    i += 1
  return out


def _check_output(b: Block, got: str, expected: str | None) -> None:
  if expected is None:
    return
  checker = doctest.OutputChecker()
  flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  assert checker.check_output(expected, got, flags), (
      f"{b.where}: the output shown after the block differs from what it prints:\n"
      + checker.output_difference(doctest.Example("", expected), got, flags))


def _exec(b: Block) -> str:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(b.code, b.where, "exec"), {"__name__": "docs"})  # pylint: disable=exec-used
  return out.getvalue()


def _console(b: Block) -> None:
  """Runs each ``$ python -m orbax_flax ...`` line; the lines after it are its output."""
  commands: list[tuple[str, list[str]]] = []
  for line in b.code.splitlines():
    if line.startswith("$ "):
      commands.append((line[2:].split("#")[0].strip(), []))
    elif commands:
      commands[-1][1].append(line)
    elif line.strip():
      raise AssertionError(f"{b.where}: output before the first `$ ` command: {line!r}")
  assert commands, f"{b.where}: a console doc-test needs `$ python -m orbax_flax ...` lines"
  for command, shown in commands:
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "orbax_flax"], (
        f"{b.where}: a console doc-test runs only `python -m orbax_flax ...`, got {command!r};"
        " mark the block <!-- not-run: why --> instead")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      rc = cli.main(argv[3:], out=out)
    assert rc == 0, f"{b.where}: `{command}` exited {rc}:\n{out.getvalue()}"
    _check_output(b, out.getvalue(), "\n".join(shown) + "\n" if any(s.strip() for s in shown) else None)


def _runnable_files() -> list[str]:
  return [p for p in FILES if any(b.marker == "run" for b in blocks(p))]


def test_every_code_block_runs_or_says_why():
  bad = []
  for path in FILES:
    for b in blocks(path):
      if b.lang in CODE and b.marker is None:
        bad.append(f"{b.where}: a ```{b.lang} block without <!-- doc-test --> or <!-- not-run: why -->")
      elif b.marker == "not-run" and len(b.reason) < 10:
        bad.append(f"{b.where}: <!-- not-run: ... --> needs a reason, got {b.reason!r}")
      elif b.marker == "run" and b.lang not in ("python", "console"):
        bad.append(f"{b.where}: only python and console blocks run; mark ```{b.lang} not-run")
  assert not bad, "\n".join(bad)


def test_the_readme_has_its_three_examples_and_a_small_front_door():
  readme = blocks(FILES[0])
  assert sum(b.marker == "run" and b.lang == "python" for b in readme) >= 3
  assert len(open(FILES[0], encoding="utf-8").read().splitlines()) <= 220


def test_the_readme_test_command_is_what_ci_runs():
  command = next(b.code.strip() for b in blocks(FILES[0]) if "pytest" in b.code and b.lang == "bash")
  assert command in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()


@pytest.mark.parametrize("path", _runnable_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_doc_blocks_run(path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  for name in ("configs", "examples"):
    os.symlink(os.path.join(ROOT, name), tmp_path / name)
  for b in blocks(path):
    if b.marker != "run":
      continue
    if b.lang == "console":
      _console(b)
      continue
    _check_output(b, _exec(b), b.output)
    if path == FILES[0] and "nnx.Optimizer" in b.code:
      # The README says so: a second run resumes at step 30 and has nothing left to do.
      assert _exec(b).strip() == "30 False [20, 30]"


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_lead_somewhere():
  bad = []
  for path in FILES:
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"\w+://", link):
        continue
      file, _, anchor = link.partition("#")
      target = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
      if not os.path.exists(target):
        bad.append(f"{os.path.relpath(path, ROOT)}: {link}: no such file")
      elif anchor:
        body = re.sub(r"```.*?```", "", open(target, encoding="utf-8").read(), flags=re.S)
        headings = re.findall(r"^#+ (.*)$", body, re.M)
        if anchor not in {_slug(h) for h in headings}:
          bad.append(f"{os.path.relpath(path, ROOT)}: {link}: no such heading")
  assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ the config table


def _table_tool():
  spec = importlib.util.spec_from_file_location("config_table", os.path.join(ROOT, "docs", "config_table.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_every_policy_field_has_one_docstring_entry():
  tool = _table_tool()
  assert not tool.problems(ofx.CheckpointPolicy), (
      "; ".join(tool.problems(ofx.CheckpointPolicy)) + f". To fix: {tool.REGENERATE}.")


def test_the_config_table_is_generated_from_the_docstring():
  tool = _table_tool()
  shown = tool.current(open(tool.DOC, encoding="utf-8").read())
  assert shown == tool.render(ofx.CheckpointPolicy), (
      f"the config table in docs/manager.md differs from CheckpointPolicy's docstring; {tool.REGENERATE}")


def test_the_table_tool_notices_a_field_without_an_entry():
  tool = _table_tool()

  @dataclasses.dataclass(frozen=True)
  class Policy:
    """A policy.

    Attributes:
      kept: a field with an entry,
        over two lines.
      gone: an entry without a field.
    """
    kept: int = 0
    new: str = ""

  assert tool.attributes(Policy) == {"kept": "a field with an entry, over two lines.",
                                     "gone": "an entry without a field."}
  assert tool.problems(Policy) == ["field 'new' has no entry in the Attributes: section",
                                   "Attributes: entry 'gone' is not a field"]
  with pytest.raises(ValueError, match="python docs/config_table.py"):
    tool.render(Policy)


def _call_row(path: str, name: str) -> list[str]:
  """The parameter names a table row ``| `name(...)` | ... |`` of ``path`` shows."""
  m = re.search(r"^\| `" + name + r"\((.*?)\)[^`]*` \|", open(path).read(), re.M)
  assert m, f"{os.path.relpath(path, ROOT)}'s table has no row for {name}()"
  return [p.split("=")[0].strip() for p in m.group(1).split(",") if p.strip() not in ("*", "...")]


@pytest.mark.parametrize("name", ["save", "restore"])
def test_engine_table_lists_every_argument(name):
  import inspect  # pylint: disable=g-import-not-at-top
  got = _call_row(os.path.join(ROOT, "docs", "engine.md"), name)
  assert got == list(inspect.signature(getattr(ofx, name)).parameters)


def test_exception_save_wait_is_the_one_the_code_uses():
  from orbax_flax.training import checkpoint_callback  # pylint: disable=g-import-not-at-top
  text = open(os.path.join(ROOT, "docs", "training.md")).read()
  m = re.search(r"if the others have not failed within (\d+(?:\.\d+)?) s", text)
  assert m, "docs/training.md no longer says how long an exception save waits for the others"
  assert float(m.group(1)) == checkpoint_callback.FAILED_AGREEMENT_S


def test_the_docs_quote_no_run_fingerprint_and_the_exit_status_the_code_uses():
  """Numbers a doc quotes are checked here or not quoted: a params fingerprint depends on the
  JAX version and platform (docs/training.md once quoted one the example did not print)."""
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  texts = {p: open(os.path.join(ROOT, p)).read() for p in
           ["README.md"] + [os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs"))
                            if n.endswith(".md")]}
  for path, text in texts.items():
    assert not re.findall(r"params [0-9a-f]{16}\b", text), path
  training = texts[os.path.join("docs", "training.md")]
  quoted = set(re.findall(r"PREEMPTED_EXIT_CODE`? = (\d+)", training))
  assert quoted == {str(ofx.PREEMPTED_EXIT_CODE)}, quoted
  assert f"the example exits {ofx.PREEMPTED_EXIT_CODE}" in training


def test_device_sh_installs_every_package_the_benchmark_imports():
  """``benchmarks/device.sh`` runs the benchmark on a bare accelerator machine that has only
  JAX and numpy: every other package the benchmark imports must be in the list it checks and
  installs. (On a TPU it once stopped at the safetensors rows, which it did not install.)"""
  local = {os.path.splitext(os.path.basename(p))[0]
           for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))}
  preinstalled = {"jax", "jaxlib", "numpy", "orbax_flax"}  # the machine's, and the repository's
  with open(os.path.join(ROOT, "benchmarks", "save_restore.py")) as f:
    source = f.read()
  imported = set(re.findall(r"^\s*(?:import (\w+)|from (\w+)[\w.]* import )", source, re.M))
  imported = {a or b for a, b in imported} - set(sys.stdlib_module_names) - local - preinstalled
  with open(os.path.join(ROOT, "benchmarks", "device.sh")) as f:
    listed = re.search(r"^for mod in ([^;]+); do", f.read(), re.M).group(1).split()
  assert imported, "the benchmark's imports were not found: the pattern above is out of date"
  missing = imported - {m.split(".")[0] for m in listed}
  assert not missing, f"benchmarks/device.sh does not check or install {sorted(missing)}"


def test_every_ofx_attribute_path_the_docs_write_resolves_in_a_fresh_process():
  """The docs' code runs in this process, where the engine's modules are imported already:
  ``t = ofx.engine.transforms`` (docs/interop.md) ran here and was an AttributeError in a
  user's fresh script. Each ``ofx.a.b...`` the docs, the README and the docstrings write is
  looked up in a new interpreter that has only imported orbax_flax (``ofx.a`` alone goes
  through the package's own lazy lookup)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  texts = FILES + sorted(glob.glob(os.path.join(ROOT, "orbax_flax", "**", "*.py"), recursive=True))
  chains = set()
  for path in texts:
    with open(path) as f:
      chains |= set(re.findall(r"\bofx((?:\.[A-Za-z_]\w*)+)", f.read()))
  assert ".CheckpointPolicy.from_config" in chains  # the scan finds them
  bad = []
  for chain in sorted(c for c in chains if c.count(".") > 1):
    code = ("import functools, orbax_flax as ofx\n"
            f"functools.reduce(getattr, {chain.strip('.').split('.')!r}, ofx)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       check=False, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if r.returncode:
      bad.append(f"ofx{chain}: " + (r.stderr.strip().splitlines() or ["?"])[-1])
  assert not bad, bad


def test_the_manager_signature_the_docs_open_with_is_the_code_s():
  """docs/manager.md opened with `CheckpointManager(..., writes=None)`, an argument the class
  does not take (TypeError for whoever copied it)."""
  text = open(os.path.join(ROOT, "docs", "manager.md")).read()
  shown = re.search(r"`ofx\.CheckpointManager\((.*?)\)`", text, re.S).group(1)
  names = [p.strip().split("=")[0] for p in shown.replace("\n", " ").split(",")]
  names = [n for n in names if n and n != "*"]
  import inspect  # pylint: disable=g-import-not-at-top
  assert names == list(inspect.signature(ofx.CheckpointManager).parameters), names
