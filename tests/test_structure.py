"""The house rules of the layout (docs/architecture.md, "Folders: what each owns and may import"), checked on every
module's imports, at any depth (imports inside functions count: a lazy import up a floor is still an import up a
floor).

Floors, lowest first: a module may import from its own floor and lower ones, never from a higher one; no module
circles; training is reached only from the commands that train or build (bench, CLI), never from a serving path; the
product never imports tests. A method's name is written only in the methods registry, one proposer a file, and the
scheduler and the ingress's prepare step never load torch."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "src/specserve": "specserve",
    "protos": "specserve.protos",
    "workers": "specserve.workers",
    "cluster": "specserve.cluster",
}  # folder -> package (pyproject.toml's package-dir)
FLOORS = [  # lowest first; a module's room is the longest of these its name starts with
    ("specserve", "specserve.protos"),
    ("specserve.client",),
    ("specserve.workers", "specserve.workers.speculation.methods"),  # config, errors, the methods registry
    ("specserve.workers.models",),
    ("specserve.workers.runtime",),
    ("specserve.workers.speculation",),
    ("specserve.workers.service",),
    ("specserve.workers.training",),
    ("specserve.cluster",),  # app_config, speculative_config: the cluster's floor
    ("specserve.cluster.scheduling",),
    ("specserve.cluster.serve",),
    ("specserve.cluster.bench",),
    ("specserve.cluster.cli",),
]
ROOMS = {room: floor for floor, rooms in enumerate(FLOORS) for room in rooms}
TRAINING = "specserve.workers.training"
MAY_TRAIN = ("specserve.workers.training", "specserve.cluster.bench", "specserve.cluster.cli")
GENERATED = ("_pb2.py", "_pb2_grpc.py")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


MODULES = _modules()


def _room(module: str) -> str:
    return max((r for r in ROOMS if module == r or module.startswith(r + ".")), key=len)


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imports(module: str) -> set[str]:
    """The specserve (and tests) modules `module` imports, wherever the import statement stands."""
    path = MODULES[module]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module if _is_package(module) else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return {m for m in found if m in MODULES or m == "tests" or m.startswith("tests.")}


GRAPH = {module: _imports(module) - {module} for module in MODULES}


def test_the_map_covers_every_module():
    assert len(MODULES) > 60
    for module in MODULES:
        assert _room(module) in ROOMS, module


def test_every_package_is_in_the_wheel():
    """pyproject lists the packages by hand (the package-dir mapping): one it misses is left out of a wheel, as the
    Dockerfile's `pip install .` builds, though an editable install still finds it."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {
        ".".join((package, *init.parent.relative_to(ROOT / folder).parts))
        for folder, package in SOURCES.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert packages - listed == set()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    floor = ROOMS[_room(module)]
    up = sorted(m for m in GRAPH[module] if m in MODULES and ROOMS[_room(m)] > floor)
    assert not up, f"{module} (floor {floor}, {_room(module)}) imports from higher floors: {up}"


def test_the_client_imports_only_the_protos():
    for module in MODULES:
        if _room(module) == "specserve.client":
            assert all(_room(m) in ("specserve", "specserve.protos") for m in GRAPH[module]), GRAPH[module]


def test_the_product_never_imports_tests():
    leaks = {m: sorted(d for d in deps if d == "tests" or d.startswith("tests.")) for m, deps in GRAPH.items()}
    assert not {m: d for m, d in leaks.items() if d}


def test_training_is_reached_only_from_the_commands_that_train():
    for module, deps in GRAPH.items():
        if _room(module) in MAY_TRAIN:
            continue
        assert not [d for d in deps if _room(d) == TRAINING], f"{module} imports training code"


def test_no_import_circles():
    # Tarjan's strongly connected components over the module graph; packages' __init__ docstrings import nothing.
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(GRAPH[node] & MODULES.keys()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    assert not circles


def _product_files() -> list[Path]:
    return [p for p in MODULES.values() if not p.name.endswith(GENERATED)]


def test_no_file_is_over_the_limit():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _product_files()}
    long = {path: n for path, n in lengths.items() if n > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_is_over_the_limit():
    long = {}
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _only_tests_call(product: dict[str, str], tests: str) -> list[str]:
    """Functions and methods of `product` (path -> source) whose name appears in no product source but at its own
    definition, yet in `tests`: code kept alive by its tests alone (dunders, called by Python, aside)."""
    named = Counter(re.findall(r"\w+", "\n".join(product.values())))
    tested = set(re.findall(r"\w+", tests))
    found = []
    for path, source in product.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("__"):
                if named[node.name] == 1 and node.name in tested:
                    found.append(f"{path}:{node.name}")
    return found


def test_no_function_is_called_only_by_tests():
    """A function that only tests call is a second way of doing what the product does another way (issue 57: the
    planner's `best_k` and `round_rate` were): it belongs in tests/helpers/ as a test's oracle, or nowhere."""
    product = {str(p.relative_to(ROOT)): p.read_text() for p in MODULES.values()}  # generated stubs call servicers
    tests = "\n".join(p.read_text() for p in TESTS.rglob("*.py") if p.name != "test_structure.py")
    found = _only_tests_call(product, tests)
    assert not found, f"called only by tests (move to tests/helpers/ or delete): {found}"
    # and the check sees one: a product function named only where it is defined and in a test
    planted = {"m.py": "def used():\n    return kept()\n\ndef kept():\n    return 1\n\ndef only_tested():\n    pass\n"}
    assert _only_tests_call(planted, "only_tested(); kept()") == ["m.py:only_tested"]


def test_one_strict_base():
    """Every model that refuses unknown fields gets it from StrictModel (workers/config/strict.py), never its own
    ConfigDict: one base, so the rule cannot drift apart between configs, requests and edges."""
    base = MODULES["specserve.workers.config.strict"]
    own = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _product_files()
        if path != base
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "ConfigDict"
        and any(k.arg == "extra" and getattr(k.value, "value", None) == "forbid" for k in node.keywords)
    ]
    assert not own, f"subclass StrictModel instead: {own}"


def test_each_folder_says_its_job():
    for path in MODULES.values():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc) > 20, f"{path.relative_to(ROOT)} has no one-line docstring saying its job"


# -- the tests' own house ---------------------------------------------------------------------------------------------

TESTS = ROOT / "tests"
HELPERS = "tests.helpers"


def _test_tree_modules() -> dict[str, Path]:
    """Every module under tests/ by its import name (tests/ and its folders are namespace packages but helpers/)."""
    modules = {}
    for path in sorted(TESTS.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


TEST_TREE = _test_tree_modules()


def _imported_names(module: str, path: Path) -> set[str]:
    """The absolute names of what `module` imports (relative imports resolved), at any depth."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _shares_a_package_fixture(path: Path) -> bool:
    """An __init__.py beside a conftest.py with a package-scoped fixture: pytest scopes such a fixture to a folder
    only where the folder is a package (elsewhere it lives to the session's end)."""
    conftest = path.parent / "conftest.py"
    return path.name == "__init__.py" and conftest.is_file() and 'scope="package"' in conftest.read_text()


def test_every_shared_test_module_lives_in_tests_helpers():
    """Under tests/ there are test modules (test_*.py), conftest.py files and tests/helpers/; nothing else (but the
    __init__.py of a folder that shares a package-scoped fixture)."""
    stray = [
        str(path.relative_to(ROOT))
        for module, path in TEST_TREE.items()
        if not (path.name.startswith("test_") or path.name == "conftest.py" or module.startswith(HELPERS))
        and not _shares_a_package_fixture(path)
    ]
    assert not stray, f"shared test code belongs in tests/helpers/ (fixtures in a conftest.py): {stray}"


@pytest.mark.parametrize("module", sorted(TEST_TREE))
def test_no_test_module_imports_another(module):
    """From tests/, a module imports only tests.helpers: never a test module (pytest would see its tests and fixtures
    twice, and the two files could not move apart) and never a conftest.py (pytest loads those itself)."""
    path = TEST_TREE[module]
    wrong = sorted(
        name
        for name in _imported_names(module, path)
        if (name == "tests" or name.startswith("tests.")) and name != HELPERS and not name.startswith(HELPERS + ".")
    )
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}: move what it needs to tests/helpers/ or a conftest.py"


def test_tests_take_free_ports_from_the_product():
    """One free_port: specserve.workers.service.local_processes.free_port; the tests keep no copy of it."""
    copies = [
        f"{path.relative_to(ROOT)}:{node.name}"
        for path in TEST_TREE.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and "free_port" in node.name
        and not node.name.startswith("test_")
    ]
    assert not copies, copies


# -- tests mirror the tree (tests/README.md) --------------------------------------------------------------------------

# A test module's folder under tests/ names the source folder whose module it tests (tests/ itself mirrors
# src/specserve); tests across modules live only in these named folders of tests/integration/.
MIRRORS = {"": "src/specserve", "protos": "protos", "workers": "workers", "cluster": "cluster"}
INTEGRATION = ("served", "tiny_app", "disaggregated", "workers", "bench", "real_model")
ACROSS_THE_TREE = ("test_structure.py",)  # the house rules themselves, over every folder


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "helpers" not in p.relative_to(TESTS).parts)


def _subject(path: Path) -> Path | None:
    """The source module a test module's path names: test_X.py or test_X_<aspect>.py in tests/<folder>/<sub>/ ->
    <folder>/<sub>/X.py (the longest X that exists), None where there is none."""
    parts = path.relative_to(TESTS).parts
    top = parts[0] if len(parts) > 1 else ""
    if top not in MIRRORS:
        return None
    folder = ROOT / MIRRORS[top] / Path(*parts[1:-1])
    words = path.stem.removeprefix("test_").split("_")
    for n in range(len(words), 0, -1):
        if (folder / ("_".join(words[:n]) + ".py")).is_file():
            return folder / ("_".join(words[:n]) + ".py")
    return None


def _misplaced(paths: list[Path]) -> list[str]:
    wrong = []
    for path in paths:
        parts = path.relative_to(TESTS).parts
        if parts[0] == "integration":
            if len(parts) != 3 or parts[1] not in INTEGRATION:
                wrong.append(f"{path.relative_to(ROOT)}: tests across modules go in tests/integration/{INTEGRATION}")
        elif not (len(parts) == 1 and parts[0] in ACROSS_THE_TREE) and _subject(path) is None:
            wrong.append(f"{path.relative_to(ROOT)}: no source module at its mirrored path (test_X[_aspect] -> X.py)")
    return wrong


def test_every_test_module_sits_at_its_source_modules_mirrored_path():
    """tests/cluster/scheduling/test_admission.py tests cluster/scheduling/admission.py; test_kv_cache_prefixes.py in
    tests/workers/runtime/ tests workers/runtime/kv_cache.py; nothing sits flat in tests/cluster or tests/workers but
    the tests of cluster/*.py and workers/*.py."""
    assert len(_test_modules()) > 100
    wrong = _misplaced(_test_modules())
    assert not wrong, "\n".join(wrong)


def test_the_mirror_check_refuses_a_test_in_the_wrong_place():
    stray = [
        TESTS / "cluster" / "test_admission.py",  # flat: admission.py is in cluster/scheduling/
        TESTS / "workers" / "runtime" / "test_nothing_here.py",
        TESTS / "integration" / "test_everything.py",  # across modules, but in no named folder
        TESTS / "integration" / "elsewhere" / "test_app.py",
    ]
    assert len(_misplaced(stray)) == len(stray)
    assert not _misplaced([TESTS / "workers" / "runtime" / "test_kv_cache_prefixes.py"])


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group(0)).lower() for r in requirements}


def test_every_package_the_tests_import_is_a_dependency_or_in_the_dev_extras():
    """`pip install -e '.[dev]'` is all the suite needs: every third-party module the tests import comes from a
    distribution that pyproject.toml names (the runtime dependencies or the `dev` extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = _requirement_names(project["dependencies"] + project["optional-dependencies"]["dev"])
    providers = importlib.metadata.packages_distributions()
    tops = {
        name.split(".")[0]
        for module, path in TEST_TREE.items()
        for name in _imported_names(module, path)
        if name and not name.startswith(".")
    }
    third_party = sorted(t for t in tops if t not in sys.stdlib_module_names and t not in ("specserve", "tests"))
    missing = {t: providers.get(t) for t in third_party if not _requirement_names(providers.get(t, [t])) & named}
    assert not missing, f"imported by the tests, not in pyproject.toml (module: distributions): {missing}"


# -- the methods registry and the proposers ---------------------------------------------------------------------------

REGISTRY = "specserve.workers.speculation.methods"
# Where a method's name may still be written: the registry; the commands (bench rows, CLI options); the config keys
# users write (`draft: ngram`, vLLM's speculative_config, the word 'eagle' for a packaged head, `--draft ngram`); the
# OpenAI API's own `suffix` field.
NAMES_MAY_APPEAR = (
    REGISTRY,
    "specserve.cluster.bench",
    "specserve.cluster.cli",
    "specserve.cluster.app_config",
    "specserve.cluster.speculative_config",
    "specserve.workers.models.packaged_heads",
    "specserve.cluster.serve.openai_api",
)
PROPOSER_FOLDER = "specserve.workers.speculation"


def _method_names() -> tuple[str, ...]:
    from specserve.workers.speculation.methods import NAMES

    return NAMES


def _strings(path: Path) -> list[ast.Constant]:
    """The module's string constants but its docstrings."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_method_names_are_written_only_in_the_registry():
    """Adding a method touches the registry (workers/speculation/methods.py) and its proposer: every other reader asks
    the registry what a method does. 'draft' and 'none' also name a worker role and a plain step, so they are checked
    where they are compared with a method (`x.method == "draft"`, `spec.method in (...)`)."""
    names = set(_method_names())
    unambiguous = names - {"draft", "none"}
    found = []
    for module, path in MODULES.items():
        if any(module == m or module.startswith(m + ".") for m in NAMES_MAY_APPEAR):
            continue
        found += [f"{module}:{n.lineno} {n.value!r}" for n in _strings(path) if n.value in unambiguous]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Attribute) and side.attr == "method" for side in (node.left, *node.comparators)
            ):
                named = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
                found += [f"{module}:{node.lineno} compares a method with {v!r}" for v in named]
    assert not found, f"method names outside the registry (ask workers/speculation/methods.py instead): {found}"


def test_each_proposer_module_holds_one_proposer():
    """Under workers/speculation/, one proposer a file: at most one class implementing the Drafter interface
    (`propose_batch` and `release`) per module."""
    crowded = {}
    for module, path in MODULES.items():
        if not module.startswith(PROPOSER_FOLDER + "."):
            continue
        proposers = [
            node.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)
            and {"propose_batch", "release"} <= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        ]
        if len(proposers) > 1:
            crowded[module] = proposers
    assert not crowded, crowded


TORCH_FREE = (  # imported without torch: the CPU-only scheduler, the edges' last step, what they read of the workers
    *(m for m in MODULES if m.startswith("specserve.cluster.scheduling")),
    "specserve.cluster.serve.prepare",
    "specserve.workers.config.request",
    "specserve.workers.config.settings",
    "specserve.workers.speculation.methods",
    "specserve.workers.speculation.drafter",
    "specserve.workers.speculation.ngram",
    "specserve.workers.speculation.suffix",
    "specserve.workers.speculation.eagle.config",
    "specserve.workers.speculation.wire_format",
    "specserve.workers.service.sampling_wire",
    "specserve.workers.service.results",
)


def test_the_scheduler_and_the_edges_import_no_torch():
    """In a fresh interpreter, each in turn: importing it (and everything it imports) leaves torch unloaded, so the
    first that loads it is named."""
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, f'{name} imports torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code, *TORCH_FREE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
