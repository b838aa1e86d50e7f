"""`replay train`: build a run from its config and train it with the recorder on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from replaybisect.errors import sigterm_raises
from replaybisect.store import Store


@dataclass
class TrainResult:
    run_id: str
    status: str  # ok | nonfinite
    steps_completed: int  # steps whose update was applied: a stopped run's failing step is not one (completed_steps)
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
    from replaybisect.record.session import RunSession

    # 1. build first: a config that does not build never creates a run
    state = loop.build_state(cfg)
    batch_source, val_dataset = loop.build_data(cfg)
    if not isinstance(store, Store):
        store = store()

    # 2. the run: tags, params, config
    session = RunSession.open(store, code_folder=code_folder or Path.cwd(), kind=kind, run_name=run_name,
                              parent_run_id=parent_run_id, tags=extra_tags)
    with session.failure_ends_run(), sigterm_raises():
        session.write_config(cfg)
        data_position = {"seed": cfg.seed, "batch_size": cfg.train.batch_size, "dataset_len": len(batch_source.dataset)}
        # train.num_workers > 0: worker processes build the same batches ahead (started before the recorder's threads)
        with loop.read_ahead(batch_source, cfg.train.num_workers) as batches:
            hooks = session.start_recording(cfg, state, data_position)

            # 3. train
            report = (lambda step: progress(step + 1, cfg.train.steps)) if progress else None
            try:
                stopped_by = loop.train_loop(state, batches, 0, cfg.train.steps, hooks, val_dataset=val_dataset, progress=report)
            finally:
                session.close_hooks()
        status = session.finish()  # (a SIGTERM until the run's end is recorded ends it KILLED)

    # 4. the verdict
    stopped = stopped_by is not None or getattr(hooks, "halted", False)  # (a failure found at the last flush)
    return TrainResult(
        run_id=session.run_id,
        status=status,
        steps_completed=completed_steps(hooks.steps_completed, hooks.first_nonfinite_step, stopped),
        first_nonfinite_step=hooks.first_nonfinite_step,
        nonfinite_what=hooks.nonfinite_what,
        final_loss=hooks.last_loss,
        stopped=stopped,
        snapshot_steps=sorted(set(hooks.snapshot_steps)),
        tracking_uri=store.uri,
    )


def completed_steps(steps_taken: int, first_nonfinite_step: Optional[int], stopped: bool) -> int:
    """The steps a run completed: those it took, less a stopped run's failing step (halted before its update)."""
    return first_nonfinite_step if stopped and first_nonfinite_step is not None else steps_taken
