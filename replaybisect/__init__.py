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
Bad input raises `ReplayError` (its message says what to do): each verb's request (verbs/<verb>/request.py) checks
the function's arguments as it checks the command's, so both refuse the same input in the same words. Importing
this package is cheap: torch and MLflow load on the first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from replaybisect.core.jobs import settings_from
from replaybisect.errors import ReplayError
from replaybisect.request import front_door
from replaybisect.verbs.ablate.request import AblateRequest
from replaybisect.verbs.bisect.request import BisectRequest
from replaybisect.verbs.check.request import CheckRequest
from replaybisect.verbs.diagnose.request import DiagnoseRequest
from replaybisect.verbs.nan.request import NanRequest
from replaybisect.verbs.memory.request import MemoryRequest
from replaybisect.verbs.profile.request import ProfileRequest
from replaybisect.verbs.verify.request import VerifyRequest
from replaybisect.verbs.train.request import TrainRequest

if TYPE_CHECKING:
    from replaybisect.verbs.ablate.engine import AblationResult
    from replaybisect.verbs.bisect.engine import BisectResult
    from replaybisect.verbs.check.engine import CheckReport
    from replaybisect.verbs.diagnose.engine import Diagnosis
    from replaybisect.verbs.memory.engine import MemoryReport
    from replaybisect.verbs.profile.engine import ProfileReport
    from replaybisect.verbs.verify.engine import VerifyReport
    from replaybisect.verbs.nan.engine import NanReport
    from replaybisect.verbs.train.engine import TrainResult

__version__ = "0.1.0"

__all__ = [
    "train", "find_nan", "ablate", "bisect", "check", "diagnose", "profile", "memory", "verify", "Recorder", "NonFiniteStep", "replaying",
    "TrainResult", "NanReport", "AblationResult", "BisectResult", "CheckReport", "Diagnosis", "ProfileReport", "MemoryReport", "VerifyReport",
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
    "ProfileReport": "replaybisect.verbs.profile.engine",
    "MemoryReport": "replaybisect.verbs.memory.engine",
    "VerifyReport": "replaybisect.verbs.verify.engine",
    "Recorder": "replaybisect.record.recorder",  # record your own training loop
    "NonFiniteStep": "replaybisect.errors",
}


def __getattr__(name: str):
    if name in _RESULT_TYPES:
        import importlib

        return getattr(importlib.import_module(_RESULT_TYPES[name]), name)
    raise AttributeError(f"module 'replaybisect' has no attribute {name!r}")


def replaying() -> bool:
    """True while a replay runs your script again (a run recorded without `build`): skip writes into your
    folders (checkpoints, logs), which the replay refuses, with `if not replaybisect.replaying():`."""
    from replaybisect.core.reentry import replaying as replaying_now

    return replaying_now()


def _store(tracking_uri: Optional[str]):
    """The store a recording function writes to: created when new."""
    from replaybisect.store import open_store

    return open_store(tracking_uri)


def _run_store(tracking_uri: Optional[str], run_id: str):
    """The store holding `run_id`, for a function that examines it: looked up first, and never created."""
    from replaybisect.store import locate_store, open_store, require_run

    location = locate_store(tracking_uri)
    require_run(location, run_id)
    return open_store(location.uri, create=False, read_once=True)


@front_door(TrainRequest, positional=("overrides",), internal=("parent_run_id", "kind", "tags"))
def train(request: TrainRequest) -> "TrainResult":
    """Train a Hydra config with the recorder on (as `replay train`). `config_dir` is your config folder
    (default: the built-in example); `overrides` are Hydra overrides. A run that stops on a non-finite loss
    returns with `status == "nonfinite"` (the command exits 3)."""
    from replaybisect.core import config as config_mod
    from replaybisect.report import run_label
    from replaybisect.verbs.train.engine import train as train_run

    cfg = config_mod.compose(request.config_dir, request.config_name, list(request.overrides))
    return train_run(cfg, lambda: _store(request.tracking_uri),
                     run_name=request.run_name or run_label(cfg, request.config_dir, request.config_name),
                     extra_tags=request.run_tags(), code_folder=request.code_folder)


@front_door(NanRequest, positional=("run_id", "step"))
def find_nan(request: NanRequest) -> "NanReport":
    """Where the first NaN/Inf of a recorded run came from, and why (as `replay nan`): the state before the
    failing step is restored, the replay checked against the logged losses, and the step re-run under probes.
    `device` replays elsewhere than the run's train.device; `code_dirs`/`trust` say which of the stored config's
    `_target_`s may be built and `allow_unsigned` (the run's id) replays a run whose signature does not verify (see
    the trust model); `nproc` replays a distributed run over the real collective, one process per recorded rank
    (as `--nproc`)."""
    from replaybisect.verbs.nan.ranked import answer

    store = _run_store(request.tracking_uri, request.run_id)
    report = answer(store, request)
    if request.publish:
        from replaybisect.verbs.nan.report import publish as publish_report

        publish_report(store, report)
    return report


# the job settings by name (core/jobs.py's SETTINGS), as `submitit={"partition": "gpu", ...}`
SUBMITIT = {"submitit": ("jobs", settings_from, Optional[dict])}


@front_door(AblateRequest, positional=("run_id", "arms"), aliases=SUBMITIT)
def ablate(request: AblateRequest) -> "AblationResult":
    """Replay the failure once unchanged and once per one-variable change (as `replay ablate`); each arm gets a
    verdict (fixes | delays | no-effect | worse). Arms take values (`"lr=x0.3"`, `"clip=265"`); `patch` replays your
    changed module(s) as one more arm; `sweep="lr"` (or "clip") searches the stable range instead of arms.
    Default arms: those `replay ablate` runs with none named (`replay ablate --list`; none with `patch` or `sweep`).
    `executor="submitit"` runs the arms as SLURM jobs; `submitit` holds the command's job options by name: cluster,
    partition, time_min, gpus, cpus, mem_gb, account, slurm, executor_folder."""
    from replaybisect.verbs.ablate.engine import ablate_request

    store = _run_store(request.tracking_uri, request.run_id)
    result = ablate_request(store, request)
    if request.publish:
        from replaybisect.verbs.ablate.report import publish as publish_report

        publish_report(store, result)
    return result


@front_door(BisectRequest, positional=("good", "bad"), aliases=SUBMITIT)
def bisect(request: BisectRequest) -> "BisectResult":
    """The first commit on BAD's first-parent history that breaks convergence (as `replay bisect`). Trials run in
    a private clone: the repository's working tree, index and branches are never touched. `executor="submitit"`
    trains each trial as a job (SLURM, else submitit's local executor); `submitit` holds the job options by name,
    as for `ablate`."""
    from replaybisect.verbs.bisect.engine import bisect as run_bisect

    result = run_bisect(**request.arguments())
    if request.publish:
        from replaybisect.verbs.bisect.report import publish as publish_report

        publish_report(_store(result.tracking_uri), result)
    return result


@front_door(CheckRequest, positional=("overrides",))
def check(request: CheckRequest) -> "CheckReport":
    """The 5-minute checklist (as `replay check`) on a config (`overrides`, `config_dir`) or on a recorded run
    (`run_id`, at a healthy snapshot, or the one at or before `step`): overfit one batch, data sanity, loss/head,
    initialization, activations, gradient flow, LR range (from `lr_min` to `lr_max` in `lr_steps`)."""
    from replaybisect.core import config as config_mod
    from replaybisect.verbs.check.engine import check as run_check

    run_id = request.run_id
    cfg = None if run_id else config_mod.compose(request.config_dir, request.config_name, list(request.overrides))
    store = _run_store(request.tracking_uri, run_id) if run_id else None  # a config needs a store only to publish
    report = run_check(store, cfg=cfg, run_id=run_id, step=request.step, options=request.options(), trust=request.trusted)
    if request.publish:
        from replaybisect.verbs.check.report import publish as publish_report

        publish_report(store or _store(request.tracking_uri), report, cfg, code_folder=request.code_folder)
    return report


@front_door(DiagnoseRequest, positional=("run_id",))
def diagnose(request: DiagnoseRequest) -> "Diagnosis":
    """Read a run's recorded curves (no replay) and name the pathology and the next command (as `replay diagnose`)."""
    from replaybisect.verbs.diagnose.engine import analyse, load_curves

    store = _run_store(request.tracking_uri, request.run_id)
    curves = load_curves(store, request.run_id)
    result = analyse(curves)
    if request.publish:
        from replaybisect.verbs.diagnose.report import publish as publish_report

        publish_report(store, result, curves)
    return result


@front_door(ProfileRequest, positional=("run_id", "step"))
def profile(request: ProfileRequest) -> "ProfileReport":
    """A recorded step (by default the run's slowest) replayed under torch.profiler (as `replay profile`): the top ops
    by time and memory, the modules by forward time, the step times against the recorded ones. With `publish`, the
    trace, profile.md and profile.json are recorded in a child run (`report_run_id`); `trace` is the local trace file
    only while the function runs (it is removed after: read it from the child run)."""
    import tempfile
    from pathlib import Path

    from replaybisect.verbs.profile.engine import profile as run_profile

    store = _run_store(request.tracking_uri, request.run_id)
    with tempfile.TemporaryDirectory(prefix="replaybisect-profile-") as folder:
        report = run_profile(store, request.run_id, request.step, steps=request.steps, device=request.torch_device,
                             trust=request.trusted, trace_folder=Path(folder))
        if request.publish:
            from replaybisect.verbs.profile.report import publish as publish_report

            publish_report(store, report)
    return report


@front_door(MemoryRequest, positional=("run_id", "step"))
def memory(request: MemoryRequest) -> "MemoryReport":
    """What keeps a run's memory growing (as `replay memory`): a few recorded steps replayed, and the list, dict or
    tensor of the loop's code that gains tensors or autograd nodes each step named, with the line that adds to it."""
    from replaybisect.verbs.memory.engine import memory as run_memory

    store = _run_store(request.tracking_uri, request.run_id)
    report = run_memory(store, request.run_id, request.step, steps=request.steps, device=request.torch_device,
                        trust=request.trusted)
    if request.publish:
        from replaybisect.verbs.memory.report import publish as publish_report

        publish_report(store, report)
    return report


@front_door(VerifyRequest, positional=("run_id",), aliases=SUBMITIT)
def verify(request: VerifyRequest) -> "VerifyReport":
    """Is the recording what this code computes here (as `replay verify`)? Recorded steps (`steps`: "A:B") replayed
    from their snapshots and compared bit for bit: exact | transient | device | hardware | recorder | code |
    nondeterministic | loop. `cross_check=True` replays a difference this machine reproduces once more on another machine, as
    a submitit job (`submitit` holds the job options by name, as for ablate)."""
    from replaybisect.verbs.verify.engine import verify as run_verify

    store = _run_store(request.tracking_uri, request.run_id)
    report = run_verify(store, request.run_id, request.start, request.end, device=request.torch_device, trust=request.trusted,
                        sample=request.sample, cross_check=request.jobs if request.cross_check else None)
    if request.publish:
        from replaybisect.verbs.verify.report import publish as publish_report

        publish_report(store, report)
    return report
