"""`replay train` end to end: the real CLI on a real SQLite MLflow store, read back with the plain MLflow client."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, assert_one_line_error, train_in_process
from replaybisect.core import snapshot as fmt


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One built-in run shared by the read-back tests."""
    from tests.helpers import Workspace

    workspace = Workspace(tmp_path_factory.mktemp("trained"))
    result = workspace.train(*FAST, "scheduler=cosine")
    return workspace, result


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One workspace (one SQLite store) for the runs trained in this process: each test reads its own run by id."""
    from tests.helpers import Workspace

    return Workspace(tmp_path_factory.mktemp("in-process"))


def _train_here(workspace, *overrides: str, config_dir: Path | None = None):
    """`replay train OVERRIDES` in this process (what the command runs, without its start-up): the TrainResult.
    `replay train` itself runs end to end in the other tests of this module."""
    return train_in_process(workspace.store(), *overrides, config_dir=config_dir, code_folder=config_dir or workspace.path)


def test_run_is_readable_with_plain_mlflow(trained):
    from mlflow import MlflowClient

    workspace, result = trained
    assert result["status"] == "ok" and result["steps_completed"] == 40
    client = MlflowClient(tracking_uri=workspace.tracking_uri)
    run = client.get_run(result["run_id"])

    # the resolved config as params and as an artifact
    assert run.data.params["train.steps"] == "40"
    assert run.data.params["model._target_"] == "replaybisect.models.MLP"
    assert run.data.params["scheduler.T_max"] == "40"  # interpolation resolved
    config_text = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(workspace.path))).read_text()
    assert "steps: 40" in config_text

    # per-step metrics, validation, layer statistics
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(40))
    for key in ("grad_norm", "lr", "step_time", "data_time"):
        assert len(client.get_metric_history(run.info.run_id, key)) == 40, key
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_loss")) == [9, 19, 29, 39]
    for key in ("param_norm", "update_ratio", "grad_norm/net.0", "weight_norm/net.0", "act_zero_frac/net.1"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [0, 10, 20, 30], key

    # tags
    tags = run.data.tags
    assert tags["replaybisect.status"] == "ok"
    assert tags["replaybisect.kind"] == "train"
    assert tags["replaybisect.snapshot_steps"] == "0,10,20,30"
    assert run.info.status == "FINISHED"

    # snapshots: every one verifies; the batches of its interval are stored
    root = Path(run.info.artifact_uri.removeprefix("file://")) / "snapshots"
    assert sorted(p.name for p in root.iterdir()) == ["step-000000", "step-000010", "step-000020", "step-000030"]
    snapshot = fmt.load(root / "step-000010")
    assert sorted(snapshot.batches) == list(range(10, 20))
    assert snapshot.state["step"] == 10 and snapshot.state["scheduler"]["last_epoch"] == 10
    assert any(name.startswith("optim/") and name.endswith("exp_avg_sq") for name in snapshot.tensors)


def test_runs_lists_the_run(trained):
    workspace, result = trained
    listing = workspace.replay("runs", "--json").json()
    (entry,) = [r for r in listing["runs"] if r["run_id"] == result["run_id"]]
    assert entry["status"] == "ok" and entry["steps"] == 40 and entry["snapshot_steps"] == [0, 10, 20, 30]
    table = workspace.replay("runs")
    assert table.returncode == 0 and result["run_id"] in table.stdout


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_replay_from_every_snapshot_reproduces_every_loss_exactly(shared, precision):
    """Dropout, a scheduler and interleaved validation: replaying from any snapshot gives == losses."""
    from replaybisect.replay.restore import logged_losses, replay, restore

    run_id = _train_here(shared, *FAST, f"train.precision={precision}", "scheduler=cosine", "model.dropout=0.2",
                         "train.val_every=7").run_id
    store = shared.store()
    logged = logged_losses(store, run_id)
    assert len(logged) == 40
    for step in (0, 10, 30):
        restored = restore(store, run_id, step)
        assert restored.step == step
        replayed = replay(restored, 40, logged=logged)
        assert replayed.reproduced == "exact", replayed.mismatches[:3]
        assert replayed.losses == {s: logged[s] for s in range(step, 40)}


def test_two_runs_of_one_config_log_identical_losses(workspace):
    """One by the installed command, one in this process: the same config gives the same losses either way."""
    from replaybisect.replay.restore import logged_losses

    first = workspace.train(*FAST, "model.dropout=0.3")
    second = _train_here(workspace, *FAST, "model.dropout=0.3").to_json()
    store = workspace.store()
    assert first["run_id"] != second["run_id"]
    assert logged_losses(store, first["run_id"]) == logged_losses(store, second["run_id"])


def test_user_config_with_only_model_data_loss_optim(workspace):
    user = workspace.path / "myproject"
    user.mkdir()
    (user / "mymodel.py").write_text(
        textwrap.dedent(
            """
            import torch
            class Tiny(torch.nn.Module):
                def __init__(self, width):
                    super().__init__()
                    self.layer = torch.nn.Linear(64, width)
                def forward(self, x):
                    return self.layer(x)
            """
        )
    )
    (user / "exp.yaml").write_text(
        textwrap.dedent(
            """
            model: {_target_: mymodel.Tiny, width: 10}
            data: {_target_: replaybisect.data.Digits}
            loss: {_target_: torch.nn.CrossEntropyLoss}
            optim: {_target_: torch.optim.SGD, _partial_: true, lr: 0.1}
            """
        )
    )
    git = lambda *args: subprocess.run(["git", "-C", str(user), *args], check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "start")
    sha = git("rev-parse", "HEAD")
    result = workspace.train("train.steps=12", "snapshot.every=5", extra=("--config-dir", str(user), "--config-name", "exp"))
    assert result["status"] == "ok" and result["snapshot_steps"] == [0, 5, 10]
    # the schema's defaults were applied: batch size 64
    run = workspace.store().get_run(result["run_id"])
    assert run.data.params["train.batch_size"] == "64"
    assert run.data.tags["replaybisect.code_dir"] == str(user)
    # the user's code version: mymodel.py and exp.yaml are untracked, which does not make it dirty
    assert run.data.tags["replaybisect.git_sha"] == sha and run.data.tags["replaybisect.git_dirty"] == "false"


def _poisoned_project(root: Path, nan_index: int) -> Path:
    project = root / "poisoned"
    project.mkdir()
    (project / "poisoned_data.py").write_text(
        textwrap.dedent(
            f"""
            import torch
            from replaybisect.data import Digits

            class BatchNormNet(torch.nn.Module):  # its forward updates running statistics in place
                def __init__(self):
                    super().__init__()
                    self.net = torch.nn.Sequential(
                        torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
                    )
                def forward(self, x):
                    return self.net(x)

            class PoisonedDigits(Digits):
                def __init__(self, **kwargs):
                    super().__init__(**kwargs)
                    self.inputs = self.inputs.clone()
                    self.inputs[{nan_index}, 5] = float("nan")
            """
        )
    )
    (project / "config.yaml").write_text(
        textwrap.dedent(
            """
            model: {_target_: poisoned_data.BatchNormNet}
            data: {_target_: poisoned_data.PoisonedDigits}
            optim: {_target_: torch.optim.AdamW, _partial_: true, lr: 0.001}
            """
        )
    )
    return project


def _step_of_sample(index: int, batch_size: int, seed: int = 0) -> int:
    from replaybisect.data import Digits
    from replaybisect.core.loop import BatchSource

    source = BatchSource(Digits(), batch_size, seed)
    return next(step for step in range(source.steps_per_epoch) if index in source.indices(step).tolist())


def test_planted_nan_stops_with_exit_3_tags_and_emergency_snapshot(workspace):
    nan_index = 700
    failing = _step_of_sample(nan_index, 32)
    project = _poisoned_project(workspace.path, nan_index)
    args = ("--config-dir", str(project), "train.steps=60", "train.batch_size=32", "snapshot.every=10")
    run = workspace.replay("train", "--json", *args)
    assert run.returncode == 3, run.stderr
    assert f"step {failing}" in run.stderr, run.stderr  # --json: stdout is the JSON alone, the one line on stderr
    result = run.json()
    assert result["status"] == "nonfinite" and result["first_nonfinite_step"] == failing and result["stopped"]
    assert result["steps_completed"] == failing  # steps 0..failing-1: the failing one halted before its update

    store = workspace.store()
    tags = store.tags(result["run_id"])
    assert tags["status"] == "nonfinite" and tags["first_nonfinite_step"] == str(failing)
    losses = dict(store.metric_history(result["run_id"], "loss"))
    assert max(losses) == failing and math.isnan(losses[failing])
    assert all(math.isfinite(v) for s, v in losses.items() if s < failing)

    # the emergency snapshot: the state before the failing step, with the failing batch
    root = store.local_artifact_dir(result["run_id"]) / "snapshots"
    emergency = fmt.load(root / fmt.folder_name(failing))
    assert emergency.state["step"] == failing
    assert list(emergency.batches) == [failing]
    assert torch.isnan(emergency.batches[failing][0]).any()
    # finite, and bit-identical to replaying the periodic snapshot up to the failing step: the NaN batch's
    # forward had already updated BatchNorm's running statistics in place when the step halted
    assert all(torch.isfinite(t).all() for name, t in emergency.tensors.items() if name.startswith("model/"))
    from replaybisect.core.state import live_tensors
    from replaybisect.replay.restore import replay, restore

    restored = restore(store, result["run_id"], failing - 1)
    replay(restored, failing)
    live = live_tensors(restored.state)
    assert sorted(live) == sorted(emergency.tensors)
    assert all(torch.equal(live[name], emergency.tensors[name]) for name in live)
    # the periodic snapshot before it holds the batches up to and including the failing one
    periodic = fmt.load(root / fmt.folder_name(failing - failing % 10))
    assert max(periodic.batches) == failing

    human = workspace.replay("train", *args)  # without --json the summary names the next command
    assert human.returncode == 3, human.stderr
    assert f"step {failing}" in human.stdout + human.stderr
    assert "replay nan --run-id " in human.stdout, human.stdout


def test_on_nonfinite_continue_goes_on(shared):
    nan_index = 700
    failing = _step_of_sample(nan_index, 32)
    project = _poisoned_project(shared.path, nan_index)
    result = _train_here(shared, "train.steps=40", "train.batch_size=32", "snapshot.every=10",
                         "snapshot.on_nonfinite=continue", config_dir=project).to_json()
    assert result["steps_completed"] == 40 and not result["stopped"]
    assert result["status"] == "nonfinite" and result["first_nonfinite_step"] == failing
    store = shared.store()
    assert sorted(dict(store.metric_history(result["run_id"], "loss"))) == list(range(40))
    assert (store.local_artifact_dir(result["run_id"]) / "snapshots" / fmt.folder_name(failing) / fmt.MANIFEST).is_file()


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["train.stpes=5"], ["train.stpes"]),
        (["model._target_=nosuchpackage.Model"], ["model", "nosuchpackage"]),
        (["train.precision=fp8"], ["fp8", "fp32"]),
        (["train.steps=-5"], ["train.steps=-5"]),
        (["--tracking-uri", "http://127.0.0.1:9"], ["unreachable", "127.0.0.1:9"]),
        (["--tracking-uri", "sqlite:////nonexistent/folder/mlflow.db"], ["does not exist"]),
        (["--config-dir", "/nonexistent/conf"], ["does not exist"]),
    ],
)
def test_bad_input_is_one_line_exit_2(workspace, args, fragments):
    result = workspace.replay("train", *args)
    assert_one_line_error(result, *fragments)
    assert not (workspace.path / "mlruns").exists()  # nothing recorded: no file store ...
    database = workspace.path / "mlflow.db"
    if database.exists():  # ... and no run in the workspace's SQLite store, if one was opened at all
        assert workspace.store().search_runs("", max_results=10) == []


def test_help_does_not_import_torch_or_mlflow():
    code = (  # main() ends the process: what it imported is read by the last exit handler
        "import atexit, sys\n"
        "atexit.register(lambda: print('HEAVY', sorted(m for m in ('torch', 'mlflow') if m in sys.modules)))\n"
        "sys.argv = ['replay', '--help']\n"
        "from replaybisect.cli import main\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in done.stdout, done.stdout + done.stderr
    assert "train" in done.stdout and "runs" in done.stdout
    module_help = subprocess.run([sys.executable, "-m", "replaybisect", "train", "--help"], capture_output=True, text=True, timeout=60)
    assert module_help.returncode == 0 and "Hydra override" in module_help.stdout


def test_ctrl_c_marks_the_run_killed_and_keeps_its_verified_snapshots(workspace):
    import signal

    from tests.helpers import REPLAY, wait_until
    from replaybisect.replay.restore import newest_good_snapshot

    store = workspace.store()  # create the SQLite store first: two processes migrating one new file collide
    process = subprocess.Popen(
        [REPLAY, "train", "train.steps=100000", "snapshot.every=5", "train.val_every=0"],
        cwd=workspace.path, env=workspace.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    wait_until(lambda: any(r.data.tags.get("replaybisect.snapshot_steps") for r in store.search_runs("")),
               timeout=120, interval=0.1)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr
    (run,) = store.search_runs("")
    assert run.data.tags["replaybisect.status"] == "killed" and run.info.status == "KILLED"
    assert newest_good_snapshot(store, run.info.run_id, None, []).step >= 0
