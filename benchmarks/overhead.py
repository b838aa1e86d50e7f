"""The recorder's cost on every recording path, measured to about 1%: plain and recorded training of the same model
interleaved in one process step by step (ABBA: the order flips every pair), so that drift in the machine's speed
(other processes, frequency, the allocator's state) lands on both sides of each pair.

    python benchmarks/overhead.py [--paths control,train,recorder,inline,ddp,lightning,hf] [--steps 600] [--precision fp32]
    python benchmarks/overhead.py --paths lightning-control,hf-control --precision fp32   # the trainers' controls

Each path runs in its own process, with one thread (torch.set_num_threads(1), OMP_NUM_THREADS=1) and glibc's heap
trimming off (MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_THRESHOLD_ at 256 MiB: otherwise a loop that frees every batch
pays page faults that one keeping a few tensors alive does not, which alone moved these ratios by up to 20%). In
it, the plain and the recorded blocks train the same parameters and optimizer state, the recorded ones with the
path's defaults (metrics every step, a snapshot every 100 steps with every batch in between, layer statistics every
50). Two copies of a model in one process train at speeds up to 2% apart, by where their tensors happen to lie in
memory, and that bias is the same in every pair: no interval over pairs can see it.

A step's time drifts over seconds on a shared machine (successive steps correlate at 0.5 to 0.6, steps 20 apart at
0.2; blocks of the same 50 steps took 12.7 s and 10.4 s one after the other), so the loops alternate every step: with
blocks of 10 steps the plain-against-plain control read 0.982 [0.970, 0.997] on such a machine, an interval that left
out 1; step by step it read 1.000 [0.994, 1.006]. A trainer's fit cannot be stepped from outside, so its plain and
recorded fits run in two threads that take turns a step at a time (`Turns`: only the thread whose turn it is runs;
with whole fits of 100 steps as the blocks, the intervals were +/-5 to 6%). A recorded step's time includes
waiting for the recorder's background writes it started (where any are pending), so none of its work spills into the
next plain step. The recorder's work comes in lumps (a
flush every 50 steps, a snapshot every 100), so the figure is the ratio of the total times, recorded/plain, and its
95% interval a bootstrap over runs of consecutive pairs that hold 100 recorded steps each (2,000 resamples). Also
printed: the plain step time, the time the recorder adds a step (recorded minus plain: the figure to compare across
machines, whose step times differ), the part of it spent waiting for the recorder's writer thread (included: an upper
bound), and the lowest and highest ratio of those runs.

`--precision fp32` trains the GPT paths (recorder, inline, ddp, lightning, control) in fp32 instead of bf16 autocast: on
a CPU that emulates bf16 matmuls (no AVX-512 BF16 or AMX) their bf16 step takes some ten times the fp32 one, which
would hide the recorder. `replay train`'s MLP and the transformers GPT-2 train in fp32 either way.

Each path's run stands for a long one: its metric points go to the logger process from its second flush on
(--handoff 0), as a run's do once their logging has cost 2 s in the training process (record/metrics_process.py).

- control: the GPT below, plain against plain: what the benchmark reads when nothing differs.
- train: `replay train`'s built-in loop (a 5.2M-parameter MLP, AdamW, batch 64): recorded against the same loop
  and state with no recorder (NullHooks).
- recorder: examples/own_loop/gpt_loop.py's GPT (width 128, 4 layers, 4 micro-batches, AdamW, bf16 autocast),
  `rec.step(batch)` with its step function against calling the step function.
- inline: the same loop calling its step itself, the Recorder watching. The plain blocks train a shallow copy of the
  model and of the optimizer (the same parameters, gradients and optimizer state; the recorder watches the objects
  it was given), and each recorded block ends by closing the step the loop left open (else the plain block after
  it would run inside it). The optimizer hooks stay installed for the recorder's life, so the plain blocks pay
  their identity check too: a cost this path does not count.
- ddp: the `recorder` path with the model wrapped in DistributedDataParallel in a one-process gloo group.
- lightning: the GPT as a LightningModule (bf16-mixed, 4 accumulated batches, clip 5), two `trainer.fit`s taking
  turns, one with ReplayCallback. The plain fit trains a shallow copy of the module (the same submodules and
  tensors, hooks of its own) and both take the same optimizer from configure_optimizers, so the two train the same
  parameters and optimizer state, as the loops' blocks do. A turn runs from one optimizer step's end to the next's
  (the data's fetch and every hook between included); each fit's start, first step and end are one-off costs,
  left out as the loops' are. As for inline, the recorder's global optimizer hook sees the plain fit's updates
  too (a check each). With no recorder on either fit, the second fit read 1.009 and 1.010 against the first, with
  intervals that hold 1, so half the pairs run with the recorded fit started second on the module as built, half
  with it started first on the twin (`Turns.objects`). The transformers Trainer's ratio moved 2.5% from one process
  to the next, which an interval over one process's pairs cannot show, so a trainer path runs in two processes,
  and each one's ratio and its halves' are printed too.
- lightning-control, hf-control (not in the default --paths): the trainers' fits as above, plain against plain
  (the "recorded" fit given a callback that does nothing).
- hf: a GPT-2 from GPT2Config (width 128, 4 layers, context 64, batch 8, accumulation 2), two `Trainer.train()`s
  taking turns as lightning's, one with ReplayCallback, the plain one on a shallow copy of the model, both given the
  same optimizer (each Trainer makes its own schedule on it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "own_loop"
PATHS = ("control", "train", "recorder", "inline", "ddp", "lightning", "hf", "lightning-control", "hf-control")
DEFAULT_PATHS = PATHS[:7]
TRAINERS = ("lightning", "hf", "lightning-control", "hf-control")  # two fits taking turns (Turns)
TRAINER_PAIRS = 2  # a trainer's path measures this many times --steps
TRAINER_PROCESSES = 2  # in this many processes (the transformers Trainer's ratio moved 2.5% from one to the next)
CYCLE = 100  # steps: the recorder's cycle (a snapshot every 100 steps), a run in the interval's bootstrap
PINNED = {"MALLOC_TRIM_THRESHOLD_": str(2**28), "MALLOC_MMAP_THRESHOLD_": str(2**28), "OMP_NUM_THREADS": "1",
          "MKL_NUM_THREADS": "1"}


# ---- the measurement: plain and recorded blocks, interleaved ----------------------------------------------------
def interleaved(plain: Callable[[], float], recorded: Callable[[], float], pairs: int) -> list[tuple[float, float]]:
    """(plain seconds, recorded seconds) per pair, after one discarded pair of warm-up; the order flips each pair."""
    plain(), recorded()
    WAITED[0] = 0.0
    measured = []
    for pair in range(pairs):
        if pair % 2 == 0:
            a = plain()
            b = recorded()
        else:
            b = recorded()
            a = plain()
        measured.append((a, b))
    return measured


def median_interval(ratios: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The median ratio and a 95% bootstrap interval for it (blocks that are alike: benchmarks/snapshot_stall.py)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def ratio_interval(pairs: list[tuple[float, float]], run: int, resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float, float, list[float]]:
    """Total recorded time over total plain time, a 95% bootstrap interval for it over runs of `run` consecutive pairs
    (each holding whole cycles of the recorder's lumpy work, and the drift's correlation), and each run's ratio."""
    runs = [pairs[start:start + run] for start in range(0, len(pairs), run)]
    totals = [(sum(a for a, _ in chunk), sum(b for _, b in chunk)) for chunk in runs]
    rng = random.Random(seed)
    resampled = []
    for _ in range(resamples):
        drawn = rng.choices(totals, k=len(totals))
        resampled.append(sum(b for _, b in drawn) / sum(a for a, _ in drawn))
    resampled.sort()
    ratio = sum(b for _, b in totals) / sum(a for a, _ in totals)
    return ratio, resampled[int(0.025 * resamples)], resampled[int(0.975 * resamples) - 1], [b / a for a, b in totals]


def timed_steps(step: Callable[[object], object], batches: list, block: int, drain: Callable[[], None] = lambda: None):
    """A block function: `block` steps over the batches (cycled), then `drain` (the recorder's pending writes)."""
    position = [0]

    def run() -> float:
        started = time.perf_counter()
        for _ in range(block):
            step(batches[position[0] % len(batches)])
            position[0] += 1
        drain()
        return time.perf_counter() - started

    return run


WAITED = [0.0]  # seconds the recorded blocks spent waiting for the writer's jobs (after the warm-up pair)


def writes_done(hooks) -> Callable[[], None]:
    """Waits until the recorder's single writer thread has done every job queued so far (no round trip to the thread
    when none is pending: a step that queued nothing is timed as it ran). The wait counts in the recorded time, an
    upper bound: in a run, the job would go on beside the next steps (on a spare core, costing them the GIL it takes);
    it is also summed in WAITED, printed on its own."""
    def wait() -> None:
        started = time.perf_counter()
        for job in list(hooks._jobs):
            job.result()
        WAITED[0] += time.perf_counter() - started
    return wait


# ---- the paths ---------------------------------------------------------------------------------------------------
PRECISION = {"precision": "bf16"}  # the GPT paths' (--precision)


def gpt_setup(folder: str, wrap_ddp: bool = False):
    import torch
    from omegaconf import OmegaConf

    sys.path[:0] = [str(EXAMPLE), str(HERE)]
    import fp32_step
    import gpt_loop

    cfg = OmegaConf.merge(OmegaConf.load(EXAMPLE / "config.yaml"),
                          {"lr": 1e-3, "d": 128, "layers": 4, "heads": 4, "T": 64, "micro_batch": 8})
    generator = torch.Generator().manual_seed(0)
    batches = [gpt_loop.get_batch(cfg, generator) for _ in range(64)]
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder}/mlflow.db"
    fp32 = PRECISION["precision"] == "fp32"
    if wrap_ddp:
        import ddp_overhead

        return cfg, batches, ddp_overhead.build, fp32_step.train_step if fp32 else ddp_overhead.train_step
    return cfg, batches, gpt_loop.build, fp32_step.train_step if fp32 else gpt_loop.train_step


def path_control(folder: str, block: int):
    cfg, batches, build, train_step = gpt_setup(folder)
    model, optimizer = build(cfg)
    plain = timed_steps(lambda batch: train_step(model, optimizer, batch), batches, block)
    return plain, timed_steps(lambda batch: train_step(model, optimizer, batch), batches, block), lambda: None


def path_recorder(folder: str, block: int, wrap_ddp: bool = False):
    import replaybisect

    cfg, batches, build, train_step = gpt_setup(folder, wrap_ddp)
    model, optimizer = build(cfg)
    rec = replaybisect.Recorder(model, optimizer, step_fn=train_step, build=build, config=cfg)
    plain = timed_steps(lambda batch: train_step(model, optimizer, batch), batches, block)
    return plain, timed_steps(rec.step, batches, block, writes_done(rec._hooks)), rec.close


def path_inline(folder: str, block: int):
    import copy

    import replaybisect

    cfg, batches, build, train_step = gpt_setup(folder)
    model, optimizer = build(cfg)
    twin_model, twin_optimizer = copy.copy(model), copy.copy(optimizer)  # (shallow: the same tensors, other objects)
    rec = replaybisect.Recorder(model, optimizer, config=cfg)

    def ended() -> None:
        rec._inline.close_step()  # what the next block's first training call would do
        writes_done(rec._hooks)()

    plain = timed_steps(lambda batch: train_step(twin_model, twin_optimizer, batch), batches, block)
    recorded = timed_steps(lambda batch: train_step(model, optimizer, batch), batches, block, ended)
    return plain, recorded, rec.close


def path_ddp(folder: str, block: int):
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    return path_recorder(folder, block, wrap_ddp=True)


def recorded_train(folder: str, overrides: list[str]):
    """`replay train`'s loop recording into a SQLite store in `folder`, driven block by block: (cfg, its state, the
    batches by step, the hooks, a function that ends the run)."""
    from replaybisect.core import config, loop
    from replaybisect.record.session import RunSession
    from replaybisect.store import open_store

    cfg = config.compose(None, "config", overrides)
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    session = RunSession.open(open_store(f"sqlite:///{folder}/mlflow.db"), code_folder=Path(folder))
    session.write_config(cfg)
    reader = loop.read_ahead(source, 0)
    batches = reader.__enter__()
    hooks = session.start_recording(cfg, state, {"seed": cfg.seed, "batch_size": cfg.train.batch_size,
                                                 "dataset_len": len(source.dataset)})

    def close():
        session.close_hooks()
        session.finish()
        reader.__exit__(None, None, None)

    return cfg, state, batches, hooks, close


def path_train(folder: str, block: int):
    from replaybisect.core import loop
    from replaybisect.record.hooks import NullHooks

    overrides = ["model.hidden=1600", "model.depth=3", "model.dropout=0.0", "train.steps=100000", "train.batch_size=64",
                 "train.val_every=0", "snapshot.every=100", "snapshot.layer_stats_every=50"]
    cfg, state, batches, hooks, close = recorded_train(folder, overrides)
    done = {"plain": 0, "recorded": 0}  # each side's own steps: the recorded run's are contiguous

    def block_of(name: str, run_hooks, drain=lambda: None):
        def run() -> float:
            started = time.perf_counter()
            loop.train_loop(state, batches, done[name], done[name] + block, run_hooks)
            done[name] += block
            drain()
            return time.perf_counter() - started
        return run

    return block_of("plain", NullHooks()), block_of("recorded", hooks, writes_done(hooks)), close


# ---- the trainers: two fits taking turns step by step ------------------------------------------------------
class Aborted(Exception):
    """The other fit failed: this one stops at its next step's end (Turns.step_ended)."""


class Turns:
    """Two fits, plain and recorded, in two threads of this process, taking turns a step at a time (ABBA: plain and
    recorded, then recorded and plain, after a warm-up pair): a thread runs only while it holds the condition's lock,
    which it gives up only at the end of a step (or of its fit), so the two never run at once, and each turn is one
    step of its fit, timed from when its thread got the turn to when it hands it on (a recorded turn waits for the
    writer's pending jobs first, as a loop's recorded step does). A fit's start and end, and the steps after the last
    turn, are outside the turns: one-off costs, left out as the loops' are."""

    def __init__(self, pairs: int, swapped: bool = False):
        self.swapped = swapped
        self.order = [name for pair in range(pairs + 1)
                      for name in (("plain", "recorded") if pair % 2 == 0 else ("recorded", "plain"))]
        self.turn = 0
        self.seconds: dict[str, list[float]] = {"plain": [], "recorded": []}
        self.started: dict[str, float] = {}
        self.condition = threading.Condition()
        self.failed: list[BaseException] = []
        self.waited_from = 0.0  # WAITED when the warm-up pair ended
        self.waited = 0.0  # seconds the recorded turns after the warm-up pair waited for the writer

    def objects(self, built, twin) -> dict[str, object]:
        """Which fit trains the model as built and which its shallow twin (`shared_twin`), and so which of the two
        starts first: swapped, the recorded fit takes the twin and starts first. With no recorder on either fit
        (Lightning), the second fit read 1.009 [0.989, 1.024] against the first over 300 pairs and 1.010 [0.998,
        1.018] over 600: perhaps 1%, perhaps nothing; a trainer path runs half its pairs each way round."""
        return {"plain": built, "recorded": twin} if self.swapped else {"plain": twin, "recorded": built}

    def steps(self) -> int:
        """The steps a fit takes: its first (before its first turn), one a turn, and one after its last."""
        return len(self.order) // 2 + 2

    def step_ended(self, name: str, drain: Callable[[], None] = lambda: None) -> None:
        """Called by `name`'s fit at the end of each optimizer step (its thread holds the lock): ends its turn, if it
        is in one, and waits for its next. Raises Aborted where the other fit failed."""
        if name in self.started:
            drain()
            self.seconds[name].append(time.perf_counter() - self.started.pop(name))
            self.turn += 1
            if self.turn == 2:
                self.waited_from = WAITED[0]  # (the warm-up pair's waiting is not counted)
            self.condition.notify_all()
        self.condition.wait_for(lambda: self.turn >= len(self.order) or self.order[self.turn] == name)
        if self.failed:
            raise Aborted
        if self.turn < len(self.order):
            self.started[name] = time.perf_counter()

    def run(self, fits: dict[str, Callable[[], None]]) -> list[tuple[float, float]]:
        """Runs both fits, each in its own thread (neither the main one, so neither installs signal handlers), the
        first (plain, or recorded where swapped) holding the lock before the other starts; the (plain, recorded)
        seconds of each pair after the warm-up one. A fit that fails, or ends before its turns do, is an error."""
        holding = threading.Event()

        def fit(run: Callable[[], None]) -> None:
            with self.condition:
                holding.set()
                try:
                    run()
                except BaseException as error:
                    self.failed.append(error)
                finally:
                    self.turn = len(self.order)  # the schedule is over: the other fit goes on to its end, or stops
                    self.condition.notify_all()

        first, second = (fits["recorded"], fits["plain"]) if self.swapped else (fits["plain"], fits["recorded"])
        threads = [threading.Thread(target=fit, args=(first,), daemon=True),
                   threading.Thread(target=fit, args=(second,), daemon=True)]
        threads[0].start()
        holding.wait()
        threads[1].start()
        for thread in threads:
            thread.join()
        failures = [error for error in self.failed if not isinstance(error, Aborted)]
        if failures:
            raise failures[0]
        if any(len(times) != len(self.order) // 2 for times in self.seconds.values()):
            raise RuntimeError(f"a fit ended before its turns did: {len(self.seconds['plain'])} plain and "
                               f"{len(self.seconds['recorded'])} recorded steps of {len(self.order) // 2} each")
        self.waited = WAITED[0] - self.waited_from
        return list(zip(self.seconds["plain"], self.seconds["recorded"]))[1:]


def shared_twin(module):
    """A second object of `module` with the same submodules, parameters and buffers (a shallow copy), but hooks of
    its own: the plain fit trains the very tensors the recorded one does (two copies of a model train at speeds up
    to 2% apart, by where their tensors lie), and the recorder's hooks on the model stay on the recorded one."""
    import copy

    twin = copy.copy(module)
    for name, value in vars(module).items():
        if "hooks" in name and isinstance(value, dict):
            setattr(twin, name, type(value)(value))
    return twin


def path_lightning(folder: str, turns: Turns, control: bool = False):
    import lightning as L
    import torch

    from replaybisect.lightning import ReplayCallback

    cfg, batches, _, _ = gpt_setup(folder)
    import gpt_loop

    class GptModule(L.LightningModule):
        def __init__(self, d: int = 128, layers: int = 4):
            super().__init__()
            self.save_hyperparameters()
            self.model, _ = gpt_loop.build(cfg)

        def training_step(self, batch):
            x, y = batch
            return self.model(x, y)

        def configure_optimizers(self):
            return optimizer  # one optimizer for both fits: the same state, as the loops' blocks share theirs

    samples = [(x[i], y[i]) for batch in batches for x, y in batch for i in range(x.shape[0])]
    loader = torch.utils.data.DataLoader(samples, batch_size=cfg.micro_batch, shuffle=False)  # 4 accumulated a step
    module = GptModule()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

    class Handoff(L.Callback):
        def __init__(self, name: str, drain=lambda: None):
            self.name, self.drain, self.seen = name, drain, 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self.seen:  # an optimizer step ended with this batch
                self.seen = trainer.global_step
                turns.step_ended(self.name, self.drain)

    def fit(name: str, fitted_module, callbacks: list) -> Callable[[], None]:
        def run() -> None:
            trainer = L.Trainer(max_steps=turns.steps(), accelerator="cpu", devices=1, accumulate_grad_batches=4,
                                precision="32-true" if PRECISION["precision"] == "fp32" else "bf16-mixed",
                                gradient_clip_val=5.0, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
            trainer.fit(fitted_module, loader)
        return run

    # the recorder before the handoff: its step is over when the plain fit runs, so its global optimizer hook, which
    # the shared optimizer's plain updates reach too, does nothing there (a control: a callback that does nothing)
    recorder = L.Callback() if control else ReplayCallback()
    drain = (lambda: None) if control else lambda: writes_done(recorder.recording.hooks)()  # (once the fit started)
    trained = turns.objects(module, shared_twin(module))
    return turns.run({"plain": fit("plain", trained["plain"], [Handoff("plain")]),
                      "recorded": fit("recorded", trained["recorded"], [recorder, Handoff("recorded", drain)])})


def path_hf(folder: str, turns: Turns, control: bool = False):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from replaybisect.hf import ReplayCallback

    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder}/mlflow.db"
    config = GPT2Config(n_embd=128, n_layer=4, n_head=4, n_positions=64, vocab_size=256)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (4096, 64), generator=generator)]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # one for both fits, as the loops' blocks share theirs

    class Handoff(TrainerCallback):
        def __init__(self, name: str, drain=lambda: None):
            self.name, self.drain = name, drain

        def on_step_end(self, args, state, control, **kwargs):
            turns.step_ended(self.name, self.drain)

    def fit(name: str, fitted_model, callbacks: list) -> Callable[[], None]:
        def run() -> None:
            args = TrainingArguments(output_dir=f"{folder}/out-{name}", max_steps=turns.steps(),
                                     per_device_train_batch_size=8, gradient_accumulation_steps=2, learning_rate=1e-3,
                                     max_grad_norm=1.0, report_to="none", save_strategy="no", logging_strategy="no",
                                     use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
            Trainer(model=fitted_model, args=args, train_dataset=data, callbacks=callbacks,
                    optimizers=(optimizer, None)).train()
        return run

    recorder = TrainerCallback() if control else ReplayCallback()  # before the handoff: as lightning's
    drain = (lambda: None) if control else lambda: writes_done(recorder.recording.hooks)()
    trained = turns.objects(model, shared_twin(model))
    return turns.run({"plain": fit("plain", trained["plain"], [Handoff("plain")]),
                      "recorded": fit("recorded", trained["recorded"], [recorder, Handoff("recorded", drain)])})


def child(path: str, pairs: int, handoff: float, precision: str) -> None:
    import torch

    from replaybisect.record import metrics_process

    torch.set_num_threads(1)
    PRECISION["precision"] = precision
    metrics_process.HANDOFF_SECONDS = handoff  # one run, as long as a real one: its steady state
    with tempfile.TemporaryDirectory() as folder:
        if path in TRAINERS:
            trainer = {"lightning": path_lightning, "hf": path_hf}[path.removesuffix("-control")]
            halves = [Turns(pairs // 2, swapped) for swapped in (False, True)]
            measured = [pair for turns in halves for pair in trainer(folder, turns, path.endswith("-control"))]
            result = {"waited": sum(turns.waited for turns in halves), "halves": pairs // 2}  # (the first half's pairs)
        else:
            setups = {"control": path_control, "train": path_train, "recorder": path_recorder, "inline": path_inline,
                      "ddp": path_ddp}
            plain, recorded, close = setups[path](folder, 1)  # a block: one step
            measured = interleaved(plain, recorded, pairs)
            close()
            result = {"waited": WAITED[0]}
    print("RESULT " + json.dumps({"path": path, "pairs": measured, **result}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS))
    parser.add_argument("--steps", type=int, default=600,
                        help="recorded steps per loop path (as many plain ones); a trainer's path takes twice as many "
                             "(its steps' times spread two to three times as much), in two processes")
    parser.add_argument("--handoff", type=float, default=0.0,
                        help="seconds of in-process metrics logging before the logger process takes over (default 0: the "
                             "steady state of a run long enough to hand off; the recorder's default is "
                             "metrics_process.HANDOFF_SECONDS)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="the GPT paths' precision (default bf16 autocast; fp32 where the CPU emulates bf16)")
    parser.add_argument("--child")
    parser.add_argument("--pairs", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.pairs, args.handoff, args.precision)
        return
    paths = [path.strip() for path in args.paths.split(",") if path.strip()]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown path {', '.join(unknown)}: choose from {', '.join(PATHS)}")
    print(f"{args.steps} recorded and {args.steps} plain steps per loop path, {args.steps * TRAINER_PAIRS} per trainer, "
          f"interleaved ABBA step by step; 1 thread; heap trimming off; the GPT in {args.precision}")
    print(f"{'path':<17} {'plain ms/step':>13} {'+ms/step':>9} {'(waiting)':>9} {'recorded/plain':>15} {'95% interval':>17} "
          f"{f'per {CYCLE} steps':>17}")
    for path in paths:
        processes = TRAINER_PROCESSES if path in TRAINERS else 1
        pairs = args.steps * (TRAINER_PAIRS if path in TRAINERS else 1) // processes
        results = [measured_in_process(path, pairs, args) for _ in range(processes)]
        if any(isinstance(result, str) for result in results):
            print(f"{path:<17} failed: {next(result for result in results if isinstance(result, str))}")
            continue
        measured = [pair for result in results for pair in result["pairs"]]
        ratio, low, high, runs = ratio_interval(measured, CYCLE)
        step_ms = sum(plain for plain, _ in measured) / len(measured) * 1e3
        added_ms = sum(recorded - plain for plain, recorded in measured) / len(measured) * 1e3
        waited_ms = sum(result["waited"] for result in results) / len(measured) * 1e3
        print(f"{path:<17} {step_ms:>13.1f} {added_ms:>9.2f} {waited_ms:>9.2f} {ratio:>15.3f} {f'[{low:.3f}, {high:.3f}]':>17} "
              f"{f'{min(runs):.3f}..{max(runs):.3f}':>17}", flush=True)
        if path in TRAINERS:  # each process's ratio, and its halves': the recorded fit second, then first (Turns.objects)
            each = [(ratio_interval(result["pairs"], CYCLE)[0], ratio_interval(result["pairs"][:result["halves"]], CYCLE)[0],
                     ratio_interval(result["pairs"][result["halves"]:], CYCLE)[0]) for result in results]
            print(f"{'':<17} each process (recorded fit second, first): "
                  + "; ".join(f"{whole:.3f} ({second:.3f}, {first:.3f})" for whole, second, first in each), flush=True)


def measured_in_process(path: str, pairs: int, args) -> dict | str:
    """One child process's RESULT for `path`, or the line that says why it failed."""
    done = subprocess.run([sys.executable, __file__, "--child", path, "--pairs", str(pairs),
                           "--handoff", str(args.handoff), "--precision", args.precision],
                          capture_output=True, text=True, env={**os.environ, **PINNED})
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        return f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ''}"
    return json.loads(line[len("RESULT "):])


if __name__ == "__main__":
    main()
