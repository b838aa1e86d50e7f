"""The recording hooks: batched metrics, per-layer statistics, two-phase asynchronous snapshots, the NaN guard.

Two-phase snapshots (CheckFreq's design): the step pays only for copying tensors into preallocated host
buffers (on a GPU, pinned buffers and asynchronous copies: the step only queues them, and the writer waits for
them); one background worker serialises, writes (temp name, fsync, rename) and uploads. One snapshot in flight:
the next copy waits for the previous write instead of dropping a snapshot.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
import contextlib
from pathlib import Path
from typing import Any, Optional

import torch

from replaybisect.errors import disk_full_named
from replaybisect.record.device_guard import DeviceGuard, PendingStep
from replaybisect.record.metrics_process import HandOff
from replaybisect.core.layer_stats import LayerStats
from replaybisect.core.loop import TrainState
from replaybisect.core.step_watch import StepOutcome, carried_gradients
from replaybisect.core.user_step import ManualUpdate
from replaybisect.core import oom, outside_model, ranks
from replaybisect.core import snapshot as fmt
from replaybisect.core.shards import whole
from replaybisect.core.state import state_entries, state_json
from replaybisect.store import OLD_SERVER_TAG_VALUE, Store

def _lower_priority() -> None:
    """The writer yields the CPU to the training threads (Linux: nice is per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class RecordingHooks:
    """The loop hooks (loop.LoopHooks) that record a run, whichever path trains it (`replay train`, the `Recorder`,
    the Lightning callback): metrics, layer statistics, snapshots with their batches, the failing step."""

    defers_reads = True  # the built-in step keeps its loss and gradient norm on the device: read at each metrics flush

    def __init__(self, store: Store, run_id: str, cfg, state: TrainState, data_position: dict[str, Any], runs_steps: bool = True):
        self.store = store
        self.run_id = run_id
        self.cfg = cfg
        self.state = state
        self.data_position = data_position
        self.snapshot_every = cfg.snapshot.every
        self.sharded = ranks.is_sharded(state.model)  # fully_shard (core/ranks.py)
        self.stats_every = cfg.snapshot.layer_stats_every
        self.flush_every = max(1, cfg.snapshot.metrics_flush_every)
        self.flush_seconds = cfg.snapshot.metrics_flush_seconds or math.inf  # 0: by step count only
        self._next_flush = time.monotonic() + self.flush_seconds
        self.keep_batches = cfg.snapshot.keep_batches
        self.on_nonfinite_stop = cfg.snapshot.on_nonfinite == "stop"
        # a loop that updates by hand has no lr of its own here (ManualUpdate's 1.0 would read as one)
        self._logs_lr = not isinstance(state.optimizer, ManualUpdate)

        self.metrics: list[tuple[str, float, int]] = []
        self.snapshot_steps: list[int] = []  # closed (written or being written), in order
        self._written_steps: list[int] = []  # manifest on disk
        # (step, seconds the step waited in all, bytes copied, of those seconds the wait for the previous write)
        self.snapshot_blocking: list[tuple[int, float, int, float]] = []
        self.first_nonfinite_step: int | None = None
        self.nonfinite_what: str | None = None
        self.crashed_step: int | None = None  # the step that raised (on_exception)
        self._last_outcome: Optional[StepOutcome] = None  # the last step that logged a loss
        self.steps_completed = 0
        # a fused optimizer in replay train's step: the non-finite verdicts stay on the device until a flush
        self.device_guard = DeviceGuard(state) if runs_steps and DeviceGuard.applies(cfg, state) else None
        self.halted = False  # a flush found a failed step: the loop stops, nothing after it is recorded
        self.failed_outcome: Optional[StepOutcome] = None  # that step's outcome

        self._logging = HandOff(store, run_id)  # the metric points: by the writer thread, then a process of their own
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replaybisect-writer", initializer=_lower_priority)
        self._jobs: list[Future] = []
        self._writer_failure: BaseException | None = None  # the first background failure, raised on the next step
        self._created_folders: list[Path] = []  # removed at close unless their manifest is written
        self._buffers_job: Future | None = None  # the write that reads the host buffers
        self._host: fmt.TensorsImage | dict[str, torch.Tensor] | None = None  # the host copy, reused (_copy_to_host)
        self._open_snapshot: dict[str, Any] | None = None  # the snapshot whose batches are still arriving
        self._rng_at_start: dict | None = None
        self._stats: LayerStats | None = None
        local = store.local_artifact_dir(run_id)
        self._local_root = local / fmt.SNAPSHOTS if local else None
        self._staging = None if local else Path(tempfile.mkdtemp(prefix="replaybisect-snapshots-"))

    # ---- LoopHooks --------------------------------------------------------------------------
    def before_step(self, step: int, state: TrainState, rng_at_start: dict) -> None:
        due = fmt.snapshot_due(step, self.snapshot_every)
        if self.device_guard is not None:
            if due and self.device_guard.pending:
                self._flush_metrics()  # the verdicts are read before a snapshot of a state they may have stopped at
            self.device_guard.opened(step, rng_at_start)
        if self.halted:
            return
        self._rng_at_start = rng_at_start
        if due:
            self._close_open_snapshot()
            self._begin_snapshot(step, rng_at_start, reason="periodic")

    def observer(self, step: int):
        if self.sharded:  # per-layer statistics of shards would take collectives rank 0 alone calls: not taken
            return None
        if self.stats_every and step % self.stats_every == 0:
            self._stats = LayerStats(self.state.model)
            return self._stats
        return None

    def on_nonfinite(self, outcome: StepOutcome, batch, state_intact: bool = True) -> bool:
        """The state is still the one before this step: save it with the failing batch, tag the run. Not
        `state_intact` (one of several optimizers updated before the fault): only the batch is kept."""
        if self.first_nonfinite_step is None:
            self.first_nonfinite_step = outcome.step
            self.nonfinite_what = outcome.nonfinite
            self._keep_failing_step(outcome.step, batch, "nonfinite", state_intact=state_intact, grads=outcome.carried_grads)
            self.store.set_tags(
                self.run_id,
                {"first_nonfinite_step": outcome.step, "nonfinite_what": outcome.nonfinite, "status": "nonfinite"},
            )
        return not self.on_nonfinite_stop

    def on_exception(self, step: int, error: BaseException, batch, updated: bool = False, outcome: Optional[StepOutcome] = None) -> None:
        """Step `step` raised `error` (the loop raises it on): recorded as the run's failing step, as a non-finite
        step is (the state before it and its batch, tags failing_step, failure=exception, error_type, error,
        error_frame). `updated`: it raised after its optimizer update, so only its batch is kept (a replay reaches
        it from the last snapshot). `outcome`: the step's, where it is known (after its first backward, the gradients
        it began with are the ones taken then, not the live ones). The run's end (FAILED, crashed) is the session's."""
        if self.device_guard is not None and self.device_guard.pending:
            self._flush_metrics()  # an earlier step found non-finite at this flush is the failure
        if self.halted or self.crashed_step is not None:
            return
        self.crashed_step = step
        grads = _gradients_begun_with(outcome, self.state)
        self._keep_failing_step(step, batch, "exception", state_intact=not updated, grads=grads)
        self.store.set_tags(self.run_id, crash_tags(step, error, self.state.device))
        with contextlib.suppress(Exception):  # the run's end names the step and the next command (session.mark_ended)
            error.replaybisect_failing_step = step
            error.replaybisect_state_kept = not updated  # (else a replay reaches the step from the last snapshot)
            error.replaybisect_run_id = self.run_id

    def _keep_failing_step(self, step: int, batch, reason: str, state_intact: bool = True, grads=None) -> None:
        """The state before the failing `step` (still the live one when `state_intact`; `grads`: the gradients it
        began with, which the loop had not cleared) and its batch, kept."""
        opened = self._open_snapshot
        self._keep_batch(step, batch, force=True)  # the open interval ends with the failing batch
        # else the periodic snapshot of this step is it; a sharded model's state is gathered by every rank together, at
        # periodic snapshots only: its replay starts from the last one, through the interval's batches
        if state_intact and not (opened and opened["step"] == step) and not self.sharded:
            self._close_open_snapshot()
            self._begin_snapshot(step, self._rng_at_start, reason=reason, keep_open=True)
            self._keep_batch(step, batch, force=True)
        self._keep_grads(step, grads)
        self._close_open_snapshot()

    def _keep_grads(self, step: int, grads) -> None:
        """The snapshot opened at `step` holds the gradients the step began with (the loop had not cleared them)."""
        if grads is not None and self._open_snapshot is not None and self._open_snapshot["step"] == step:
            self._open_snapshot["grads"] = {name: grad.detach().cpu() for name, grad in grads.items()}

    def after_step(self, outcome: StepOutcome, batch, step_time: float, data_time: float) -> bool:
        if self.halted:  # a step after the failure a flush found (skipped on the device): not recorded
            return False
        step = outcome.step
        if self.device_guard is not None:
            self.device_guard.ran(outcome, batch)
        # a NaN loss that is no failure is a step without a loss (Lightning's training_step returned None): not logged;
        # a loss still on the device (a deferred read) is a computed one, read with the others at the flush
        unread = isinstance(outcome.loss_value, torch.Tensor)
        has_loss = unread or not (math.isnan(outcome.loss) and outcome.nonfinite is None)
        self.metrics += [("loss", outcome.loss_value, step)] if has_loss else []
        self.metrics += [("lr", outcome.lr, step)] if self._logs_lr else []
        self.metrics += [("step_time", step_time, step), ("data_time", data_time, step)]
        if outcome.grad_norm_value is not None:
            self.metrics.append(("grad_norm", outcome.grad_norm_value, step))
        if self._stats is not None:
            self.metrics += [(key, value, step) for key, value in self._stats.finish().items()]
            self._stats = None
        if step == 0 and self.state.user_loop:
            _tag_not_optimized(self.store, self.run_id, self.state)
        if outcome.carried_grads is not None:  # (diagnose's gradients-not-zeroed counts them)
            self.metrics.append(("grads_carried", 1.0, step))
            self._keep_grads(step, outcome.carried_grads)
        if self._open_snapshot is not None and step != self.first_nonfinite_step:
            self._keep_batch(step, batch)
        if has_loss:
            self._last_outcome = outcome  # its loss read when asked (last_loss)
        self.steps_completed = step + 1
        if (step + 1) % self.flush_every == 0 or time.monotonic() >= self._next_flush:
            self._flush_metrics()
        if self._writer_failure is not None:  # a failed write (a full disk) stops training now, not at close
            raise self._writer_failure
        return not self.halted

    def after_validation(self, step: int, val_loss: float) -> None:
        self.metrics.append(("val_loss", val_loss, step))

    # ---- snapshots ------------------------------------------------------------------------------
    def _begin_snapshot(self, step: int, rng_raw: dict, reason: str, keep_open: bool = False) -> None:
        """Phase 1, on the training thread: copy every tensor into host buffers (waits for the previous write)."""
        started = time.perf_counter()
        if self._buffers_job is not None:
            self._buffers_job.result()  # one in flight: the host buffers are about to be reused
        waited = time.perf_counter() - started
        host = self._host = _copy_to_host(self.state, self._host)
        copied = _copies_done(self.state.device)  # on a GPU the step does not wait: the writer does, before it reads
        saved_state = state_json(self.state, step, rng_raw, {**self.data_position, "step": step}, reason)
        blocking = time.perf_counter() - started
        self.snapshot_blocking.append((step, blocking, _host_bytes(host), waited))
        self.metrics.append(("snapshot_blocking_time", blocking, step))
        folder = self._folder(step)
        self._buffers_job = self._submit(_write_state_files, folder, host, saved_state, copied)
        self._open_snapshot = {"step": step, "folder": folder, "batches": {}, "files_job": self._buffers_job}
        if not (self.keep_batches or keep_open):
            self._close_open_snapshot()

    def _keep_batch(self, step: int, batch, force: bool = False) -> None:
        """Keep the batch of `step` for the open snapshot (always the failing batch, whatever keep_batches says)."""
        if (self.keep_batches or force) and self._open_snapshot is not None:
            if step not in self._open_snapshot["batches"]:
                self._open_snapshot["held_bytes"] = self._open_snapshot.get("held_bytes", 0) + _nbytes(batch)
            self._open_snapshot["batches"][step] = batch

    def _close_open_snapshot(self) -> None:
        """Phase 2 ends: write the interval's batches, then the manifest (last)."""
        opened, self._open_snapshot = self._open_snapshot, None
        if opened is None:
            return
        self._submit(self._finish_snapshot, opened)
        self.snapshot_steps.append(opened["step"])

    def _folder(self, step: int) -> Path:
        root = self._local_root if self._local_root is not None else self._staging
        folder = root / fmt.folder_name(step)
        if folder.exists():  # the periodic snapshot of a step that then failed: rewrite it with the failing batch
            for job in self._jobs:
                job.result()
            shutil.rmtree(folder)
        with disk_full_named(f"snapshot {folder.name}", root):
            folder.mkdir(parents=True)
        self._created_folders.append(folder)
        return folder

    def _finish_snapshot(self, opened: dict[str, Any]) -> None:
        files = dict(opened["files_job"].result())
        folder: Path = opened["folder"]
        with disk_full_named(f"snapshot {folder.name}", folder.parent):
            if opened["batches"]:
                files[fmt.BATCHES] = fmt.write_batches_atomic(folder / fmt.BATCHES, opened["batches"])
            if opened.get("grads"):
                files[fmt.GRADS] = fmt.write_tensors_atomic(folder / fmt.GRADS, opened["grads"])
            fmt.write_manifest(folder, opened["step"], files)
            if self._staging is not None:  # remote artifact store: upload data files first, the manifest last
                target = f"{fmt.SNAPSHOTS}/{folder.name}"
                for name in list(files) + [fmt.MANIFEST]:
                    self.store.log_artifact(self.run_id, folder / name, target)
                shutil.rmtree(folder, ignore_errors=True)
        self._written_steps.append(opened["step"])
        with disk_full_named("tags", self.store.uri, in_store=True):
            self.store.set_tags(self.run_id, {"snapshot_steps": steps_tag(sorted(set(self._written_steps)))})

    # ---- metrics and the background worker -------------------------------------------------------
    def _flush_metrics(self) -> None:
        judging = self.device_guard is not None and not self.halted  # (once halted, later steps are not recorded)
        verdicts = self.device_guard.verdict_points() if judging else []
        if self.steps_completed:  # the memory the run holds now, at the last step recorded (host counters: no sync),
            at = self.steps_completed - 1  # and the recorder's own share: the batches the open snapshot keeps
            held = float(self._open_snapshot.get("held_bytes", 0)) if self._open_snapshot is not None else 0.0
            self.metrics += [(name, value, at) for name, value in memory_points(self.state.device)] + [("memory/recorder", held, at)]
        points, self.metrics = read_points(self.metrics + verdicts), []  # one transfer for both
        self._next_flush = time.monotonic() + self.flush_seconds
        if judging:
            read = {(name, step): value for name, value, step in points if name.startswith(VERDICT)}
            points = [point for point in points if not point[0].startswith(VERDICT)]
            failure = self.device_guard.first_failure(read)
            if failure is not None:
                points = self._stop_at(*failure, points)
        if points:
            self._submit(self._log_metrics, points)

    def _stop_at(self, failed: PendingStep, what: str, points: list) -> list:
        """A flush found that `failed` went non-finite (its update and every later one were skipped on the device):
        the state is put back to the one before it and it is recorded as a step halted at once; the points of later
        steps are dropped. Returns the points to log."""
        step, outcome = failed.step, failed.outcome
        self.device_guard.put_back(failed)
        kept = [(name, value, at) for name, value, at in points if at < step or (at == step and _logged_when_halted(name, what))]
        outcome.nonfinite, outcome.updated = what, False
        outcome.loss = next((value for name, value, at in kept if name == "loss" and at == step), math.nan)
        if what == "loss":
            outcome.grad_norm = None
        if self._open_snapshot is not None:  # the interval's batches end with the failing one
            self._open_snapshot["batches"] = {at: batch for at, batch in self._open_snapshot["batches"].items() if at < step}
        self._rng_at_start = failed.rng_at_start
        self._last_outcome = self.failed_outcome = outcome
        self.steps_completed = step + 1
        self.halted = True
        self.on_nonfinite(outcome, failed.batch)
        return kept

    @property
    def last_loss(self) -> Optional[float]:
        return self._last_outcome.loss if self._last_outcome is not None else None

    def _log_metrics(self, points: list[tuple[str, float, int]]) -> None:
        with disk_full_named("metrics", self.store.uri, in_store=True):
            self._logging.log(points)

    def _submit(self, function, *args) -> Future:
        job = self._worker.submit(function, *args)
        job.add_done_callback(self._note_failure)
        self._jobs = [j for j in self._jobs if not j.done() or j.exception() is not None] + [job]
        return job

    def _note_failure(self, job: Future) -> None:
        if self._writer_failure is None and not job.cancelled() and job.exception() is not None:
            self._writer_failure = job.exception()

    def close(self) -> None:
        """Finish every pending write (snapshots, metrics); raise the first background failure.
        Interrupted (Ctrl-C, SIGTERM) or failed, it still finishes what it can and leaves no incomplete
        snapshot folder and no temp file behind."""
        try:
            self._flush_metrics()  # (first: a failure it finds ends the open snapshot's interval at the failing step)
            self._close_open_snapshot()
            self._flush_metrics()
            for job in self._jobs:
                job.result()
            self._logging.close()  # every point it was sent logged; its failure raised
        finally:
            self._worker.shutdown(wait=True)
            self._logging.close(quiet=True)  # (after a failure above: ended, what it has logged)
            _remove_incomplete_snapshots(self._created_folders)
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)

def _gradients_begun_with(outcome: Optional[StepOutcome], state) -> Optional[dict]:
    """The gradients a user's step that raised began with: taken at its first backward where it got that far, else the
    live ones (none for the built-in step, which clears them)."""
    if outcome is not None and outcome.backpropagated:
        return outcome.carried_grads
    return carried_gradients(state.model, state.params) if state.user_loop else None


def _copies_done(device: torch.device):
    """A CUDA event after the step's copies into pinned host buffers (queued on the device's stream, so they read
    the state before the next step's kernels change it); None on the CPU, where the copies are done already."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _tag_not_optimized(store, run_id: str, state) -> None:
    """Parameters the first step gave gradients that no optimizer updates (a layer added after the optimizer was
    built): tagged once, by name (replay diagnose's not-optimized)."""
    optimized = {id(param) for param in state.params}
    missed = [name for name, param in state.model.named_parameters() if param.grad is not None and id(param) not in optimized]
    if missed:
        shown = ",".join(missed[:NOT_OPTIMIZED_SHOWN]) + (f",+{len(missed) - NOT_OPTIMIZED_SHOWN}" if len(missed) > NOT_OPTIMIZED_SHOWN else "")
        store.set_tags(run_id, {"not_optimized": shown})


def _copy_to_host(state, held: fmt.TensorsImage | dict | None) -> fmt.TensorsImage | dict[str, torch.Tensor]:
    """Every tensor of the state copied into host memory kept from snapshot to snapshot (pinned on a GPU): the file
    image the writer writes as it is, or, for a dtype it cannot lay out, one buffer per tensor."""
    entries = state_entries(state)
    pin = any(value.is_cuda for _, value in entries)
    layout = fmt.TensorsImage.layout_of(entries)
    if layout is None:
        return _copy_to_buffers(entries, held if isinstance(held, dict) else {})
    image = held if isinstance(held, fmt.TensorsImage) and held.layout == layout else fmt.TensorsImage(layout, pin)
    for name, value in entries:  # a shard gathered whole one tensor at a time
        tensor = whole(value)
        image.views[name].copy_(tensor.detach(), non_blocking=tensor.is_cuda)
    return image


def _copy_to_buffers(entries, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name, value in entries:
        tensor = whole(value)
        buffer = buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            buffers[name] = buffer
        buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
    return buffers


def steps_tag(steps: list[int]) -> str:
    """The run's snapshot_steps tag: the newest steps that fit a tag value every MLflow server keeps. A long run's
    thousands of snapshots would pass the limit (MLflow cuts a value at 8000 characters, older servers refuse one over
    5000); replays list the snapshots themselves, and `replay runs` shows the last few."""
    kept, length = [], -1
    for step in reversed(steps):
        length += len(str(step)) + 1
        if length > OLD_SERVER_TAG_VALUE:
            break
        kept.append(step)
    return ",".join(str(step) for step in reversed(kept))


def crash_tags(step: int, error: BaseException, device: torch.device) -> dict[str, Any]:
    """The run's tags for a step that raised: where, what, the user's frame; for one that ran out of memory also the cap
    and what the process held (`replay memory` runs the step under both)."""
    from replaybisect.frames import error_message, raised_at

    frame = raised_at(error)
    tags = {"failing_step": step, "failure": "exception", "error_type": type(error).__name__,
            "error": error_message(error), **({"error_frame": frame[:500]} if frame else {})}
    return {**tags, **oom.failure_tags(error, device)} if oom.is_out_of_memory(error) else tags


def _write_state_files(folder: Path, host, saved_state: dict, copied=None) -> dict[str, dict]:
    if copied is not None:
        copied.synchronize()  # the device's copies into the host buffers have landed
    with disk_full_named(f"snapshot {folder.name}", folder.parent):
        tensors_file = folder / fmt.TENSORS
        return {
            fmt.TENSORS: host.write_atomic(tensors_file) if isinstance(host, fmt.TensorsImage) else fmt.write_tensors_atomic(tensors_file, host),
            fmt.STATE: fmt.write_atomic(folder / fmt.STATE, fmt.encode_json(saved_state)),
        }


def _host_bytes(host) -> int:
    if isinstance(host, fmt.TensorsImage):
        return host.data_bytes
    return sum(buffer.numel() * buffer.element_size() for buffer in host.values())


def _remove_incomplete_snapshots(folders: list[Path]) -> None:
    """A snapshot whose write failed or was cut short is discarded: it could never be loaded."""
    for folder in folders:
        if folder.is_dir() and not (folder / fmt.MANIFEST).is_file():
            shutil.rmtree(folder, ignore_errors=True)




class NullHooks:
    """LoopHooks that record nothing: the recorder turned off (benchmarks) or a bare replay."""

    def __init__(self, stop_on_nonfinite: bool = True):
        self.stop_on_nonfinite = stop_on_nonfinite
        self.losses: dict[int, float] = {}
        self.first_nonfinite_step: int | None = None
        self.nonfinite_what: str | None = None
        self.last_loss: float | None = None
        self.steps_completed = 0
        self.snapshot_steps: list[int] = []

    def before_step(self, step, state, rng_at_start):
        pass

    def observer(self, step):
        return None

    def on_nonfinite(self, outcome, batch):
        if self.first_nonfinite_step is None:
            self.first_nonfinite_step = outcome.step
            self.nonfinite_what = outcome.nonfinite
        return not self.stop_on_nonfinite

    def after_step(self, outcome, batch, step_time, data_time):
        self.losses[outcome.step] = outcome.loss
        self.last_loss = outcome.loss
        self.steps_completed = outcome.step + 1
        return True

    def close(self):
        pass

    def after_validation(self, step, val_loss):
        pass


NOT_OPTIMIZED_SHOWN = 8  # parameter names the not_optimized tag lists
VERDICT = "verdict/"  # record/device_guard.py's points: read with the metrics, never logged
AFTER_BACKWARD = ("grad_norm/", "weight_norm/", "param_norm", "update_ratio")  # layer statistics of a step's backward and update


def _logged_when_halted(name: str, what: str) -> bool:
    """Whether a step halted before its update (at its loss, or at its gradients) logs this point: not its
    validation, nor the layer statistics of its backward and update, nor a gradient norm after a failed loss."""
    return name != "val_loss" and not name.startswith(AFTER_BACKWARD) and not (what == "loss" and name == "grad_norm")


def _nbytes(value: Any) -> int:
    """The bytes of the tensors in a stored batch (a record: its micro-batches, RNG states, carry)."""
    return sum(tensor.nbytes for tensor in outside_model.tensors(value))


def memory_points(device: torch.device) -> list[tuple[str, float]]:
    """The memory the process holds: on a CUDA device the allocator's current and peak bytes (host-side counters),
    else the process's resident set size (/proc/self/statm; none where there is no such file)."""
    if device.type == "cuda":
        return [("memory/allocated", float(torch.cuda.memory_allocated(device))),
                ("memory/peak", float(torch.cuda.max_memory_allocated(device)))]
    size = oom.resident()
    return [] if size is None else [("memory/rss", float(size))]


def read_points(points: list[tuple[str, Any, int]]) -> list[tuple[str, float, int]]:
    """The metric points with every value still on a device (deferred reads) read in one transfer per device."""
    unread = [index for index, (_, value, _) in enumerate(points) if isinstance(value, torch.Tensor)]
    if not unread:
        return points
    read = list(points)
    by_device: dict = {}
    for index in unread:
        by_device.setdefault(points[index][1].device, []).append(index)
    for indices in by_device.values():
        try:
            tensors = [points[index][1].detach().reshape(()) for index in indices]
            # fp64 stays fp64 (a float64 model's loss); fp32 values widen exactly
            dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
            values = torch.stack([t.to(dtype) for t in tensors]).tolist()
        except RuntimeError:  # a device that failed (a sticky CUDA error): its values are lost, the others kept
            values = [None] * len(indices)
        for index, value in zip(indices, values):
            read[index] = (points[index][0], value, points[index][2])
    return [point for point in read if point[1] is not None]


