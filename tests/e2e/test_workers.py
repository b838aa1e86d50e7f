"""train.num_workers: DataLoader workers build the same batches as the main process does.

- batches with 0 and 2 workers are identical (==) across an epoch boundary, for a dataset with random
  augmentation in __getitem__ (torch, numpy and python draws), read in order or not;
- reading items leaves the training RNG streams where they were;
- a `replay train ... train.num_workers=2` run replays exactly from batches rebuilt in-process (0 workers); a NaN made by the augmentation is found by `replay nan` with reproduced: exact.
"""

from __future__ import annotations

import random
import re
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from replaybisect.core import loop
from replaybisect.core.rng import capture_raw

# The project's dataset: jitter from torch, numpy and python in __getitem__, and a NaN when a draw is tiny.
PROJECT_CODE = '''
import random

import numpy as np
import torch
from torch.utils.data import Dataset


class JitterPoints(Dataset):
    """Points of 4 classes with random jitter per read; nan_below > 0 makes an item NaN when its draw is below it."""

    def __init__(self, n: int = 96, nan_below: float = 0.0, fail_at: int = -1):
        self.fail_at = fail_at  # an item whose read raises, as a missing file would
        generator = torch.Generator().manual_seed(7)
        self.targets = torch.randint(0, 4, (n,), generator=generator)
        self.inputs = torch.randn(4, 8, generator=generator)[self.targets] * 2 + torch.randn(n, 8, generator=generator)
        self.nan_below = nan_below

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        if index == self.fail_at:
            raise KeyError(f"label file missing for item {index}")
        if index == 0:
            print("reading item 0")  # user code owns stdout, in worker processes too: --json must still parse
        draw = torch.rand(())
        jitter = 0.1 * torch.randn(8) + float(np.random.uniform(-0.05, 0.05)) + random.gauss(0.0, 0.05)
        x = self.inputs[index] + jitter
        if draw < self.nan_below:
            x = x * float("nan")
        return x, self.targets[index]


class DropoutNet(torch.nn.Module):
    """Dropout draws from the training stream: item reads must not shift it."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)
'''

CONFIG = '''
model: {_target_: jitter_data.DropoutNet}
data: {_target_: jitter_data.JitterPoints, n: 96, nan_below: 0.0}
loss: {_target_: torch.nn.CrossEntropyLoss}
optim: {_target_: torch.optim.AdamW, _partial_: true, lr: 0.01}
train: {steps: 30, batch_size: 8, val_every: 0, device: cpu, num_threads: 1}
snapshot: {every: 10, layer_stats_every: 0}
'''


class Jitter(Dataset):
    """In-process copy of the project's dataset idea: torch, numpy and python draws in every read."""

    def __init__(self, n: int = 20):
        self.base = torch.arange(n, dtype=torch.float32)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        noise = torch.rand(3) + float(np.random.rand()) + random.random()
        return {"x": self.base[index] + noise, "y": torch.tensor(index)}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_batches_with_0_and_2_workers_are_identical_across_an_epoch_boundary():
    rng_before = capture_raw()
    in_process = loop.BatchSource(Jitter(), batch_size=4, seed=3)  # 5 steps an epoch
    expected = {step: in_process.batch(step) for step in range(12)}
    assert not torch.equal(expected[0]["x"], expected[5]["x"])  # epochs differ: order and jitter
    with loop.read_ahead(loop.BatchSource(Jitter(), batch_size=4, seed=3), num_workers=2) as batches:
        from_workers = {step: batches(step) for step in range(12)}
        assert same(batches(7), expected[7]) and same(batches(3), expected[3]) and same(batches(4), expected[4])  # out of order
    assert all(same(from_workers[step], expected[step]) for step in range(12))
    # neither the workers' seeds nor the items' draws came from the training streams
    after = capture_raw()
    assert torch.equal(after["torch"], rng_before["torch"]) and after["python"] == rng_before["python"]
    assert np.array_equal(after["numpy"][1], rng_before["numpy"][1]) and after["numpy"][2:] == rng_before["numpy"][2:]


def test_a_sample_is_a_function_of_seed_step_and_index():
    source = loop.BatchSource(Jitter(), batch_size=4, seed=3)
    late = source.batch(8)
    other = loop.BatchSource(Jitter(), batch_size=4, seed=3)
    for step in range(8):
        other.batch(step)
    assert same(other.batch(8), late)  # whatever was read before
    # one index read in two epochs gets different jitter; another seed gives other draws
    index = int(source.indices(0)[0])
    step_two = next(step for step in range(5, 10) if index in source.indices(step).tolist())
    row = source.indices(step_two).tolist().index(index)
    assert not torch.equal(source.batch(0)["x"][0], source.batch(step_two)["x"][row])
    assert not same(loop.BatchSource(Jitter(), batch_size=4, seed=4).batch(8), late)


def test_every_stream_differs_per_step_and_index():
    """torch's CPU generator keeps 32 bits of a seed: step and index must both reach them, and numpy's too."""
    from replaybisect.core.rng import isolated_rng, sample_seed, seed_sample_streams

    draws = set()
    with isolated_rng():
        for step in range(4):
            for index in (0, 1, 999_983):
                seed_sample_streams(sample_seed(5, step, index))
                draws.add((float(torch.rand(())), float(np.random.rand()), random.random()))
    assert len({d[0] for d in draws}) == len({d[1] for d in draws}) == len({d[2] for d in draws}) == 12


def test_built_in_datasets_read_without_seeding():
    from replaybisect.data import CharText, Digits

    assert Digits.__getitem__.draws_no_randomness and CharText.__getitem__.draws_no_randomness
    assert not getattr(Jitter.__getitem__, "draws_no_randomness", False)


@pytest.fixture
def project(workspace):
    folder = workspace.path / "jitter"
    folder.mkdir()
    (folder / "jitter_data.py").write_text(PROJECT_CODE)
    (folder / "config.yaml").write_text(textwrap.dedent(CONFIG))
    return folder


def test_workers_run_replays_exactly_from_batches_built_without_workers(workspace, project):
    from replaybisect.replay.restore import logged_losses, replay, restore

    # batches are not kept: the replay rebuilds every batch in-process (0 workers), with dropout drawing meanwhile
    result = workspace.train_here("train.num_workers=2", "snapshot.keep_batches=false", config_dir=project)
    assert result["snapshot_steps"] == [0, 10, 20]
    store = workspace.store()
    logged = logged_losses(store, result["run_id"])
    restored = restore(store, result["run_id"], 0)
    assert not restored.has_stored_batch(0)
    replayed = replay(restored, 30, logged=logged)
    assert replayed.reproduced == "exact", replayed.mismatches[:3]
    assert replayed.losses == logged


def test_nan_from_the_augmentation_under_workers_is_reproduced_exactly(workspace, project):
    import sys

    sys.path.insert(0, str(project))
    try:
        from jitter_data import JitterPoints
    finally:
        sys.path.remove(str(project))
    source = loop.BatchSource(JitterPoints(nan_below=0.004), batch_size=8, seed=0)
    failing = next(step for step in range(200) if torch.isnan(source.batch(step)[0]).any())
    assert 12 < failing < 60, failing  # past the first epoch (12 steps), with snapshots before it

    # batches are not kept: the replay up to the failing step rebuilds them in-process (0 workers)
    args = ("data.nan_below=0.004", "train.num_workers=2", "train.steps=60", "snapshot.keep_batches=false")
    run = workspace.replay("train", "--json", "--config-dir", str(project), *args)
    assert run.returncode == 3, run.stderr
    assert run.json()["first_nonfinite_step"] == failing
    found = workspace.answer_here("find_nan", run.json()["run_id"])  # (the training above is the command)
    assert found["failing_step"] == failing and found["reproduced"] == "exact", found
    assert found["category"] == "data", found


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_raises_shows_its_own_traceback_then_one_line(workspace, project, workers):
    """The user's bug is shown from the user's frame down (not typer's and the loop's), the same with workers, and
    the run that crashed is marked so, its records kept."""
    result = workspace.replay("train", "--config-dir", str(project), "+data.fail_at=37", f"train.num_workers={workers}")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == ("replay: error: your code raised KeyError: 'label file missing for item 37' "
                         "(jitter_data.py:24 in __getitem__); fix it and run the command again"), result.stderr
    traceback_lines = lines[lines.index(next(line for line in lines if line.startswith("Traceback"))):]
    assert traceback_lines[1].strip().startswith(f'File "{project / "jitter_data.py"}", line 24'), result.stderr
    assert not any(part in result.stderr for part in ("typer", "replaybisect/", "worker.py")), result.stderr
    crashed = re.search(r"replaybisect: run ([0-9a-f]{32}) ended as crashed", result.stderr)
    assert crashed, result.stderr
    assert workspace.store().get_run(crashed.group(1)).info.status == "FAILED"
