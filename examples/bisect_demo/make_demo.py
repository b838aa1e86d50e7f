"""Build a git repository to try `replay bisect` on: a tiny regression model trained from its own code.

    python examples/bisect_demo/make_demo.py /tmp/demo            # 40 commits, one of them a regression
    replay bisect --repo /tmp/demo demo-good demo-bad --steps 40 --workers 2

The repository's `conf/config.yaml` points `_target_`s at its own `model.py` and `data.py`. Most commits
only edit NOTES.md; one commit makes training converge worse (`--kind clear`: the config's learning rate
drops 10x; `--kind subtle`: the model adds a small error it cannot learn away, costing about the loss's
seed-to-seed spread; `--kind nonfinite`: the learning rate is so large the loss overflows); one earlier
commit breaks the import of `model.py` and the next commit fixes it. Tags `demo-good` (the first commit)
and `demo-bad` (the last) mark the range. The tests build their histories with the same functions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

MODEL = '''"""A small regression network."""
import torch
{broken_import}

class Regressor(torch.nn.Module):
    def __init__(self, n_in: int = 8, hidden: int = 16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1){output_change}
'''

DATA = '''"""Noisy linear targets, fixed by their own generator (the run's seed sets init and data order)."""
import torch


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int = 512, n_in: int = 8, noise: float = 0.3):
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, n_in, generator=generator)
        weight = torch.randn(n_in, generator=generator)
        self.y = self.x @ weight + noise * torch.randn(n, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]
'''

CONFIG = '''model: {{_target_: model.Regressor, n_in: 8, hidden: 16}}
data: {{_target_: data.Points, n: 512}}
loss: {{_target_: torch.nn.MSELoss}}
optim: {{_target_: torch.optim.SGD, lr: {lr}, _partial_: true}}
train: {{steps: 40, batch_size: 32, val_every: 0}}
snapshot: {{every: 0, layer_stats_every: 0}}
'''

# What each regression kind changes (in model.py's forward or the config's lr).
CLEAN = {"output_change": "", "lr": "0.05"}
REGRESSIONS = {
    "clear": {"output_change": "", "lr": "0.005"},  # learning rate 10x smaller: far from converged at 40 steps
    # a small input-dependent error the network cannot learn away in 40 steps: the loss rises by about its
    # seed-to-seed spread, so one seed cannot tell it from noise (the endpoints need more seeds)
    "subtle": {"output_change": " + 0.25 * torch.sin(3 * x[:, 0])", "lr": "0.05"},
    "nonfinite": {"output_change": "", "lr": "1.0e4"},  # diverges to inf/nan
}


class DemoRepo:
    """A repository built commit by commit (plain git commands, run in the new repository only)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "main")
        self.git("config", "user.name", "Demo Author")
        self.git("config", "user.email", "demo@example.com")
        self.git("config", "commit.gpgsign", "false")
        self.counter = 0

    def git(self, *args: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        env.update(GIT_AUTHOR_DATE=f"2026-01-01T00:{self.counter // 60 % 60:02d}:{self.counter % 60:02d}Z" if hasattr(self, "counter") else "2026-01-01T00:00:00Z")
        env["GIT_COMMITTER_DATE"] = env["GIT_AUTHOR_DATE"]
        return subprocess.run(["git", *args], cwd=self.path, env=env, check=True, capture_output=True, text=True).stdout.strip()

    def write(self, name: str, text: str) -> None:
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def commit(self, message: str) -> str:
        self.counter += 1
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", message)
        return self.git("rev-parse", "HEAD")

    def code(self, *, output_change: str = "", lr: str = "0.05", broken: bool = False) -> None:
        self.write("model.py", MODEL.format(broken_import="import a_module_that_does_not_exist" if broken else "",
                                            output_change=output_change))
        self.write("data.py", DATA)
        self.write("conf/config.yaml", CONFIG.format(lr=lr))

    def note(self, line: str) -> str:
        notes = self.path / "NOTES.md"
        notes.write_text((notes.read_text() if notes.exists() else "") + line + "\n")
        return self.commit(line)


def linear_history(path: str | Path, *, commits: int = 40, regression_at: int = 27, kind: str = "clear",
                   broken_at: int | None = 12) -> tuple[DemoRepo, list[str]]:
    """`commits` commits, oldest first: the first is good, `regression_at` brings the regression,
    `broken_at` breaks the import of model.py and the commit after it fixes it."""
    repo = DemoRepo(path)
    shas = []
    regressed = False
    for index in range(commits):
        if index == 0:
            repo.code(**CLEAN)
            repo.write("NOTES.md", "# notes\n")
            shas.append(repo.commit("a regression model that trains"))
        elif index == regression_at:
            repo.code(**REGRESSIONS[kind])
            regressed = True
            shas.append(repo.commit("refactor the model"))  # the subject does not give the answer away
        elif broken_at is not None and index == broken_at:
            repo.code(**(REGRESSIONS[kind] if regressed else CLEAN), broken=True)
            shas.append(repo.commit("import a helper that is not there"))
        elif broken_at is not None and index == broken_at + 1:
            repo.code(**(REGRESSIONS[kind] if regressed else CLEAN))
            shas.append(repo.commit("drop the missing import"))
        else:
            shas.append(repo.note(f"note {index}"))
    repo.git("tag", "demo-good", shas[0])
    repo.git("tag", "demo-bad", shas[-1])
    return repo, shas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--commits", type=int, default=40)
    parser.add_argument("--regression-at", type=int, default=27)
    parser.add_argument("--kind", choices=sorted(REGRESSIONS), default="clear")
    parser.add_argument("--broken-at", type=int, default=12)
    args = parser.parse_args()
    if Path(args.path).exists() and any(Path(args.path).iterdir()):
        parser.error(f"{args.path} exists and is not empty")
    _, shas = linear_history(args.path, commits=args.commits, regression_at=args.regression_at, kind=args.kind,
                             broken_at=args.broken_at)
    # the answer is for `replay bisect` to find, not for this script to print
    print(f"built {args.path}: {len(shas)} commits between tags demo-good and demo-bad; one of them slows convergence")
    print(f"find it: replay bisect --repo {args.path} demo-good demo-bad --steps 40 --workers 2")


if __name__ == "__main__":
    main()
