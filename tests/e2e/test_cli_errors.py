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

from conftest import Workspace, assert_one_line_error

LONG_KEY = "k" * 300  # Hydra looks a `+key=` up as a file name: "File name too long"
LONG_VALUE = "x" * 10_000
BROKEN_YAML = "defaults: [{model: mlp}, {data: digits}, {optim: adamw}]\nseed: [1\n"

# (id, arguments, fragments the error line must contain)
USAGE = [
    ("unknown-verb", ["nann"], ["No such command 'nann'", "Did you mean 'nan'", "replay --help"]),
    ("unknown-root-option", ["--bogus"], ["No such option: --bogus", "replay --help"]),
    ("train-option-needs-value", ["train", "--run-name"], ["--run-name", "requires an argument", "replay train --help"]),
    ("runs-limit-not-int", ["runs", "--limit", "abc"], ["--limit", "valid integer", "replay runs --help"]),
    ("runs-limit-zero", ["runs", "--limit", "0"], ["--limit", "1 to 50000"]),
    ("runs-limit-over-mlflow-cap", ["runs", "--limit", "50001"], ["--limit", "1 to 50000"]),
    ("runs-status-unknown", ["runs", "--status", "bogus"], ["--status 'bogus'", "ok, nonfinite, crashed"]),
    ("runs-kind-unknown", ["runs", "--kind", "bogus"], ["--kind 'bogus'", "train, replay, ablation-arm", "all"]),
    ("runs-unknown-option", ["runs", "--bogus"], ["No such option: --bogus", "replay runs --help"]),
    ("nan-missing-run-id", ["nan"], ["Missing option '--run-id'", "replay nan --help"]),
    ("nan-run-id-without-value", ["nan", "--run-id"], ["--run-id", "requires an argument", "replay nan --help"]),
    ("nan-negative-step", ["nan", "--run-id", "x", "--step", "-1"], ["--step", "greater than or equal to 0"]),
    ("nan-step-not-int", ["nan", "--run-id", "x", "--step", "one"], ["--step", "valid integer"]),
    ("diagnose-missing-run-id", ["diagnose"], ["Missing option '--run-id'", "replay diagnose --help"]),
    ("diagnose-extra-argument", ["diagnose", "--run-id", "x", "extra"], ["extra", "replay diagnose --help"]),
    ("ablate-horizon-without-value", ["ablate", "lr", "--run-id", "x", "--horizon"], ["--horizon", "requires an argument", "replay ablate --help"]),
    ("ablate-horizon-huge", ["ablate", "lr", "--run-id", "x", "--horizon", "10000001"], ["--horizon", "less than or equal to 1000000"]),
    ("ablate-workers-huge", ["ablate", "lr", "--run-id", "x", "--workers", "100000"], ["--workers", "less than or equal to 256"]),
    ("ablate-gpus-negative", ["ablate", "lr", "--run-id", "x", "--gpus", "-1"], ["--gpus", "greater than or equal to 0"]),
    ("ablate-mem-not-number", ["ablate", "lr", "--run-id", "x", "--mem-gb", "lots"], ["--mem-gb"]),
    ("bisect-missing-good", ["bisect"], ["Missing argument 'good'", "replay bisect --help"]),
    ("bisect-missing-bad", ["bisect", "v1"], ["Missing argument 'bad'", "replay bisect --help"]),
    ("bisect-steps-zero", ["bisect", "a", "b", "--steps", "0"], ["--steps", "1 to 1000000"]),
    ("bisect-steps-huge", ["bisect", "a", "b", "--steps", "100000000000000000000"], ["--steps", "1 to 1000000"]),
    ("bisect-seeds-zero", ["bisect", "a", "b", "--seeds", "0"], ["--seeds", "1 to 100"]),
    ("bisect-seeds-huge", ["bisect", "a", "b", "--seeds", "1000"], ["--seeds", "1 to 100"]),
    ("bisect-max-seeds-zero", ["bisect", "a", "b", "--max-seeds", "0"], ["--max-seeds", "1 to 300"]),
    ("bisect-workers-zero", ["bisect", "a", "b", "--workers", "0"], ["--workers", "1 to 256"]),
    ("bisect-workers-huge", ["bisect", "a", "b", "-w", "100000"], ["--workers", "1 to 256"]),
    ("bisect-threshold-nan", ["bisect", "a", "b", "--threshold", "nan"], ["--threshold nan must be a finite number"]),
    ("check-overfit-steps-zero", ["check", "--overfit-steps", "0"], ["--overfit-steps", "1 to 1000000", "replay check --help"]),
    ("check-overfit-steps-huge", ["check", "--overfit-steps", "1000000000"], ["--overfit-steps", "1 to 1000000"]),
    ("check-overfit-samples-one", ["check", "--overfit-samples", "1"], ["--overfit-samples", "2 to 32"]),
    ("check-lr-steps-float", ["check", "--lr-steps", "1e20"], ["--lr-steps", "valid integer"]),
    ("check-lr-steps-huge", ["check", "--lr-steps", "100000000000000000000"], ["--lr-steps", "2 to 1000000"]),
    ("check-only-unknown", ["check", "--only", "bogus"], ["unknown check bogus", "choose from"]),
    ("nan-device-unknown", ["nan", "--run-id", "x", "--device", "bogus"], ["'bogus' is not a device"]),
    ("check-lr-min-nan", ["check", "--lr-min", "nan"], ["--lr-min nan", "finite"]),
    ("check-lr-max-inf", ["check", "--lr-max", "inf"], ["--lr-max inf", "finite"]),
]

# Config values, through both verbs that compose a config.
CONFIG = [
    ("lr-not-number", ["optim.lr=abc"], ["optim.lr='abc' is not a number"]),
    ("lr-negative", ["optim.lr=-1"], ["cannot build `optim`", "Invalid learning rate: -1"]),
    ("closure-optimizer-fp16", ["optim._target_=torch.optim.LBFGS", "~optim.weight_decay", "train.precision=fp16"], ["LBFGS", "re-evaluates the loss", "bf16"]),
    ("accumulate-uneven", ["train.batch_size=10", "train.accumulate=4"], ["train.batch_size=10", "train.accumulate=4", "multiple"]),
    ("yaml-syntax", ["--config-dir", "conf", "--config-name", "broken"], ["YAML syntax error", "broken.yaml line 3"]),
    ("long-override-key", [f"+{LONG_KEY}=1"], ["File name too long", "chars); check the overrides"]),
    ("long-override-value", [f"train.steps={LONG_VALUE}"], ["train.steps=xxx", "(10012 chars)"]),
    ("threads-absurd", ["train.num_threads=100000"], ["train.num_threads=100000", "between 1 and 1024"]),
    ("val-batches-negative", ["train.val_batches=-1"], ["train.val_batches=-1 must be positive"]),
    ("clip-nan", ["train.clip_grad_norm=nan"], ["train.clip_grad_norm=nan"]),
    ("seed-out-of-range", [f"seed={2**70}"], [f"seed={2**70}", "seed range"]),
    ("config-dir-a-file", ["--config-dir", "conf/broken.yaml"], ["conf/broken.yaml is a file, not a folder", "--config-dir"]),
]


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


# ---- an exception nobody caught: whose it is decides what is shown ------------------------------------------
def _caught(run, drop_caller_frames: int = 1) -> BaseException:
    try:
        run()
    except Exception as error:  # noqa: BLE001 - the point is to report any exception
        for _ in range(drop_caller_frames):  # this test's own frames are a user's; drop them where they are not the point
            error.__traceback__ = error.__traceback__.tb_next
        return error
    raise AssertionError("nothing was raised")


def _users_model():
    import torch

    return torch.zeros(2, 3) @ torch.zeros(2, 3)  # a shape bug in "user code" (this file), raised inside torch


def test_a_crash_below_user_code_shows_its_traceback_from_the_users_frame(capsys):
    from replaybisect.cli import _report_crash

    _report_crash(_caught(_users_model))
    stderr = capsys.readouterr().err.strip().splitlines()
    assert stderr[0].startswith("Traceback (from your code") and "test_cli_errors.py" in stderr[1] and "_users_model" in stderr[1]
    assert stderr[-1].startswith("replay: error: your code raised RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert "(test_cli_errors.py:" in stderr[-1] and "in _users_model); fix it" in stderr[-1]


def test_a_crash_in_our_own_code_is_an_internal_error_to_report(capsys):
    from replaybisect.cli import _report_crash
    from replaybisect.core import rng

    _report_crash(_caught(lambda: rng._unsigned(None), drop_caller_frames=2))
    stderr = capsys.readouterr().err.strip().splitlines()
    assert stderr[0] == "Traceback (most recent call last):" and "rng.py" in stderr[-4]
    assert stderr[-1] == "replay: internal error: TypeError: Mersenne Twister words are not an int32 tensor; please report it with the traceback above"


def test_a_crash_in_a_library_with_no_user_frame_names_where_it_was_raised(capsys):
    import json

    from replaybisect.cli import _report_crash

    _report_crash(_caught(lambda: json.loads("{"), drop_caller_frames=2))
    stderr = capsys.readouterr().err.strip().splitlines()
    assert stderr[0] == "Traceback (most recent call last):"
    assert stderr[-1].startswith("replay: error: JSONDecodeError: Expecting property name") and "(raised in decoder.py:" in stderr[-1]


def test_a_crash_caused_by_running_out_of_memory_says_so_in_its_last_line(capsys):
    """A library may wrap a MemoryError (MLflow's SQL session does): the one line still says out of memory, which is
    what `replay watch` reads to report a triage that hit its --memory-mb."""
    import json

    from replaybisect.cli import _report_crash

    def wrapped():
        try:
            raise MemoryError()
        except MemoryError:
            json.loads("{")  # the library's own error, raised while handling it

    _report_crash(_caught(wrapped, drop_caller_frames=2))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("replay: error: JSONDecodeError") and "(caused by MemoryError: out of memory)" in last, last
