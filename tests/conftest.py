"""Shared fixtures: a real SQLite MLflow store per test, and the installed `replay` command as a user runs it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import signal

# A suite started in the background (`.ci/run &` from a script) inherits SIGINT ignored, and so would every `replay`
# it starts: the Ctrl-C tests need the signal delivered as a terminal would.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Tiny test models run fastest on one thread, and a 2-core CI machine runs several processes at once.
# Runs record their thread count and replays restore it, so this changes speed, not results.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

REPLAY = shutil.which("replay") or str(Path(sys.executable).with_name("replay"))


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


@dataclass
class Workspace:
    """A user's working folder with its own SQLite tracking store."""

    path: Path

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.path / 'mlflow.db'}"

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(MLFLOW_TRACKING_URI=self.tracking_uri, PYTHONUNBUFFERED="1", REPLAYBISECT_CACHE=str(self.path / ".cache"))
        env.pop("REPLAYBISECT_FULL_ERROR", None)
        env.update(extra)
        return env

    def replay(self, *args: str, timeout: float = 600, env: dict | None = None) -> CliResult:
        """Run the installed `replay` command in this folder, as a user would."""
        done = subprocess.run(
            [REPLAY, *args], cwd=self.path, env=env or self.env(), capture_output=True, text=True, timeout=timeout
        )
        return CliResult(done.returncode, done.stdout, done.stderr)

    def train(self, *overrides: str, expect: int = 0, extra: tuple[str, ...] = ()) -> dict:
        """`replay train --json OVERRIDES`; returns the JSON result (run_id, status, ...)."""
        result = self.replay("train", "--json", *extra, *overrides)
        assert result.returncode == expect, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return result.json()

    def train_here(self, *overrides: str, config_dir: Path | None = None) -> dict:
        """What `train(OVERRIDES)` prints as JSON, trained in this process with `rb.train` (the same request and
        engine, without a `replay` process's seconds of imports): for tests about what is done with a run."""
        import replaybisect as rb

        with in_folder(self.path):  # where `replay train` would run: the run's code folder for the built-in config
            printed = as_printed(rb.train(overrides, config_dir=config_dir, tracking_uri=self.tracking_uri))
        assert printed["status"] == "ok", printed
        return printed

    def answer_here(self, verb: str, run_id: str, folder: Path | None = None, publish: bool = False, **options) -> dict:
        """What `replay VERB --run-id RUN_ID --json` prints (`--no-child-run` unless `publish`), computed in this
        process with `rb.VERB` (find_nan, ablate, check, diagnose: the same request and engine, without a `replay`
        process's seconds of imports), run from `folder` (this workspace unless given) as the command would be."""
        import replaybisect as rb

        with in_folder(folder or self.path):
            return as_printed(getattr(rb, verb)(run_id=run_id, tracking_uri=self.tracking_uri, publish=publish, **options))

    def store(self):
        from replaybisect.store import open_store

        return open_store(self.tracking_uri)


@pytest.fixture(scope="session", autouse=True)
def trusted_code_dirs(tmp_path_factory):
    """The examples and the tests' own temporary projects are this suite's own code: stored runs may build their
    `_target_`s from there (replaybisect/trust.py), as a user would say with --code-dir. test_trust.py unsets it."""
    from unittest import mock

    folders = os.pathsep.join([str(EXAMPLES), str(tmp_path_factory.getbasetemp())])
    with mock.patch.dict(os.environ, {"REPLAYBISECT_CODE_DIR": folders}):
        yield


@pytest.fixture(scope="session", autouse=True)
def signing_key_folder(tmp_path_factory):
    """The user's config folder, where the key that signs runs is made on first use (core/provenance.py): the suite's
    own, never the developer's."""
    from unittest import mock

    from replaybisect.core import provenance

    with mock.patch.dict(os.environ, {"XDG_CONFIG_HOME": str(tmp_path_factory.mktemp("config"))}):
        os.environ.pop("REPLAYBISECT_KEY", None)
        os.environ.pop("REPLAYBISECT_KEY_FILE", None)
        provenance.signing_key(create=True)  # as after the user's first recording (test_provenance: before it)
        yield


# Every verb that replays a stored run, as a user types it (the run id last), at its smallest.
STORED_RUN_VERBS = {
    "nan": ("nan", "--run-id"),
    "ablate": ("ablate", "lr", "--workers", "2", "--horizon", "2", "--run-id"),
    "check": ("check", "--overfit-steps", "5", "--lr-steps", "4", "--run-id"),
}


def sign_as_recorder(store, run_id: str) -> None:
    """Sign the run's stored config.yaml and tags as they are now with this user's key, as the recorder would have:
    for tests of what holds even in a signed config (the trust checks behind the signature, a replay's own limits)."""
    from replaybisect.core import provenance

    text = store.read_artifact_text(run_id, "config.yaml")
    signed = provenance.signature(provenance.signing_key(create=True), run_id, text, store.tags(run_id))
    store.set_tags(run_id, {provenance.SIGNATURE_TAG: signed})


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    return Workspace(tmp_path)


# Small, fast training settings for end-to-end tests (a few seconds a run on 2 cores).
FAST = ("train.steps=40", "train.batch_size=32", "snapshot.every=10", "snapshot.layer_stats_every=10", "train.val_every=10", "model.hidden=32")


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def train_example(store, name: str, *overrides: str, env: dict[str, str] | None = None):
    """Train examples/NAME/config.yaml in this process (environment `env` set meanwhile); the TrainResult."""
    from unittest import mock

    from replaybisect.core import config as config_mod
    from replaybisect.verbs.train.engine import train

    folder = EXAMPLES / name
    with mock.patch.dict(os.environ, env or {}):
        cfg = config_mod.compose(folder, "config", list(overrides))
        return train(cfg, store, code_folder=folder)


def record_script(workspace: Workspace, folder: str, source: str, *args: str, expect: str) -> tuple[Path, str]:
    """tests/user_loop/SOURCE copied into a project folder as train.py and run with ARGS as a user runs it; it
    must print `expect` (its failure). The project folder and the run id."""
    import re

    project = workspace.path / folder
    project.mkdir()
    shutil.copy(Path(__file__).resolve().parent / "user_loop" / source, project / "train.py")
    done = subprocess.run([sys.executable, "train.py", *args], cwd=project, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    assert expect in done.stdout + done.stderr, done.stdout + done.stderr[-2000:]
    return project, re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)


def folder_tree(folder: Path) -> dict[str, str]:
    """Every path under `folder` with its file's sha256: two trees are equal when nothing was written there."""
    import hashlib

    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
            for path in sorted(folder.rglob("*"))}


@contextlib.contextmanager
def in_folder(folder: Path):
    """Run in `folder`, as the CLI does: a store created here keeps its artifacts (./mlruns) here."""
    previous = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def as_printed(result) -> dict:
    """A verb's result as its `--json` prints it (the same encoding as options.print_json), for the tests that call
    the Python API in this process instead of starting `replay` (seconds of imports a process)."""
    from replaybisect.core.jsonutil import strict_json

    return json.loads(strict_json(result.to_json()))


def outcome_lines(stderr: str) -> list[str]:
    """stderr without the lines every command may print before its outcome: where it records (`store: ...`)
    and its progress (`training: ...`)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(("store: ", "training: "))]


def assert_one_line_error(result: CliResult, *fragments: str) -> None:
    """Bad input: exit 2, one line on stderr naming the problem, no traceback."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), f"{fragment!r} not in {lines[0]!r}"


# The longest modules first: pytest-xdist (`-n N --dist loadfile --no-loadscope-reorder`) hands modules out in
# collection order, and a long one handed out last runs alone at the end while the other workers sit idle (measured:
# the suite's last minutes). Without --no-loadscope-reorder xdist orders modules by their number of tests instead.
# The order: each module's summed test time on a 2-core machine, longest first.
LONGEST_FIRST = [
    "test_inline_loop.py", "test_distributed.py", "test_watch.py", "test_bisect_train.py", "test_ablate.py", "test_trust.py",
    "test_script_loop.py", "test_check_run_state.py", "test_train.py", "test_user_loop.py", "test_watch_units.py", "test_bisect.py",
    "test_hf.py", "test_lightning.py", "test_zoo.py", "test_watch_jobs.py", "test_step_guard.py", "test_ablate_patch.py",
    "test_divergence.py", "test_diagnose.py", "test_snapshots.py", "test_signals.py", "test_check.py", "test_cli_errors.py",
    "test_workers.py", "test_ablate_values.py", "test_nan.py", "test_store_safety.py", "test_bad_input.py", "test_store_race.py",
    "test_bisect_printing.py", "test_user_stdout.py", "test_store_location.py", "test_snapshot_fuzz.py", "test_optim_factory.py",
    "test_disk_full.py", "test_runs.py", "test_nan_fix.py", "test_host_reads.py", "test_check_library.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its own order
