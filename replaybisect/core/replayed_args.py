"""A script's recorded command line, replayed as data: what a replay may hand a re-entered script as `sys.argv`.

The run's signature (core/provenance.py) already proves the arguments are the ones recorded; this holds whatever the
signature says (a run replayed with --allow-unsigned, a recorder's bug). A `@hydra.main` app reads its argv as
overrides, and Hydra builds whatever `hydra.*` names (callbacks, launchers, its output and log folders) before the
script's first line, where no trust check of ours sees it. So for a Hydra app: no Hydra flag but --config-name with a
plain name, no override of `hydra` or its groups, no interpolation, and an addition (`+key`) only of a key the
recorded run's own config has (a plain `key=value` can only change what the app's config already holds); Hydra's output folder is the replay's scratch folder (core/reentry.py).
An argparse script's arguments are its own business: it runs with the replay's write guard (core/reentry.py).
Light: no torch, no MLflow.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Optional

from replaybisect.errors import UntrustedConfig

_OVERRIDE = re.compile(r"^(?P<prefix>\+\+|\+|~)?(?P<key>[A-Za-z_][\w\-]*(?:[./][A-Za-z_][\w\-]*)*)(?:@[\w.\-]*)?(?P<value>=.*)?$",
                       re.DOTALL)
_CONFIG_NAME = re.compile(r"^[A-Za-z0-9_][\w\-]*(?:/[A-Za-z0-9_][\w\-]*)*(?:\.yaml)?$")
CONFIG_NAME_FLAGS = ("--config-name", "-cn")
_MISSING = object()


def admit(path: Path, script: dict[str, Any], user_config: Any, run_id: str) -> bool:
    """Check the stored command line of the script at `path` before it runs again; whether it is a Hydra app (then
    the replay appends its own output-folder overrides). One-line UntrustedConfig for an argument it may not take."""
    declared = bool(script.get("hydra", False))
    if not declared and is_hydra_app(path):
        raise UntrustedConfig(f"refused to run {path.name} again for run {run_id}: it is a @hydra.main app, but its stored "
                              "train.script says it is not one (so Hydra would choose its own output folder): the stored "
                              "config was changed after recording; nothing was run")
    if declared:
        recorded = _as_container(user_config)
        for argument in _overrides(script["args"], run_id, path.name):
            _check_override(argument, recorded, run_id, path.name)
    return declared


def is_hydra_app(path: Path) -> bool:
    """Whether the script's source decorates a function with `hydra.main` (read with ast: nothing of it runs)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return False
    aliases = {"hydra"}  # names bound to the hydra module, or to hydra.main itself
    mains: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {alias.asname or alias.name for alias in node.names if alias.name == "hydra"}
        elif isinstance(node, ast.ImportFrom) and node.module == "hydra":
            mains |= {alias.asname or alias.name for alias in node.names if alias.name == "main"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                called = decorator.func if isinstance(decorator, ast.Call) else decorator
                if (isinstance(called, ast.Attribute) and called.attr == "main" and isinstance(called.value, ast.Name)
                        and called.value.id in aliases) or (isinstance(called, ast.Name) and called.id in mains):
                    return True
    return False


def _overrides(args: list[str], run_id: str, name: str) -> list[str]:
    """The overrides of a Hydra command line; a flag other than --config-name PLAIN_NAME is refused."""
    overrides, pending = [], None
    for argument in args:
        if pending is not None:
            _check_config_name(argument, run_id, name)
            pending = None
        elif argument in CONFIG_NAME_FLAGS:
            pending = argument
        elif argument.startswith("--config-name="):
            _check_config_name(argument.split("=", 1)[1], run_id, name)
        elif argument.startswith("-"):
            raise _refused(argument, "a Hydra flag (it picks config files, reruns a pickled job or changes how the app runs)",
                           run_id, name)
        else:
            overrides.append(argument)
    if pending is not None:
        raise _refused(pending, "a flag without its value", run_id, name)
    return overrides


def _check_config_name(value: str, run_id: str, name: str) -> None:
    if not _CONFIG_NAME.match(value) or ".." in value:
        raise _refused(value, "not a plain config name (a path could pick config files outside the app's)", run_id, name)


def _check_override(argument: str, recorded: Any, run_id: str, name: str) -> None:
    match = _OVERRIDE.match(argument)
    if match is None:
        raise _refused(argument, "not a Hydra override of the app's config", run_id, name)
    prefix, key, value = match["prefix"] or "", match["key"], match["value"] or ""
    if not value and prefix != "~":
        raise _refused(argument, "not a Hydra override of the app's config (key=value)", run_id, name)
    top = re.split(r"[./]", key, maxsplit=1)[0]
    if top == "hydra":
        raise _refused(argument, "an override of Hydra's own settings (its callbacks, launcher and folders run code "
                       "and choose where files are written)", run_id, name)
    if "${" in value:
        raise _refused(argument, "an interpolation (it can read the environment or run a resolver)", run_id, name)
    if prefix in ("+", "++") and _select(recorded, key.replace("/", ".")) is _MISSING:
        raise _refused(argument, "it adds a key the recorded run's config does not have", run_id, name)


def _refused(argument: str, why: str, run_id: str, name: str) -> UntrustedConfig:
    shown = "".join(c if c.isprintable() else "?" for c in argument[:120])
    return UntrustedConfig(f"refused to run {name} again for run {run_id} with the argument {shown!r}: {why}; the run's "
                           "stored command line was changed after it was recorded (record the run again); nothing was run")


def _as_container(node: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=False)
    return node if isinstance(node, (dict, list)) else {}


def _select(tree: Any, dotted: str) -> Any:
    node: Optional[Any] = tree
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node
