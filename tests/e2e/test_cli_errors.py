"""Bad input on the command line, over every verb: one line on stderr, exit 2, no traceback, nothing created.

Each case runs the installed `replay` in a fresh folder whose default tracking store is `./mlflow.db`: a failed
command must leave the folder as it was (no store file, no artifacts). Cases that could touch an existing store
run again against a store that already holds a run, which must stay byte for byte the same.
Most cases exit before torch or MLflow is imported (~0.4 s each); the optimizer cases import torch (~3 s).
Bad input that was already refused in one line (ablate's checks, check's --run-id with a config, ...) is tested
in the verbs' own modules.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.cli_cases import BROKEN_YAML, CONFIG, USAGE  # the cases, shared with unit/test_requests.py
from tests.helpers import Workspace, assert_one_line_error


def _contents(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def _user_folder(path: Path) -> Workspace:
    workspace = Workspace(path)
    (path / "conf").mkdir()
    (path / "conf" / "broken.yaml").write_text(BROKEN_YAML)
    return workspace


def _assert_one_line_and_nothing_created(workspace: Workspace, args, fragments) -> None:
    before = _contents(workspace.path)
    result = workspace.replay(*args)
    assert_one_line_error(result, *fragments)
    assert result.stdout == ""
    assert _contents(workspace.path) == before  # no mlflow.db, no mlruns, no cache


@pytest.mark.parametrize("args, fragments", [pytest.param(a, f, id=i) for i, a, f in USAGE])
def test_usage_error_is_one_line_and_creates_nothing(tmp_path, args, fragments):
    _assert_one_line_and_nothing_created(_user_folder(tmp_path), args, fragments)


# Both verbs compose the config with the same function (core/config.py's compose), which raises every one of these
# errors: `train` runs every case; `check` imports torch before it composes (~3 s a case), so it runs the two that
# prove its wiring: its own --config-dir/--config-name, and an override it passes on.
CHECK_WIRING = {"yaml-syntax", "lr-not-number", "config-dir-a-file"}
CONFIG_CASES = [pytest.param("train", a, f, id=f"train-{i}") for i, a, f in CONFIG] + [
    pytest.param("check", a, f, id=f"check-{i}") for i, a, f in CONFIG if i in CHECK_WIRING
]


@pytest.mark.parametrize("verb, args, fragments", CONFIG_CASES)
def test_bad_config_value_is_one_line_and_creates_nothing(tmp_path, verb, args, fragments):
    _assert_one_line_and_nothing_created(_user_folder(tmp_path), [verb, *args], fragments)


@pytest.fixture(scope="module")
def store_with_a_run(tmp_path_factory) -> Workspace:
    """A store that already holds a (tiny) training run."""
    workspace = _user_folder(tmp_path_factory.mktemp("store"))
    workspace.train_here("train.steps=3", "model.hidden=16", "snapshot.every=0", "train.val_every=0", "snapshot.layer_stats_every=0")
    return workspace


@pytest.mark.parametrize(
    "args",
    [
        ("runs", "--status", "bogus"),
        ("runs", "--kind", "bogus"),
        ("runs", "--limit", "50001"),
        ("train", "optim.lr=-1"),
        ("check", "--config-dir", "conf", "--config-name", "broken"),
    ],
    ids=["runs-status", "runs-kind", "runs-limit", "train-lr", "check-yaml"],
)
def test_bad_input_leaves_an_existing_store_unchanged(store_with_a_run, args):
    database = store_with_a_run.path / "mlflow.db"
    digest = hashlib.sha256(database.read_bytes()).hexdigest()
    contents = _contents(store_with_a_run.path)
    result = store_with_a_run.replay(*args)
    assert_one_line_error(result)
    assert hashlib.sha256(database.read_bytes()).hexdigest() == digest
    assert _contents(store_with_a_run.path) == contents


def test_a_tracking_uri_that_is_a_plain_path_to_an_mlflow_db_is_that_store(store_with_a_run):
    """Was: "tracking store mlflow.db is a file, not a folder" (a plain path was taken for a file store's folder)."""
    database = store_with_a_run.path / "mlflow.db"
    digest = hashlib.sha256(database.read_bytes()).hexdigest()
    (run,) = store_with_a_run.store().search_runs("")
    env = {key: value for key, value in store_with_a_run.env().items() if key != "MLFLOW_TRACKING_URI"}
    listed = store_with_a_run.replay("runs", "--tracking-uri", "mlflow.db", env=env)
    assert listed.returncode == 0 and run.info.run_id[:8] in listed.stdout, listed.stderr
    assert f"store: {database} (from --tracking-uri)" in listed.stderr
    missing = store_with_a_run.replay("diagnose", "--run-id", "nope", "--tracking-uri", str(database), env=env)
    assert_one_line_error(missing, f"no run 'nope' in {database}")
    assert hashlib.sha256(database.read_bytes()).hexdigest() == digest


def test_runs_limit_cap_is_mlflows():
    from mlflow.store.tracking import SEARCH_MAX_RESULTS_THRESHOLD

    from replaybisect.verbs.runs.engine import MAX_LIMIT

    assert MAX_LIMIT == SEARCH_MAX_RESULTS_THRESHOLD


def test_bare_replay_prints_the_help_and_exits_0(tmp_path):
    before = _contents(tmp_path)
    result = Workspace(tmp_path).replay()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: replay") and result.stderr == ""
    assert _contents(tmp_path) == before


def test_version_prints_the_installed_version_without_torch(tmp_path):
    from importlib.metadata import version

    workspace = Workspace(tmp_path)
    result = workspace.replay("--version")
    assert (result.returncode, result.stdout, result.stderr) == (0, f"replay {version('replaybisect')}\n", "")
    # cheap: neither torch nor mlflow is imported for it
    probe = workspace.replay("--version", env=workspace.env(PYTHONPROFILEIMPORTTIME="1"))
    imported = {line.split("|")[-1].strip().split(".")[0] for line in probe.stderr.splitlines() if "|" in line}
    assert "typer" in imported and not imported & {"torch", "mlflow"}

