"""The layout, drawn from the imports: the package imports nothing from the root, no module of the
project imports another that (directly or not) imports it back, and no test edits sys.path or imports
another test file. Read from the source, nothing run."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

ROOT_MODULES = {p.stem for p in ROOT.glob("*.py")}


def project_imports(path: Path) -> set[str]:
    """The project modules `path` imports ("data", "t2ibench.families.sd2", ...), wherever in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] in ROOT_MODULES or name.split(".")[0] == "t2ibench":
                found.add(name)
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def graph() -> dict[str, set[str]]:
    files = [*ROOT.glob("*.py"), *(ROOT / "t2ibench").rglob("*.py")]
    modules = {module_name(p): p for p in files}
    return {name: {m for m in project_imports(path) if m in modules and m != name} for name, path in modules.items()}


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
    for path in [*ROOT.glob("*.py"), *(ROOT / "t2ibench").rglob("*.py")]:
        if path.parent.name != "families":
            text = path.read_text()
            assert "UNet2DConditionModel(" not in text and "CLIPTextModel(" not in text, path


def test_tests_share_setup_through_conftest_and_helpers_only():
    # pytest.ini puts the root on the path; what several test files use is in conftest.py or helpers.py.
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                raise AssertionError(f"{path.name}:{node.lineno} uses sys.path")
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{name}" for name in names]
            imported_tests = [n for n in names if any(part.startswith("test_") for part in n.split("."))]
            assert not imported_tests, f"{path.name}:{node.lineno} imports the test file {imported_tests}"
