"""The trust boundary: a config read back from a tracking store is untrusted input.

Anyone who can write runs to a shared tracking server can write a run's `config.yaml` and its tags. Before
anything of such a config is imported or built, `admit` walks all of it and accepts a `_target_` only when

- its dotted path is under an allow-listed prefix (torch, replaybisect, the user's `--trust` prefixes), or
- its top-level module is a file in the user's own project: the folder `replay` runs in or a `--code-dir`
  (found with `PathFinder.find_spec` on those folders only, which executes nothing),

and refuses, whatever the prefix, the calls and flags that load pickles or code (torch.load, numpy.load,
mlflow's load_model, os/subprocess/importlib, `weights_only: false`, `allow_pickle: true`, ...) and
interpolations (`${oc.env:...}` reads the environment). The run's `replaybisect.code_dir` tag is only a
hint: its folder is imported from when it lies inside a trusted folder, never otherwise.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from replaybisect.core import config as config_mod
from replaybisect.errors import ConfigError, ReplayError

BUILTIN_PREFIXES = ("torch", "replaybisect")
TRUST_ENV = "REPLAYBISECT_TRUST"  # comma-separated module prefixes, like --trust
CODE_DIR_ENV = "REPLAYBISECT_CODE_DIR"  # folders separated by os.pathsep, like --code-dir

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

# Refused in a stored config under any prefix. A pattern matches a dotted path when any segment-aligned
# tail of the path starts with it, so re-exports (`replaybisect.core.loop.torch.load`) are caught without importing.
DENIED = tuple(
    pattern.split(".")
    for pattern in (
        # Python's own ways to run code, start processes or unpickle
        "builtins", "__builtin__", "os", "posix", "nt", "sys", "subprocess", "pty", "shutil", "importlib", "runpy",
        "pkgutil", "zipimport", "ctypes", "marshal", "shelve", "copyreg", "multiprocessing", "socket",
        "dill", "joblib", "cloudpickle",
        # torch's loaders of pickles, TorchScript, packages, hub code and native libraries
        "torch.load", "torch.serialization", "torch.jit.load", "torch.jit._serialization", "torch.package",
        "torch.hub", "torch.utils.model_zoo", "torch.utils.cpp_extension", "torch.utils.benchmark",
        "torch.ops.load_library", "torch.classes.load_library", "torch._ops", "torch.distributed",
        "torch.multiprocessing", "torch.fx", "torch.export.load", "torch.utils.data.datapipes",
        # numpy's pickle loaders (np: the usual alias, reached through a module that imported it)
        "numpy.load", "numpy.lib.npyio", "numpy.lib.format", "numpy.ma.load", "np.load",
        # MLflow loads models with cloudpickle
        "mlflow",
    )
)


class UntrustedConfig(ConfigError):
    """A stored config names code that is not trusted here, or a code/pickle loader."""


@dataclass(frozen=True)
class Trust:
    """The user's decision: which folders hold their own code, and which module prefixes they trust."""

    roots: tuple[str, ...]  # resolved folders: the working folder first, then --code-dir and $REPLAYBISECT_CODE_DIR
    prefixes: tuple[str, ...]  # allow-listed dotted prefixes: torch, replaybisect, then --trust and $REPLAYBISECT_TRUST

    @classmethod
    def from_user(cls, code_dirs: tuple[str | Path, ...] | list = (), prefixes: tuple[str, ...] | list = ()) -> "Trust":
        """The working folder, `code_dirs` and `prefixes`, plus the environment's (one-line errors for bad ones)."""
        env_dirs = [part for part in os.environ.get(CODE_DIR_ENV, "").split(os.pathsep) if part.strip()]
        env_prefixes = [part for part in os.environ.get(TRUST_ENV, "").split(",") if part.strip()]
        roots = [Path.cwd().resolve()]
        for option, folders in (("--code-dir", code_dirs), (f"${CODE_DIR_ENV}", env_dirs)):
            for folder in folders:
                path = Path(folder).expanduser()
                if not path.is_dir():
                    raise ReplayError(f"{option} {folder} is not a folder; pass the folder that holds your modules")
                roots.append(path.resolve())
        trusted = list(BUILTIN_PREFIXES)
        for option, names in (("--trust", prefixes), (f"${TRUST_ENV}", env_prefixes)):
            for name in names:
                prefix = name.strip().rstrip(".")
                if not _DOTTED.match(prefix):
                    raise ReplayError(f"{option} {name!r} is not a module prefix; pass a dotted name such as mypkg or mypkg.models")
                trusted.append(prefix)
        return cls(roots=tuple(dict.fromkeys(map(str, roots))), prefixes=tuple(dict.fromkeys(trusted)))

    def to_json(self) -> dict[str, list[str]]:
        """For worker processes: they inherit this decision, not the run's tag."""
        return {"roots": list(self.roots), "prefixes": list(self.prefixes)}

    @classmethod
    def from_json(cls, data: dict[str, list[str]]) -> "Trust":
        return cls(roots=tuple(data["roots"]), prefixes=tuple(data["prefixes"]))

    def import_folders(self, code_dir_tag: Optional[str], artifact_root: Optional[Path] = None) -> tuple[list[Path], bool]:
        """The folders a stored config's modules may come from, and whether the run's code_dir tag was ignored.
        The tag's folder (and its parent, as `replay train` adds it) counts only when it resolves inside a root,
        and never inside the store's own artifact folder (anyone who can write runs writes files there)."""
        folders = [Path(root) for root in self.roots]
        if not code_dir_tag:
            return folders, False
        tagged = Path(code_dir_tag)
        if not tagged.is_absolute():
            return folders, True
        uploaded = Trust(roots=(os.path.realpath(artifact_root),), prefixes=()) if artifact_root else None
        candidates = [
            folder for folder in (tagged.resolve(), tagged.resolve().parent)
            if folder.is_dir() and self.inside(folder) and not (uploaded and uploaded.inside(folder))
        ]
        if tagged.resolve() not in candidates:
            return folders, True
        return list(dict.fromkeys([*candidates, *folders])), False

    def inside(self, path: Path) -> bool:
        real = Path(os.path.realpath(path))
        return any(real == Path(root) or real.is_relative_to(root) for root in self.roots)

    def allowed_prefix(self, target: str) -> bool:
        return any(target == prefix or target.startswith(prefix + ".") for prefix in self.prefixes)


@dataclass
class _Target:
    path: str
    key: str
    by_prefix: bool


def admit(cfg, trust: Trust, code_dir_tag: Optional[str], source: str, artifact_root: Optional[Path] = None) -> list[Path]:
    """Check a stored config before anything of it is imported or built; the folders its modules import from.

    Raises UntrustedConfig (exit 2) naming the first refused target or flag and how to trust it."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=False)  # interpolations stay text: they are refused, not resolved
    folders, tag_ignored = trust.import_folders(code_dir_tag, artifact_root)
    targets = [_check_static(path, key, trust, folders, source, code_dir_tag if tag_ignored else None)
               for path, key in _walk(tree, "", source)]
    config_mod.add_code_paths(*folders)
    for target in targets:
        _check_resolved(target, trust, source)
    return folders


def _walk(node: Any, key: str, source: str) -> Iterator[tuple[str, str]]:
    """(target, key) for every `_target_` anywhere; refuses loader flags and interpolations on the way."""
    if isinstance(node, dict):
        for name, value in node.items():
            child = f"{key}.{name}" if key else str(name)
            if name == "_target_":
                yield value, child
            else:
                _check_flag(str(name), value, child, source)
                yield from _walk(value, child, source)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{key}[{index}]", source)
    elif isinstance(node, str) and "${" in node:
        raise UntrustedConfig(
            f"refused interpolation {node!r} at {key} in the stored config of {source}: a recorded config is stored "
            "resolved, and an interpolation can read the environment; nothing was run"
        )


def _check_flag(name: str, value: Any, key: str, source: str) -> None:
    lowered = name.lower()
    text = str(value).strip().lower()
    truthy = value is not None and text not in ("false", "0", "no", "off", "none", "null", "")
    refused = (
        (lowered == "weights_only" and value is not None and text not in ("true", "1", "yes", "on"))
        or (lowered in ("allow_pickle", "trust_remote_code") and truthy)
        or ("pickle" in lowered and lowered != "allow_pickle")
    )
    if refused:
        raise UntrustedConfig(
            f"refused `{name}: {value}` at {key} in the stored config of {source}: it lets a loader unpickle or run "
            "code; replaybisect never builds that from a stored config (load such files in your own module); nothing was run"
        )


def _denied(path: str) -> bool:
    parts = path.split(".")
    if any("pickle" in part.lower() or (part.startswith("__") and part.endswith("__")) for part in parts):
        return True
    return any(parts[start : start + len(pattern)] == pattern for start in range(len(parts)) for pattern in DENIED)


def _refuse_denied(path: str, key: str, source: str, via: str = "") -> UntrustedConfig:
    return UntrustedConfig(
        f"refused `_target_` {path}{via} at {key} in the stored config of {source}: it loads pickles or runs code, "
        "which replaybisect never builds from a stored config, whatever --trust says; nothing was run"
    )


def _check_static(path: Any, key: str, trust: Trust, folders: list[Path], source: str, ignored_tag: Optional[str]) -> _Target:
    """Everything decidable without importing: the name's shape, the deny-list, a prefix or a project file."""
    from importlib.machinery import PathFinder

    if not isinstance(path, str) or not _DOTTED.match(path):
        raise UntrustedConfig(f"refused `_target_` {path!r} at {key} in the stored config of {source}: not a dotted name; nothing was run")
    if _denied(path):
        raise _refuse_denied(path, key, source)
    if trust.allowed_prefix(path):
        if any(part.startswith("_") for part in path.split(".")):
            raise UntrustedConfig(f"refused `_target_` {path} at {key} in the stored config of {source}: a private name; nothing was run")
        return _Target(path, key, by_prefix=True)
    top = path.split(".")[0]
    spec = PathFinder.find_spec(top, [str(folder) for folder in folders])  # finds, never executes
    if spec is not None and _spec_inside(spec, trust):
        return _Target(path, key, by_prefix=False)
    where = "this folder" + (" or a --code-dir" if len(trust.roots) > 1 else "")
    hint = f" (the run's code_dir tag {ignored_tag} is not inside {where}, so it is not used)" if ignored_tag else ""
    raise UntrustedConfig(
        f"untrusted `_target_` {path} at {key} in the stored config of {source}: {top} is not a module in {where}{hint} "
        f"and not under a trusted prefix; if you trust it, pass --code-dir DIR (the folder holding {top}) or --trust {top}"
    )


def _spec_inside(spec, trust: Trust) -> bool:
    locations = [spec.origin] if spec.origin and spec.has_location else list(spec.submodule_search_locations or [])
    return bool(locations) and all(trust.inside(Path(location)) for location in locations)


def _check_resolved(target: _Target, trust: Trust, source: str) -> None:
    """After the static check passed for every target: import only trusted modules, and refuse a name that is
    an alias of a denied callable (`mymodule.T.load` where mymodule did `import torch as T`)."""
    import sys

    from hydra.utils import get_object

    try:
        obj = get_object(target.path)
    except Exception as error:  # ImportError, AttributeError, or the user's module failing to import
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ConfigError(
            f"cannot build `{target.key.removesuffix('._target_')}`: {target.path}: {reason}; "
            "if it lives in another folder, pass --code-dir DIR"
        ) from None
    origin = _origin(obj)
    if origin and _denied(origin):
        raise _refuse_denied(target.path, target.key, source, via=f" (= {origin})")
    if not target.by_prefix:
        module = sys.modules.get(target.path.split(".")[0])
        files = [getattr(module, "__file__", None)] if getattr(module, "__file__", None) else list(getattr(module, "__path__", []))
        if not files or not all(trust.inside(Path(file)) for file in files):
            raise UntrustedConfig(
                f"untrusted `_target_` {target.path} at {target.key} in the stored config of {source}: its module was "
                f"imported from {files[0] if files else 'nowhere'}, outside this folder and --code-dir; pass --code-dir DIR or --trust"
            )


def _origin(obj: Any) -> str:
    """Where an object was defined: module.qualname (a module: its name)."""
    import inspect

    if inspect.ismodule(obj):
        return obj.__name__
    owner = obj if hasattr(obj, "__qualname__") else type(obj)
    module = getattr(owner, "__module__", None) or ""
    return f"{module}.{getattr(owner, '__qualname__', '')}".strip(".")
