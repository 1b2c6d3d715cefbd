"""docs/ARCHITECTURE.md stays true to the code: every name in its package tree exists, every library module and
every front-end package is in the tree, and every `mlxpaged` import under app/ is one its front-end table allows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
ENTRY_INDENT = 10  # deeper lines in the tree continue the description above them
EVERY_FRONT_END = "every front end"


def fenced_block_after(heading: str) -> list[str]:
    """The lines of the first fenced block under the `## heading` section."""
    text = DOC.read_text()
    section = text[text.index(f"## {heading}\n") :]
    start = section.index("```\n") + len("```\n")
    return section[start : section.index("```", start)].splitlines()


def tree_entries() -> list[Path]:
    """Each file or folder the package tree names, relative to the repository root."""
    folders: dict[int, Path] = {}
    entries = []
    for line in fenced_block_after("The packages"):
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= ENTRY_INDENT:
            continue
        names = re.split(r"\s{2,}", line.strip())[0]
        parent = folders[indent - 2] if indent else Path()
        for name in names.split(", "):
            entries.append(parent / name)
            if name.endswith("/"):
                folders[indent] = parent / name
    return entries


def named_modules() -> set[str]:
    """Every `.py` file the tree names, and each named package's `__init__.py`."""
    named = set()
    for entry in tree_entries():
        named.add(
            (entry / "__init__.py").as_posix()
            if str(entry).endswith("/") or (ROOT / entry).is_dir()
            else entry.as_posix()
        )
    return named


def test_every_name_in_the_package_tree_exists():
    missing = [str(entry) for entry in tree_entries() if not (ROOT / entry).exists()]
    assert not missing, f"docs/ARCHITECTURE.md names what is not in the repository: {missing}"


def test_the_tree_parses_into_the_packages_it_draws():
    entries = {entry.as_posix() for entry in tree_entries()}
    assert {
        "mlxpaged/engine/engine.py",
        "mlxpaged/platform/model_facts.py",
        "app/server/chat",
        "app/tui/widgets",
        "mlxpaged/kernels/paged_attention.metal",
    } <= entries


def test_every_library_module_is_in_the_tree():
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mlxpaged").rglob("*.py")}
    missing = sorted(modules - named_modules())
    assert not missing, f"docs/ARCHITECTURE.md's package tree leaves out: {missing}"


def test_every_front_end_package_and_top_level_module_is_in_the_tree():
    app = ROOT / "app"
    wanted = {p.relative_to(ROOT).as_posix() for p in app.rglob("__init__.py")}
    wanted |= {p.relative_to(ROOT).as_posix() for p in app.glob("*.py")}
    missing = sorted(wanted - named_modules())
    assert not missing, f"docs/ARCHITECTURE.md's package tree leaves out: {missing}"


def allowed_imports() -> dict[str, list[str]]:
    """importer ("every front end", or a path under app/) -> the mlxpaged modules it may import."""
    allowed: dict[str, list[str]] = {}
    importer = None
    for line in fenced_block_after("Front ends and the library")[1:]:  # the first line is the header
        if line.startswith(" "):
            allowed[importer] += line.split()
            continue
        if line.startswith(EVERY_FRONT_END):
            importer, modules = EVERY_FRONT_END, line[len(EVERY_FRONT_END) :]
        else:
            importer, modules = line.split(None, 1)
        allowed[importer] = modules.split()
    return allowed


def imported_library_modules(path: Path) -> set[str]:
    """The mlxpaged modules a file imports, by name relative to the package ("" for `mlxpaged` itself)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from mlxpaged.platform import backend` imports the module mlxpaged.platform.backend
            names = [
                f"{node.module}.{alias.name}" if _is_module(f"{node.module}.{alias.name}") else node.module
                for alias in node.names
            ]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            names = [arg.value for arg in node.args[:1] if isinstance(arg, ast.Constant)]
        found |= {
            name.removeprefix("mlxpaged").removeprefix(".")
            for name in names
            if name == "mlxpaged" or name.startswith("mlxpaged.")
        }
    return found


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _allows(patterns: list[str], module: str) -> bool:
    for pattern in patterns:
        name = "" if pattern == "mlxpaged" else pattern
        if module == name or (name.endswith(".*") and (module + ".").startswith(name[:-1])):
            return True
    return False


def test_the_front_end_table_names_real_modules():
    for importer, patterns in allowed_imports().items():
        assert importer == EVERY_FRONT_END or (ROOT / importer).exists(), importer
        for pattern in patterns:
            assert pattern == "mlxpaged" or _is_module("mlxpaged." + pattern.removesuffix(".*")), pattern


def test_front_ends_import_only_what_the_table_allows():
    allowed = allowed_imports()
    beyond = {}
    for path in sorted((ROOT / "app").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        patterns = allowed[EVERY_FRONT_END] + [
            m
            for importer, modules in allowed.items()
            if importer != EVERY_FRONT_END and relative.startswith(importer)
            for m in modules
        ]
        if extra := sorted(m for m in imported_library_modules(path) if not _allows(patterns, m)):
            beyond[relative] = extra
    assert not beyond, (
        "front ends import library modules docs/ARCHITECTURE.md's 'Front ends and the library' "
        f"table does not allow (use the Engine, or add them to the table and say why): {beyond}"
    )


def test_the_import_check_sees_imports_beyond_the_table(tmp_path):
    source = tmp_path / "front_end.py"
    source.write_text(
        "import mlxpaged\nfrom mlxpaged.platform import backend\nfrom mlxpaged.engine.core import X\n"
        "importlib.import_module('mlxpaged.kernels.self_check')\n"
    )
    assert imported_library_modules(source) == {"", "platform.backend", "engine.core", "kernels.self_check"}
    assert not _allows(allowed_imports()[EVERY_FRONT_END], "engine.core")
