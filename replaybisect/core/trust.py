"""The trust boundary: a config read back from a tracking store is untrusted input, and a config is code.

Anyone who can write runs to a shared tracking server can write a run's `config.yaml` and its tags. A list of
trusted module prefixes cannot make that safe (`torch` alone holds functions that start processes, load code or
write files), so a stored config builds by **kind**: each key may build only what it needs.

- From a library (torch, or replaybisect's short registry), per key: `model`, `loss` and every object nested in a
  config (`_args_`, keyword arguments) only `torch.nn.Module` subclasses; `optim` only `torch.optim.Optimizer`
  subclasses; `scheduler` only LR scheduler subclasses; `data`/`val_data` only `Dataset` subclasses; functions
  (`train.step_fn`, `train.build`) only from the registry. Nothing else of a library is ever built.
- From the user's own code, anything it defines: modules that are real files (never a namespace package) under
  the working folder or a `--code-dir`, never inside an MLflow artifact folder of any store; or an installed
  package the user named with `--trust`.

`admit` decides all of it before any call: first everything decidable from the names alone (and `importlib`'s
finders, which execute nothing), then, only when every target passed, it imports the modules (torch's, the
user's own) and checks each object's kind and where it was defined. Loader flags (`weights_only: false`, ...),
interpolations and the calls that load pickles or code are refused whatever the user trusts.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

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

    def allowed_prefix(self, target: str) -> bool:
        return any(_under(target, prefix) for prefix in self.prefixes)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


@dataclass
class _Target:
    path: str
    key: str  # where the `_target_` is: model._args_[0]._target_
    kind: tuple[str, tuple[str, ...]]  # what a library object may be there
    source: str  # "library", "registry", "own" (a --trust package) or "file" (a module file in the user's folders)


def admit(cfg, trust: Trust, code_dir_tag: Optional[str], source: str, artifact_root: Optional[Path] = None) -> list[Path]:
    """Check a stored config before anything of it is imported or built; the folders its modules import from.

    Raises UntrustedConfig (exit 2) naming the first refused target or flag, and how to trust it if it can be."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=False)  # interpolations stay text: they are refused, not resolved
    folders, tag_ignored = trust.import_folders(code_dir_tag, artifact_root)
    context = _Context(trust, folders, source, code_dir_tag if tag_ignored else None, artifact_root)
    targets = [_check_static(path, key, context) for path, key in _walk(tree, "", source)]
    for target in targets:  # libraries first: they need none of the user's folders on sys.path
        if target.source != "file":
            _check_resolved(target, context)
    path_before = list(sys.path)
    config_mod.add_code_paths(*folders)
    try:
        for target in targets:
            if target.source == "file":
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

    def own_file(self, path: str | Path) -> bool:
        """A file of the user's: inside their folders and outside every artifact folder."""
        return self.trust.inside(Path(path)) and not self.trust.uploaded(Path(path), self.artifact_root)


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


def _check_static(path: Any, key: str, context: _Context) -> _Target:
    """Everything decidable without importing: the name's shape, the deny-list, the key's kind, where it comes from."""
    source, trust = context.source, context.trust
    if not isinstance(path, str) or not _DOTTED.match(path) or len(path) > 300:
        raise UntrustedConfig(f"refused `_target_` {str(path)[:80]!r} at {key} in the stored config of {source}: not a dotted name; nothing was run")
    if _denied(path):
        raise _refuse_denied(path, key, source)
    kind = kind_at(key)
    if kind is None:
        raise _refuse_kind(path, key, kind, source, "this key takes a value, not an object")
    if _under(path, OWN_PREFIX):
        if not _registry_allows(path, key):
            raise _refuse_kind(path, key, kind, source, "replaybisect builds only its registered step functions, models and datasets, each in its place")
        return _Target(path, key, kind, "registry")
    if any(_under(path, prefix) for prefix in trust.own_prefixes):
        _refuse_private(path, key, source)
        return _Target(path, key, kind, "own")
    if _under(path, LIBRARY_PREFIX) or _under(path, MODEL_LIBRARY_PREFIX):
        _refuse_private(path, key, source)
        if not kind[1]:
            raise _refuse_kind(path, key, kind, source, "a library function")
        if _under(path, MODEL_LIBRARY_PREFIX):  # a transformers model class, whatever else the key may build
            kind = (f"{MODULE[0]} (from transformers)", MODULE[1])
        return _Target(path, key, kind, "library")
    if _module_files(path, context):
        return _Target(path, key, kind, "file")
    where = "this folder" + (" or a --code-dir" if len(trust.roots) > 1 else "")
    top = path.split(".")[0]
    tag = "".join(c if c.isprintable() else "?" for c in context.ignored_tag[:200]) if context.ignored_tag else ""
    hint = f" (the run's code_dir tag {tag} is not inside {where}, so it is not used)" if context.ignored_tag else ""
    raise UntrustedConfig(
        f"untrusted `_target_` {path} at {key} in the stored config of {source}: {top} is not a module file in {where}{hint}; "
        f"if you trust it, pass --code-dir DIR (the folder holding {top}) or --trust {top}"
    )


def _refuse_private(path: str, key: str, source: str) -> None:
    if any(part.startswith("_") for part in path.split(".")):
        raise UntrustedConfig(f"refused `_target_` {path} at {key} in the stored config of {source}: a private name; nothing was run")


def _module_files(path: str, context: _Context) -> list[str]:
    """The files of the modules a dotted path imports from the user's folders (found, never executed): each a real
    file inside a root and outside every artifact folder. Empty when any is not (a namespace package, an upload)."""
    from importlib.machinery import PathFinder

    parts = path.split(".")
    locations: list[str] = [str(folder) for folder in context.folders]
    files = []
    for end in range(1, len(parts)):  # the last part is the object, never a module
        spec = PathFinder.find_spec(".".join(parts[:end]), locations)
        if spec is None:
            break
        if not (spec.has_location and spec.origin and os.path.isfile(spec.origin)):
            return []  # a namespace package: any folder of that name, an artifact folder included
        origin = Path(spec.origin)
        if not context.own_file(origin):
            return []
        files.append(str(origin))
        if not spec.submodule_search_locations:
            break
        locations = list(spec.submodule_search_locations)
    return files


def _check_resolved(target: _Target, context: _Context) -> None:
    """After every target passed the static check: import, then check the object itself before anything calls it.
    A library object must be a class of the key's kind; an alias of a denied callable is refused (`mymodule.T.load`
    where mymodule did `import torch as T`); the user's own modules must still come from their folders."""
    from hydra.utils import get_object

    try:
        obj = get_object(target.path)
    except Exception as error:  # ImportError, AttributeError, or the user's module failing to import
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ConfigError(
            f"cannot build `{target.key.removesuffix('._target_')}`: {target.path}: {reason[:300]}; "
            "if it lives in another folder, pass --code-dir DIR"
        ) from None
    origin = _origin(obj)
    if origin and _denied(origin):
        raise _refuse_denied(target.path, target.key, context.source, via=f" (= {origin})")
    if target.source == "file":
        _check_own_file(target, context)
    if target.source == "registry" or _defined_by_user(obj, target, context):
        return
    if not _of_kind(obj, target.kind[1]):
        what = "a function" if callable(obj) and not isinstance(obj, type) else f"{origin or type(obj).__name__}"
        raise _refuse_kind(target.path, target.key, target.kind, context.source, f"{what} is not {target.kind[0]}" if target.kind[1] else "a library function")


def _check_own_file(target: _Target, context: _Context) -> None:
    module = sys.modules.get(target.path.split(".")[0])
    files = [getattr(module, "__file__", None)] if getattr(module, "__file__", None) else list(getattr(module, "__path__", []))
    if not files or not all(context.own_file(f) for f in files):
        raise UntrustedConfig(
            f"untrusted `_target_` {target.path} at {target.key} in the stored config of {context.source}: its module was "
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
