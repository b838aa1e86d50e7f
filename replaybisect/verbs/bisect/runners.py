"""How a trial runs at a commit: trained by `replay train` in a worktree (TrainRunner), or a shell command
(CommandRunner); the metric read back from its run."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Sequence
from urllib.parse import urlparse

from replaybisect.core.jobs import JOB_FAILED
from replaybisect.verbs.bisect.gitops import UserRepo, cache_root
from replaybisect.verbs.bisect.results import BisectAborted, SeedRun
TAIL_FRACTION = 0.1  # the metric: mean over the last 10% of logged steps (DESIGN §5)
# What `replay train` logs (replaybisect/record/hooks.py): a trial's --metric is one of these, or a per-layer one
TRAIN_METRICS = ("loss", "val_loss", "grad_norm", "lr", "param_norm", "update_ratio", "step_time", "data_time",
                 "snapshot_blocking_time", "grads_carried",
                 "memory/rss", "memory/allocated", "memory/peak", "memory/recorder")  # (a memory regression bisects too)
LAYER_METRICS = ("grad_norm/", "weight_norm/", "act_zero_frac/", "act_sat_frac/")  # + the layer's module name


def is_train_metric(name: str) -> bool:
    """Whether `replay train` logs a metric of this name (a trial's --metric)."""
    return name in TRAIN_METRICS or (name.startswith(LAYER_METRICS) and not name.endswith("/"))
TRIAL_THREADS = "1"  # OMP_NUM_THREADS of a trial when the user has not set it
OUTPUT_TAIL = 4000  # characters of a trial's output kept with its run


# ---------------------------------------------------------------------------------------------
# trial runners: how one (commit, seed) is run in a worktree
# ---------------------------------------------------------------------------------------------
def content_hash(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def output_tail(text: str, limit: int = OUTPUT_TAIL) -> str:
    return text[-limit:]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1].removeprefix("replay: error: ")[:300] if lines else ""


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "none"


class TrainRunner:
    """Train the repository's own config at the commit: `python -m replaybisect train ...`."""

    mode = "train"

    def __init__(self, *, config_dir: str, config_name: str, overrides: Sequence[str], steps: int | None,
                 metric: str, tracking_uri: str):
        self.config_dir = config_dir
        self.config_name = config_name
        self.overrides = list(overrides)
        self.steps = steps
        self.metric = metric
        self.tracking_uri = tracking_uri
        # The tree hash covers the repository's code and config; this covers what the command line adds
        # and what trains it (PyTorch does not promise identical results across versions).
        self.config_hash = content_hash({"mode": "train", "config_dir": config_dir, "config_name": config_name,
                                  "overrides": self.overrides, "steps": steps,
                                  "replaybisect": _package_version("replaybisect"), "torch": _package_version("torch"),
                                  "threads": os.environ.get("OMP_NUM_THREADS", TRIAL_THREADS)})

    def command(self, worktree: Path, seed: int, parent_run_id: str, sha: str) -> list[str]:
        command = [sys.executable, "-m", "replaybisect", "train",
                   "--config-dir", str(worktree / self.config_dir), "--config-name", self.config_name,
                   "--json", "--tracking-uri", self.tracking_uri,
                   "--parent-run-id", parent_run_id, "--kind", "bisect-trial", "--run-name", f"{sha[:10]} seed {seed}",
                   "--tag", f"bisect_sha={sha}", "--tag", f"bisect_seed={seed}",
                   f"seed={seed}"]
        if self.steps is not None:
            command.append(f"train.steps={self.steps}")
        return command + self.overrides

    def one_step_command(self, worktree: Path, tracking_uri: str) -> list[str]:
        """The commit's first step alone, seed 0, recorded in a store of its own (not a trial: nothing cached, no run
        under the bisect): what `Bisector.numerics` traces."""
        return [sys.executable, "-m", "replaybisect", "train", "--config-dir", str(worktree / self.config_dir),
                "--config-name", self.config_name, "--json", "--tracking-uri", tracking_uri, "seed=0",
                *self.overrides, "train.steps=1", "snapshot.enabled=false"]

    def interpret(self, store, returncode: int, stdout: str, stderr: str, seed: int) -> tuple[SeedRun, bool]:
        """(the run, whether the result may be cached)."""
        report = _parse_json(stdout)
        run_id = report.get("run_id")
        if returncode == JOB_FAILED:  # the job, not the trial: a crash, tried once more and not remembered
            return SeedRun(seed, "skip", detail=_last_line(stderr)), False
        if returncode == 0:
            if not run_id:
                return SeedRun(seed, "skip", detail="`replay train` printed no run id"), False
            metric = tail_mean(store.metric_history(run_id, self.metric))
            if metric is None:
                return SeedRun(seed, "skip", run_id=run_id, detail=f"the run logged no `{self.metric}` metric"), True
            if not math.isfinite(metric):
                return SeedRun(seed, "nonfinite", metric=None, run_id=run_id, detail=f"{self.metric} is {metric}"), True
            return SeedRun(seed, "ok", metric=metric, run_id=run_id), True
        if returncode == 3:  # stopped on a non-finite loss or gradient: bad at once
            step = report.get("first_nonfinite_step")
            return SeedRun(seed, "nonfinite", run_id=run_id, detail=f"step {step}" if step is not None else _last_line(stderr)), True
        if returncode == 2:  # bad config, `_target_` that does not import: the commit cannot be tested
            return SeedRun(seed, "skip", run_id=run_id, detail=_last_line(stderr) or "bad config (exit 2)"), True
        if returncode == 1:  # a crash that is not a divergence; maybe the machine's fault (a locked store): not cached
            return SeedRun(seed, "skip", run_id=run_id, detail=_last_line(stderr) or "crashed (exit 1)"), False
        # killed by a signal (out of memory, for one): infrastructure, skip and do not remember it
        return SeedRun(seed, "skip", run_id=run_id, detail=f"killed (exit status {returncode})"), False


class CommandRunner:
    """`--cmd`: any shell command, with `git bisect run` exit statuses."""

    mode = "cmd"

    def __init__(self, cmd: str):
        self.cmd = cmd
        self.metric = "exit status"
        self.config_hash = content_hash({"mode": "cmd", "cmd": cmd})

    def command(self, worktree: Path, seed: int, parent_run_id: str, sha: str) -> list[str]:
        return ["/bin/sh", "-c", self.cmd]

    def interpret(self, store, returncode: int, stdout: str, stderr: str, seed: int) -> tuple[SeedRun, bool]:
        if returncode == JOB_FAILED:  # the job, not the command: a crash, tried once more and not remembered
            return SeedRun(seed, "skip", detail=_last_line(stderr)), False
        if returncode < 0 or returncode >= 128:
            raise BisectAborted(f"--cmd exited with status {returncode if returncode >= 0 else 128 - returncode} "
                                f"(>= 128 means abort, as in git bisect run): {_last_line(stderr) or _last_line(stdout)}; "
                                "fix the command and run again")
        if returncode == 0:
            return SeedRun(seed, "good", detail="exit 0"), True
        if returncode == 125:
            return SeedRun(seed, "skip", detail="exit 125 (skip)"), True
        detail = f"exit {returncode}"
        if returncode in (126, 127):  # git bisect run treats these as bad, but they usually mean a broken command
            detail += " (command not found or not executable?)"
        return SeedRun(seed, "bad", detail=detail), True


def _parse_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    try:
        return json.loads(stdout)
    except (json.JSONDecodeError, ValueError):
        return {}


def tail_mean(history: Sequence[tuple[int, float]], fraction: float = TAIL_FRACTION) -> float | None:
    """Mean of the values over the last `fraction` of the logged steps (at least one)."""
    if not history:
        return None
    count = max(1, math.ceil(len(history) * fraction))
    values = [value for _, value in history[-count:]]
    return sum(values) / len(values)


def absolute_tracking_uri(uri: str) -> str:
    """Trials run in another folder: make a relative SQLite or file store path absolute."""
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite" and uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path = uri[len("sqlite:///"):]
        if path and path != ":memory:" and not path.startswith("/"):
            return "sqlite:///" + str(Path(path).resolve())
    if parsed.scheme == "" and "://" not in uri:
        return str(Path(uri).expanduser().resolve())
    return uri


def store_outside_repo(uri: str, user: UserRepo) -> str:
    """A SQLite or file store inside the user's working tree would write there: keep it in the cache instead."""
    parsed = urlparse(uri)
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else (uri if parsed.scheme == "" else "")
    if not path or not Path(path).resolve().is_relative_to(user.path):
        return uri
    moved = "sqlite:///" + str(cache_root() / "mlflow.db")
    print(f"replay bisect: the tracking store {uri} is inside the repository being bisected; recording to {moved} "
          "instead (pass --tracking-uri to choose)", file=sys.stderr)
    cache_root().mkdir(parents=True, exist_ok=True)
    return moved
