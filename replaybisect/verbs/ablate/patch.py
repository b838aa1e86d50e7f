"""`replay ablate --patch fix.py` (or a folder): the failure replayed with the user's changed modules in place of
the recorded ones, from the same snapshot over the same batches.

The patch is the user's own code, named on their command line: it is trusted as `--code-dir` is (its folder goes
first on sys.path while the patched arm runs). What it replaces:
- a module of the same dotted name as one of the run's modules (`planted_forward.py` in the patch replaces the
  recorded `planted_forward`): the whole module, so everything built from it or importing it uses the patch;
- for a single file of another name (`fix.py`), the run's `_target_` classes (or an own loop's step and build
  functions) it defines by name (`fix.GatedMLP` is built where the config names `planted_forward.GatedMLP`).
A patch that does not import, or replaces nothing of the run, is refused in one line before anything runs.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from replaybisect.core import bindings
from replaybisect.core.trust import BUILTIN_PREFIXES
from replaybisect.errors import ReplayError

PATCH_ARM = "patch"
MAX_MODULES = 500  # a folder with more .py files than this is not a patch


@dataclass(frozen=True)
class Patch:
    path: str  # the file or folder as given (resolved)
    folder: str  # first on sys.path while a patched arm runs
    replaced: tuple[str, ...]  # the run's modules the patch replaces in place (same dotted name)
    rewrites: dict[str, str] = field(default_factory=dict)  # a recorded `_target_` -> the patch's class of that name
    evicted: tuple[str, ...] = ()  # imported afresh while patched: the replaced modules and the run's own target modules

    def summary(self) -> str:
        what = [f"module {name}" for name in self.replaced] + [f"{old} -> {new}" for old, new in self.rewrites.items()]
        return f"your patch {Path(self.path).name}: " + ", ".join(what)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "folder": self.folder, "replaced": list(self.replaced), "rewrites": dict(self.rewrites),
                "evicted": list(self.evicted)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Patch":
        return cls(path=data["path"], folder=data["folder"], replaced=tuple(data["replaced"]), rewrites=dict(data["rewrites"]),
                   evicted=tuple(data["evicted"]))


def check_path(text: str) -> Path:
    """The patch's path, checked before any run is read: an existing .py file or a folder."""
    path = Path(text).expanduser()
    if "\0" in text or not path.exists():
        raise ReplayError(f"--patch {text[:200]!r} does not exist; pass your changed module (fix.py) or a folder of them")
    if path.is_file() and path.suffix != ".py":
        raise ReplayError(f"--patch {text[:200]!r} is not a .py file; pass your changed module (fix.py) or a folder of them")
    return path.resolve()


def _own_targets(cfg) -> list[str]:
    """The `_target_`s of the run's config that are the user's code (not torch's, not replaybisect's)."""
    from omegaconf import OmegaConf

    from replaybisect.core.trust import _walk  # the trust boundary's walk over every `_target_` (the config passed it)

    tree = OmegaConf.to_container(cfg, resolve=False)
    targets = [target for target, _ in _walk(tree, "", "the run")]
    return list(dict.fromkeys(t for t in targets if isinstance(t, str) and not t.startswith(tuple(p + "." for p in BUILTIN_PREFIXES))))


def _module_names(path: Path) -> dict[str, Path]:
    """The patch's modules: a file is one module (its stem); a folder, every .py under it by dotted name."""
    if path.is_file():
        return {path.stem: path}
    modules: dict[str, Path] = {}
    for file in sorted(path.rglob("*.py")):
        parts = file.relative_to(path).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and all(part.isidentifier() for part in parts):
            modules[".".join(parts)] = file
        if len(modules) > MAX_MODULES:
            raise ReplayError(f"--patch {path} holds more than {MAX_MODULES} modules; pass the folder of your changed modules only")
    return modules


def load_patch(path: Path, cfg) -> Patch:
    """Check the patch against the run's config (its modules imported here, trusted as --code-dir): what it replaces.
    One-line ReplayError when it does not import or replaces nothing of the run."""
    targets = _own_targets(cfg)
    target_modules = list(dict.fromkeys(t.rpartition(".")[0] for t in targets))
    modules = _module_names(path)
    run_modules = set(target_modules) | {name for name in modules if _imported_elsewhere(name, modules[name])}
    replaced = tuple(name for name in modules if name in run_modules)
    folder = path if path.is_dir() else path.parent
    rewrites: dict[str, str] = {}
    if path.is_file() and not replaced:
        rewrites = _class_rewrites(path, targets, folder)
    if not replaced and not rewrites:
        named = ", ".join(targets) or "none"
        raise ReplayError(f"--patch {path.name} defines none of the run's modules or classes (its config builds: {named[:300]}); "
                          "name your changed module like the recorded one, or define the class under the same name")
    patch = Patch(path=str(path), folder=str(folder), replaced=replaced, rewrites=rewrites,
                  evicted=tuple(dict.fromkeys([*replaced, *target_modules, *([path.stem] if rewrites else [])])))
    with patched_modules(patch):  # import what the arm will import: a patch that does not import is bad input
        for name in replaced:
            _import_from(name, modules[name], path)
    return patch


def _defines(path: Path, names: set[str]) -> bool:
    """The file binds one of `names` at its top level (a class, a def, an assignment such as `GatedMLP = StableMLP`,
    also under a top-level if/try/with), read without running it."""
    try:
        tree = bindings.parse(path)
    except (SyntaxError, ValueError, OSError):
        return True  # let the import say what is wrong, in its one line
    return bool(bindings.defined_names(tree) & names)


def _imported_elsewhere(name: str, file: Path) -> bool:
    """A module of this name is part of the running code (imported when the run's config was admitted), from
    another file than the patch's."""
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None)
    return module is not None and origin is not None and Path(origin).resolve() != file.resolve()


def _import_from(name: str, file: Path, path: Path):
    try:
        module = importlib.import_module(name)
    except (Exception, SystemExit) as error:
        raise ReplayError(f"--patch {path.name}: {name} does not import: {_one_line(error, file)}") from None
    origin = getattr(module, "__file__", None)
    if origin is None or Path(origin).resolve() != file.resolve():
        raise ReplayError(f"--patch {path.name}: `import {name}` finds {origin} before the patch's {file}; "
                          "give the patch's package an __init__.py")
    return module


def _one_line(error: BaseException, file: Path) -> str:
    if isinstance(error, SyntaxError):
        return f"SyntaxError: {error.msg} ({Path(error.filename or file).name}, line {error.lineno})"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == file.resolve()]
    where = f" ({file.name}, line {frames[-1].lineno})" if frames else ""
    message = " ".join(str(error).split())[:200]
    return f"{type(error).__name__}: {message}{where}"


def _class_rewrites(path: Path, targets: list[str], folder: Path) -> dict[str, str]:
    """recorded target -> `stem.Name` for every target whose name the patch file defines itself: a class (a model),
    or a function (an own loop's step or build function). A name it only imports is the recorded object: no change."""
    if not _defines(path, {target.rpartition(".")[2] for target in targets}):
        return {}  # nothing to rewrite: never import (run) a file that cannot replace anything
    patch = Patch(path=str(path), folder=str(folder), replaced=(), evicted=(path.stem,))
    with patched_modules(patch):
        module = _import_from(path.stem, path, path)
        rewrites = {}
        for target in targets:
            name = target.rpartition(".")[2]
            defined = getattr(module, name, None)
            if callable(defined) and getattr(defined, "__module__", None) == path.stem:
                rewrites[target] = f"{path.stem}.{name}"
        return rewrites


def patched_config(cfg, patch: Patch):
    """A copy of the run's config building the patch's classes where the config names the recorded ones."""
    from omegaconf import DictConfig, ListConfig, open_dict

    new = copy.deepcopy(cfg)

    def rewrite(node) -> None:
        if isinstance(node, DictConfig):
            for key in list(node.keys()):
                value = node[key]
                if key == "_target_" and isinstance(value, str) and value in patch.rewrites:
                    node[key] = patch.rewrites[value]
                elif isinstance(value, (DictConfig, ListConfig)):
                    rewrite(value)
        elif isinstance(node, ListConfig):
            for value in node:
                if isinstance(value, (DictConfig, ListConfig)):
                    rewrite(value)

    with open_dict(new):
        rewrite(new)
    return new


@contextlib.contextmanager
def patched_modules(patch: Patch) -> Iterator[None]:
    """While inside: the patch's folder first on sys.path and the modules it touches imported afresh (from the patch,
    or re-importing it); after: sys.path and those modules as they were, so the other arms in this process run the
    recorded code."""
    names = set(patch.evicted)
    saved = {name: module for name, module in sys.modules.items() if name in names or name.startswith(tuple(n + "." for n in names))}
    path_before = list(sys.path)
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, patch.folder)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path[:] = path_before
        for name in [n for n in sys.modules if n in names or n.startswith(tuple(n2 + "." for n2 in names))]:
            del sys.modules[name]
        sys.modules.update(saved)
