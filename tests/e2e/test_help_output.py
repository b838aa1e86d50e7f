"""Help prints its examples as written (click's no-rewrap blocks), and the top-level help lists every verb whole,
with an example. No store, no torch: each case is a fraction of a second."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers import REPLAY

EXAMPLES = {
    "train": [
        "replay train train.steps=300 optim.lr=3e-3 model=cnn train.precision=bf16",
        "replay train --config-dir examples/nan_forward   # a run that dies with loss=nan (exit 3)",
    ],
    "ablate": [
        "replay ablate lr,clip,precision --run-id 3f2a... --horizon 40",
        "replay ablate lr --run-id 3f2a... --workers 2 --from-step 100",
    ],
    "bisect": [
        "replay bisect v1.2 main --steps 200 --workers 3 optim.lr=3e-3",
        "replay bisect --repo /tmp/demo demo-good demo-bad --steps 40 --workers 2",
        "first bad commit: 3f2a9c1e07 refactor the model",
        "author: Ada <ada@example.com>",
    ],
}


def _help(*args: str, columns: str = "80") -> str:
    env = dict(os.environ, COLUMNS=columns)
    done = subprocess.run([REPLAY, *args, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("verb", sorted(EXAMPLES))
def test_examples_print_as_written(verb):
    for columns in ("80", "60"):
        lines = [line.strip() for line in _help(verb, columns=columns).splitlines()]
        for example in EXAMPLES[verb]:
            assert example in lines, f"{example!r} re-wrapped at {columns} columns:\n" + "\n".join(lines)


def test_top_level_help_has_whole_summaries_and_an_example():
    text = _help()
    commands = text.split("Commands:")[1]  # the usage line ends in [ARGS]...
    assert "..." not in commands and "…" not in commands
    for verb in ("train", "runs", "nan", "ablate", "bisect", "check", "diagnose"):
        assert any(line.split()[:1] == [verb] and len(line.split()) > 2 for line in text.splitlines()), verb
    assert "  replay nan --run-id RUN_ID" in text and "nearest mlflow.db" in text
