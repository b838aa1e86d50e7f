"""What a Python file binds at its top level, read with `ast` and never run.

The trust boundary reads a stored config's modules with it before importing any of them (what a name is bound to,
and where a re-exported name was defined), and `replay ablate --patch` reads a patch file with it to know whether
it defines one of the run's classes. Top level means the module's own statements, also those under a top-level
`if`, `try` or `with` (`try: from fast import X` / `except ImportError: X = slow`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

DEFINED = ("class", "def", "assign")  # a name the file defines itself; "import" is a re-export


@dataclass(frozen=True)
class Binding:
    how: str  # "class", "def", "assign" or "import"
    # import: the absolute dotted path it re-exports (`import torch as T` -> torch; `from .m import X` -> pkg.m.X;
    # None for a relative import beyond the top-level package); assign: the dotted name it aliases (`load = T.load`
    # -> T.load), None for any other value (a call, a literal)
    origin: Optional[str]
    line: int


@dataclass(frozen=True)
class TopLevel:
    names: dict[str, tuple[Binding, ...]] = field(default_factory=dict)
    stars: tuple[Optional[str], ...] = ()  # the modules of `from X import *`, absolute (None: cannot be placed)


def parse(path: str | Path) -> ast.Module:
    """The file's syntax tree (SyntaxError, ValueError, OSError as Python's import would meet them)."""
    data = Path(path).read_bytes()
    try:
        return ast.parse(data, filename=str(path))
    except RecursionError:  # nested deeper than the parser goes: Python's import fails the same way
        raise SyntaxError("too deeply nested to parse", (str(path), 1, 0, "")) from None


def defined_names(tree: ast.Module) -> set[str]:
    """The names the file defines itself at its top level: by class, def or assignment (`GatedMLP = StableMLP`)."""
    return {name for name, bindings in top_level(tree).names.items() if any(b.how in DEFINED for b in bindings)}


def top_level(tree: ast.Module, module: str = "", is_package: bool = False) -> TopLevel:
    """Every name bound at the top level of the module `module` (dotted; a package's `__init__` when
    `is_package`), with how; relative imports are made absolute from `module`."""
    names: dict[str, list[Binding]] = {}
    stars: list[Optional[str]] = []

    def bind(name: str, how: str, origin: Optional[str], line: int) -> None:
        names.setdefault(name, []).append(Binding(how, origin, line))

    for node in _statements(tree.body):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            bind(node.name, "class" if isinstance(node, ast.ClassDef) else "def", None, node.lineno)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name, plain in _assigned(target):
                    bind(name, "assign", _dotted(node.value) if plain else None, node.lineno)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:  # `x: int` alone binds nothing
            for name, plain in _assigned(node.target):
                bind(name, "assign", _dotted(node.value) if plain else None, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:  # `import torch.serialization as S` binds S to torch.serialization
                    bind(alias.asname, "import", alias.name, node.lineno)
                else:  # `import torch.nn` binds torch
                    top = alias.name.split(".")[0]
                    bind(top, "import", top, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, module, is_package)
            for alias in node.names:
                if alias.name == "*":
                    stars.append(base)
                else:
                    bind(alias.asname or alias.name, "import", f"{base}.{alias.name}" if base else None, node.lineno)
    return TopLevel({name: tuple(found) for name, found in names.items()}, tuple(stars))


_BLOCKS = (ast.If, ast.Try, ast.With) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())


def _statements(body: list) -> Iterator[ast.stmt]:
    for node in body:
        if isinstance(node, _BLOCKS):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            for block in blocks:
                yield from _statements(block)
        else:
            yield node


def _assigned(target: ast.expr) -> Iterator[tuple[str, bool]]:
    """The names an assignment target binds, and whether it is the plain `name = value` form (`a.b = x` and
    `a[0] = x` bind no name: they change an object that is bound elsewhere)."""
    if isinstance(target, ast.Name):
        yield target.id, True
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            for name, _ in _assigned(element):
                yield name, False
    elif isinstance(target, ast.Starred):
        for name, _ in _assigned(target.value):
            yield name, False


def _dotted(value: ast.expr) -> Optional[str]:
    """`T.load` for the expression `T.load`; None for anything that is not a (dotted) name."""
    parts = []
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    if not isinstance(value, ast.Name):
        return None
    return ".".join([value.id, *reversed(parts)])


def _absolute(name: Optional[str], level: int, module: str, is_package: bool) -> Optional[str]:
    """`from ..x import y` made absolute, as importlib would resolve it in `module` (None: beyond the top)."""
    if level == 0:
        return name
    package = module.split(".") if is_package else module.split(".")[:-1]
    if not module or level - 1 >= len(package):
        return None
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))
