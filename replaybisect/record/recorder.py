"""`replaybisect.Recorder`: record a training loop you wrote yourself, so `replay nan`, `replay ablate` and
`replay check --run-id` can replay it bit for bit.

    def build(cfg):                                   # importable: replay rebuilds the objects with it
        model = GPT(cfg)
        return model, configure_optimizers(model, cfg)

    def train_step(model, optimizer, batch):          # your whole step; arguments passed by name
        ...forward, backward, clip, optimizer.step()...
        return loss

    model, optimizer = build(cfg)
    rec = replaybisect.Recorder(model, optimizer, step_fn=train_step, build=build, config=cfg)
    for batch in batches:
        rec.step(batch)
    rec.close()

The run is an ordinary replaybisect run in MLflow (metrics every step, snapshots with the batches): its stored
config says `train.loop: user`, `train.build` and `train.step_fn` name your functions, and `user:` holds
your config. A replay imports your module (it must not train on import: keep the loop under
`if __name__ == "__main__":`), builds with `build(config)`, loads the snapshot and calls `train_step`.

A script as it is written needs neither: leave out `build` and pass the step where it is written, a nested
function closing over the script's own objects::

    model, optimizer = ...                            # the script's own code, unchanged
    def step(batch):
        ...forward, backward, optimizer.step()...
        return loss
    rec = replaybisect.Recorder(model, optimizer, step_fn=step, config=vars(args))
    for batch in batches:
        rec.step(batch)

The stored config then holds `train.script` (the script, its arguments, the working folder): a replay runs the
script again, and this Recorder hands the script's objects over at the first `rec.step` (core/reentry.py).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from replaybisect.core import ranks, reentry, several
from replaybisect.core.step_watch import holds_gradients
from replaybisect.record import ranked
from replaybisect.core.config import PRECISIONS, OnNonfinite, Precision
from replaybisect.errors import ConfigError, NonFiniteStep, ReplayError, Terminated


# ---- naming the user's functions so a replay can import them -------------------------------------------------
def function_target(function: Callable, what: str) -> tuple[str, Path]:
    """`module.function` a replay can import, and the folder it imports from."""
    qualname = getattr(function, "__qualname__", "")
    if not callable(function) or not getattr(function, "__module__", None) or "<" in qualname or "." in qualname:
        raise ConfigError(f"{what}={function!r} is not a module-level function; define it at the top level of a module "
                          "so a replay can import it, or leave out build= to record the script as written (a replay runs "
                          "it again)")
    module_name, source = module_and_file(function, what)
    if function.__module__ == "__main__":
        _check_import_is_quiet(source)
    folder = source.resolve().parent
    for _ in module_name.split(".")[1:]:  # a package module: the folder the top package is in
        folder = folder.parent
    return f"{module_name}.{qualname}", folder


def module_and_file(code: Callable, what: str) -> tuple[str, Path]:
    """The name a replay imports `code`'s module by (a script run as `__main__`: its file's stem), and its file."""
    module_name = code.__module__
    source = Path(getattr(sys.modules.get(module_name), "__file__", "") or "")
    if not source.is_file():
        raise ConfigError(f"{what}: cannot find the file of module {module_name}; define it in a .py file")
    return (source.stem if module_name == "__main__" else module_name), source


def _check_import_is_quiet(script: Path) -> None:
    """A replay imports the script: training must not start on import. Refused at the top level (outside an
    `if __name__ == "__main__":` block): loops, `with` blocks, calls of the script's own functions, and
    anything that makes a Recorder."""
    tree = ast.parse(script.read_text(encoding="utf-8"))
    own = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            continue
        calls_own = any(isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in own for sub in ast.walk(node))
        if isinstance(node, (ast.For, ast.While, ast.With, ast.AsyncFor, ast.AsyncWith)) or calls_own or "Recorder(" in ast.unparse(node):
            raise ConfigError(f"{script.name} line {node.lineno} runs code when imported, and a replay imports {script.name} "
                              "for build and step_fn: put the training under `if __name__ == \"__main__\":`")


def unwrapped(value: Any, attribute: str) -> Any:
    """accelerate's prepared optimizer or scheduler: the torch object it wraps (what steps, and what a snapshot
    holds). `accelerator.prepare` leaves the model itself a torch module."""
    inner = getattr(value, attribute, None)
    if value is not None and type(value).__module__.startswith("accelerate.") and inner is not None:
        return inner
    return value


def plain_config(config: Any) -> dict:
    """The user's config as plain data (a DictConfig, dict, dataclass or argparse Namespace)."""
    from omegaconf import DictConfig, OmegaConf

    if config is None:
        return {}
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if not isinstance(config, dict) and hasattr(config, "__dict__"):
        config = vars(config)
    if not isinstance(config, dict):
        raise ConfigError(f"config is a {type(config).__name__}; pass a dict, a DictConfig, a dataclass or a Namespace")
    try:
        return OmegaConf.to_container(OmegaConf.create(config), resolve=True)
    except Exception as error:
        raise ConfigError(f"config cannot be stored as YAML ({str(error).splitlines()[0]}); keep it to numbers, strings, lists and dicts") from None


def replay_config(*, step_target: Optional[str], build_target: Optional[str], config: dict, seed: int, precision: str,
                  snapshot_every: int, layer_stats_every: int, on_nonfinite: str, steps: Optional[int],
                  script: Optional[dict] = None, distributed: Optional[dict] = None, clip_grad_norm: Optional[float] = None):
    """The run's config in replaybisect's schema: what `replay` reads back. A script run (`script`: how it was
    started) names no functions: its step is a closure, replayed by running the script again."""
    from omegaconf import OmegaConf

    from replaybisect.core.config import ReplayConfig, validate

    cfg = OmegaConf.merge(OmegaConf.structured(ReplayConfig), {
        "seed": seed,
        "loss": None,
        "user": config,
        "train": {"loop": "user", "step_fn": _partial(step_target), "build": _partial(build_target), "script": script,
                  "precision": precision, "clip_grad_norm": clip_grad_norm,
                  "steps": steps or 1, "val_every": 0, "device": "auto", **(distributed or {})},
        "snapshot": {"every": snapshot_every, "layer_stats_every": layer_stats_every, "on_nonfinite": on_nonfinite,
                     "keep_batches": True},
    })
    validate(cfg)
    return cfg


def _partial(target: Optional[str]) -> Optional[dict]:
    return {"_target_": target, "_partial_": True} if target is not None else None


# ---- the recorder ---------------------------------------------------------------------------------------------
def loop_data_started(last_step_end: Optional[float], called: float, opened: float) -> float:
    """When the loop's data time for a step began: the recorder's last step end (the first step: when the recorder was
    called), moved on by the recorder's own opening of the step (called..opened: snapshot, RNG, batch copy, a ranked
    job's gather of every rank's batch), which is not the loop's time."""
    return (last_step_end if last_step_end is not None else called) + (opened - called)


class Recorder:
    """Records your loop: metrics to MLflow every step, snapshots (model, optimizer, scheduler, scaler, RNG) every
    `snapshot_every` steps with every batch in between. `step(batch)` runs your step function on the batch.

    step_fn(model, optimizer, batch, ...): one optimizer step: forward, backward, clipping, optimizer.step(),
        micro-batch accumulation, all yours; it returns the loss. It gets the arguments it names from model,
        optimizer, scheduler, scaler, batch, config (or cfg), step, carry. If it takes no `scheduler`, the recorder
        steps the scheduler after each update. Keep randomness inside it on torch's generators (dropout is). `carry`
        is a dict the step keeps state in for the next step (an RNN's hidden state: `carry["hidden"] = h.detach()`):
        stored with every batch; a replay's first step starts from the stored one, and later steps from what the
        replay itself computed, not from the recording.
    model, optimizer (and scheduler) may be several, by name: `Recorder({"G": netG, "D": netD}, {"G": optG, "D": optD})`
        records a GAN's step (core/several.py): every optimizer in each snapshot, a step ends when each has stepped.
    build(config) -> (model, optimizer[, scheduler[, scaler]]) or a dict: how a replay makes the objects. Left out,
        the run is a script's: step_fn may be a closure over the script's objects, and a replay runs the script
        again (its command line, in its working folder), taking the objects over at the first `step`.
    config: your config (a Hydra DictConfig, dict, dataclass, Namespace), stored with the run and given back to
        build and step_fn on replay.
    precision: noted from the autocast regions your first step enters, unless given (fp32 | bf16 | fp16).
    on_nonfinite: "stop" (default: `step` raises NonFiniteStep, the run ends FAILED) or "continue".
    """

    def __init__(self, model, optimizer=None, *, step_fn: Optional[Callable] = None, build: Optional[Callable] = None, config: Any = None, scheduler=None,
                 scaler=None, seed: Optional[int] = None, precision: Optional[Precision] = None,
                 tracking_uri: Optional[str] = None, experiment: Optional[str] = None, run_name: Optional[str] = None,
                 snapshot_every: int = 100, layer_stats_every: int = 50, on_nonfinite: OnNonfinite = "stop",
                 steps: Optional[int] = None):
        from omegaconf import OmegaConf

        from replaybisect.core import user_step
        from replaybisect.core.inline_step import RemoteStep
        from replaybisect.core.loop import BufferGuard, TrainState
        from replaybisect.record.inline import InlineRecording
        from replaybisect.errors import sigterm_raises

        seed = _checked_arguments(tracking_uri, experiment, run_name, seed, snapshot_every, layer_stats_every, steps, on_nonfinite)
        inline = step_fn is None  # the loop as it is written: its steps found by watching model and optimizer
        if inline and build is not None:
            raise ConfigError("without step_fn the Recorder watches your loop's model and optimizer as they run: pass no "
                              "build= (a replay runs your script again); pass step_fn= with build=")
        optimizer, scheduler = unwrapped(optimizer, "optimizer"), unwrapped(scheduler, "scheduler")
        parts = user_step.unpack_parts({"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}, "Recorder")
        model, scheduler = parts["model"], parts["scheduler"]  # (several, by name: one of each, core/several.py)
        if not inline:
            user_step.step_arguments(step_fn)
        self._inline: Optional[InlineRecording] = None  # recording a loop without step_fn
        self._ranked: Optional[ranked.RankedSteps] = None  # one rank of a distributed job
        self._remote: Optional[RemoteStep] = None  # replaying one
        self._handover = None
        if reentry.replaying():  # a replay re-entered this script: the objects go to it at the first step
            self._hand_over_later(parts, step_fn, updates_by_hand=optimizer is None)
            return
        one_line_failures()  # a refusal below ends the script with its one line (each rank's, under torchrun)
        ranked.refuse_sharded(model, snapshot_every)
        if inline and on_nonfinite != "stop":
            raise ConfigError("without step_fn a non-finite step stops the run (on_nonfinite=\"stop\"): the Recorder "
                              "cannot take your loop's step again; pass step_fn= to go on past it")
        step_target, build_target, script, code_folder, name = self._how_replayed(step_fn, build)
        link = ranked.link_for(inline, build, step_fn)  # one rank of a distributed job, or None
        self._ranked = ranked.RankedSteps(link, model, snapshot_every) if link is not None else None
        if precision is not None and precision not in PRECISIONS:
            raise ConfigError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
        config_plain = plain_config(config)
        self._settings = dict(step_target=step_target, build_target=build_target, script=script, config=config_plain,
                              seed=torch.initial_seed() if seed is None else seed, snapshot_every=snapshot_every,
                              layer_stats_every=layer_stats_every, on_nonfinite=on_nonfinite, steps=steps,
                              distributed=ranks.layout(link.world_size, self._ranked.sharded) if link is not None else None,
                              clip_grad_norm=self.clip_grad_norm)
        self.cfg = replay_config(precision=precision or "fp32", **self._settings)  # validates before any run exists
        self._precision_seen: Optional[list[str]] = None if precision else []  # noted on the first step
        self.state = TrainState(cfg=self.cfg, model=model, optimizer=parts["optimizer"], scheduler=scheduler, scaler=scaler,
                                loss_fn=None, step_fn=step_fn, device=user_step.model_device(model),
                                precision=precision, clip_grad_norm=self.clip_grad_norm, user_loop=True,
                                user_config=OmegaConf.create(config_plain), carry={},
                                ranks_agree=ranks.any_rank_failed(user_step.model_device(model)) if link is not None else None)
        self._buffers = BufferGuard(model)
        self.steps_taken = 0
        self._last_outcome = None  # the last recorded step's outcome: its loss read when asked (last_loss)
        self.first_nonfinite_step: Optional[int] = None
        self._config_written = False
        self._last_step_end: Optional[float] = None
        self._last_updated = True  # the last rec.step made an update (else the next carries its gradients on)
        self._eval_tagged = False  # the run's tag says the model trained in eval mode
        sources = own_sources(*([step_fn] if step_fn else []), *([build] if build else []),
                              files=[Path(script["path"])] if inline else [])
        self._session, self._hooks = ranked.run_of_this_rank(
            link, tracking_uri, on_nonfinite,
            lambda: open_session(tracking_uri, experiment, code_folder, {"replaybisect.loop": "user", **sources, **self.run_tags,
                                                                          **_optimizer_names(parts["optimizer"])},
                                 run_name or f"train {name} (own loop)"),
            lambda session: session.start_recording(self.cfg, self.state, {"seed": int(self.cfg.seed)}, runs_steps=not inline))
        self.store, self.run_id = self._session.store, self._session.run_id
        one_line_failures()  # (rank 0 has it from open_session; the other ranks end with one line too)
        self._exit = contextlib.ExitStack()
        self._exit.enter_context(sigterm_raises())
        if inline:
            try:
                self._inline = InlineRecording(self)
            except ConfigError as error:
                self._fail(error)
                raise
        _watch_unclosed(self)  # a script that never calls rec.close() ends its run at exit, snapshots whole

    # what a recorder for replaybisect's own loop (verbs/train/ranks.py) sets differently
    clip_grad_norm: Optional[float] = None  # clipped where the step watch sees the gradients, as the built-in step does
    run_tags: dict = {}

    def _how_replayed(self, step_fn, build):
        return _how_replayed(step_fn, build)

    def _hand_over_later(self, parts: dict, step_fn: Optional[Callable], updates_by_hand: bool) -> None:
        """In a replay that re-entered the script: the objects go to the replay at the first step (core/reentry.py);
        a loop recorded as written runs each step the replay asks for (core/inline_step.py)."""
        from replaybisect.core.inline_step import RemoteStep

        self._handover = {**parts, "step_fn": step_fn}
        if step_fn is None:
            self._remote = RemoteStep(parts["model"], parts["optimizer"], parts["scaler"],
                                      lambda: reentry.hand_over(self._handover), updates_by_hand=updates_by_hand)
            self._handover["step_fn"] = self._remote
            reentry.at_script_end(self._remote.script_done)  # a script without rec.close() ends its loop there
            reentry.at_script_raise(self._remote.script_raised)
        self.run_id, self.store, self.steps_taken, self._last_outcome = reentry.replayed_run_id(), None, 0, None

    # ---- the loop ------------------------------------------------------------------------------------------
    @property
    def last_loss(self) -> Optional[float]:
        """The last recorded step's loss (read from the device when asked)."""
        return self._last_outcome.loss if self._last_outcome is not None else None

    def step(self, batch) -> torch.Tensor | float:
        """Run one step of your step function on `batch` and record it; returns the loss: a 0-dim tensor on the
        step's device, not read from it (read it when you print it, as a plain loop would: `f"{loss:.4f}"`), or a
        float where it was read anyway (a DDP job's rank, a step that returned a number)."""
        from replaybisect.core import loop, user_step

        if self._handover is not None and self._remote is None:
            reentry.hand_over(self._handover)  # the replay takes over here and ends the process
        if self._remote is not None or self._inline is not None:
            raise ConfigError("this Recorder has no step_fn: it records your loop as it runs, so call no rec.step(); "
                              "pass step_fn= to run your step through rec.step(batch)")
        if self._session.ended:
            raise RuntimeError("this Recorder is closed; make a new one for another run")
        step = self.steps_taken
        if step == 0:
            code = getattr(self.state.step_fn, "__code__", None)
            if code is not None:
                self._tag_loop(code.co_filename, code.co_firstlineno, code.co_name)
        called = time.perf_counter()
        try:
            rng_at_start = loop.open_step(step, self.state, self._hooks, self._buffers)
            # the step begins with cleared gradients, unless the last one made no update: it accumulates over rec.step calls
            carried = not self._last_updated and holds_gradients(self.state.params)
            record = user_step.pack(batch, self.state.device, rng_at_start, self.state.optimizer,
                                    self.state.carry if user_step.takes_carry(self.state.step_fn) else None,
                                    user_step.step_variables(self.state.step_fn) if self._settings["script"] else None,
                                    grads_carried=carried, eval_modules=self._modes(step))
            stored = record
            if self._ranked is not None:
                self._ranked.opened(step, self.state)
                stored = self._ranked.stored(step, record)
            data_started = loop_data_started(self._last_step_end, called, time.perf_counter())
            self.state.fresh_record = True
            with self._noting_precision():
                outcome, keep_going = loop.take_step(self.state, step, record, self._hooks, self._buffers, rng_at_start,
                                                     data_started, stored=stored)
            if self._ranked is not None:
                self._ranked.finished(step, outcome.loss, self._hooks)
            self._last_updated = outcome.updated or outcome.scaler_skipped
            self._stepped(outcome)
            self._last_step_end = time.perf_counter()  # after the recorder's own flush of the step
        except BaseException as error:
            self.state.fresh_record = False
            failure = self._fail(error)
            if failure is not None:  # a full disk met outside the snapshot writer: its one line, as replay train says it
                raise failure from error
            raise
        if not keep_going:
            self._stop(getattr(self._hooks, "failed_outcome", None) or outcome)  # (a failure found at a flush: the step it happened at)
        value = outcome.loss_value  # (a copy: the value queued for logging stays as the step left it)
        return value.clone() if isinstance(value, torch.Tensor) else value

    def _tag_loop(self, filename: str, line: int, function: str) -> None:
        """Where the user's loop (or step function) is, as the run's tag loop_line: a finding about the loop names it."""
        if self.store is not None:
            self.store.set_tags(self.run_id, {LOOP_TAG: f"{Path(filename).name}:{line} in {function}"[:250]})

    def _modes(self, step: int) -> list[str]:
        """The modules in eval mode as this step begins (its record keeps them: a replay sets them so); the run is tagged
        at the first step the whole model trains in eval mode (dropout off: replay diagnose's model-in-eval)."""
        from replaybisect.core import user_step

        in_eval = user_step.eval_modules(self.state.model)
        if "" in in_eval and not self._eval_tagged and self.store is not None:
            self._eval_tagged = True
            self.store.set_tags(self.run_id, {EVAL_TAG: step})
        return in_eval

    def _stepped(self, outcome) -> None:
        """A step is recorded (by `step`, or seen in the loop: record/inline.py)."""
        if not self._config_written:
            self._write_config()
        self.steps_taken = outcome.step + 1
        self._last_outcome = outcome
        if outcome.nonfinite and self.first_nonfinite_step is None:
            self.first_nonfinite_step = outcome.step

    def _stop(self, outcome) -> None:
        """A non-finite step ended the run: it is closed, and NonFiniteStep says so."""
        self.first_nonfinite_step, self.steps_taken = outcome.step, outcome.step + 1
        self.close()
        raise nonfinite_step(outcome, self.run_id)

    def _noting_precision(self):
        """The first step notes the autocast regions it enters (the run's precision), unless it was given."""
        from replaybisect.core import user_step

        if self._config_written or self._precision_seen is None:
            return contextlib.nullcontext()
        return user_step.noting_precision(self._precision_seen)

    def _write_config(self) -> None:
        if self._precision_seen is not None:  # the autocast dtype the first step ran under (fp16 if any region was)
            seen = set(self._precision_seen)
            detected = "fp16" if "fp16" in seen else "bf16" if "bf16" in seen else "fp32"
            self._precision_seen = None
            self.cfg = replay_config(precision=detected, **self._settings)
            self.state.cfg, self.state.precision = self.cfg, detected
        self._session.write_config(self.cfg)
        self._config_written = True

    # ---- the end ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish every pending write and end the run (FINISHED, or FAILED after a non-finite step)."""
        if self._remote is not None:
            self._remote.script_done()  # a replay asking for another step is told; the replay ends the process
        if self._handover is not None or self._session.ended:
            return
        try:
            if self._inline is not None:
                self._inline.close()
            if not self._config_written:
                self._write_config()
            self._session.finish()
        except BaseException as error:
            self._fail(error)
            raise
        finally:
            self._exit.close()

    def _fail(self, error: BaseException):
        """Ctrl-C / SIGTERM: KILLED; anything else FAILED; what was recorded stays. Returns the one-line DiskFull to
        raise instead of `error`, if it is one."""
        if isinstance(error, Terminated):  # seen on its way up (a script's loop holds no sigterm_raises block to see it)
            Terminated.pending = False
        try:
            if self._inline is not None:
                self._inline.crashed(error)
                self._inline.remove()
            if self._ranked is not None and self._ranked.is_writer:
                error = self._ranked.blamed(error, self.store, self.run_id)
            return self._session.fail(error)
        finally:
            self._exit.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if self._handover is not None:
            return
        if error is None or isinstance(error, NonFiniteStep):
            self.close()
        else:
            self._fail(error)


def _optimizer_names(optimizer) -> dict[str, str]:
    """The run's tag naming its optimizers, where several (an ablation arm on one: lr[D]=x0.1)."""
    from replaybisect.store import TAG

    if not isinstance(optimizer, several.Optimizers):
        return {}
    return {TAG + several.OPTIMIZERS_TAG: ",".join(optimizer.named)}


def _checked_arguments(tracking_uri, experiment, run_name, seed, snapshot_every, layer_stats_every, steps,
                       on_nonfinite) -> Optional[int]:
    """Every argument checked before anything is recorded (a wrong kind is a one-line ReplayError); the seed."""
    from replaybisect.core import arguments

    arguments.tracking_uri(tracking_uri)
    arguments.text(experiment, "experiment")
    arguments.text(run_name, "run_name")
    arguments.count(snapshot_every, "snapshot_every")
    arguments.count(layer_stats_every, "layer_stats_every")
    arguments.count(steps, "steps", minimum=1, optional=True)
    arguments.text(on_nonfinite, "on_nonfinite")
    return None if seed is None else arguments.integer(seed, "seed")


def _how_replayed(step_fn: Callable, build: Optional[Callable]) -> tuple[Optional[str], Optional[str], Optional[dict], Path, str]:
    """(step target, build target, script entry, code folder, name for the run): importable functions a replay
    imports, or without `build` the script a replay runs again (its step may then be a closure)."""
    if build is not None:
        step_target, folder = function_target(step_fn, "step_fn")
        build_target, _ = function_target(build, "build")
        return step_target, build_target, None, folder, step_target.rsplit(".", 1)[0]
    if step_fn is not None and not callable(step_fn):
        raise ConfigError(f"step_fn={step_fn!r} is not a function; pass your step (a function of the batch)")
    script = reentry.script_entry()
    return None, None, script, Path(script["path"]).parent, Path(script["path"]).stem


def open_session(tracking_uri: Optional[str], experiment: Optional[str], code_folder: Path, tags: dict[str, str],
                 run_name: str):
    """The run a library recorder (the Recorder, the Lightning callback) writes to, announced on stderr."""
    from replaybisect.record.session import RunSession
    from replaybisect.store import open_store

    session = RunSession.open(open_store(tracking_uri), code_folder=code_folder, run_name=run_name, experiment=experiment,
                              tags=tags)
    print(f"replaybisect: recording run {session.run_id} to {session.store.uri}", file=sys.stderr)
    one_line_failures()
    return session


def own_sources(*code: Callable, files: list[Path] = ()) -> dict[str, str]:
    """The tag holding the sha256 of the files of the user's modules a replay imports: those defining `code` (the
    step and build functions, the LightningModule), already checked by function_target. A replay says which of them
    changed since (core.repo.changed_sources). No tag when no file can be read or the hashes do not fit one."""
    import json

    from replaybisect.core.repo import SOURCE_TAG, file_sha256
    from replaybisect.store import OLD_SERVER_TAG_VALUE, TAG

    files = {**dict(module_and_file(item, "code") for item in code), **{file.stem: file for file in files}}
    hashes = {name: digest for name, file in files.items() if (digest := file_sha256(file)) is not None}
    text = json.dumps(hashes, sort_keys=True)
    return {TAG + SOURCE_TAG: text} if hashes and len(text) <= OLD_SERVER_TAG_VALUE else {}


def nonfinite_step(outcome, run_id: str) -> NonFiniteStep:
    """What `Recorder.step` and the Lightning callback raise on a step that stopped before its update. In a Hydra
    app it is also one of Hydra's compact errors, which Hydra prints as its message alone."""
    value = outcome.loss if outcome.nonfinite == "loss" else outcome.grad_norm
    stop = NonFiniteStep.of_library(outcome.step, outcome.nonfinite, value, run_id)
    hydra_errors = sys.modules.get("hydra.errors")  # imported by the app: never imported here (2 s)
    if hydra_errors is not None and os.environ.get(FULL_ERROR) != "1":
        compact = type("NonFiniteStep", (NonFiniteStep, hydra_errors.CompactHydraException), {"__str__": _named})
        stop = compact(str(stop), stop.run_id, stop.step, stop.what)
    return stop


LOOP_TAG = "loop_line"  # file:line of the loop's first training call (or of the step function)
EVAL_TAG = "eval_mode_step"  # the first step the whole model trained in eval mode
FULL_ERROR = "REPLAYBISECT_FULL_ERROR"  # =1: the whole traceback of a stopped run, framework frames and all


def _named(stop: BaseException) -> str:
    return f"replaybisect.NonFiniteStep: {BaseException.__str__(stop)}"


# Recorders whose run is not ended yet: a script may leave out rec.close() (the three-line form, or a step function)
_UNCLOSED: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


def _watch_unclosed(recorder: Recorder) -> None:
    """A script that ends without `rec.close()` ends its run at exit: FINISHED, or FAILED (KILLED for Ctrl-C)
    when an exception ended the script (one_line_failures' hook)."""
    if not _UNCLOSED:
        # before the interpreter's own exit handlers: concurrent.futures refuses new work from then on, and a run's
        # last snapshot is written by a worker thread (threading's exit hooks run in reverse order of registration)
        register = getattr(threading, "_register_atexit", atexit.register)
        register(_close_unclosed)
    _UNCLOSED.add(recorder)


def _close_unclosed() -> None:
    for recorder in list(_UNCLOSED):
        if not recorder._session.ended:
            with contextlib.suppress(Exception):
                recorder.close()
    _UNCLOSED.clear()


def _fail_unclosed(error: BaseException) -> None:
    for recorder in list(_UNCLOSED):
        if not recorder._session.ended:
            with contextlib.suppress(Exception):
                recorder._fail(error)
    _UNCLOSED.clear()


def one_line_failures() -> None:
    """A script that lets NonFiniteStep end it (a Trainer's fit, a bare loop) ends with its one line, the answer
    and the next command, instead of a traceback through the framework; so does one the recorder refuses as the
    loop runs (a ReplayError). REPLAYBISECT_FULL_ERROR=1 shows it all."""
    if getattr(sys.excepthook, "replaybisect", False):
        return
    previous = sys.excepthook

    def excepthook(kind, error, trace) -> None:
        _fail_unclosed(error)  # a loop's run left open by the exception that ended the script
        if issubclass(kind, Terminated) and os.environ.get(FULL_ERROR) != "1":
            # the script ends as SIGTERM ends a process (exit status 143), its run KILLED, in one line
            print("replaybisect: terminated (SIGTERM); the run ended KILLED with what it recorded", file=sys.stderr, flush=True)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        if os.environ.get(FULL_ERROR) == "1" or not issubclass(kind, (NonFiniteStep, ReplayError)):
            previous(kind, error, trace)
        elif issubclass(kind, NonFiniteStep):
            print(_named(error) if not str(error).startswith("replaybisect.") else error, file=sys.stderr)
        else:  # what the recorder refuses in your loop (an update by hand that accumulates): its one line
            print(f"replaybisect: {error}", *getattr(error, "__notes__", []), sep="\n", file=sys.stderr)

    excepthook.replaybisect = True
    sys.excepthook = excepthook
