"""replaybisect: replay, ablate and bisect failing PyTorch training runs recorded to MLflow.

The same work as the `replay` command, from Python (a notebook, a script, a CI job)::

    import replaybisect as rb

    run = rb.train(["train.steps=200", "optim.lr=3"])         # TrainResult (run.status == "nonfinite")
    report = rb.find_nan(run.run_id)                           # NanReport: category, module, op, suggestion
    fix = rb.ablate(run.run_id, ["lr", "clip", "precision"])   # AblationResult: a verdict per arm
    rb.diagnose(run.run_id).findings                           # what the recorded curves show
    rb.check(["model=cnn"]).checks                             # the checklist on a config (or run_id=...)
    rb.bisect("v1.0", "main", repo=".").first_bad              # the commit that broke convergence

Every function takes `tracking_uri` (default: $MLFLOW_TRACKING_URI, else ./mlflow.db) and, where the
command records its findings as MLflow runs and artifacts, `publish` (True: as the command does).
Bad input raises `ReplayError` (its message says what to do). Importing this package is cheap: torch
and MLflow load on the first call.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from replaybisect.errors import ReplayError

if TYPE_CHECKING:
    from replaybisect.verbs.ablate.engine import AblationResult
    from replaybisect.verbs.bisect.engine import BisectResult
    from replaybisect.verbs.check.engine import CheckReport
    from replaybisect.verbs.diagnose.engine import Diagnosis
    from replaybisect.verbs.nan.engine import NanReport
    from replaybisect.verbs.train.engine import TrainResult

__version__ = "0.1.0"

__all__ = [
    "train", "find_nan", "ablate", "bisect", "check", "diagnose", "Recorder", "NonFiniteStep",
    "TrainResult", "NanReport", "AblationResult", "BisectResult", "CheckReport", "Diagnosis",
    "ReplayError",
]

# result types, imported on first use (they pull in torch)
_RESULT_TYPES = {
    "TrainResult": "replaybisect.verbs.train.engine",
    "NanReport": "replaybisect.verbs.nan.engine",
    "AblationResult": "replaybisect.verbs.ablate.engine",
    "BisectResult": "replaybisect.verbs.bisect.engine",
    "CheckReport": "replaybisect.verbs.check.engine",
    "Diagnosis": "replaybisect.verbs.diagnose.engine",
    "Recorder": "replaybisect.user_loop",  # record your own training loop
    "NonFiniteStep": "replaybisect.user_loop",
}


def __getattr__(name: str):
    if name in _RESULT_TYPES:
        import importlib

        return getattr(importlib.import_module(_RESULT_TYPES[name]), name)
    raise AttributeError(f"module 'replaybisect' has no attribute {name!r}")


def _store(tracking_uri: Optional[str]):
    """The store a recording function writes to: created when new."""
    from replaybisect.store import open_store

    return open_store(tracking_uri)


def _run_store(tracking_uri: Optional[str], run_id: str):
    """The store holding `run_id`, for a function that examines it: looked up first, and never created."""
    from replaybisect.store import locate_store, open_store, require_run

    location = locate_store(tracking_uri)
    require_run(location, run_id)
    return open_store(location.uri, create=False)


def _arguments(*, tracking_uri=None, run_id="-", step=None, run_name=None) -> None:
    """The arguments every function shares, checked at the call: one-line ReplayErrors (run_id "-": not taken)."""
    from replaybisect.core import arguments

    arguments.tracking_uri(tracking_uri)
    if run_id != "-":
        arguments.run_id(run_id)
    arguments.count(step, "step", optional=True)
    arguments.text(run_name, "run_name")


def _trust(code_dirs: Sequence[str | Path], trust: Sequence[str]):
    from replaybisect.core.trust import Trust

    return Trust.from_user([str(d) for d in code_dirs], list(trust))


def train(
    overrides: Sequence[str] = (),
    *,
    config_dir: str | Path | None = None,
    config_name: str = "config",
    tracking_uri: Optional[str] = None,
    run_name: Optional[str] = None,
) -> "TrainResult":
    """Train a Hydra config with the recorder on (as `replay train`). `config_dir` is your config folder
    (default: the built-in example); `overrides` are Hydra overrides. A run that stops on a non-finite loss
    returns with `status == "nonfinite"` (the command exits 3)."""
    _arguments(tracking_uri=tracking_uri, run_name=run_name)
    from replaybisect.core import config as config_mod
    from replaybisect.report import run_label
    from replaybisect.verbs.train.engine import train as train_run

    cfg = config_mod.compose(config_dir, config_name, list(overrides))
    code_folder = Path(config_dir).resolve() if config_dir else Path.cwd()
    return train_run(cfg, lambda: _store(tracking_uri), run_name=run_name or run_label(cfg, config_dir, config_name),
                     code_folder=code_folder)


def find_nan(
    run_id: str,
    step: Optional[int] = None,
    *,
    tracking_uri: Optional[str] = None,
    code_dirs: Sequence[str | Path] = (),
    trust: Sequence[str] = (),
    publish: bool = True,
) -> "NanReport":
    """Where the first NaN/Inf of a recorded run came from, and why (as `replay nan`): the state before the
    failing step is restored, the replay checked against the logged losses, and the step re-run under probes.
    `code_dirs`/`trust` say which of the stored config's `_target_`s may be built (see the README's trust model)."""
    _arguments(tracking_uri=tracking_uri, run_id=run_id, step=step)
    from replaybisect.verbs.nan.engine import find_nan as find

    store = _run_store(tracking_uri, run_id)
    report = find(store, run_id, step, trust=_trust(code_dirs, trust))
    if publish:
        from replaybisect.verbs.nan.report import publish as publish_report

        publish_report(store, report)
    return report


def ablate(
    run_id: str,
    arms: Optional[Sequence[str] | str] = None,
    *,
    from_step: Optional[int] = None,
    horizon: Optional[int] = None,
    workers: Optional[int] = None,
    tracking_uri: Optional[str] = None,
    code_dirs: Sequence[str | Path] = (),
    trust: Sequence[str] = (),
    publish: bool = True,
    patch: Optional[str | Path] = None,
    sweep: Optional[str] = None,
) -> "AblationResult":
    """Replay the failure once unchanged and once per one-variable change (as `replay ablate`); each arm gets a
    verdict (fixes | delays | no-effect | worse). Arms take values (`"lr=x0.3"`, `"clip=265"`); `patch` replays your
    changed module(s) as one more arm; `sweep="lr"` (or "clip") searches the stable range instead of arms.
    Default arms: lr, clip, precision (none with `patch` or `sweep`)."""
    _arguments(tracking_uri=tracking_uri, run_id=run_id)
    from replaybisect.verbs.ablate import engine

    store = _run_store(tracking_uri, run_id)
    options = {"horizon": horizon} if horizon is not None else {}
    if arms is None and patch is None and sweep is None:
        arms = ("lr", "clip", "precision")
    result = engine.ablate(
        store, run_id, list(arms) if arms is not None and not isinstance(arms, str) else arms,
        from_step=from_step, workers=workers, trust=_trust(code_dirs, trust), patch=patch, sweep=sweep, **options,
    )
    if publish:
        from replaybisect.verbs.ablate.report import publish as publish_report

        publish_report(store, result)
    return result


def bisect(
    good: str,
    bad: str,
    *,
    repo: str | Path = ".",
    overrides: Sequence[str] = (),
    config_dir: str = "conf",
    config_name: str = "config",
    steps: Optional[int] = None,
    seeds: int = 3,
    workers: int = 1,
    cmd: Optional[str] = None,
    tracking_uri: Optional[str] = None,
    publish: bool = True,
) -> "BisectResult":
    """The first commit on BAD's first-parent history that breaks convergence (as `replay bisect`). Trials run in
    a private clone: the repository's working tree, index and branches are never touched."""
    _arguments(tracking_uri=tracking_uri)
    from replaybisect.verbs.bisect.engine import bisect as run_bisect

    result = run_bisect(
        good, bad, repo=repo, config_dir=config_dir, config_name=config_name, overrides=list(overrides),
        steps=steps, seeds=seeds, workers=workers, cmd=cmd, tracking_uri=tracking_uri,
    )
    if publish:
        from replaybisect.verbs.bisect.report import publish as publish_report

        publish_report(_store(result.tracking_uri), result)
    return result


def check(
    overrides: Sequence[str] = (),
    *,
    run_id: Optional[str] = None,
    step: Optional[int] = None,
    config_dir: str | Path | None = None,
    config_name: str = "config",
    only: Optional[Sequence[str]] = None,
    tracking_uri: Optional[str] = None,
    code_dirs: Sequence[str | Path] = (),
    trust: Sequence[str] = (),
    publish: bool = True,
) -> "CheckReport":
    """The 5-minute checklist (as `replay check`) on a config (`overrides`, `config_dir`) or on a recorded run
    (`run_id`, at a healthy snapshot, or the one at or before `step`): overfit one batch, data sanity, loss/head,
    initialization, activations, gradient flow, LR range."""
    _arguments(tracking_uri=tracking_uri, run_id=run_id if run_id is not None else "-", step=step)
    from replaybisect.verbs.check.engine import CheckOptions
    from replaybisect.verbs.check.engine import check as run_check
    from replaybisect.core import config as config_mod

    if run_id and (overrides or config_dir is not None):
        raise ReplayError("pass either run_id or a config (config_dir/overrides), not both")
    from replaybisect.verbs.check.engine import select

    options = CheckOptions(only=list(only) if only else None)
    select(options.only)  # an unknown check is bad input before any store is opened
    cfg = None if run_id else config_mod.compose(config_dir, config_name, list(overrides))
    store = _run_store(tracking_uri, run_id) if run_id else None  # a config needs a store only to publish
    report = run_check(store, cfg=cfg, run_id=run_id, step=step, options=options, trust=_trust(code_dirs, trust) if run_id else None)
    if publish:
        from replaybisect.verbs.check.report import publish as publish_report

        store = store or _store(tracking_uri)
        code_folder = None if run_id else (Path(config_dir).resolve() if config_dir else Path.cwd())
        publish_report(store, report, cfg, code_folder=code_folder)
    return report


def diagnose(run_id: str, *, tracking_uri: Optional[str] = None, publish: bool = True) -> "Diagnosis":
    """Read a run's recorded curves (no replay) and name the pathology and the next command (as `replay diagnose`)."""
    _arguments(tracking_uri=tracking_uri, run_id=run_id)
    from replaybisect.verbs.diagnose.engine import analyse, load_curves

    store = _run_store(tracking_uri, run_id)
    curves = load_curves(store, run_id)
    result = analyse(curves)
    if publish:
        from replaybisect.verbs.diagnose.report import publish as publish_report

        publish_report(store, result, curves)
    return result
