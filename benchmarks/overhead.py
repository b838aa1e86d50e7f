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
out 1; step by step it read 1.000 [0.994, 1.006]. A trainer's fit cannot be stepped from outside, so its one fit
alternates: the recorder records only the steps an ABBA schedule gives it (`Alternation`), and a callback after it
times each step. (Two fits in two threads taking turns a step at a time, the design this replaced, read from 0.972 to
1.048 in one process or another, with intervals that could not show it: each thread's speed depended on where its
tensors lay, which one fit in one thread shares between both kinds of step.) A recorded step's time includes
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
- lightning: the GPT as a LightningModule (bf16-mixed, 4 accumulated batches, clip 5), one `trainer.fit` with
  ReplayCallback recording every other step in ABBA order (on the others its hooks find no step of its open and
  pass through). A step runs from one optimizer step's end to the next's (the data's fetch and every hook between
  included); the fit's start, first pair and end are one-off costs, left out as the loops' are. As for inline, the
  recorder's global optimizer hook sees the plain steps' updates too (a check each): a cost this path does not
  count. A trainer path runs in two processes and prints each one's ratio too.
- lightning-control, hf-control (not in the default --paths): the trainers' fits as above with a callback that does
  nothing in the recorder's place.
- hf: a GPT-2 from GPT2Config (width 128, 4 layers, context 64, batch 8, accumulation 2), one `Trainer.train()`
  with ReplayCallback recording every other step as lightning's does (on the others its model, backward, clip and
  optimizer hooks pass through: a check each, a cost this path does not count). Both trainers' data last one epoch,
  so no epoch's end falls in a timed step (it would fall on a plain one every time), and each step's end checks that
  the recorder took exactly the steps the schedule gave it.
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
import time
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "own_loop"
PATHS = ("control", "train", "recorder", "inline", "ddp", "lightning", "hf", "lightning-control", "hf-control")
DEFAULT_PATHS = PATHS[:7]
TRAINERS = ("lightning", "hf", "lightning-control", "hf-control")  # one fit, its steps alternating (Alternation)
TRAINER_PAIRS = 2  # a trainer's path measures this many times --steps
TRAINER_PROCESSES = 2  # in this many processes, each one's ratio printed
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


# ---- the trainers: one fit whose steps alternate plain and recorded ---------------------------------------------
class Alternation:
    """One fit whose optimizer steps alternate plain and recorded, ABBA after a warm-up pair (plain then recorded):
    the recorder records the recorded steps only (`records`), and each step is timed from the previous step's end to
    its own (the data's fetch and every hook in between; a recorded step's end waits for the writer's pending jobs
    first, as a loop's recorded step does). One thread, one model and optimizer, one allocator state for both kinds
    of step, as the loops' blocks have. The fit's first pair and its end are left out, as the loops' one-off costs
    are."""

    def __init__(self, pairs: int):
        self.order = [kind for pair in range(pairs + 1)
                      for kind in (("plain", "recorded") if pair % 2 == 0 else ("recorded", "plain"))]
        self.seconds: dict[str, list[float]] = {"plain": [], "recorded": []}
        self.waited = 0.0  # seconds the recorded steps after the warm-up pair waited for the writer
        self._ended: Optional[float] = None  # when the last step ended
        self._waited_from = 0.0  # WAITED when the warm-up pair ended
        self._given = 0  # steps the schedule gave the recorder so far

    def steps(self) -> int:
        """The optimizer steps the fit takes."""
        return len(self.order)

    def records(self, step: int) -> bool:
        """Whether the recorder records optimizer step `step` (counted from 0, as the trainer's global step)."""
        return step < len(self.order) and self.order[step] == "recorded"

    def step_ended(self, step: int, drain: Callable[[], None] = lambda: None, recorded: Optional[int] = None) -> None:
        """Called at the end of optimizer step `step`, by a callback after the recorder's; `recorded`: the steps the
        recorder has taken so far, where there is one (a recorder gated on another step than this clock counts is an
        error, not a measurement)."""
        if self.records(step):
            drain()
        now = time.perf_counter()
        self._given += self.records(step)
        if recorded is not None and recorded != self._given:
            raise RuntimeError(f"the recorder took {recorded} steps by the end of step {step}, the schedule gave it {self._given}")
        if step >= 2 and self._ended is not None:
            self.seconds[self.order[step]].append(now - self._ended)
        elif step == 1:
            self._waited_from = WAITED[0]  # (the warm-up pair's waiting is not counted)
        self._ended = now

    def pairs(self) -> list[tuple[float, float]]:
        """The (plain, recorded) seconds of each pair after the warm-up one; a fit that ended before its steps did is
        an error, not a shorter measurement (step_ended checked the recorder's steps at each step's end)."""
        done = {kind: len(times) for kind, times in self.seconds.items()}
        if set(done.values()) != {len(self.order) // 2 - 1}:
            raise RuntimeError(f"the fit ended before its steps did: {done['plain']} plain and {done['recorded']} "
                               f"recorded steps timed of {len(self.order) // 2 - 1} each")
        self.waited = WAITED[0] - self._waited_from
        return list(zip(self.seconds["plain"], self.seconds["recorded"]))


def path_lightning(folder: str, alternation: Alternation, control: bool = False) -> list[tuple[float, float]]:
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
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class SomeSteps(ReplayCallback):
        """The recorder, on the steps `alternation` gives it: its other hooks do nothing while no step of its is open."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
            if alternation.records(trainer.global_step):
                super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    class Clock(L.Callback):
        def __init__(self, drain: Callable[[], None]):
            self.drain, self.seen = drain, 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self.seen:  # an optimizer step ended with this batch
                self.seen = trainer.global_step
                alternation.step_ended(self.seen - 1, self.drain, None if control else recorder.steps_taken)

    samples = [(x[i], y[i]) for batch in batches for x, y in batch for i in range(x.shape[0])]
    samples *= -(-alternation.steps() * 4 * cfg.micro_batch // len(samples))  # one epoch: no epoch's end in a timed step
    loader = torch.utils.data.DataLoader(samples, batch_size=cfg.micro_batch, shuffle=False)  # 4 accumulated a step
    recorder = L.Callback() if control else SomeSteps()
    drain = (lambda: None) if control else lambda: writes_done(recorder.recording.hooks)()  # (once the fit started)
    trainer = L.Trainer(max_steps=alternation.steps(), accelerator="cpu", devices=1, accumulate_grad_batches=4,
                        precision="32-true" if PRECISION["precision"] == "fp32" else "bf16-mixed", gradient_clip_val=5.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorder, Clock(drain)])
    trainer.fit(GptModule(), loader)
    return alternation.pairs()


def path_hf(folder: str, alternation: Alternation, control: bool = False) -> list[tuple[float, float]]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from replaybisect.hf import ReplayCallback

    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder}/mlflow.db"
    config = GPT2Config(n_embd=128, n_layer=4, n_head=4, n_positions=64, vocab_size=256)
    generator = torch.Generator().manual_seed(0)
    rows = max(4096, alternation.steps() * 16)  # one epoch: no epoch's end in a timed step
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (rows, 64), generator=generator)]
    torch.manual_seed(0)

    class SomeSteps(ReplayCallback):
        """The recorder, on the steps `alternation` gives it: its model, backward and clip hooks pass through while no
        step of its is open."""

        def on_step_begin(self, args, state, control, **kwargs):
            if alternation.records(state.global_step):
                super().on_step_begin(args, state, control, **kwargs)

    class Clock(TrainerCallback):
        def __init__(self, drain: Callable[[], None]):
            self.drain = drain

        def on_step_end(self, args, state, control, **kwargs):
            alternation.step_ended(state.global_step - 1, self.drain,  # (the Trainer counted the step already)
                                   None if control else recorder.steps_taken)

    recorder = TrainerCallback() if control else SomeSteps()
    drain = (lambda: None) if control else lambda: writes_done(recorder.recording.hooks)()
    args = TrainingArguments(output_dir=f"{folder}/out", max_steps=alternation.steps(), per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, learning_rate=1e-3, max_grad_norm=1.0, report_to="none",
                             save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)
    Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=[recorder, Clock(drain)]).train()
    return alternation.pairs()


def child(path: str, pairs: int, handoff: float, precision: str) -> None:
    import torch

    from replaybisect.record import metrics_process

    torch.set_num_threads(1)
    PRECISION["precision"] = precision
    metrics_process.HANDOFF_SECONDS = handoff  # one run, as long as a real one: its steady state
    with tempfile.TemporaryDirectory() as folder:
        if path in TRAINERS:
            trainer = {"lightning": path_lightning, "hf": path_hf}[path.removesuffix("-control")]
            alternation = Alternation(pairs)
            measured = trainer(folder, alternation, path.endswith("-control"))
            result = {"waited": alternation.waited}
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
        if path in TRAINERS:  # each process's ratio
            print(f"{'':<17} each process: " + "; ".join(f"{ratio_interval(result['pairs'], CYCLE)[0]:.3f}" for result in results),
                  flush=True)


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
