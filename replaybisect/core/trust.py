"""The trust boundary: a config read back from a tracking store is untrusted input, and a config is code.

Anyone who can write runs to a shared tracking server can write a run's `config.yaml` and its tags. A list of
trusted module prefixes cannot make that safe (`torch` alone holds functions that start processes, load code or
write files), so a stored config builds by **kind**: each key may build only what it needs.

- From a library (torch, or replaybisect's short registry), per key: `model`, `loss` and every object nested in a
  config (`_args_`, keyword arguments) only `torch.nn.Module` subclasses; `optim` only `torch.optim.Optimizer`
  subclasses; `scheduler` only LR scheduler subclasses; `data`/`val_data` only `Dataset` subclasses; functions
  (`train.step_fn`, `train.build`) only from the registry. Nothing else of a library is ever built.
- From the user's own code, anything it defines: modules that are real files under the working folder or a
  `--code-dir` (also in folders without `__init__.py`: a namespace package all of whose folders are there), never
  inside an MLflow artifact folder of any store; or an installed package the user named with `--trust`.

`admit` decides all of it before any call: first everything decidable without running anything: the names, the
modules located with `importlib`'s finders, and what the user's files bind, read with `ast` (a re-export such as
`mymod.T.load`, where mymod did `import torch as T`, is checked where it was defined: torch.load, refused); then,
only when every target passed, it imports the modules (torch's first, then the user's own) and checks each object's
kind and where it was defined. Loader flags (`weights_only: false`, ...), interpolations and the calls that load
pickles or code are refused whatever the user trusts.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from replaybisect.core import bindings
from replaybisect.core import config as config_mod
from replaybisect.errors import ConfigError, ReplayError, UntrustedConfig

LIBRARY_PREFIX = "torch"  # importable to check a kind; builds only the classes each key may build
MODEL_LIBRARY_PREFIX = "transformers"  # its model classes only (a Trainer run's model): never its loaders or datasets
OWN_PREFIX = "replaybisect"  # contributes only REGISTRY
BUILTIN_PREFIXES = (LIBRARY_PREFIX, MODEL_LIBRARY_PREFIX, OWN_PREFIX)
TRUST_ENV = "REPLAYBISECT_TRUST"  # comma-separated module prefixes, like --trust
CODE_DIR_ENV = "REPLAYBISECT_CODE_DIR"  # folders separated by os.pathsep, like --code-dir

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
ARTIFACT_FOLDER_NAMES = ("mlruns", "mlartifacts")  # MLflow's default artifact roots

# ---- what each key may build from a library -------------------------------------------------------------------
MODULE = ("a torch.nn.Module subclass", ("torch.nn.Module",))
OPTIMIZER = ("a torch.optim.Optimizer subclass", ("torch.optim.Optimizer",))
SCHEDULER = ("an LR scheduler subclass", ("torch.optim.lr_scheduler.LRScheduler", "torch.optim.lr_scheduler.ReduceLROnPlateau"))
DATASET = ("a torch.utils.data.Dataset subclass", ("torch.utils.data.Dataset",))
BLOCK = ("a Module, Optimizer, LR scheduler or Dataset subclass", MODULE[1] + OPTIMIZER[1] + SCHEDULER[1] + DATASET[1])
FUNCTION = ("a function from replaybisect's registry", ())

KINDS = {  # the key of a config's top-level object -> (what it is called, the base classes a library class needs)
    "model": MODULE, "loss": MODULE, "optim": OPTIMIZER, "scheduler": SCHEDULER, "data": DATASET, "val_data": DATASET,
    "train.step_fn": FUNCTION, "train.build": FUNCTION, "user": BLOCK,
}
NESTED = {"user": BLOCK}  # what an object nested inside a key's object may be; default MODULE

# replaybisect's registry: its built-in step functions, models and datasets, each with the keys it may fill.
_MODELS, _DATA = ("model", "user"), ("data", "val_data", "user")
REGISTRY = {
    "replaybisect.core.loop.supervised_step": ("train.step_fn", "user"),  # "user": a `replay train` DDP run's config
    "replaybisect.core.loop.sequence_step": ("train.step_fn", "user"),
    "replaybisect.verbs.train.ranks.train_step": ("train.step_fn",),
    "replaybisect.verbs.train.ranks.build": ("train.build",),
    "replaybisect.lightning.lightning_step": ("train.step_fn",),
    "replaybisect.lightning.build": ("train.build",),
    "replaybisect.hf.hf_step": ("train.step_fn",),
    "replaybisect.hf.build": ("train.build",),
    "replaybisect.models.MLP": _MODELS,
    "replaybisect.models.SmallCNN": _MODELS,
    "replaybisect.models.CharTransformer": _MODELS,
    "replaybisect.data.Digits": _DATA,
    "replaybisect.data.Blobs": _DATA,
    "replaybisect.data.CharText": _DATA,
}

# Refused in a stored config whatever the user trusts. A pattern matches a dotted path when any segment-aligned
# tail of the path starts with it, so re-exports (`mymodule.torch.load`) are caught without importing.
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
        "torch.utils.collect_env",
        # numpy's pickle loaders (np: the usual alias, reached through a module that imported it)
        "numpy.load", "numpy.lib.npyio", "numpy.lib.format", "numpy.ma.load", "np.load",
        # MLflow loads models with cloudpickle; replaybisect's own verbs compose and build unchecked configs
        "mlflow", "hydra", "omegaconf",
    )
)


@dataclass(frozen=True)
class Trust:
    """The user's decision: which folders hold their own code, and which installed packages are their code too."""

    roots: tuple[str, ...]  # resolved folders: the working folder first, then --code-dir and $REPLAYBISECT_CODE_DIR
    prefixes: tuple[str, ...]  # torch, replaybisect (by kind and registry), then --trust and $REPLAYBISECT_TRUST
    unsigned: tuple[str, ...] = ()  # runs replayed without a signature that verifies (--allow-unsigned RUN_ID)

    @classmethod
    def from_user(cls, code_dirs: tuple[str | Path, ...] | list = (), prefixes: tuple[str, ...] | list = (),
                  unsigned: tuple[str, ...] | list = ()) -> "Trust":
        """The working folder, `code_dirs` and `prefixes`, plus the environment's (one-line errors for bad ones), and
        the runs the user vouches for without a signature (never from the environment: a flag names each run)."""
        env_dirs = [part for part in os.environ.get(CODE_DIR_ENV, "").split(os.pathsep) if part.strip()]
        env_prefixes = [part for part in os.environ.get(TRUST_ENV, "").split(",") if part.strip()]
        roots = [Path.cwd().resolve()]
        for option, folders in (("--code-dir", code_dirs), (f"${CODE_DIR_ENV}", env_dirs)):
            for folder in folders:
                path = Path(folder).expanduser()
                if "\0" in str(folder) or not path.is_dir():
                    raise ReplayError(f"{option} {str(folder)[:200]!r} is not a folder; pass the folder that holds your modules")
                roots.append(path.resolve())
        trusted = list(BUILTIN_PREFIXES)
        for option, names in (("--trust", prefixes), (f"${TRUST_ENV}", env_prefixes)):
            for name in names:
                prefix = name.strip().rstrip(".")
                if not _DOTTED.match(prefix):
                    raise ReplayError(f"{option} {name!r} is not a module prefix; pass a dotted name such as mypkg or mypkg.models")
                trusted.append(prefix)
        for run_id in unsigned:
            if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
                raise ReplayError(f"--allow-unsigned {str(run_id)[:80]!r} is not a run id; pass the 32-character id of the "
                                  "run you vouch for (`replay runs` lists them)")
        return cls(roots=tuple(dict.fromkeys(map(str, roots))), prefixes=tuple(dict.fromkeys(trusted)),
                   unsigned=tuple(dict.fromkeys(unsigned)))

    def to_json(self) -> dict[str, list[str]]:
        """For worker processes: they inherit this decision, not the run's tag."""
        return {"roots": list(self.roots), "prefixes": list(self.prefixes), "unsigned": list(self.unsigned)}

    @classmethod
    def from_json(cls, data: dict[str, list[str]]) -> "Trust":
        return cls(roots=tuple(data["roots"]), prefixes=tuple(data["prefixes"]), unsigned=tuple(data.get("unsigned", ())))

    @property
    def own_prefixes(self) -> tuple[str, ...]:
        """The installed packages the user said are their own code (--trust). torch and replaybisect stay what
        they are (kinds and a registry) whatever --trust says: `--trust torch` does not make torch.load buildable."""
        return tuple(p for p in self.prefixes if not any(_under(p, builtin) for builtin in BUILTIN_PREFIXES))

    def import_folders(self, code_dir_tag: Optional[str], artifact_root: Optional[Path] = None) -> tuple[list[Path], bool]:
        """The folders a stored config's modules may come from, and whether the run's code_dir tag was ignored.
        The tag only picks among the user's own folders: its folder (and its parent, as `replay train` adds it)
        counts when it resolves inside a root and outside every artifact folder."""
        folders = [Path(root) for root in self.roots]
        if not code_dir_tag:
            return folders, False
        if len(code_dir_tag) > 4096 or "\0" in code_dir_tag or not Path(code_dir_tag).is_absolute():
            return folders, True
        try:
            tagged = Path(code_dir_tag).resolve()
            candidates = [folder for folder in (tagged, tagged.parent)
                          if folder.is_dir() and self.inside(folder) and not self.uploaded(folder, artifact_root)]
        except OSError:  # a name too long for the file system
            return folders, True
        if tagged not in candidates:
            return folders, True
        return list(dict.fromkeys([*candidates, *folders])), False

    def inside(self, path: Path) -> bool:
        real = Path(os.path.realpath(path))
        return any(real == Path(root) or real.is_relative_to(root) for root in self.roots)

    def uploaded(self, path: Path, artifact_root: Optional[Path] = None) -> bool:
        """Whether `path` lies where a tracking store keeps uploaded files: the store's own artifact root, a folder
        named like MLflow's default roots, or a run's `<run id>/artifacts` folder, of any store."""
        real = Path(os.path.realpath(path))
        if artifact_root is not None and real.is_relative_to(os.path.realpath(artifact_root)):
            return True
        root = next((Path(r) for r in self.roots if real == Path(r) or real.is_relative_to(r)), None)
        parts = real.relative_to(root).parts if root else real.parts
        return any(part in ARTIFACT_FOLDER_NAMES or (part == "artifacts" and index and _RUN_ID.match(parts[index - 1]))
                   for index, part in enumerate(parts))


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


@dataclass
class _Target:
    path: str
    key: str  # where the `_target_` is: model._args_[0]._target_
    kind: tuple[str, tuple[str, ...]]  # what a library object may be there
    source: str  # "library", "registry", "own" (a --trust package) or "file" (a module file in the user's folders)
    alias_of: Optional[str] = None  # the config's own `_target_` when this is what it re-exports (mymod.nn.Linear)
    optional: bool = False  # one of several `from X import *` a name may come from: not finding it there is no error

    @property
    def name(self) -> str:
        """The target as the messages name it: `mymod.nn.Foo (= torch.nn.Foo)` for a re-export."""
        return f"{self.alias_of} (= {self.path})" if self.alias_of else self.path


def admit(cfg, trust: Trust, code_dir_tag: Optional[str], source: str, artifact_root: Optional[Path] = None) -> list[Path]:
    """Check a stored config before anything of it is imported or built; the folders its modules import from.

    Raises UntrustedConfig (exit 2) naming the first refused target or flag, and how to trust it if it can be."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=False)  # interpolations stay text: they are refused, not resolved
    folders, tag_ignored = trust.import_folders(code_dir_tag, artifact_root)
    context = _Context(trust, folders, source, code_dir_tag if tag_ignored else None, artifact_root)
    targets = [target for path, key in _walk(tree, "", source) for target in _check_static(path, key, context)]
    for target in targets:  # libraries first: they need none of the user's folders on sys.path, and run none of their code
        if target.source in ("library", "registry"):
            _check_resolved(target, context)
    path_before = list(sys.path)
    config_mod.add_code_paths(*folders)
    try:
        for target in targets:  # the user's own code last: a --trust package may live in a --code-dir too
            if target.source in ("own", "file"):
                _check_resolved(target, context)
    except ReplayError:
        sys.path[:] = path_before  # a refused config leaves no folder of it on sys.path
        raise
    return folders


@dataclass
class _Context:
    trust: Trust
    folders: list[Path]
    source: str  # "run X", for the messages
    ignored_tag: Optional[str]
    artifact_root: Optional[Path]
    _parsed: dict = field(default_factory=dict)  # a module file -> what it binds at its top level

    def own_file(self, path: str | Path) -> bool:
        """A file (or a namespace package's folder) of the user's: inside their folders and outside every artifact folder."""
        return self.trust.inside(Path(path)) and not self.trust.uploaded(Path(path), self.artifact_root)

    @functools.cached_property
    def import_path(self) -> list[str]:
        """sys.path as it will be when the user's modules are imported (config.add_code_paths with these folders),
        so a module is located here where its import will find it."""
        path = list(sys.path)
        for folder in reversed([str(folder.resolve()) for folder in self.folders if folder.is_dir()]):
            if folder not in path:
                path.insert(0, folder)
        return path

    def top_level(self, module: "_Module") -> Optional[bindings.TopLevel]:
        """What `module` binds at its top level, read with ast (None: not Python source). SyntaxError and the like as
        its import would raise them."""
        if module.source is None:
            return None
        if module.source not in self._parsed:
            tree = bindings.parse(module.source)
            self._parsed[module.source] = bindings.top_level(tree, module.name, is_package=bool(module.portions))
        return self._parsed[module.source]


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
            f"refused interpolation {node[:80]!r} at {key} in the stored config of {source}: a recorded config is stored "
            "resolved, and an interpolation can read the environment or run a resolver; nothing was run"
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


def kind_at(key: str) -> tuple[str, tuple[str, ...]] | None:
    """What a library object may be at the `_target_` key `key` (None: this key builds nothing)."""
    node = key.removesuffix("._target_")
    top = next((name for name in KINDS if node == name or node.startswith((name + ".", name + "["))), None)
    if top is None:
        return None
    return KINDS[top] if node == top else NESTED.get(top, MODULE)


def _registry_allows(path: str, key: str) -> bool:
    node = key.removesuffix("._target_")
    return any(node == allowed or (allowed == "user" and node.startswith(("user.", "user["))) for allowed in REGISTRY.get(path, ()))


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


def _refuse_kind(path: str, key: str, kind: tuple[str, tuple[str, ...]] | None, source: str, why: str) -> UntrustedConfig:
    node = key.removesuffix("._target_")
    allowed = f"builds only {kind[0]} from a library" if kind else "builds no object"
    return UntrustedConfig(
        f"refused `_target_` {path} at {key} in the stored config of {source}: {why}; `{node}` {allowed} "
        "(your own code from this folder or a --code-dir may build anything it defines); nothing was run"
    )


def _check_static(path: Any, key: str, context: _Context, alias_of: Optional[str] = None, hops: int = 0) -> list[_Target]:
    """Everything decidable without importing: the name's shape, the deny-list, the key's kind, where it comes from,
    and, for the user's modules, what the name is bound to in their files (read with ast): a re-export is checked
    the same way where it was defined (`mymod.T.load` is torch.load). The target, and what it re-exports."""
    source, trust = context.source, context.trust
    if not isinstance(path, str) or not _DOTTED.match(path) or len(path) > 300:
        raise UntrustedConfig(f"refused `_target_` {str(path)[:80]!r} at {key} in the stored config of {source}: not a dotted name; nothing was run")
    shown = f"{alias_of} (= {path})" if alias_of else path  # what the messages name
    if _denied(path):
        raise _refuse_denied(alias_of or path, key, source, via=f" (= {_defined_at(path)})" if alias_of else "")
    kind = kind_at(key)
    if kind is None:
        raise _refuse_kind(shown, key, kind, source, "this key takes a value, not an object")
    if hops > MAX_HOPS:
        raise UntrustedConfig(f"refused `_target_` {alias_of or path} at {key} in the stored config of {source}: re-exported "
                              f"through more than {MAX_HOPS} modules; name it where it is defined; nothing was run")
    if _under(path, OWN_PREFIX):
        if not _registry_allows(path, key):
            raise _refuse_kind(shown, key, kind, source, "replaybisect builds only its registered step functions, models and datasets, each in its place")
        return [_Target(path, key, kind, "registry", alias_of)]
    if any(_under(path, prefix) for prefix in trust.own_prefixes):
        _refuse_private(path, key, source, shown)
        target = _Target(path, key, kind, "own", alias_of)
        return [target, *(_resolve(target, context, strict=False, hops=hops) or [])]
    if _under(path, LIBRARY_PREFIX) or _under(path, MODEL_LIBRARY_PREFIX):
        _refuse_private(path, key, source, shown)
        if not kind[1]:
            raise _refuse_kind(shown, key, kind, source, "a library function")
        if _under(path, MODEL_LIBRARY_PREFIX):  # a transformers model class, whatever else the key may build
            kind = (f"{MODULE[0]} (from transformers)", MODULE[1])
        return [_Target(path, key, kind, "library", alias_of)]
    target = _Target(path, key, kind, "file", alias_of)
    reexported = _resolve(target, context, strict=True, hops=hops)
    if reexported is not None:
        return [target, *reexported]
    where = "this folder" + (" or a --code-dir" if len(trust.roots) > 1 else "")
    top = path.split(".")[0]
    tag = "".join(c if c.isprintable() else "?" for c in context.ignored_tag[:200]) if context.ignored_tag else ""
    hint = f" (the run's code_dir tag {tag} is not inside {where}, so it is not used)" if context.ignored_tag else ""
    raise UntrustedConfig(
        f"untrusted `_target_` {shown} at {key} in the stored config of {source}: {top} is not a module file in {where}{hint}; "
        f"if you trust it, pass --code-dir DIR (the folder holding {top}) or --trust {top}"
    )


MAX_HOPS = 16  # re-exports followed from one `_target_` (a cycle of imports ends here)


class _NotBound(UntrustedConfig):
    """The name is bound nowhere at its module's top level (a `from X import *` it may come from says so too)."""


def _refuse_private(path: str, key: str, source: str, shown: Optional[str] = None) -> None:
    if any(part.startswith("_") for part in path.split(".")):
        raise UntrustedConfig(f"refused `_target_` {shown or path} at {key} in the stored config of {source}: a private name; nothing was run")


def _defined_at(path: str) -> str:
    """Where a denied library name was defined, for its message (torch.load is torch.serialization.load); torch is
    imported to say so, nothing else is."""
    if not _under(path, LIBRARY_PREFIX):
        return path
    try:
        from hydra.utils import get_object

        return _origin(get_object(path)) or path
    except Exception:
        return path


@dataclass(frozen=True)
class _Module:
    """A module located by importlib's PathFinder (which executes nothing)."""

    name: str  # dotted
    origin: Optional[str]  # its file (a package's __init__.py); None for a namespace package (folders without __init__.py)
    portions: tuple[str, ...]  # the folders its submodules are found in (none for a plain module)

    @property
    def source(self) -> Optional[str]:
        return self.origin if self.origin and self.origin.endswith(".py") else None


def _find(name: str, locations: list[str]) -> Optional[_Module]:
    """The module `name` as its import finds it in `locations` (sys.path, or its parent package's folders)."""
    from importlib.machinery import PathFinder

    # the last part only: PathFinder builds a namespace package's path from its parent's, which need not be imported
    spec = PathFinder.find_spec(name.rpartition(".")[2], locations)
    if spec is None:
        return None
    portions = tuple(spec.submodule_search_locations or ())  # now: a namespace path is recomputed when sys.path changes
    if spec.has_location and spec.origin and os.path.isfile(spec.origin):
        return _Module(name, spec.origin, portions)
    return _Module(name, None, portions) if portions and spec.origin in (None, "namespace") else None


def _own_module(module: Optional[_Module], context: _Context) -> bool:
    """A module of the user's: a real file inside their folders and outside every artifact folder, or a namespace
    package (a folder without __init__.py) every folder of which is such a folder."""
    if module is None:
        return False
    if module.origin:
        return context.own_file(module.origin)
    return all(os.path.isdir(folder) and context.own_file(folder) for folder in module.portions)


def _resolve(target: _Target, context: _Context, strict: bool, hops: int) -> Optional[list[_Target]]:
    """Locate the target's modules as its import will and read what the first name after them is bound to (ast), as
    hydra's `_locate` finds it: an attribute of the module first, else its submodule. Returns what it re-exports,
    checked where it was defined.

    `strict` (a module file of the user's): None when a module is not the user's (outside their folders, in an
    artifact folder); the name must be bound at its module's top level, by class, def, assignment or import.
    Otherwise (a --trust package): what can be read is followed, what cannot (an extension, a lazy module) is left
    to the import."""
    parts = target.path.split(".")
    module = _find(parts[0], context.import_path)
    if strict and not _own_module(module, context):
        return None
    found: list[_Target] = []
    for index in range(1, len(parts)):
        if module is None:
            return found
        name, rest = parts[index], parts[index + 1 :]
        top = None  # a namespace package binds nothing: the name must be a module in it
        if module.origin:
            top = _read(module, target, context)
            if top is None:  # an extension module: what it binds cannot be read before it runs
                if not strict:
                    return found
                raise UntrustedConfig(
                    f"refused `_target_` {target.alias_of or target.path} at {target.key} in the stored config of {context.source}: "
                    f"{module.origin} is not Python source, so what it binds cannot be read before it runs; nothing was run")
        if top is not None and name in top.names:
            reexported, submodule = _follow(top, module.name, name, rest, target, context, hops)
            found += reexported
            if not submodule:
                return found
        sub = _find(f"{module.name}.{name}", list(module.portions)) if module.portions else None
        if sub is not None:
            if strict and not _own_module(sub, context):
                return None
            module = sub
            continue
        if top is not None and top.stars:
            return found + _via_stars(top, module.name, ".".join(parts[index:]), target, context, hops)
        if not strict:
            return found
        raise _NotBound(
            f"refused `_target_` {target.alias_of or target.path} at {target.key} in the stored config of {context.source}: "
            f"{name} is not bound at the top level of {module.origin or module.portions[0]} (by class, def, assignment or "
            "import; read without running it), nor is it a module there; nothing was run")
    return found  # the path names a module: its import decides


def _read(module: _Module, target: _Target, context: _Context) -> Optional[bindings.TopLevel]:
    try:
        return context.top_level(module)
    except (SyntaxError, ValueError, OSError) as error:  # its import would fail the same way, before running any of it
        where = f" (line {error.lineno})" if isinstance(error, SyntaxError) and error.lineno else ""
        reason = " ".join(str(getattr(error, "msg", None) or error).split())[:200]
        raise ConfigError(f"cannot build `{target.key.removesuffix('._target_')}`: {target.path}: {module.origin} does not "
                          f"parse: {type(error).__name__}: {reason}{where}") from None


def _follow(top: bindings.TopLevel, module: str, name: str, rest: list[str], target: _Target, context: _Context,
            hops: int) -> tuple[list[_Target], bool]:
    """Every binding of `module.name` checked: defined there (class, def, assignment) is the user's own; a re-export
    (`import torch as T`, `from x import Y`, `load = T.load`) is checked where it was defined. Also whether the
    name is (also) the module's own submodule (`from . import model` in a package), which the caller walks into."""
    import builtins

    reexported: list[_Target] = []
    submodule = defined = False
    for binding in top.names[name]:
        if binding.how == "import":
            if binding.origin is None:
                raise UntrustedConfig(
                    f"refused `_target_` {target.alias_of or target.path} at {target.key} in the stored config of {context.source}: "
                    f"{module}.{name} is a relative import beyond its top-level package (line {binding.line}); nothing was run")
            if binding.origin == f"{module}.{name}":
                submodule = True
                continue
            origin = binding.origin
            if not _denied(origin) and not _locatable(origin.split(".")[0], context):
                continue  # `try: from fastlib import X` where fastlib is not there: X is bound by the other branch
        elif binding.how == "assign" and binding.origin:  # an alias of another name: resolved where that is bound
            head = binding.origin.split(".")[0]
            if head in top.names:
                origin = f"{module}.{binding.origin}"
            elif top.stars:  # `from torch import *` then `ld = load`
                try:
                    reexported += _via_stars(top, module, ".".join([binding.origin, *rest]), target, context, hops)
                except _NotBound:
                    pass  # bound nowhere: its import fails (NameError), or a builtin of that name, checked below
                else:
                    continue
                if not hasattr(builtins, head):
                    continue
                origin = f"builtins.{binding.origin}"
            elif hasattr(builtins, head):
                origin = f"builtins.{binding.origin}"
            else:
                continue  # bound nowhere: its import fails (NameError)
            if origin == f"{module}.{name}":
                defined = True  # `x = x`
                continue
        else:
            defined = True  # defined here: the user's own code
            continue
        reexported += _check_static(".".join([origin, *rest]), target.key, context, target.alias_of or target.path, hops + 1)
    return reexported, submodule and not defined


def _locatable(top: str, context: _Context) -> bool:
    """Whether a top-level module can be imported at all (found without running it)."""
    from importlib.machinery import FrozenImporter

    return (top in sys.modules or top in sys.builtin_module_names or FrozenImporter.find_spec(top) is not None
            or _find(top, context.import_path) is not None)


def _via_stars(top: bindings.TopLevel, module: str, dotted: str, target: _Target, context: _Context, hops: int) -> list[_Target]:
    """A name the module binds only through `from X import *`: each X it may come from, checked there (a module of
    the user's that does not bind it is not where it comes from; a library's import decides)."""
    found: list[_Target] = []
    bound = False
    for star in top.stars:
        if star is None:
            raise UntrustedConfig(
                f"refused `_target_` {target.alias_of or target.path} at {target.key} in the stored config of {context.source}: "
                f"{module} star-imports beyond its top-level package; nothing was run")
        try:
            candidates = _check_static(f"{star}.{dotted}", target.key, context, target.alias_of or target.path, hops + 1)
        except _NotBound:
            continue
        bound = True
        for candidate in candidates:
            candidate.optional = candidate.source in ("library", "own")
        found += candidates
    if not bound:
        raise _NotBound(
            f"refused `_target_` {target.alias_of or target.path} at {target.key} in the stored config of {context.source}: "
            f"{dotted.split('.')[0]} is bound at the top level of {module} by none of its `import *`; nothing was run")
    return found


def _check_resolved(target: _Target, context: _Context) -> None:
    """After every target passed the static check: import, then check the object itself before anything calls it.
    A library object must be a class of the key's kind; an alias of a denied callable is refused (`mymodule.T.load`
    where mymodule did `import torch as T`); the user's own modules must still come from their folders."""
    from hydra.utils import get_object

    try:
        obj = get_object(target.path)
    except Exception as error:  # ImportError, AttributeError, or the user's module failing to import
        if target.optional:  # one `from X import *` of several: the name comes from another
            return
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ConfigError(
            f"cannot build `{target.key.removesuffix('._target_')}`: {target.name}: {reason[:300]}; "
            "if it lives in another folder, pass --code-dir DIR"
        ) from None
    origin = _origin(obj)
    if origin and _denied(origin):
        raise _refuse_denied(target.alias_of or target.path, target.key, context.source, via=f" (= {origin})")
    if target.source == "file":
        _check_own_file(target, context)
    if target.source == "registry" or _defined_by_user(obj, target, context):
        return
    if not _of_kind(obj, target.kind[1]):
        what = "a function" if callable(obj) and not isinstance(obj, type) else f"{origin or type(obj).__name__}"
        raise _refuse_kind(target.name, target.key, target.kind, context.source, f"{what} is not {target.kind[0]}" if target.kind[1] else "a library function")


def _check_own_file(target: _Target, context: _Context) -> None:
    module = sys.modules.get(target.path.split(".")[0])
    files = [getattr(module, "__file__", None)] if getattr(module, "__file__", None) else list(getattr(module, "__path__", []))
    if not files or not all(context.own_file(f) for f in files):
        raise UntrustedConfig(
            f"untrusted `_target_` {target.name} at {target.key} in the stored config of {context.source}: its module was "
            f"imported from {files[0] if files else 'nowhere'}, outside this folder and --code-dir; pass --code-dir DIR or --trust"
        )


def _defined_by_user(obj: Any, target: _Target, context: _Context) -> bool:
    """Whether the object was defined by the user's own code: a module file in their folders, or a --trust package."""
    module_name = getattr(obj if hasattr(obj, "__module__") else type(obj), "__module__", None) or ""
    if any(_under(module_name, prefix) for prefix in context.trust.own_prefixes):
        return True
    if target.source != "file":
        return False
    module_file = getattr(sys.modules.get(module_name), "__file__", None)
    return bool(module_file) and context.own_file(module_file)


def _of_kind(obj: Any, bases: tuple[str, ...]) -> bool:
    from hydra.utils import get_class

    return isinstance(obj, type) and any(issubclass(obj, get_class(base)) for base in bases)


def _origin(obj: Any) -> str:
    """Where an object was defined: module.qualname (a module: its name)."""
    import inspect

    if inspect.ismodule(obj):
        return obj.__name__
    owner = obj if hasattr(obj, "__qualname__") else type(obj)
    module = getattr(owner, "__module__", None) or ""
    return f"{module}.{getattr(owner, '__qualname__', '')}".strip(".")
