"""Host reads in a recorded step: on a GPU each read of a tensor's value on the host (`.item()`, `float(t)`,
`bool(t)`, `.tolist()`) makes the host wait for the device. `replay train`'s recorded step reads once, the non-finite
guard's flag, and its loss and gradient norm at each metrics flush (snapshot.metrics_flush_every). Counted on CPU:
every `aten::_local_scalar_dense` and `Tensor.tolist` whose nearest caller outside torch is replaybisect's own
code (torch's optimizer counters and the data's indices are CPU values on any device)."""

from __future__ import annotations

import math
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import EXAMPLES

OURS = str(Path(__file__).resolve().parents[1] / "replaybisect")


PLUMBING = ("torch/_tensor.py", "torch/utils/_python_dispatch.py", "torch/_ops.py", "torch/overrides.py", "torch/_jit_internal.py",
            "torch/_compile.py")


def _ours() -> bool:
    """Whether the read's caller (the first frame past torch's tensor and dispatch plumbing and this module) is
    replaybisect's: a read inside a library's own code (an optimizer's step counter) is the library's."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename == __file__ or frame.filename.endswith(PLUMBING) or "/torch/_dynamo/" in frame.filename:
            continue
        return frame.filename.startswith(OURS)
    return False


class HostReads(TorchDispatchMode):
    """Counts replaybisect's own reads of tensor values on the host while it is entered."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        counter = self

        def tolist(tensor, *args, **kwargs):
            if _ours():
                counter.count += 1
            return counter._tolist(tensor, *args, **kwargs)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _ours():
            self.count += 1
        return func(*args, **(kwargs or {}))


def _recorded_builtin(tmp_path, *overrides: str):
    from replaybisect.core import config as config_mod
    from replaybisect.core import loop
    from replaybisect.record.session import RunSession
    from replaybisect.store import open_store

    cfg = config_mod.compose(None, "config", ["snapshot.every=1000", "snapshot.layer_stats_every=0", "train.val_every=0",
                                              "snapshot.metrics_flush_seconds=0", *overrides])
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    session = RunSession.open(open_store(f"sqlite:///{tmp_path / 'mlflow.db'}"), code_folder=tmp_path)
    session.write_config(cfg)
    hooks = session.start_recording(cfg, state, {"seed": 0, "batch_size": cfg.train.batch_size, "dataset_len": len(source.dataset)})
    return cfg, state, source, session, hooks


def _count_steps(state, source, hooks, steps: range) -> tuple[int, list]:
    """Reads in `steps` recorded steps (each batch read before counting: the data's own reads are not the step's)."""
    from replaybisect.core import loop

    buffers, outcomes, reads = loop.BufferGuard(state.model), [], HostReads()
    for step in steps:
        batch = source.batch(step)
        with reads:
            rng = loop.open_step(step, state, hooks, buffers)
            outcome, keep_going = loop.take_step(state, step, batch, hooks, buffers, rng, 0.0)
        outcomes.append(outcome)
        if not keep_going:
            break
    return reads.count, outcomes


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_recorded_builtin_step_reads_the_guard_once_and_its_metrics_at_each_flush(tmp_path, precision):
    cfg, state, source, session, hooks = _recorded_builtin(tmp_path, f"train.precision={precision}", "snapshot.metrics_flush_every=10")
    _count_steps(state, source, hooks, range(0, 5))  # past the first steps' one-off work
    reads, _ = _count_steps(state, source, hooks, range(5, 25))
    session.close_hooks()
    session.finish()
    assert reads <= 20 + 2, reads  # the guard's each step, one per flush (at steps 9 and 19); it was 3 a step
    history = dict(session.store.metric_history(session.run_id, "loss"))
    norms = dict(session.store.metric_history(session.run_id, "grad_norm"))
    assert sorted(history) == list(range(25)) and all(math.isfinite(v) for v in history.values())
    assert sorted(norms) == list(range(25))


def test_with_reads_deferred_a_nan_loss_still_stops_before_its_update_and_is_named_a_loss(tmp_path):
    """examples/nan_forward (NaN in the forward at step 20): the guard's one read stops the step before the update."""
    from replaybisect.core import config as config_mod
    from replaybisect.core import loop
    from replaybisect.record.session import RunSession
    from replaybisect.store import open_store

    config_mod.add_code_paths(EXAMPLES / "nan_forward")
    cfg = config_mod.compose(EXAMPLES / "nan_forward", "config", ["train.steps=30"])
    state = loop.build_state(cfg)
    source, _ = loop.build_data(cfg)
    session = RunSession.open(open_store(f"sqlite:///{tmp_path / 'mlflow.db'}"), code_folder=tmp_path)
    session.write_config(cfg)
    hooks = session.start_recording(cfg, state, {"seed": cfg.seed, "batch_size": cfg.train.batch_size, "dataset_len": len(source.dataset)})
    _, outcomes = _count_steps(state, source, hooks, range(30))
    session.close_hooks()
    last = outcomes[-1]
    assert last.step == 20 and last.nonfinite == "loss" and not last.updated and not math.isfinite(last.loss)
    assert hooks.first_nonfinite_step == 20 and hooks.nonfinite_what == "loss"


def test_an_fp16_run_that_goes_on_past_a_nan_loss_takes_the_step_again(tmp_path):
    """The guard's read comes before the GradScaler unscales: the halted step leaves the scaler as it was, so with
    on_nonfinite=continue the step is taken again (a second unscale_ in one step would raise)."""
    import replaybisect as rb
    from conftest import in_folder

    with in_folder(tmp_path):
        result = rb.train(["train.steps=14", "train.precision=fp16", "snapshot.on_nonfinite=continue"],
                          config_dir=EXAMPLES / "nan_forward", tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert result.status == "nonfinite" and result.first_nonfinite_step == 11 and result.nonfinite_what == "loss"
    assert result.steps_completed == 14 and not result.stopped
