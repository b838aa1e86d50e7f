"""The step and the loop: the one code path that `train`, `nan`, `ablate`, `check` and bisect trials share.

Reads top to bottom:
  1. build everything from the config (seeded, so construction is reproducible);
  2. the batch of step t is a pure function of (seed, t): no iterator state to save; each item is read under RNG
     streams seeded by (seed, t, index), so DataLoader workers (train.num_workers) build the same batches;
  3. one step: forward under autocast -> loss -> backward (scaled for fp16) -> pre-clip grad norm
     -> optional clip -> optimizer update -> scheduler;
  4. the loop runs steps and hands each outcome to a recorder (or a replay comparator).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from replaybisect.core import oom, op_trace, user_step
from replaybisect.core.snapshot import like
from replaybisect.core.state import copy_into, copy_state, load_state  # noqa: F401 (loop.copy_state, loop.load_state)
from replaybisect.core.device import resolve_device
from replaybisect.core.config import Precision, build_optimizer, check_closure_optimizer, instantiate, needs_closure
from replaybisect.core.observer import StepObserver
from replaybisect.core.step_watch import StepHalted, StepOutcome, StepWatch, fault_handler  # noqa: F401 (loop.StepOutcome)
from replaybisect.errors import ConfigError, ReplayError, raise_if_terminated
from replaybisect.core.rng import (capture_raw, epoch_permutation_seed, isolated_rng, restore_raw, sample_seed, seed_everything,
                                   seed_sample_streams)

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- step functions: (model, batch, loss_fn) -> scalar loss --------------------------------
def supervised_step(model, batch, loss_fn):
    """(inputs, targets) tuples, or dicts with `input`/`target` keys."""
    inputs, targets = (batch["input"], batch["target"]) if isinstance(batch, dict) else (batch[0], batch[1])
    return loss_fn(model(inputs), targets)


def sequence_step(model, batch, loss_fn):
    """Language modelling: (B, T) tokens -> (B, T, V) logits, flattened for a token-level loss."""
    inputs, targets = (batch["input"], batch["target"]) if isinstance(batch, dict) else (batch[0], batch[1])
    logits = model(inputs)
    return loss_fn(logits.flatten(0, 1), targets.flatten())


# ---- data: batch of step t = f(seed, t) ---------------------------------------------------
@dataclass
class BatchSource:
    """Data order as a pure function of (seed, step): a per-epoch permutation seeded by (seed, epoch); items read
    under streams seeded by (seed, step, index). Reads in this process, in any order (replays, checks)."""

    dataset: Any
    batch_size: int
    seed: int
    _epoch: int = field(default=-1, repr=False)
    _permutation: Optional[torch.Tensor] = field(default=None, repr=False)

    def __post_init__(self):
        if len(self.dataset) < self.batch_size:
            raise ConfigError(
                f"the dataset has {len(self.dataset)} samples, fewer than train.batch_size={self.batch_size}; lower train.batch_size"
            )
        self.steps_per_epoch = len(self.dataset) // self.batch_size

    def indices(self, step: int) -> torch.Tensor:
        epoch, position = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(epoch_permutation_seed(self.seed, epoch))
            self._permutation = torch.randperm(len(self.dataset), generator=generator)
            self._epoch = epoch
        start = position * self.batch_size
        return self._permutation[start : start + self.batch_size]

    def batch(self, step: int):
        return default_collate(read_samples(self.dataset, self.seed, step, [int(i) for i in self.indices(step)]))


def read_samples(dataset, seed: int, step: int, indices: list[int]) -> list:
    """Items `indices` of step `step`, each read under RNG streams seeded by (seed, step, index): a random
    augmentation in __getitem__ draws the same numbers in any process, and the training streams are untouched."""
    if getattr(type(dataset).__getitem__, "draws_no_randomness", False):
        return [dataset[index] for index in indices]
    with isolated_rng():
        items = []
        for index in indices:
            seed_sample_streams(sample_seed(seed, step, index))
            items.append(dataset[index])
    return items


class _StepBatches(Dataset):
    """The DataLoader's view of a BatchSource: item `step` is the batch of step `step`, built in a worker."""

    def __init__(self, source: BatchSource):
        self.source = source

    def __getitem__(self, step: int):
        return self.source.batch(step)


class _StepsFrom(Sampler):
    """Steps `start`, `start`+1, ... for the DataLoader to hand its workers; `start` is set before each iter()."""

    def __init__(self):
        self.start = 0

    def __iter__(self):
        return itertools.count(self.start)


def _as_built(batch):
    return batch


def _leave_stopping_to_the_main_process(worker_id: int) -> None:
    """Ctrl-C and SIGTERM (sent to the whole process group by a terminal or SLURM) end the run through the main
    process, which stops the workers: a worker that died of them first would turn a clean stop into a crash.
    A main process stopped while it fetched a batch's tensors drops the connection multiprocessing's fd-sharing
    thread is serving; that thread's traceback (through sys.excepthook) would break the one line a stopped run prints."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    default_hook = sys.excepthook

    def quiet_when_the_reader_left(kind, error, trace) -> None:
        if issubclass(kind, (ConnectionError, EOFError)) and any(
                frame.filename.endswith("resource_sharer.py") for frame in traceback.extract_tb(trace)):
            return
        default_hook(kind, error, trace)

    sys.excepthook = quiet_when_the_reader_left


class WorkerBatches:
    """BatchSource.batch(step) built ahead by DataLoader worker processes (train.num_workers): the same batches,
    since each is the same pure function of (seed, step). Steps asked for in order come from the workers'
    read-ahead; any other step restarts the read-ahead there (the workers persist)."""

    def __init__(self, source: BatchSource, num_workers: int, start: int = 0):
        self.steps = _StepsFrom()
        self.loader = DataLoader(
            _StepBatches(source), batch_size=None, sampler=self.steps, num_workers=num_workers, collate_fn=_as_built,
            worker_init_fn=_leave_stopping_to_the_main_process, persistent_workers=True,
            generator=torch.Generator(),  # an explicit generator: the workers' seeds are not drawn from the training stream
            multiprocessing_context="fork" if sys.platform == "linux" else None,  # start in milliseconds (3.14 defaults to forkserver)
        )
        self._restart(start)  # the workers start now, reading ahead from `start`

    def _restart(self, step: int) -> None:
        self.steps.start = step
        self._iterator = iter(self.loader)
        self._next_step = step

    def __call__(self, step: int):
        if self._iterator is None or step != self._next_step:
            self._restart(step)
        self._next_step = step + 1
        return next(self._iterator)

    def close(self) -> None:
        if self._iterator is not None:
            self._iterator._shutdown_workers()  # now, not when the loader is collected
            self._iterator = None


@contextlib.contextmanager
def read_ahead(source: BatchSource, num_workers: int, start: int = 0):
    """step -> batch for the loop: `source.batch` itself, or with num_workers > 0 the same batches built ahead by
    worker processes from step `start` on (stopped on leaving the block)."""
    if num_workers <= 0:
        yield source.batch
        return
    batches = WorkerBatches(source, num_workers, start)
    try:
        yield batches
    finally:
        batches.close()


# ---- state ---------------------------------------------------------------------------------
@dataclass
class TrainState:
    """Everything a step reads or changes, named: nothing reached through globals."""

    cfg: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Optional[torch.amp.GradScaler]
    loss_fn: Callable
    step_fn: Callable
    device: torch.device
    precision: Precision
    clip_grad_norm: Optional[float]
    user_loop: bool = False  # the step is the user's own (a run recorded by replaybisect.Recorder): see core/user_step.py
    user_config: Any = None  # loop: user: the user's config, handed to their build and step functions
    accumulate: int = 1  # micro-batches per optimizer step (built-in step)
    # loop: user: what the user's step carries to the next one (an RNN's hidden state), when it takes `carry`;
    # None until a replay's first step takes it from that step's record (core/user_step.py)
    carry: Optional[dict] = None
    # loop: user, recorded from a script: the script's own objects, handed over when a replay re-entered it
    # (core/reentry.py); nothing can rebuild them, so a copy is saved and put back in place (state_copy)
    live: bool = False
    # one rank of a distributed job while it records: whether any rank's step failed, asked of every rank before the
    # update (core/ranks.py); the ranks halt together, so none waits in an all-reduce for one that stopped
    ranks_agree: Optional[Callable[[bool], bool]] = None
    # loop: user: an ablation arm's zero-grad: every replayed step starts with cleared gradients, whatever the
    # recorded loop did (a loop that never zeroes them, core/user_step.carries_gradients)
    clear_grads: bool = False
    # loop: user: the next record to run was packed from this state just now (rec.step): its RNG streams and module
    # modes are already this state's, so the step does not set them again (core/user_step._run_record); one step only
    fresh_record: bool = False

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]




def build_state(cfg, device: torch.device | None = None) -> TrainState:
    """Seed, then build model, optimizer, scheduler and scaler in a fixed order."""
    if cfg.train.num_threads:
        torch.set_num_threads(int(cfg.train.num_threads))
    if cfg.train.loop == "user":
        return _build_user_state(cfg)
    device = device or resolve_device(cfg.train.device)
    seed_everything(cfg.seed)
    model = instantiate(cfg.model, "model")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"`model` built a {type(model).__name__}, not a torch.nn.Module; point model._target_ at an nn.Module")
    model = model.to(device)
    optimizer = build_optimizer(cfg.optim, model.parameters(), model=model)
    check_closure_optimizer(cfg, optimizer)
    scheduler = instantiate(cfg.scheduler, "scheduler")(optimizer=optimizer) if cfg.get("scheduler") else None
    scaler = torch.amp.GradScaler(device.type) if cfg.train.precision == "fp16" else None
    loss_fn = instantiate(cfg.loss, "loss")
    step_fn = instantiate(cfg.train.step_fn, "train.step_fn")
    return TrainState(
        cfg=cfg,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        loss_fn=loss_fn,
        step_fn=step_fn,
        device=device,
        precision=cfg.train.precision,
        clip_grad_norm=cfg.train.clip_grad_norm,
        accumulate=cfg.train.accumulate,
    )


def _build_user_state(cfg) -> TrainState:
    """A run recorded from the user's own loop: their build(config) makes the objects (on the device they choose)."""
    from replaybisect.core import ranks

    seed_everything(cfg.seed)
    parts = user_step.build_parts(cfg)
    device = user_step.model_device(parts["model"])
    return TrainState(
        cfg=cfg,
        model=parts["model"],
        optimizer=parts["optimizer"],
        scheduler=parts["scheduler"],
        scaler=parts["scaler"],
        loss_fn=None,
        step_fn=parts["step_fn"],
        device=device,
        precision=cfg.train.precision,
        clip_grad_norm=cfg.train.clip_grad_norm,
        user_loop=True,
        user_config=parts["user_config"],
        live=cfg.train.get("script") is not None,
        # replay nan --nproc: the ranks halt together at a non-finite step, as they did recording
        ranks_agree=ranks.any_rank_failed(device) if ranks.replaying_rank() is not None else None,
    )


@contextlib.contextmanager
def state_copy(state: TrainState, cfg=None) -> Iterator[TrainState]:
    """A copy of the state to change freely (clone_state), gone when the block ends. A live state (a re-entered
    script's own objects, which its step function closes over) cannot be copied into other objects: the copy is
    the same objects, and their values (weights, optimizer, scheduler, scaler, carry) are put back afterwards."""
    if not state.live:
        yield clone_state(state, cfg)
        return
    with kept_in_place(state):
        copy = under_settings(state, cfg if cfg is not None else state.cfg)
        copy.carry = user_step.copied(state.carry, "carry") if state.carry is not None else None
        yield copy


def under_settings(state: TrainState, cfg) -> TrainState:
    """The same objects under `cfg`'s step settings (precision, clipping): a live state's ablation arm, which has
    the objects to itself in its own process."""
    return replace(state, cfg=cfg, precision=cfg.train.precision, clip_grad_norm=cfg.train.clip_grad_norm)


@contextlib.contextmanager
def kept_in_place(state: TrainState) -> Iterator[None]:
    """Whatever the block does to the state's objects is undone when it ends: their values are saved and loaded
    back, the gradients, the train/eval mode and the carry restored."""
    saved = copy_state(state)
    buffers = {name: buffer.detach().clone() for name, buffer in state.model.named_buffers()}  # non-persistent ones too
    # the gradients a loop that does not clear them carries into its next step
    grads = [param.grad.detach().clone() if param.grad is not None else None for param in state.model.parameters()]
    carry = user_step.copied(state.carry, "carry") if state.carry is not None else None
    training = [module.training for module in state.model.modules()]
    try:
        yield
    finally:
        load_state(state, saved)
        with torch.no_grad():
            for name, buffer in state.model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
        for param, grad in zip(state.model.parameters(), grads):
            param.grad = grad
        for module, mode in zip(state.model.modules(), training):
            module.training = mode
        state.carry = carry


def clone_state(state: TrainState, cfg=None) -> TrainState:
    """An independent copy of model, optimizer, scheduler, scaler and loss module: what a probe, a check or an
    ablation arm may change without touching the live state. With `cfg`, the copy lives in objects built from
    that config (an arm's changed optimizer or precision) and carries the state's weights, moments, schedule
    and grad scale. RNG streams and the thread count are left as they were.

    Optimizer and scheduler are rebuilt and loaded from deep copies of their state dicts, the way `restore`
    does it: a deep-copied optimizer loses the step wrapper its scheduler installed, and the copy's scheduler
    then warns that `optimizer.step()` was overridden."""
    target = cfg if cfg is not None else state.cfg
    threads = torch.get_num_threads()
    if state.live:
        raise ReplayError("a replay of a script holds the script's own objects, which cannot be copied into new ones; "
                          "this copy needs loop.state_copy")
    if state.user_loop:
        with isolated_rng():
            parts = user_step.build_parts(target)  # fresh objects from the user's build, holding the state's values
        torch.set_num_threads(threads)
        clone = replace(state, cfg=target, model=parts["model"], optimizer=parts["optimizer"], scheduler=parts["scheduler"],
                        scaler=parts["scaler"], step_fn=parts["step_fn"], precision=target.train.precision,
                        clip_grad_norm=target.train.clip_grad_norm, user_config=parts["user_config"],
                        carry=user_step.copied(state.carry, "carry"))
        copy_into(clone, state)
        return clone
    with isolated_rng():  # building draws from (and seeds) the RNG streams
        model = _clone_model(state, target, rebuild=cfg is not None)
        optimizer, scheduler = _clone_optimizer(state, target, model)
    torch.set_num_threads(threads)
    precision = target.train.precision if target is not None else state.precision
    scaler = torch.amp.GradScaler(state.device.type) if precision == "fp16" else None
    if scaler is not None and state.scaler is not None:
        scaler.load_state_dict(copy.deepcopy(state.scaler.state_dict()))
    clip = target.train.clip_grad_norm if target is not None else state.clip_grad_norm
    accumulate = target.train.accumulate if target is not None else state.accumulate
    return replace(state, cfg=target, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                   loss_fn=copy.deepcopy(state.loss_fn), precision=precision, clip_grad_norm=clip, accumulate=accumulate)


def _clone_model(state: TrainState, cfg, rebuild: bool) -> torch.nn.Module:
    if not rebuild:
        try:
            return copy.deepcopy(state.model)
        except Exception:  # e.g. a non-leaf tensor held as a module attribute: rebuild and load instead
            pass
    model = instantiate(cfg.model, "model").to(state.device)
    model.load_state_dict(state.model.state_dict())
    return model


def _clone_optimizer(state: TrainState, cfg, model: torch.nn.Module):
    if cfg is not None and cfg.get("optim") is not None:
        try:
            optimizer = build_optimizer(cfg.optim, model.parameters(), model=model)
            scheduler = instantiate(cfg.scheduler, "scheduler")(optimizer=optimizer) if cfg.get("scheduler") else None
            optimizer.load_state_dict(copy.deepcopy(state.optimizer.state_dict()))
            if scheduler is not None and state.scheduler is not None:
                scheduler.load_state_dict(copy.deepcopy(state.scheduler.state_dict()))
            return optimizer, scheduler
        except Exception:
            if cfg is not state.cfg:  # an arm's config that does not fit the state: say so
                raise
    # a state not built from (or not rebuildable from) its config: copy the optimizer linked to the copied parameters
    memo = {id(p): q for p, q in zip(state.model.parameters(), model.parameters())}
    return copy.deepcopy(state.optimizer, memo), None


def build_data(cfg) -> tuple[BatchSource, Any]:
    """The training batch source and the validation dataset (or None)."""
    if cfg.get("data") is None:
        raise ConfigError("the run has no `data`: it comes from your own loop, and replays read its stored batches")
    dataset = instantiate(cfg.data, "data")
    val_dataset = instantiate(cfg.val_data, "val_data") if cfg.get("val_data") else None
    return BatchSource(dataset, cfg.train.batch_size, cfg.seed), val_dataset


# ---- one step --------------------------------------------------------------------------------
def autocast(state: TrainState):
    return autocast_region(state.device.type, state.precision)


def autocast_region(device_type: str, precision: str):
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def forward_backward(model, micro_batches: list, step_fn, loss_fn, *, device_type: str, precision: str, scaler=None,
                     on_forward: Optional[Callable[[], None]] = None,
                     on_loss: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None) -> None:
    """The built-in step's forward and backward, written once (the step, its closure, a DDP rank's step): each
    micro-batch's loss under the precision's autocast, divided over the micro-batches, backpropagated (fp16: scaled).
    `on_forward` runs as each forward begins, `on_loss(loss, part)` before each backward."""
    for micro_batch in micro_batches:
        if on_forward is not None:
            on_forward()
        with autocast_region(device_type, precision):
            loss = step_fn(model, micro_batch, loss_fn)
        part = loss / len(micro_batches) if len(micro_batches) > 1 else loss
        if on_loss is not None:
            on_loss(loss, part)
        (scaler.scale(part) if scaler is not None else part).backward()


def to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return like(batch, [to_device(value, device) for value in batch])
    return batch


def run_step(
    state: TrainState,
    step: int,
    batch,
    *,
    halt_on_nonfinite: bool = True,
    observer: StepObserver | None = None,
    defer_reads: bool = False,
    device_guard=None,
) -> StepOutcome:
    """One optimizer step. With halt_on_nonfinite, a non-finite loss or grad norm returns before the
    update, so parameters, optimizer, scheduler and scaler still hold the state before this step. `defer_reads`
    (a recorded step): one host read in the step, the non-finite guard's; the loss and the gradient norm stay on the
    device (StepOutcome reads them when asked). A user's step that steps another optimizer, or a GradScaler, first
    has the losses judged before it (StepWatch.judge_losses)."""
    outcome = StepOutcome(step=step, loss=math.nan, lr=float(state.optimizer.param_groups[0]["lr"]))
    watch = StepWatch(state, outcome, observer, on_fault=fault_handler(halt_on_nonfinite), ranks_agree=state.ranks_agree,
                      defer_reads=defer_reads, device_guard=device_guard)
    if state.user_loop:  # the user's own step (forward, backward, update inside): the same moments, the same halting
        try:
            user_step.run(state, watch, batch)
        except Exception as error:
            _carries_outcome(error, outcome)
            raise
        return outcome
    try:
        _builtin_step(state, watch, batch)
    except StepHalted:
        pass
    except Exception as error:
        _carries_outcome(error, outcome)
        raise
    finally:
        watch.close_forward()  # an observer's forward region (a probe's TorchFunctionMode) never outlives the step
    return outcome


def _carries_outcome(error: Exception, outcome: StepOutcome) -> None:
    """An exception leaving the step carries its outcome (`replaybisect_outcome`: whether the update was applied)."""
    with contextlib.suppress(Exception):  # (an exception type that refuses attributes)
        error.replaybisect_outcome = outcome


def _builtin_step(state: TrainState, watch: StepWatch, batch) -> None:
    model, optimizer, scaler, outcome = state.model, state.optimizer, state.scaler, watch.outcome
    model.train()
    optimizer.zero_grad(set_to_none=True)

    # 1. forward, loss and backward, per micro-batch; fp16 scales the loss and unscales the gradients
    micro_batches = split_batch(batch, state.accumulate)
    forward_backward(model, micro_batches, state.step_fn, state.loss_fn, device_type=state.device.type,
                     precision=state.precision, scaler=scaler or None, on_forward=watch.open_forward, on_loss=watch.loss)
    outcome.loss = watch.running_loss if watch.defer_reads else watch.loss_so_far()
    if scaler:
        watch.judge_losses()  # (deferred reads: a halt comes before the unscale, which a halted step must not make)
        scaler.unscale_(optimizer)
    watch.gradients()  # the grad norm, the non-finite rule, an arm's clip

    # 2. update, schedule
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    elif needs_closure(optimizer):
        optimizer.step(_closure(state, micro_batches))
    elif watch.device_guard is not None:  # a fused optimizer skips a failed step on the device: nothing read here
        watch.device_guard.step_with(optimizer, watch.verdict)
    else:
        optimizer.step()
    if state.scheduler is not None:
        state.scheduler.step()
    watch.updated()
    watch.settle()


def _closure(state: TrainState, micro_batches: list):
    """For optimizers whose step re-evaluates the loss (LBFGS): forward and backward again on the same batch.
    The step's first evaluation (above) is what is logged and observed; the closure's are the optimizer's own."""
    def closure():
        state.optimizer.zero_grad(set_to_none=True)
        parts = []
        forward_backward(state.model, micro_batches, state.step_fn, state.loss_fn, device_type=state.device.type,
                         precision=state.precision, on_loss=lambda loss, part: parts.append(part.detach()))
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    return closure


def split_batch(batch, parts: int) -> list:
    """`parts` micro-batches of equal size along the first dimension (train.accumulate): the step's batch, and
    so the data order, is the same whatever the accumulation."""
    if parts <= 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(parts))
    if isinstance(batch, dict):
        pieces = {key: split_batch(value, parts) for key, value in batch.items()}
        return [{key: pieces[key][i] for key in batch} for i in range(parts)]
    if isinstance(batch, (list, tuple)):
        pieces = [split_batch(value, parts) for value in batch]
        return [like(batch, [piece[i] for piece in pieces]) for i in range(parts)]
    return [batch] * parts


@torch.no_grad()
def validation_loss(state: TrainState, val_dataset, batches: int) -> float:
    """Mean loss over the first `batches` validation batches; never touches the training RNG streams."""
    size = state.cfg.train.batch_size
    count = min(batches, max(1, len(val_dataset) // size))
    total = 0.0
    with isolated_rng():
        state.model.eval()
        try:
            for index in range(count):
                items = [val_dataset[i] for i in range(index * size, min((index + 1) * size, len(val_dataset)))]
                batch = to_device(default_collate(items), state.device)
                with autocast(state):
                    total += float(state.step_fn(state.model, batch, state.loss_fn).float().item())
        finally:
            state.model.train()
    return total / count


# ---- the loop ----------------------------------------------------------------------------------
class BufferGuard:
    """Copies of the model's buffers at the start of a step (BatchNorm running stats and the like, which the
    forward updates in place), so a step that halts can be put back to the state before it."""

    def __init__(self, model: torch.nn.Module):
        self.buffers = [b for b in model.buffers() if b.numel()]
        self.saved = [torch.empty_like(b) for b in self.buffers]

    def save(self) -> None:
        for kept, buffer in zip(self.saved, self.buffers):
            kept.copy_(buffer)

    def restore(self) -> None:
        with torch.no_grad():
            for kept, buffer in zip(self.saved, self.buffers):
                buffer.copy_(kept)

    def ask_as_before_step(self, ask: Callable[[], bool]) -> bool:
        """`ask()` (a halted step's hooks: go on?) with the buffers as they were before the step; if it says go on,
        the forward's updates are put back, as a framework's own loop goes on from them. Returns its answer."""
        after_forward = [buffer.detach().clone() for buffer in self.buffers]
        self.restore()
        keep_going = ask()
        if keep_going:
            with torch.no_grad():
                for buffer, value in zip(self.buffers, after_forward):
                    buffer.copy_(value)
        return keep_going


class LoopHooks(Protocol):
    """What the loop tells a recorder (or a replay comparator) about each step."""

    def before_step(self, step: int, state: TrainState, rng_at_start: dict) -> None: ...
    def observer(self, step: int) -> StepObserver | None: ...
    def on_nonfinite(self, outcome: StepOutcome, batch) -> bool: ...
    def after_step(self, outcome: StepOutcome, batch, step_time: float, data_time: float) -> bool: ...
    def after_validation(self, step: int, val_loss: float) -> None: ...


def train_loop(
    state: TrainState,
    batches: Callable[[int], Any],
    start: int,
    stop: int,
    hooks: LoopHooks,
    *,
    val_dataset=None,
    progress: Callable[[int], None] | None = None,
) -> StepOutcome | None:
    """Run steps start..stop-1. Returns the outcome that stopped the loop early, else None.

    A non-finite step halts before its update and its buffer updates are undone, so `hooks.on_nonfinite`
    sees the state before the step;
    if the hooks say go on, the step is taken again from the same RNG state, as a plain loop would.
    """
    val_every = state.cfg.train.val_every
    buffers = BufferGuard(state.model)
    for step in range(start, stop):
        rng_at_start = open_step(step, state, hooks, buffers)
        data_started = time.perf_counter()
        batch = batches(step)
        outcome, keep_going = take_step(state, step, batch, hooks, buffers, rng_at_start, data_started)
        if progress:
            progress(step)
        if not keep_going:
            return outcome
        if val_dataset is not None and val_every and (step + 1) % val_every == 0:
            hooks.after_validation(step, validation_loss(state, val_dataset, state.cfg.train.val_batches))
    return None


def open_step(step: int, state: TrainState, hooks: LoopHooks, buffers: BufferGuard, rng_at_start: Optional[dict] = None) -> dict:
    """A step's opening, on every recording path: the RNG state it starts with (returned; `rng_at_start`: taken by the
    caller at this moment), its buffers saved (a halted step puts them back), the hooks told (a snapshot of the state
    before it may begin). A SIGTERM swallowed since the last step (its handler ran in a finalizer) stops here."""
    raise_if_terminated()
    rng_at_start = capture_raw() if rng_at_start is None else rng_at_start
    buffers.save()
    hooks.before_step(step, state, rng_at_start)
    return rng_at_start


def take_step(state: TrainState, step: int, batch, hooks: LoopHooks, buffers: BufferGuard, rng_at_start: dict,
              data_started: float, stored=None) -> tuple[StepOutcome, bool]:
    """One step as the loop takes it (also the user-loop recorder's `rec.step`): hooks.before_step has run and
    the buffers are saved. A non-finite step is undone and shown to `hooks.on_nonfinite`; if they say go on,
    it is taken again from the same RNG state. Returns the outcome and whether to go on. `stored`: what the
    hooks keep for this step when it is not `batch` (a distributed job's rank 0 keeps every rank's)."""
    stored = batch if stored is None else stored
    device_batch = to_device(batch, state.device)
    carry_at_start = user_step.copied(state.carry, "carry") if state.user_loop else None
    step_started = time.perf_counter()
    try:
        with op_trace.traced(step):  # (a bisect's numerics trial only)
            outcome = run_step(state, step, device_batch, observer=hooks.observer(step),
                               defer_reads=getattr(hooks, "defers_reads", False), device_guard=getattr(hooks, "device_guard", None))
    except Exception as error:  # a crash in the step is its failing step, kept as a non-finite one is, and goes on up
        _crashed(state, step, error, stored, hooks, buffers, carry_at_start)
        raise
    keep_going = True
    if outcome.nonfinite:
        buffers.restore()  # undo the forward's in-place buffer updates: hooks see the state before the step
        if state.user_loop:
            state.carry = carry_at_start  # and what the halted step wrote into carry
        keep_going = hooks.on_nonfinite(outcome, stored)
        if keep_going:
            restore_raw(rng_at_start)
            outcome = run_step(state, step, device_batch, halt_on_nonfinite=False)
    step_ended = time.perf_counter()
    keep_going = hooks.after_step(outcome, stored, step_ended - step_started, step_started - data_started) and keep_going
    return outcome, keep_going


def _crashed(state: TrainState, step: int, error: Exception, stored, hooks: LoopHooks, buffers: BufferGuard,
             carry_at_start) -> None:
    """`error` was raised inside step `step`: its forward's buffer updates (and, for the user's step, what it wrote
    into carry) are undone, as for a non-finite step, and `hooks.on_exception` records the step as the run's failure.
    A step that raised after its optimizer update: the state is past it, the hooks keep only its batch."""
    on_exception = getattr(hooks, "on_exception", None)
    if on_exception is None or isinstance(error, ReplayError):  # (the recorder's own refusals are no crash of the step)
        return
    if oom.is_out_of_memory(error):  # the step's finished frames let go of its activations: recording it needs memory
        traceback.clear_frames(error.__traceback__)
    outcome = getattr(error, "replaybisect_outcome", None)
    updated = bool(getattr(outcome, "updated", False))
    if not updated:
        buffers.restore()
        if state.user_loop:
            state.carry = carry_at_start
    on_exception(step, error, stored, updated=updated, outcome=outcome if isinstance(outcome, StepOutcome) else None)
