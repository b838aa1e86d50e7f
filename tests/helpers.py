"""What the tests share besides fixtures (those are in conftest.py): the installed `replay` command as a user runs it,
a user's working folder with its own SQLite MLflow store, one way to train a run in this process, and a wait.

`from tests.helpers import ...` from any test module (pyproject's `pythonpath = ["."]`: the repository root). Not a
top-level `helpers`: the tests import users' code in this process, and a user's own helpers.py must stay theirs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent  # the data folders (user_loop/, zoo/, ...) are here, beside unit/ and e2e/
ROOT = TESTS.parent
EXAMPLES = ROOT / "examples"

REPLAY = shutil.which("replay") or str(Path(sys.executable).with_name("replay"))

# Small, fast training settings for end-to-end tests (a few seconds a run on 2 cores).
FAST = ("train.steps=40", "train.batch_size=32", "snapshot.every=10", "snapshot.layer_stats_every=10", "train.val_every=10", "model.hidden=32")

# Every verb that replays a stored run, as a user types it (the run id last), at its smallest.
STORED_RUN_VERBS = {
    "nan": ("nan", "--run-id"),
    "ablate": ("ablate", "lr", "--workers", "2", "--horizon", "2", "--run-id"),
    "check": ("check", "--overfit-steps", "5", "--lr-steps", "4", "--run-id"),
}


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


# ---- training a run in this process ----------------------------------------------------------------------------
def train_in_process(store, *overrides: str, config_dir: Path | None = None, config_name: str = "config",
                     code_folder: Path | None = None, env: dict[str, str] | None = None):
    """Train CONFIG_NAME.yaml of `config_dir` (the built-in config when None) with OVERRIDES, recorded to `store`,
    in this process through the engine `replay train` calls (no `replay` process, no `rb.train` request): the
    TrainResult. The run's code folder is `code_folder`, else `config_dir`, else the working folder (as `replay
    train` records it where it runs); the environment `env` is set while it composes and trains.
    (`Workspace.train_here` is the Python API's door, `rb.train`, with its answer as `--json` prints it.)"""
    from unittest import mock

    from replaybisect.core import config as config_mod
    from replaybisect.verbs.train.engine import train

    with mock.patch.dict(os.environ, env or {}):
        cfg = config_mod.compose(config_dir, config_name, list(overrides))
        return train(cfg, store, code_folder=code_folder or config_dir)


def train_example(store, name: str, *overrides: str, env: dict[str, str] | None = None):
    """Train examples/NAME/config.yaml in this process (environment `env` set meanwhile); the TrainResult."""
    return train_in_process(store, *overrides, config_dir=EXAMPLES / name, env=env)


def sign_as_recorder(store, run_id: str) -> None:
    """Sign the run's stored config.yaml and tags as they are now with this user's key, as the recorder would have:
    for tests of what holds even in a signed config (the trust checks behind the signature, a replay's own limits)."""
    from replaybisect.core import provenance

    text = store.read_artifact_text(run_id, "config.yaml")
    signed = provenance.signature(provenance.signing_key(create=True), run_id, text, store.tags(run_id))
    store.set_tags(run_id, {provenance.SIGNATURE_TAG: signed})


def resign(folder: Path, name: str) -> None:
    """Re-sign a changed file of a snapshot folder in its manifest, as someone with write access could: the parser
    must then catch the change."""
    from replaybisect.core import snapshot as fmt

    manifest = json.loads((folder / fmt.MANIFEST).read_text())
    payload = (folder / name).read_bytes()
    manifest["files"][name] = fmt.file_entry(payload)
    (folder / fmt.MANIFEST).write_text(json.dumps(manifest))


def record_script(workspace: Workspace, folder: str, source: str, *args: str, expect: str) -> tuple[Path, str]:
    """tests/user_loop/SOURCE copied into a project folder as train.py and run with ARGS as a user runs it; it
    must print `expect` (its failure). The project folder and the run id."""
    import re

    project = workspace.path / folder
    project.mkdir()
    shutil.copy(TESTS / "user_loop" / source, project / "train.py")
    done = subprocess.run([sys.executable, "train.py", *args], cwd=project, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    assert expect in done.stdout + done.stderr, done.stdout + done.stderr[-2000:]
    return project, re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)


# ---- reading what happened -------------------------------------------------------------------------------------
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


def wait_until(predicate, timeout: float, interval: float = 0.05):
    """Call `predicate` every `interval` seconds until it returns something true, at most `timeout` seconds: that
    value, or the last (false) one when the time ran out. For "until X happened"; a pause that is the scenario
    itself (train a while, then kill) stays a sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)
