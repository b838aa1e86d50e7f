"""Bad input that used to crash, hang or half-work (issue 19): each is refused in one line (exit 2 on the command
line, a ReplayError from Python) before a store or run exists where that is possible.

- values: an interpolation that does not resolve, a device this machine does not have (train.device, --device), an
  lr torch accepts but no run can train with, ablate's submitit options;
- a recorded run whose tags or stored batches were changed after recording (the batches re-manifested, so every
  checksum verifies): the replay refuses in one line naming the run and the snapshot instead of crashing;
- the Python API's arguments of the wrong kind; Lightning's ddp_spawn; a SIGTERM while `replay` is shutting down.

Most cases fail before torch or MLflow is imported, or in this process; the run they share is recorded once (tiny:
it goes non-finite at step 3).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, TESTS, Workspace, assert_one_line_error, sign_as_recorder, train_example

try:
    import lightning
except ImportError:
    lightning = None

TINY_FAILING = ("model.decay=0.3", "snapshot.every=2", "snapshot.layer_stats_every=0")  # non-finite at step 3
RUN_ID_TAG = "replaybisect.first_nonfinite_step"


def _contents(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def _refused_creating_nothing(workspace: Workspace, *args: str, fragments=()) -> None:
    before = _contents(workspace.path)
    result = workspace.replay(*args)
    assert_one_line_error(result, *fragments)
    assert _contents(workspace.path) == before  # no mlflow.db, no run


def _refusal_line(result) -> str:
    """Exit 2, no traceback, one error line (a replay may print its progress before it, as `replay nan` does)."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("replay:")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    return errors[0]


# ---- values on the command line: refused before any store or run exists ----------------------------------------
def test_an_interpolation_that_does_not_resolve_is_one_line(tmp_path):
    _refused_creating_nothing(Workspace(tmp_path), "train", "train.steps=${oc.env:REPLAYBISECT_NOPE}",
                              fragments=["cannot resolve train.steps", "REPLAYBISECT_NOPE"])


def test_a_device_this_machine_lacks_is_refused_before_any_store(tmp_path):
    """Was an internal error, after a run was created."""
    _refused_creating_nothing(Workspace(tmp_path), "train", "train.device=meta", "train.steps=2",
                              fragments=["train.device='meta' is not a device"])


@pytest.mark.parametrize("device", ["cuda:99", "bogus", "cuda", "xla", "cuda:-1"])
def test_every_device_name_is_checked_where_the_config_is_composed(device):
    """The same check, in this process: compose validates before `replay train` opens (or creates) its store (was:
    a store created, then the device refused)."""
    import torch

    from replaybisect.core import config as config_mod
    from replaybisect.errors import ConfigError

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match=f"train.device='{device}'"):
        config_mod.compose(None, None, [f"train.device={device}", "train.steps=2"])


def test_nan_on_a_device_this_machine_lacks_is_one_line(tmp_path):
    import torch

    if torch.backends.mps.is_available():
        pytest.skip("MPS is available here")
    _refused_creating_nothing(Workspace(tmp_path), "nan", "--run-id", "0123456789abcdef", "--device", "mps",
                              fragments=["--device 'mps'", "not available"])


def test_nan_device_meta_is_not_a_device_to_replay_on():
    from replaybisect.core.device import resolve_device
    from replaybisect.errors import ConfigError

    with pytest.raises(ConfigError, match="--device 'meta' is not a device"):
        resolve_device("meta", "--device")


@pytest.mark.parametrize("lr, fragment", [("-1e308", "Invalid learning rate: -1e+308"), ("1e309", "its learning rate inf")])
def test_an_lr_no_run_can_train_with_is_refused_where_the_config_is_composed(lr, fragment):
    from replaybisect.core import config as config_mod
    from replaybisect.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(f"cannot build `optim`: {fragment}")):
        config_mod.compose(None, None, [f"optim.lr={lr}"])


def test_ablate_submitit_options_are_checked_before_the_run_is_read(tmp_path):
    workspace = Workspace(tmp_path)
    (tmp_path / "jobs").write_text("a file, not a folder")
    _refused_creating_nothing(workspace, "ablate", "lr", "--run-id", "0123456789abcdef", "--executor", "submitit",
                              "--cluster", "bogus", fragments=["--cluster 'bogus' is not a submitit cluster", "slurm, local, debug"])
    _refused_creating_nothing(workspace, "ablate", "lr", "--run-id", "0123456789abcdef", "--executor", "submitit",
                              "--executor-folder", "jobs", fragments=["--executor-folder jobs is a file, not a folder"])


# ---- a recorded run whose tags or batches were changed after recording -------------------------------------------
@dataclass
class Recorded:
    workspace: Workspace
    store: object
    run_id: str

    @property
    def snapshots(self) -> Path:
        return self.store.local_artifact_dir(self.run_id) / "snapshots"


@pytest.fixture(scope="module")
def failed(tmp_path_factory) -> Recorded:
    workspace = Workspace(tmp_path_factory.mktemp("failed"))
    store = workspace.store()
    result = train_example(store, "nan_forward", *TINY_FAILING)
    assert result.status == "nonfinite" and result.first_nonfinite_step == 3, result
    return Recorded(workspace, store, result.run_id)


@pytest.fixture
def tag(failed):
    """Set a tag of the run for one test; put back after."""
    client = failed.store.client
    saved = client.get_run(failed.run_id).data.tags

    def set_tag(key: str, value: str) -> None:
        client.set_tag(failed.run_id, key, value)
        sign_as_recorder(failed.store, failed.run_id)  # (a code_dir tag is signed: these tests are of what lies behind)

    yield set_tag
    for key in ("replaybisect.first_nonfinite_step", "replaybisect.code_dir", "replaybisect.signature"):
        client.set_tag(failed.run_id, key, saved[key])


@pytest.mark.parametrize("verb", ["nan", "ablate", "diagnose"])
def test_a_failing_step_tag_that_is_not_a_step_is_one_line(failed, tag, verb):
    tag(RUN_ID_TAG, "abc")
    args = ["ablate", "lr"] if verb == "ablate" else [verb]
    line = _refusal_line(failed.workspace.replay(*args, "--run-id", failed.run_id))
    assert f"run {failed.run_id}: its tag replaybisect.first_nonfinite_step='abc' is not a step number" in line
    if verb == "diagnose":  # a listing still lists the run (one damaged run does not hide the others)
        from replaybisect.verbs.runs.engine import recent_runs

        (listed,) = recent_runs(failed.store)
        assert listed.run_id == failed.run_id and listed.first_nonfinite_step is None


def test_a_code_dir_tag_with_a_nul_is_one_line(failed, tag):
    """Run outside the trusted folders (no --code-dir): the tag would be the only way to the model's code, and a
    tag holding a NUL is no folder (was: a crash on the path)."""
    tag("replaybisect.code_dir", f"{EXAMPLES / 'nan_forward'}\0/etc")
    env = failed.workspace.env()
    env.pop("REPLAYBISECT_CODE_DIR")
    line = _refusal_line(failed.workspace.replay("nan", "--run-id", failed.run_id, env=env))
    assert "\0" not in line and "planted_forward" in line and len(line) < 1000, line


def test_a_5000_character_code_dir_tag_is_one_short_line(failed, tag, tmp_path, monkeypatch):
    from replaybisect.core.trust import Trust
    from replaybisect.errors import ReplayError
    from replaybisect.replay.restore import run_config

    tag("replaybisect.code_dir", str(EXAMPLES / "nan_forward") + "/x" * 2500)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REPLAYBISECT_CODE_DIR")
    with pytest.raises(ReplayError) as refused:
        run_config(failed.store, failed.run_id, Trust.from_user())  # the tag is the only way to the code, and no folder
    assert "planted_forward" in str(refused.value) and len(str(refused.value)) < 1000


def _rewrite_batches(snapshots: Path, change) -> None:
    """`change(x, y) -> (x, y)` on every stored batch of every snapshot, written back with a manifest that verifies."""
    from replaybisect.core import snapshot as fmt

    for folder in sorted(snapshots.iterdir()):
        loaded = fmt.load(folder)
        if not loaded.batches:
            continue
        payload = fmt.encode_batches({step: change(*batch) for step, batch in loaded.batches.items()})
        (folder / fmt.BATCHES).write_bytes(payload)
        manifest = json.loads((folder / fmt.MANIFEST).read_text())
        manifest["files"][fmt.BATCHES] = fmt.file_entry(payload)
        (folder / fmt.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def rewritten(failed, tmp_path):
    """Rewrite the run's stored batches for one test; the recorded ones are put back after."""
    backup = tmp_path / "snapshots"
    shutil.copytree(failed.snapshots, backup)
    yield lambda change: _rewrite_batches(failed.snapshots, change)
    shutil.rmtree(failed.snapshots)
    shutil.copytree(backup, failed.snapshots)


def test_replay_nan_refuses_stored_batches_with_float_labels_in_one_line(failed, rewritten):
    rewritten(lambda x, y: (x, y.float()))
    line = _refusal_line(failed.workspace.replay("nan", "--run-id", failed.run_id))
    assert re.search(f"run {failed.run_id}: replaying step [23] on the batch stored in snapshot step-00000[23] raised RuntimeError", line)
    assert "does not fit the model and loss" in line


REWRITES = {
    "labels-out-of-range": (lambda x, y: (x, y + 1000), "raised IndexError: Target 10"),
    "wrong-width": (lambda x, y: (x[:, :-1], y), "raised RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    "wrong-count": (lambda x, y: (x, y[:-1]), "holds a tensor of 31 rows, but every batch of the run has train.batch_size=32"),
}


@pytest.mark.parametrize("name", sorted(REWRITES))
def test_rewritten_stored_batches_are_a_snapshot_error_for_nan_and_ablate(failed, rewritten, name):
    from replaybisect.errors import ReplayError, SnapshotError
    from replaybisect.verbs.ablate.engine import ablate
    from replaybisect.verbs.nan.engine import find_nan

    change, fragment = REWRITES[name]
    rewritten(change)
    with pytest.raises(SnapshotError, match=fragment) as refused:
        find_nan(failed.store, failed.run_id)
    assert re.search(r"batch (of step|stored in snapshot) ", str(refused.value)) and "step-00000" in str(refused.value)
    if name == "wrong-count":  # ablate replays the same batches: the same refusal, from its baseline arm
        with pytest.raises(ReplayError, match=f"the baseline replay failed: SnapshotError: .*{fragment}"):
            ablate(failed.store, failed.run_id, ["lr"], horizon=1, workers=1)


# ---- the Python API: a wrong kind is a ReplayError at the call ----------------------------------------------------
def build(cfg):
    import torch

    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model, optimizer, batch):
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize("arguments, message", [
    ({"seed": "abc"}, "seed='abc' is not an integer"),
    ({"tracking_uri": 5}, "tracking_uri=5 is not a tracking URI"),
    ({"scheduler": "cosine"}, "Recorder got str 'cosine' as the scheduler, not a learning-rate scheduler"),
    ({"scaler": "x"}, "Recorder got str 'x' as the scaler, not a gradient scaler"),
    ({"snapshot_every": "10"}, "snapshot_every='10' is not an integer >= 0"),
], ids=["seed", "tracking-uri", "scheduler", "scaler", "snapshot-every"])
def test_recorder_arguments_of_the_wrong_kind_are_refused_before_a_run(tmp_path, monkeypatch, arguments, message):
    import replaybisect

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    model, optimizer = build(None)
    with pytest.raises(replaybisect.ReplayError) as refused:
        replaybisect.Recorder(model, optimizer, step_fn=train_step, build=build, **arguments)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "mlflow.db").exists()


def test_a_scheduler_of_another_optimizer_is_refused():
    import torch

    import replaybisect

    model, optimizer = build(None)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(replaybisect.ReplayError, match="built on another optimizer"):
        replaybisect.Recorder(model, optimizer, step_fn=train_step, build=build,
                              scheduler=torch.optim.lr_scheduler.StepLR(other, step_size=5))


@pytest.mark.parametrize("call, message", [
    (lambda rb: rb.find_nan(None), "run_id=None is not a run id"),
    (lambda rb: rb.diagnose(""), "run_id='' is not a run id"),
    (lambda rb: rb.ablate(5), "run_id=5 is not a run id"),
    (lambda rb: rb.find_nan("0123456789abcdef", step="3"), "step='3' is not an integer >= 0"),
    (lambda rb: rb.train(["train.steps=2"], tracking_uri=5), "tracking_uri=5 is not a tracking URI"),
    (lambda rb: rb.check(tracking_uri=Path("mlflow.db")), "is not a tracking URI"),
], ids=["find-nan-none", "diagnose-empty", "ablate-int", "step-str", "train-uri", "check-path-uri"])
def test_api_arguments_of_the_wrong_kind_raise_replay_error_at_the_call(tmp_path, monkeypatch, call, message):
    import replaybisect

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(replaybisect.ReplayError, match=message):
        call(replaybisect)
    assert _contents(tmp_path) == []


@pytest.mark.parametrize("args, fragment", [
    (("snapshot.metrics_flush_seconds=nan",), "snapshot.metrics_flush_seconds=nan"),
    (("snapshot.metrics_flush_seconds=-1",), "snapshot.metrics_flush_seconds=-1.0"),
    (("--run-name", ""), "--run-name '' is empty"),
    (("--config-name", ""), "--config-name '' is empty"),
], ids=["flush-seconds-nan", "flush-seconds-negative", "run-name-empty", "config-name-empty"])
def test_a_flush_period_or_name_no_run_can_have_is_refused_creating_nothing(tmp_path, args, fragment):
    """Were accepted (exit 0): a NaN or negative flush period (a negative one flushed every step), an empty run name
    (the default name instead), an empty config name."""
    _refused_creating_nothing(Workspace(tmp_path), "train", "train.steps=2", *args, fragments=[fragment])


@pytest.mark.parametrize("arguments, message", [
    ({"config_name": ""}, "--config-name '' is empty"),
    ({"run_name": " "}, "--run-name ' ' is empty"),
    ({"overrides": ["snapshot.metrics_flush_seconds=nan"]}, "snapshot.metrics_flush_seconds=nan"),
], ids=["config-name", "run-name", "flush-seconds"])
def test_train_refuses_an_empty_name_or_a_nan_flush_period_from_python(tmp_path, monkeypatch, arguments, message):
    import replaybisect

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(replaybisect.ReplayError, match=re.escape(message)):
        replaybisect.train(**{"overrides": ["train.steps=2"], **arguments})
    assert _contents(tmp_path) == []


# ---- Lightning: a strategy that trains in new processes ----------------------------------------------------------
def test_lightning_ddp_spawn_is_refused_at_fit_start_in_one_line(tmp_path, monkeypatch):
    """Was a 28-line ProcessRaisedException quoting the spawned process's traceback, after starting 2 processes."""
    if lightning is None:
        pytest.skip("lightning is not installed")
    import lightning as L

    from replaybisect.errors import ConfigError
    from replaybisect.lightning import ReplayCallback

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.syspath_prepend(str(TESTS / "lightning_model"))
    import lit_model

    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[ReplayCallback()],
                        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(ConfigError) as refused:
        trainer.fit(lit_model.LitRegressor(), lit_model.data(32))
    assert "new processes (ddp_spawn" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "mlflow.db").exists()


# ---- SIGTERM while `replay` shuts down --------------------------------------------------------------------------
SIGTERM_AT_EXIT = '''
import atexit, os, signal, time

def _terminate_at_the_very_end():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)  # a handler ends the process at once; without one, the default action kills it

atexit.register(_terminate_at_the_very_end)
'''


def test_a_sigterm_at_the_very_end_prints_one_line_and_exits_143(tmp_path):
    """The last exit handler of the interpreter sends the SIGTERM, after main() returned (bisect's end: its threads
    joined, MLflow's and multiprocessing's exit handlers): was death by signal (-15) with no line."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SIGTERM_AT_EXIT)
    workspace = Workspace(tmp_path)
    result = workspace.replay("bisect", "--help", env=workspace.env(PYTHONPATH=str(site)))
    assert result.returncode == 143, f"exit {result.returncode}\n{result.stderr}"
    assert result.stdout.startswith("Usage: replay bisect") and result.stderr == "replay: terminated (SIGTERM)\n"
