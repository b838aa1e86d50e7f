"""Runs recorded from PyTorch Lightning with replaybisect.lightning.ReplayCallback (the real `lightning` package):
replays reproduce every logged loss exactly (fp32; bf16-mixed with gradient clipping and accumulation), a
planted overflow is found by `replay nan` and fixed by the learning rate in `replay ablate`, and setups a replay
could not repeat are refused before any run exists. (On a CPU Lightning runs 16-mixed as bf16-mixed: its GradScaler
path needs a GPU and is not tested here.)"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from tests.helpers import TESTS, Workspace  # noqa: E402

MODEL = TESTS / "lightning_model"


def _trusting(folder: Path):
    """What `replay VERB` run in `folder` trusts: the user's code there (the verbs' engines are called directly where
    the command adds nothing to what a test proves; `replay nan` runs as a user runs it)."""
    from replaybisect.core.trust import Trust

    return Trust.from_user([folder])


FITS = {"overflow": ("32-true", "0.12", "60"),  # last: its NonFiniteStep ends the process, as a user's script
        "bf16": ("bf16-mixed", "0.05", "12", "0.5", "3"), "skip": ("bf16-mixed", "0.05", "12", "none", "2", "skip")}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Workspace, Path, dict[str, str], subprocess.CompletedProcess]:
    """The model's folder copied into a workspace and trained there with the callback, each of FITS a run, one after
    another in one process (python lit_model.py ARGS + ARGS + ARGS): the workspace, the folder, the run ids, the process."""
    workspace = Workspace(tmp_path_factory.mktemp("lightning"))
    folder = workspace.path / MODEL.name
    shutil.copytree(MODEL, folder)
    order = ("bf16", "skip", "overflow")
    args = [word for name in order for word in ("+", *FITS[name])][1:]
    done = subprocess.run([sys.executable, "lit_model.py", *args], cwd=folder, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    run_ids = re.findall(r"recording run ([0-9a-f]{32})", done.stderr)
    assert len(set(run_ids)) == len(order), done.stderr[-3000:]
    return workspace, folder, dict(zip(order, run_ids)), done


def _replay_in(workspace, folder: Path, *args: str) -> dict:
    """`replay ARGS --json` in the model's folder (its code is trusted there, as for a user)."""
    done = subprocess.run([shutil.which("replay") or str(Path(sys.executable).with_name("replay")), *args, "--json"],
                          cwd=folder, env=workspace.env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


def _assert_replays_exactly(store, run_id: str, from_steps) -> dict[int, float]:
    from replaybisect.replay.restore import logged_losses, replay, restore

    logged = logged_losses(store, run_id)
    end = max(logged) + 1
    for step in from_steps:
        replayed = replay(restore(store, run_id, step), end, logged=logged)
        assert replayed.reproduced == "exact", replayed.mismatches[:3]
        assert sorted(replayed.losses) == list(range(step, end))
    return logged


def test_lightning_planted_overflow_nan_and_ablate(recorded):
    """SGD at too high a learning rate diverges until ExpHead's exp overflows (step 23). The recorded fp32 run
    replays exactly up to it, `replay nan` names torch.exp in `head`, and ablation says the learning rate fixes it."""
    from replaybisect.verbs.ablate.engine import ablate

    workspace, folder, run_ids, done = recorded
    run_id = run_ids["overflow"]
    assert "NonFiniteStep" in done.stderr and f"replay nan --run-id {run_id}" in done.stderr
    store = workspace.store()
    tags = store.tags(run_id)
    assert tags["first_nonfinite_step"] == "23" and tags["loop"] == "user"
    assert set(json.loads(tags["source_sha256"])) == {"lit_model"}  # the LightningModule's module, hashed
    assert store.get_run(run_id).info.status == "FAILED"
    added = [line for line in (folder / "lit_model.py").read_text().splitlines() if "# replaybisect" in line]
    assert len(added) == 3  # import, save_hyperparameters, the callback

    logged = _assert_replays_exactly(store, run_id, (0,))  # 0..23: an epoch boundary (16 batches) and its reshuffle
    assert sorted(logged) == list(range(24)) and not math.isfinite(logged[23])

    nan = _replay_in(workspace, folder, "nan", "--run-id", run_id)
    assert nan["reproduced"] == "exact" and nan["failing_step"] == 23
    assert nan["category"] == "forward" and nan["module"] == "head" and nan["op"] == "torch.exp"
    assert "lit_model.py" in nan["source"] and nan["state_match"].startswith("bit-identical")

    ablation = ablate(store, run_id, "lr", horizon=30, trust=_trusting(folder)).to_json()
    assert ablation["baseline"]["reproduced"] == "exact"
    assert {arm["name"]: arm["verdict"] for arm in ablation["arms"]} == {"lr": "fixes"}


def test_lightning_bf16_clipping_accumulation_replays_exactly(recorded):
    """bf16-mixed autocast, gradient_clip_val, accumulate_grad_batches=3 (an epoch of 16 batches ends in a group of
    one), dropout, a per-step scheduler, a shuffling DataLoader whose items draw noise from the global RNG."""
    from replaybisect.replay.restore import run_config
    from replaybisect.verbs.check.engine import CheckOptions, check as run_checks

    workspace, folder, run_ids, _ = recorded
    run_id = run_ids["bf16"]
    store = workspace.store()
    cfg = run_config(store, run_id)
    assert cfg.train.precision == "bf16" and cfg.user.trainer.gradient_clip_val == 0.5
    logged = _assert_replays_exactly(store, run_id, (0,))
    assert len(logged) == 12  # optimizer steps, 36 batches

    # `replay check` reads the data inside a Lightning step's stored batch (its accumulated micro-batches)
    report = run_checks(store, run_id=run_id, options=CheckOptions(only=["data.finite", "data.input_scale"]),
                        trust=_trusting(folder)).to_json()
    statuses = {check["name"]: check for check in report["checks"]}
    assert statuses["data.finite"]["status"] == "pass" and statuses["data.input_scale"]["status"] == "pass", statuses


def test_batches_skipped_by_training_step_returning_none_replay_exactly(recorded):
    """training_step returns None for some batches (Lightning skips their backward): with 2 accumulated batches one
    step is half skipped and one wholly (no loss logged, not a failure)."""
    import torch

    from replaybisect.core.state import live_tensors
    from replaybisect.replay.restore import replay, restore

    workspace, _, run_ids, _ = recorded
    run_id = run_ids["skip"]  # bf16: fp32 takes the same path
    store = workspace.store()
    assert store.get_run(run_id).info.status == "FINISHED"
    logged = _assert_replays_exactly(store, run_id, (0,))
    missing = sorted(set(range(12)) - set(logged))
    assert missing == [3, 7, 11] and all(math.isfinite(loss) for loss in logged.values()), logged  # batches 6-7, 14-15, 22-23
    # the state is the run's, not only the losses
    replayed, saved = restore(store, run_id, 0), restore(store, run_id, 10)
    replay(replayed, 10, logged=logged)
    ours, theirs = live_tensors(replayed.state), live_tensors(saved.state)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[name], theirs[name]) for name in theirs)


def _fit_in_process(tmp_path, monkeypatch, **trainer_args):
    import lightning as L

    from replaybisect.lightning import ReplayCallback

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    sys.path.insert(0, str(MODEL))
    try:
        import lit_model

        model = trainer_args.pop("model", None) or lit_model.LitRegressor()
        trainer_args = {"max_steps": 2, **trainer_args}
        trainer = L.Trainer(accelerator="cpu", callbacks=[ReplayCallback()], enable_progress_bar=False,
                            logger=False, enable_checkpointing=False, enable_model_summary=False, **trainer_args)
        trainer.fit(model, lit_model.data(32))
    finally:
        sys.path.remove(str(MODEL))


@pytest.mark.parametrize("trainer_args, message", [
    pytest.param({"precision": "bf16-true"}, "this Trainer uses bf16-true", id="precision"),
])
def test_setups_a_replay_cannot_repeat_are_refused_before_a_run_exists(tmp_path, monkeypatch, trainer_args, message):
    from replaybisect.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _fit_in_process(tmp_path, monkeypatch, **trainer_args)
    assert not (tmp_path / "mlflow.db").exists()


def test_manual_optimization_is_refused(tmp_path, monkeypatch):
    from replaybisect.errors import ConfigError

    sys.path.insert(0, str(MODEL))
    try:
        import lit_model
    finally:
        sys.path.remove(str(MODEL))
    model = lit_model.LitRegressor()
    model.automatic_optimization = False
    with pytest.raises(ConfigError, match="records automatic optimization only"):
        _fit_in_process(tmp_path, monkeypatch, model=model)
    assert not (tmp_path / "mlflow.db").exists()


def test_a_module_without_saved_hparams_is_refused(tmp_path, monkeypatch):
    from replaybisect.errors import ConfigError

    (tmp_path / "unsaved_model.py").write_text(
        "import lightning as L, torch\n"
        "class Unsaved(L.LightningModule):\n"
        "    def __init__(self, width):\n        super().__init__()\n        self.layer = torch.nn.Linear(8, width)\n"
        "    def training_step(self, batch, batch_idx):\n        return self.layer(batch[0]).pow(2).mean()\n"
        "    def configure_optimizers(self):\n        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import unsaved_model

    with pytest.raises(ConfigError, match=r"takes width, which is not in its hparams; call self.save_hyperparameters\(\)"):
        _fit_in_process(tmp_path, monkeypatch, model=unsaved_model.Unsaved(4))
    assert not (tmp_path / "mlflow.db").exists()


def test_a_crash_ends_the_run_failed_and_keeps_what_was_recorded(tmp_path, monkeypatch):
    from replaybisect.replay.restore import logged_losses
    from replaybisect.store import open_store

    (tmp_path / "crashing_model.py").write_text(
        "import lit_model\n"
        "class Crashing(lit_model.LitRegressor):\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        if self.global_step == 3:\n            raise RuntimeError('boom')\n"
        "        return super().training_step(batch, batch_idx)\n"
    )
    monkeypatch.syspath_prepend(str(MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    import crashing_model

    with pytest.raises(RuntimeError, match="boom"):
        _fit_in_process(tmp_path, monkeypatch, model=crashing_model.Crashing(), max_steps=10)
    store = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = store.search_runs()
    run_id = run.info.run_id
    assert run.info.status == "FAILED" and store.tags(run_id)["status"] == "crashed"
    assert sorted(logged_losses(store, run_id)) == [0, 1, 2]
