"""`replay bisect` on a repository whose model prints to stdout (as nanoGPT prints its parameter count) in
`__init__` and in every `forward`: trials report their run through their own channel, so the regression is
found and `--json` stays one JSON object."""

from __future__ import annotations

import pytest
from tests.helpers import Workspace
from test_bisect import demo, repo_fingerprint

pytestmark = pytest.mark.slow

REGRESSION_AT = 6


def _noisy(repo) -> None:
    """The model of this commit, made to print like user code does."""
    path = repo.path / "model.py"
    text = path.read_text()
    text = text.replace("        super().__init__()\n", "        super().__init__()\n        print('number of parameters: many')\n", 1)
    text = text.replace("    def forward(self, x):\n", "    def forward(self, x):\n        print('forward', tuple(x.shape), flush=True)\n", 1)
    path.write_text(text)


def test_bisect_finds_the_regression_in_a_repository_whose_model_prints(tmp_path):
    workspace = Workspace(tmp_path)
    repo = demo.DemoRepo(tmp_path / "repo")
    shas = []
    for index in range(10):
        if index in (0, REGRESSION_AT):
            repo.code(**(demo.CLEAN if index == 0 else demo.REGRESSIONS["clear"]))
            _noisy(repo)
            shas.append(repo.commit("a regression model that prints" if index == 0 else "refactor the model (clear regression)"))
        else:
            shas.append(repo.note(f"note {index}"))
    assert "print('forward'" in (repo.path / "model.py").read_text()
    before = repo_fingerprint(repo.path)

    result = workspace.replay("bisect", "--repo", str(repo.path), "--json", shas[0], shas[-1], "--workers", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    report = result.json()  # one JSON object on stdout, whatever the trials printed
    assert report["first_bad"] == shas[REGRESSION_AT]
    assert repo_fingerprint(repo.path) == before
