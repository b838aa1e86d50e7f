"""The package's shape: dependencies point one way (command -> report -> engine -> core / store), no import cycles,
MLflow only behind store.py, the core free of MLflow and rich. Read from the source with ast, as written."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGE = ROOT / "replaybisect"
NAME = PACKAGE.name


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """Every module this file imports, at any depth (function-level imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in MODULES)
    return found


def internal_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        targets = {target for target in imported_modules(path) if target in MODULES and target != name}
        # importing a package's module runs the package's __init__, which is not a dependency of interest
        graph[name] = {t for t in targets if MODULES[t].name != "__init__.py" or t == NAME and name != NAME}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    graph = internal_graph()
    graph.pop(NAME, None)  # the public API imports everything lazily by design
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_mlflow_only_behind_the_store():
    users = sorted(name for name, path in MODULES.items() if any(m.split(".")[0] == "mlflow" for m in imported_modules(path)))
    assert users and all(name == f"{NAME}.store" or name.startswith(f"{NAME}.store.") for name in users), users


@pytest.mark.parametrize("forbidden", ["mlflow", "rich", "typer", f"{NAME}.store"])
def test_core_has_no_store_or_terminal_imports(forbidden):
    offenders = sorted(
        name
        for name, path in MODULES.items()
        if name.startswith(f"{NAME}.core")
        and any(m == forbidden or m.startswith(forbidden + ".") for m in imported_modules(path))
    )
    assert offenders == [], offenders


LAYERS = ["command", "report", "engine"]  # a verb's modules, top to bottom


def test_verb_layers_point_down():
    """Within a verb folder: command -> report -> engine, never upwards; engines never import a report."""
    wrong = []
    for name, path in MODULES.items():
        parts = name.split(".")
        if len(parts) != 4 or parts[1] != "verbs" or parts[3] not in LAYERS:
            continue
        layer = parts[3]
        for target in imported_modules(path):
            tparts = target.split(".")
            if len(tparts) == 4 and tparts[1] == "verbs" and tparts[3] in LAYERS and tparts[3] != layer:
                if LAYERS.index(tparts[3]) < LAYERS.index(layer):
                    wrong.append(f"{name} -> {target}")
    assert wrong == [], wrong


def test_only_the_front_doors_import_verbs():
    """The library (core, record, store, restore, report, options) sits below every verb: outside verbs/, only the
    CLI and the package's Python API import one."""
    offenders = sorted(
        f"{name} -> {target}"
        for name, path in MODULES.items()
        if not name.startswith(f"{NAME}.verbs") and name not in (f"{NAME}.cli", NAME)
        for target in imported_modules(path)
        if target.startswith(f"{NAME}.verbs")
    )
    assert offenders == [], offenders


def test_functions_in_the_recording_wing_are_short():
    """The recording wing reads as small functions: none over 80 lines."""
    long = []
    for path in sorted((PACKAGE / "record").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == [], long


def test_no_file_over_800_lines_and_no_class_over_300():
    """One file, one job: a module that outgrows 800 lines or a class 300 is split by what it does."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > 800:
            too_long.append(f"{path.relative_to(PACKAGE)} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                too_long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert too_long == [], too_long


def test_each_trainer_callback_is_a_thin_adapter():
    """Both ReplayCallbacks adapt record/trainer_steps.py's core to their trainer's hooks, in under 120 lines each."""
    for name in ("lightning.py", "hf.py"):
        tree = ast.parse((PACKAGE / "record" / name).read_text(encoding="utf-8"))
        [callback] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "ReplayCallback"]
        assert callback.end_lineno - callback.lineno + 1 < 120, (name, callback.end_lineno - callback.lineno + 1)
