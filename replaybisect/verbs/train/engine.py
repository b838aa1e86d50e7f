"""`replay train`: build a run from its config and train it with the recorder on."""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from replaybisect.core import config as config_mod
from replaybisect.errors import DiskFull, is_disk_full, sigterm_raises
from replaybisect.store import Store


@dataclass
class TrainResult:
    run_id: str
    status: str  # ok | nonfinite
    steps_completed: int
    first_nonfinite_step: Optional[int]
    nonfinite_what: Optional[str]  # "loss" | "grad_norm"
    final_loss: Optional[float]
    stopped: bool = False  # stopped early on a non-finite value (exit 3); false under on_nonfinite=continue
    snapshot_steps: list[int] = field(default_factory=list)
    tracking_uri: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "status": self.status,
            "steps_completed": self.steps_completed,
            "first_nonfinite_step": self.first_nonfinite_step,
            "nonfinite_what": self.nonfinite_what,
            "final_loss": self.final_loss,
            "stopped": self.stopped,
            "snapshot_steps": self.snapshot_steps,
            "tracking_uri": self.tracking_uri,
        }


def git_info(folder: Path) -> dict[str, str]:
    """git_sha / git_dirty of the user's code, read-only (no index refresh: --no-optional-locks)."""
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "--no-optional-locks", "-C", str(folder), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired):
        return {}
    return {"git_sha": sha, "git_dirty": str(dirty).lower()}


def train(
    cfg,
    store: Store | Callable[[], Store],
    *,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    kind: str = "train",
    extra_tags: dict[str, str] | None = None,
    code_folder: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TrainResult:
    """Train `cfg` recorded to `store`. A non-finite stop returns status "nonfinite" (the CLI exits 3).

    Ctrl-C and SIGTERM (raised as Terminated while training, in the main thread) end the run KILLED with
    status "killed" after flushing metrics and finishing the snapshot in flight; a full disk ends it FAILED
    with status "crashed" and failure "disk-full"; any other error FAILED/"crashed". `store` may be a function
    that opens it: called once the model and data have built, so a config that does not build creates no store."""
    from replaybisect.core import loop
    from replaybisect.recorder import NullHooks, Recorder
    from replaybisect.core.rng import isolated_rng

    # 1. build first: a config that does not build never creates a run
    state = loop.build_state(cfg)
    batch_source, val_dataset = loop.build_data(cfg)
    if not isinstance(store, Store):
        store = store()

    # 2. the run: params, config, tags
    code_folder = code_folder or Path.cwd()
    tags = {f"replaybisect.{key}": value for key, value in git_info(code_folder).items()}
    tags["replaybisect.code_dir"] = str(code_folder)  # where `_target_`s import from, for replays elsewhere
    tags.update(extra_tags or {})
    with isolated_rng():  # MLflow names runs with `random`: keep it off the (seeded) training streams
        random.seed(os.urandom(8))
        run_id = store.create_run(kind, run_name=run_name, parent_run_id=parent_run_id, tags=tags)
    try:
        with sigterm_raises():
            _remove_stale_temps(store, run_id)
            store.log_params(run_id, config_mod.flatten(cfg))
            store.log_text(run_id, config_mod.to_yaml(cfg), "config.yaml")
            data_position = {"seed": cfg.seed, "batch_size": cfg.train.batch_size, "dataset_len": len(batch_source.dataset)}
            # train.num_workers > 0: worker processes build the same batches ahead (started before the recorder's threads)
            with loop.read_ahead(batch_source, cfg.train.num_workers) as batches:
                hooks = Recorder(store, run_id, cfg, state, data_position) if cfg.snapshot.enabled else NullHooks(cfg.snapshot.on_nonfinite == "stop")

                # 3. train
                report = (lambda step: progress(step + 1, cfg.train.steps)) if progress else None
                try:
                    stopped_by = loop.train_loop(state, batches, 0, cfg.train.steps, hooks, val_dataset=val_dataset, progress=report)
                finally:
                    hooks.close()
    except BaseException as error:
        failure = as_disk_full(error, run_id, store)
        mark_ended(store, run_id, failure or error)
        if failure is not None and failure is not error:
            raise failure from error
        raise

    # 4. the verdict
    first_nonfinite = hooks.first_nonfinite_step
    status = "nonfinite" if first_nonfinite is not None else "ok"
    store.finish_run(run_id, status, "FAILED" if status == "nonfinite" else "FINISHED")
    return TrainResult(
        run_id=run_id,
        status=status,
        steps_completed=hooks.steps_completed,
        first_nonfinite_step=first_nonfinite,
        nonfinite_what=hooks.nonfinite_what,
        final_loss=hooks.last_loss,
        stopped=stopped_by is not None,
        snapshot_steps=sorted(set(hooks.snapshot_steps)),
        tracking_uri=store.uri,
    )


def as_disk_full(error: BaseException, run_id: str, store: Store) -> DiskFull | None:
    """The one-line error for a full disk met outside the snapshot writer (config artifact, tags)."""
    if isinstance(error, DiskFull):
        return error
    if isinstance(error, Exception) and is_disk_full(error):
        return DiskFull(f"no space left on device recording run {run_id} to {store.uri}; free space or point the store elsewhere (--tracking-uri)")
    return None


def mark_ended(store: Store, run_id: str, error: BaseException) -> None:
    """Ctrl-C / SIGTERM: KILLED, "killed". A full disk: FAILED, "crashed", failure "disk-full". Else FAILED, "crashed".
    Best effort: when the store itself cannot be written (its disk is full), the error that stopped the run is what counts."""
    try:
        if isinstance(error, KeyboardInterrupt):  # Terminated (SIGTERM) is one
            store.finish_run(run_id, "killed", "KILLED")
            return
        if isinstance(error, DiskFull):
            store.set_tags(run_id, {"failure": "disk-full", "error": str(error)[:1000]})
        store.finish_run(run_id, "crashed", "FAILED")
    except Exception:
        return
    if isinstance(error, Exception) and not isinstance(error, DiskFull) and hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(f"replaybisect: run {run_id} ended as crashed (FAILED); what it recorded is kept")


def _remove_stale_temps(store: Store, run_id: str) -> None:
    """Temp files that killed writers left in the snapshots of this experiment's runs still marked RUNNING
    (a run that ended cleanly left none). Only dead writers' files go: see snapshot.is_stale_temp."""
    from replaybisect.core import snapshot as fmt

    for folder in store.running_artifact_dirs(store.get_run(run_id).info.experiment_id):
        try:
            fmt.remove_stale_temps(folder / fmt.SNAPSHOTS)
        except OSError:  # another user's folder, a vanished run: not this run's business
            pass
