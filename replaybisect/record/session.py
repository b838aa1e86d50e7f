"""A recorded run's life, written once for `replay train`, the `Recorder` and the Lightning callback:
the run created with its tags (the code's git version and folder), its config, the recording hooks, and its end
(FINISHED, FAILED after a non-finite step, KILLED by Ctrl-C/SIGTERM, FAILED with the reason on a crash or a full disk).
"""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from replaybisect.core import faults
from replaybisect.core.faults import device_label
from replaybisect.core import config as config_mod
from replaybisect.core import provenance
from replaybisect.core.repo import code_version
from replaybisect.errors import DiskFull, is_disk_full, raise_if_terminated, sigterm_deferred
from replaybisect.record.hooks import NullHooks, RecordingHooks
from replaybisect.store import Store

TAG = "replaybisect."


DEVICE_LABEL = "device_label"


class RunSession:
    """One run in the store, from creation to its end. `hooks` record the steps once `start_recording` ran."""

    def __init__(self, store: Store, run_id: str, tags: Optional[dict[str, str]] = None, key=None):
        self.store = store
        self.run_id = run_id
        self.key = key  # provenance.Key the config is signed with
        self.tags = {key[len(TAG):]: str(value) for key, value in (tags or {}).items() if key.startswith(TAG)}  # as set here
        self.hooks: Any = None  # RecordingHooks, or NullHooks with the recorder off
        self.ended = False
        self._hooks_closed = False

    @classmethod
    def open(cls, store: Store, *, code_folder: Path, kind: str = "train", run_name: Optional[str] = None,
             experiment: Optional[str] = None, parent_run_id: Optional[str] = None,
             tags: Optional[dict[str, str]] = None) -> "RunSession":
        """Create the run: tagged with the code's git version and folder (where a replay imports the code from)."""
        from replaybisect.core.rng import isolated_rng

        key = provenance.signing_key(create=True)  # a key that cannot be used is said before any run is created
        faults.arm()  # (a test's fault injector: nothing unless it is set)
        all_tags = {TAG + key: value for key, value in code_version(code_folder).items()}
        all_tags[TAG + "code_dir"] = str(code_folder)
        all_tags[TAG + DEVICE_LABEL] = device_label()  # which machine made the numbers (replay verify's verdict)
        all_tags.update(tags or {})
        # MLflow names runs with `random`: keep it off the (seeded) training streams. A SIGTERM while the run is
        # created is raised once the session can end it KILLED
        with isolated_rng(), sigterm_deferred():
            random.seed(os.urandom(8))
            run_id = store.create_run(kind, run_name=run_name, parent_run_id=parent_run_id, experiment=experiment, tags=all_tags)
        session = cls(store, run_id, all_tags, key)
        with session.failure_ends_run():
            raise_if_terminated()
            session._remove_stale_temps()
        return session

    @classmethod
    def attach(cls, store: Store, run_id: str, *, code_folder: Path, tags: Optional[dict[str, str]] = None) -> "RunSession":
        """Record into a run another logger opened (the Trainer's MLflowCallback): tagged as `open` tags a new run.
        Its own params stay as they are (write_config adds only new keys)."""
        key = provenance.signing_key(create=True)
        faults.arm()
        all_tags = {TAG + key: value for key, value in code_version(code_folder).items()}
        all_tags.update({TAG + "code_dir": str(code_folder), TAG + DEVICE_LABEL: device_label(), TAG + "kind": "train",
                         TAG + "status": "running", **(tags or {})})
        store.set_tags(run_id, all_tags, prefix="")
        session = cls(store, run_id, all_tags, key)
        session.attached = True
        return session

    attached = False  # recording into a run another logger opened

    def write_config(self, cfg) -> None:
        """The config as params (what MLflow's UI compares) and as config.yaml (what a replay reads back), signed
        with the tags that pick code as this session set them (core/provenance.py: a replay verifies both)."""
        params = config_mod.flatten(cfg)
        if self.attached:  # MLflow refuses a changed param: the other logger's keep their values
            params = {key: value for key, value in params.items() if key not in self.store.get_run(self.run_id).data.params}
        text = config_mod.to_yaml(cfg)
        signed = provenance.signature(self.key or provenance.signing_key(create=True), self.run_id, text, self.tags)
        self.store.log_params(self.run_id, params, tags={provenance.SIGNATURE_TAG: signed})  # one call for both
        self.store.log_text(self.run_id, text, "config.yaml")

    def start_recording(self, cfg, state, data_position: dict[str, Any], runs_steps: bool = True):
        """The hooks that record every step (or, with snapshot.enabled=false, only count them). `runs_steps`: the
        steps go through loop.take_step (replay train, the Recorder), so a fused optimizer's update can be skipped
        on the device (record/device_guard.py); a Trainer's callback only watches them."""
        if cfg.snapshot.enabled:
            self.hooks = RecordingHooks(self.store, self.run_id, cfg, state, data_position, runs_steps=runs_steps)
        else:
            self.hooks = NullHooks(cfg.snapshot.on_nonfinite == "stop")
        return self.hooks

    @property
    def status(self) -> str:
        return "nonfinite" if self.hooks is not None and self.hooks.first_nonfinite_step is not None else "ok"

    def finish(self) -> str:
        """Every pending write done, the run ended FINISHED (or FAILED after a non-finite step); returns the status.
        A write that failed (a full disk) ends it FAILED instead, and is raised."""
        if self.ended:
            return self.status
        with self.failure_ends_run():  # until the end is recorded, a SIGTERM ends the run KILLED
            self.close_hooks()
            status = self.status
            self.store.finish_run(self.run_id, status, "FAILED" if status == "nonfinite" else "FINISHED")
            raise_if_terminated()  # one swallowed meanwhile (in SQLAlchemy's weakref callbacks)
        self.ended = True
        return status

    @contextmanager
    def failure_ends_run(self) -> Iterator[None]:
        """Inside, an error (Ctrl-C and SIGTERM too) ends the run as `fail` says and goes on up; a full disk met
        outside the snapshot writer goes up as its one-line DiskFull."""
        try:
            yield
        except BaseException as error:
            failure = self.fail(error)
            if failure is not None:
                raise failure from error
            raise

    def fail(self, error: BaseException) -> Optional[DiskFull]:
        """Ctrl-C / SIGTERM: KILLED; anything else FAILED; what was recorded stays. Returns the one-line error to
        raise for a full disk met outside the snapshot writer, else None."""
        if self.ended:
            return None
        self.ended = True
        try:
            self.close_hooks()
        except BaseException:
            pass
        failure = as_disk_full(error, self.run_id, self.store)
        mark_ended(self.store, self.run_id, failure or error)
        return failure if failure is not error else None

    def close_hooks(self) -> None:
        """Finish every pending write (snapshots, metrics), once; raises the first that failed."""
        if self.hooks is not None and not self._hooks_closed:
            self._hooks_closed = True
            self.hooks.close()

    def _remove_stale_temps(self) -> None:
        """Temp files that killed writers left in the snapshots of this experiment's runs still marked RUNNING
        (a run that ended cleanly left none). Only dead writers' files go: see snapshot.is_stale_temp."""
        from replaybisect.core import snapshot as fmt

        for folder in self.store.running_artifact_dirs(self.store.get_run(self.run_id).info.experiment_id):
            try:
                fmt.remove_stale_temps(folder / fmt.SNAPSHOTS)
            except OSError:  # another user's folder, a vanished run: not this run's business
                pass


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
        error.add_note(crash_note(error, run_id))


def crash_note(error: BaseException, run_id: str) -> str:
    """The line a crashed run ends with: a step that raised (its state and batch kept) names the next command."""
    step = getattr(error, "replaybisect_failing_step", None)
    if step is None:
        return f"replaybisect: run {run_id} ended as crashed (FAILED); what it recorded is kept"
    from replaybisect.core.oom import is_out_of_memory

    what, verb = (f"raised {type(error).__name__}", "nan")
    if is_out_of_memory(error):  # (replay memory sends a step that asks for more than any machine has to replay nan)
        what, verb = f"ran out of memory ({type(error).__name__})", "memory"
    kept = f"the state before step {step} and its batch" if getattr(error, "replaybisect_state_kept", True) else \
        f"step {step}'s batch (its update had begun: a replay reaches it from the last snapshot)"
    return (f"replaybisect: step {step} {what}; run {run_id} ended as crashed (FAILED) with {kept} kept; replay it with: "
            f"replay {verb} --run-id {run_id}")
