"""The layout, drawn from the imports: each folder of the package imports only the folders its rule
allows (ALLOWED_IMPORTS), the package imports nothing from the root, no module of the project imports
another that (directly or not) imports it back, the tests mirror the package's folders, and no test edits
sys.path or imports another test file. Read from the source, nothing run."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

ROOT_MODULES = {p.stem for p in ROOT.glob("*.py")}

# What each folder of t2ibench/ may import, besides its own modules (docs/design.md draws it; a folder's
# __init__.py says it too). The folders stand in layers, lowest first; a folder imports only folders below
# it, so a change to one is seen by those above and none below. A new module goes in the folder of its
# concern; one that needs a folder its rule does not allow belongs higher up (CONTRIBUTING.md).
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "core": set(),
    "families": {"core"},
    "datasets": {"core", "families"},
    "eval": {"core", "families", "datasets"},
    "train": {"core", "families", "datasets", "eval"},
    "memory": {"core", "families", "datasets", "eval", "train"},
    "costs": {"core", "families", "datasets"},
    "callbacks": {"core", "families", "datasets", "eval", "train", "costs"},
    "commands": {"core", "families", "datasets", "eval", "train", "memory", "costs", "callbacks"},
}
# Folders of tests/ that are not a folder of t2ibench/: bench/'s tests (tests/data/ holds a record, no tests).
TEST_FOLDERS_BESIDES = {"bench"}


def project_imports(source: str) -> dict[str, int]:
    """The project modules a file's source imports ("data", "t2ibench.families.sd2", ...), wherever in the
    file (a function's import too), each with the line of its first import."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] in ROOT_MODULES or name.split(".")[0] == "t2ibench":
                found.setdefault(name, node.lineno)
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def project_files() -> list[Path]:
    return [*ROOT.glob("*.py"), *(ROOT / "t2ibench").rglob("*.py")]


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in project_files()}
    return {name: {m for m in project_imports(path.read_text()) if m in modules and m != name}
            for name, path in modules.items()}


def folder_of(module: str) -> str | None:
    """The folder of t2ibench/ a module is in ("t2ibench.datasets.buckets" -> "datasets"); None for the root's."""
    parts = module.split(".")
    return parts[1] if parts[0] == "t2ibench" and len(parts) > 1 else None


def folder_violations(sources: dict[str, str]) -> list[str]:
    """One line per import against ALLOWED_IMPORTS, from {path under the root: source}: the file and line,
    what it imports, and what its folder may import."""
    problems = []
    for path, source in sorted(sources.items()):
        module = module_name(ROOT / path)
        folder = folder_of(module)
        if module == "t2ibench":
            continue
        if folder not in ALLOWED_IMPORTS:
            problems.append(f"{path}: a module of t2ibench/ goes in one of its folders, {sorted(ALLOWED_IMPORTS)} "
                            "(CONTRIBUTING.md, 'Where things live')")
            continue
        reported: set[int] = set()  # one line per import statement (`from M import n` also yields M.n)
        for imported, line in project_imports(source).items():
            target = folder_of(imported)
            if target is None or target == folder or line in reported:
                continue
            if target not in ALLOWED_IMPORTS[folder]:
                reported.add(line)
                allowed = ", ".join(f"{f}/" for f in sorted(ALLOWED_IMPORTS[folder])) or "no other folder"
                problems.append(f"{path}:{line} imports {imported}: {folder}/ may import {allowed} "
                                "(tests/test_layout.py, ALLOWED_IMPORTS)")
    return problems


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "t2ibench").rglob("*.py")}


def test_each_folder_imports_only_what_its_rule_allows():
    problems = folder_violations(package_sources())
    assert not problems, "\n".join(problems)


def test_an_import_against_the_rule_is_named_in_one_line():
    # The rule can fail: core/ importing the training model, and a module left outside the folders.
    sources = package_sources()
    sources["t2ibench/core/errors.py"] += "\nfrom t2ibench.train.model import DiffusionModel\n"
    sources["t2ibench/loose.py"] = "from t2ibench.core.errors import fail\n"
    line = len(sources["t2ibench/core/errors.py"].splitlines())
    assert folder_violations(sources) == [
        f"t2ibench/core/errors.py:{line} imports t2ibench.train.model: core/ may import no other folder "
        "(tests/test_layout.py, ALLOWED_IMPORTS)",
        "t2ibench/loose.py: a module of t2ibench/ goes in one of its folders, " + str(sorted(ALLOWED_IMPORTS))
        + " (CONTRIBUTING.md, 'Where things live')"]


def test_every_folder_has_a_rule_and_says_it():
    folders = {p.parent.name for p in (ROOT / "t2ibench").glob("*/__init__.py")}
    assert folders == set(ALLOWED_IMPORTS)
    for folder in folders:
        docstring = ast.get_docstring(ast.parse((ROOT / "t2ibench" / folder / "__init__.py").read_text())) or ""
        assert "May import" in docstring, f"t2ibench/{folder}/__init__.py: its docstring says what it may import"


def test_the_tests_mirror_the_package():
    # tests/<folder>/ beside t2ibench/<folder>/ (and tests/bench/ beside bench/), each a package.
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders <= set(ALLOWED_IMPORTS) | TEST_FOLDERS_BESIDES, folders
    # No folder is named like a root module: a script run from tests/ (tests/fault_run.py, a test file run as a
    # rank) has tests/ first on sys.path, where a tests/data/ package would be its `import data`.
    assert not (folders | set(ALLOWED_IMPORTS)) & ROOT_MODULES, (folders | set(ALLOWED_IMPORTS)) & ROOT_MODULES
    for folder in folders:
        assert (ROOT / "tests" / folder / "__init__.py").is_file(), f"tests/{folder}/ needs an __init__.py"


def test_the_package_imports_nothing_from_the_root():
    for module, imported in graph().items():
        if module.startswith("t2ibench"):
            assert not {m for m in imported if not m.startswith("t2ibench")}, (module, imported)


def test_no_import_cycles():
    edges = graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, " -> ".join(path + [module])
        if module in done:
            return
        for imported in edges.get(module, ()):
            visit(imported, path + [module])
        done.add(module)

    for module in edges:
        visit(module, [])


def test_commands_stay_thin_and_model_code_stays_in_its_family():
    # A model's configs and parts are named only in its family module (and its tests).
    for path in project_files():
        if path.parent.name != "families":
            text = path.read_text()
            assert "UNet2DConditionModel(" not in text and "CLIPTextModel(" not in text, path


def test_tests_share_setup_through_conftest_and_helpers_only():
    # pytest.ini puts the root on the path; what several test files use is in conftest.py or helpers.py.
    # tests/preloaded.py alone sets sys.path: a forked command's, as a new interpreter would have it.
    for path in sorted((ROOT / "tests").rglob("*.py")):
        name = path.relative_to(ROOT / "tests")
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys"
                    and str(name) != "preloaded.py"):
                raise AssertionError(f"{name}:{node.lineno} uses sys.path")
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{name}" for name in names]
            imported_tests = [n for n in names if any(part.startswith("test_") for part in n.split("."))]
            assert not imported_tests, f"{name}:{node.lineno} imports the test file {imported_tests}"
