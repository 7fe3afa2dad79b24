"""The package's shape, checked on its source: what the style guide promises a reader.

* imports go down the layers (``LAYERS``: a package imports only the packages below it,
  and says in its ``__init__`` what it may import); this replaces the earlier line limits
  and the rule against using another module's ``_private`` names;
* no import cycle between orbax_flax modules, counting imports inside
  functions (an import moved into a function to dodge a cycle is still one);
* no module-level mutable state: a module-level dict, list, set or counter
  that a function of the module changes (state belongs to an object);
* every module says in its docstring what it holds. There is no size limit: a
  module is one concept, whatever its length.

The modules that do not meet a rule yet are listed below (``_STATE_DEBT``),
each with what it holds; a listed module may not get worse, and nothing new may
join the list.
"""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "orbax_flax")
# Module-level state still to be given an owner object: name -> the variable.
_STATE_DEBT: dict[str, set[str]] = {}
# Imports of our own modules inside functions: the CLI imports its subcommand's
# modules when it runs (so that ``--help`` does not import JAX).
_LATE_IMPORTS = {"orbax_flax.cli": None}  # any
_MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "add",
             "discard", "update", "setdefault", "__setitem__", "__delitem__"}


def _modules():
  out = {}
  for d, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
        name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
        out[name] = path
  return dict(sorted(out.items()))


MODULES = _modules()


def _tree(name):
  with open(MODULES[name]) as f:
    return ast.parse(f.read(), MODULES[name])


def _imports(name):
  """(imported orbax_flax module, names taken from it, line) for every import in ``name``."""
  out = []
  package = name if MODULES[name].endswith("__init__.py") else name.rpartition(".")[0]
  for node in ast.walk(_tree(name)):
    if isinstance(node, ast.Import):
      out += [(a.name, (), node.lineno) for a in node.names if a.name.startswith("orbax_flax")]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
      if not base.startswith("orbax_flax"):
        continue
      for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in MODULES:
          out.append((sub, (), node.lineno))
        else:
          out.append((base, (a.name,), node.lineno))
  return out


def test_no_import_cycle():
  graph = {m: {i for i, _, _ in _imports(m) if i in MODULES and i != m} for m in MODULES}
  # A package's __init__ importing its submodules is not a cycle with them.
  for m in graph:
    graph[m] = {i for i in graph[m] if not m.startswith(i + ".")}
  cycles = []
  state = {}

  def visit(m, stack):
    state[m] = "open"
    for i in sorted(graph[m]):
      if state.get(i) == "open":
        cycles.append(" -> ".join(stack[stack.index(i):] + [i]))
      elif i not in state:
        visit(i, stack + [i])
    state[m] = "done"

  for m in graph:
    if m not in state:
      visit(m, [m])
  assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_no_function_level_import_of_our_modules():
  """An import moved into a function hides the import graph (often a cycle dodged)."""
  found = []
  for name in MODULES:
    allowed = _LATE_IMPORTS.get(name, set())
    if allowed is None:
      continue
    for fn in ast.walk(_tree(name)):
      if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      for node in ast.walk(fn):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("orbax_flax"):
          taken = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                   else node.module for a in node.names]
        elif isinstance(node, ast.Import):
          taken = [a.name for a in node.names if a.name.startswith("orbax_flax")]
        else:
          continue
        found += [f"{name}:{node.lineno} imports {t}" for t in taken if t not in allowed]
  assert not found, "imports inside functions (move them to the top):\n  " + "\n  ".join(found)


# Beside the engine's primitives, formats may use the one way an overwrite disposes of the
# checkpoint it replaces (kept while differential steps borrow from it): an export over one of
# our steps goes through it too (refs imports only core, format and errors).
_FORMATS_ALSO_IMPORT = {"orbax_flax.errors", "orbax_flax.differential.refs"}


def test_formats_sit_below_the_engine():
  """``formats`` reads and describes bytes; what uses the engine lives beside the engine."""
  found = []
  for name in MODULES:
    if name == "orbax_flax.formats" or name.startswith("orbax_flax.formats."):
      for other, _, line in _imports(name):
        last = other.rpartition(".")[2]
        if not (other.startswith("orbax_flax.formats") or last.startswith("_")
                or other in _FORMATS_ALSO_IMPORT):
          found.append(f"{name}:{line} imports {other}")
  assert not found, "formats may import only the engine's primitives:\n  " + "\n  ".join(found)


def _module_level_mutables(tree):
  names = {}
  for node in tree.body:
    targets, value = [], None
    if isinstance(node, ast.Assign):
      targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
      targets, value = [node.target], node.value
    mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                                 ast.SetComp)) or (
        isinstance(value, ast.Call) and getattr(value.func, "attr", getattr(value.func, "id", ""))
        in {"dict", "list", "set", "count", "defaultdict", "OrderedDict", "deque", "Counter"})
    for t in targets:
      if isinstance(t, ast.Name) and mutable:
        names[t.id] = node.lineno
  return names


def _mutations(tree, names):
  found = []
  for fn in ast.walk(tree):
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    for node in ast.walk(fn):
      if isinstance(node, ast.Global):
        found += [(n, node.lineno, "global") for n in node.names if n in names]
      elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
          isinstance(node.func.value, ast.Name) and node.func.value.id in names and \
          node.func.attr in _MUTATORS:
        found.append((node.func.value.id, node.lineno, node.func.attr))
      elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
          node.func.id == "next" and node.args and isinstance(node.args[0], ast.Call) and \
          isinstance(node.args[0].func, ast.Attribute) and \
          isinstance(node.args[0].func.value, ast.Name) and node.args[0].func.value.id in names:
        found.append((node.args[0].func.value.id, node.lineno, "next"))
      elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
        for t in (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]):
          if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in names:
            found.append((t.value.id, node.lineno, "item assignment"))
  return found


@pytest.mark.parametrize("name", list(MODULES))
def test_no_module_level_mutable_state(name):
  tree = _tree(name)
  # A ``global x`` statement rebinds module state whatever ``x`` starts as (None included).
  rebound = [(n, node.lineno, "global statement") for node in ast.walk(tree)
             if isinstance(node, ast.Global) for n in node.names]
  found = [f for f in _mutations(tree, _module_level_mutables(tree)) + rebound
           if f[0] not in _STATE_DEBT.get(name, set())]
  assert not found, (f"{name} keeps state at module level; give it an owner object:\n  "
                     + "\n  ".join(f"{n} ({how}, line {line})" for n, line, how in found))


@pytest.mark.parametrize("name", list(MODULES))
def test_every_module_says_what_it_holds(name):
  """Sizes are not limited: a module is one concept, whatever its length (the 450/300-line
  limits produced appendices instead of concepts, and are retired)."""
  assert ast.get_docstring(_tree(name)), f"{name} has no module docstring saying what it holds"


def test_every_error_and_event_type_is_exported():
  import inspect  # pylint: disable=g-import-not-at-top
  import orbax_flax as ofx  # pylint: disable=g-import-not-at-top
  from orbax_flax import errors  # pylint: disable=g-import-not-at-top
  wanted = {n for n, c in inspect.getmembers(errors, inspect.isclass)
            if issubclass(c, Exception) and c.__module__ == errors.__name__}
  wanted |= {"SaveEvent", "AsyncSave", "CheckpointMetadata"}
  assert wanted <= set(ofx.__all__), sorted(wanted - set(ofx.__all__))
  for n in ofx.__all__:
    getattr(ofx, n)


# ---------------------------------------------------------------------- layers

# The packages from the bottom up; a package may import only its own level and below
# (orbax_flax/<package>/__init__.py says what each holds). Modules at the top of the
# package (the CLI, the launcher, the public API) stand above all.
LAYERS = {
    "errors": 0,
    "core": 1, "data": 1,
    "format": 2,
    # One level: foreign formats read through the engine's reader and the engine's restore
    # dispatches to them; differential saves plug into the save and the read.
    "engine": 3, "formats": 3, "differential": 3,
    "manager": 4,
    "tiers": 5,
    "training": 6,
    "top": 7,
}
# Imports against the direction still owed a fix: (from, to) -> the modules, and why. None.
_LAYER_DEBT: dict[tuple[str, str], set[str]] = {}


def _layer_of(module: str) -> str:
  parts = module.split(".")
  if len(parts) > 1 and parts[1] in LAYERS and parts[1] != "top":
    return parts[1]
  return "top"


def test_every_package_says_what_it_may_import():
  for name, path in MODULES.items():
    if path.endswith("__init__.py") and name != "orbax_flax":
      doc = ast.get_docstring(_tree(name)) or ""
      assert "May import" in doc, f"{name}/__init__.py: say what the package holds and may import"


def test_imports_go_down_the_layers():
  against = []
  for name in MODULES:
    src = _layer_of(name)
    for node in ast.walk(_tree(name)):
      targets = []
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orbax_flax"):
        targets = ([f"orbax_flax.{a.name}" for a in node.names] if node.module == "orbax_flax"
                   else [node.module])
      elif isinstance(node, ast.Import):
        targets = [a.name for a in node.names if a.name.startswith("orbax_flax")]
      for t in targets:
        dst = _layer_of(t)
        if LAYERS[dst] > LAYERS[src] and name not in _LAYER_DEBT.get((src, dst), ()):
          against.append(f"{name} ({src}) imports {t} ({dst})")
  assert not against, "imports against the layers (see LAYERS):\n  " + "\n  ".join(against)


# The private JAX APIs orbax_flax uses, as they appear in source; every one of them is used in
# orbax_flax/core/_multihost.py only (its section "the private JAX APIs orbax_flax uses").
_JAX_PRIVATE = ("jax._src", "._addressable_device_assignment", "._device_assignment",
                "experimental.compilation_cache")
_JAX_PRIVATE_HOME = "orbax_flax.core._multihost"


def test_private_jax_apis_are_used_in_one_module():
  found = []
  for name, path in MODULES.items():
    if name == _JAX_PRIVATE_HOME:
      continue
    with open(path) as f:
      text = f.read()
    found += [f"{name}: {api}" for api in _JAX_PRIVATE if api in text]
  assert not found, ("private JAX APIs used outside " + _JAX_PRIVATE_HOME + " (add an accessor"
                     " there and call it):\n  " + "\n  ".join(found))


def test_the_private_jax_apis_we_use_still_exist():
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from orbax_flax.core import _multihost  # pylint: disable=g-import-not-at-top
  where = f"JAX {jax.__version__} changed a private API that {_JAX_PRIVATE_HOME} uses"
  try:
    state = _multihost.distributed_state()
  except ImportError as e:
    pytest.fail(f"{where}: jax._src.distributed.global_state cannot be imported ({e})")
  for attr in ("client", "preemption_sync_manager"):
    assert hasattr(state, attr), f"{where}: jax._src.distributed.global_state has no .{attr}"
  try:
    weak = _multihost.weak_typed(jax.numpy.int32(3))
  except (ImportError, AttributeError, TypeError) as e:
    pytest.fail(f"{where}: jax._src.lax.lax._convert_element_type(weak_type=True) ({e})")
  assert weak.aval.weak_type and weak.dtype == np.int32 and int(weak) == 3, where
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  for sharding in (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")),
                   jax.sharding.SingleDeviceSharding(jax.devices()[-1])):
    try:
      got = list(_multihost.addressable_device_assignment(sharding))
    except AttributeError as e:
      pytest.fail(f"{where}: {type(sharding).__name__}._addressable_device_assignment ({e})")
    array = jax.device_put(np.zeros(2 * len(jax.devices())), sharding)
    assert got == [s.device for s in array.addressable_shards], (
        f"{where}: _addressable_device_assignment is no longer the order of addressable_shards")
  # jax.experimental.compilation_cache.compilation_cache.reset_cache: JAX's cache, opened once
  # a process, opened again at the next compile (tests/test_restart.py: a second run in one
  # process caches in its own workdir).
  from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top
  try:
    _multihost.reset_compilation_cache()
  except (ImportError, AttributeError) as e:
    pytest.fail(f"{where}: jax.experimental.compilation_cache.compilation_cache.reset_cache ({e})")
  assert not compilation_cache._cache_initialized, (  # pylint: disable=protected-access
      f"{where}: reset_cache no longer makes JAX open its compilation cache again")


def test_the_modules_of_the_flat_layout_are_aliases_of_where_their_code_is_now():
  """``orbax_flax.registry`` (the layout before the layer packages) is
  ``orbax_flax.manager.registry``, with a DeprecationWarning; every old name resolves."""
  import importlib
  import sys
  import warnings
  import orbax_flax
  for old, new in orbax_flax._MOVED.items():  # pylint: disable=protected-access
    sys.modules.pop(f"orbax_flax.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      alias = importlib.import_module(f"orbax_flax.{old}")
    target = importlib.import_module(f"orbax_flax.{new}")
    assert alias is target, (old, new)
    assert target.__spec__.name == f"orbax_flax.{new}", (old, target.__spec__.name)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
               for w in caught), (old, [str(w.message) for w in caught])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from orbax_flax._location import Location  # pylint: disable=import-outside-toplevel
  assert Location is importlib.import_module("orbax_flax.core._location").Location


# What a script under tests/ may do at import besides defining things: the suite's doctest
# collection imports every module there, so one that joins a job or parses flags at import
# breaks the whole run (tier_holes_worker.py did: a CI collection error no targeted run saw).
_IMPORT_TIME_CALLS = ("sys.path.insert(", "os.environ.setdefault(", "launch.initialize_from_env(")


def test_the_scripts_under_tests_do_their_work_under_main():
  here = os.path.dirname(os.path.abspath(__file__))
  found = []
  for d, _, files in os.walk(here):
    for f in sorted(files):
      if not f.endswith(".py") or f.startswith("test_") or f == "conftest.py":
        continue
      path = os.path.join(d, f)
      with open(path) as fh:
        body = ast.parse(fh.read(), path).body
      for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef,
                             ast.Assign, ast.AnnAssign)):
          continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
          continue  # a docstring
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
          continue
        if isinstance(node, ast.Expr) and ast.unparse(node).startswith(_IMPORT_TIME_CALLS):
          continue
        found.append(f"{os.path.relpath(path, here)}:{node.lineno}: {ast.unparse(node)[:60]}")
  assert not found, ("these run at import, which the doctest collection does; move them into a "
                     "main() called under `if __name__ == \"__main__\"`:\n" + "\n".join(found))
