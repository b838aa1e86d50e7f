"""Runs recorded from the user's own loop (replaybisect.Recorder): replays reproduce every logged loss exactly
in fp32, bf16 and fp16, and `replay nan` / `replay ablate` answer on them as on `replay train` runs. Also the
built-in step's gradient accumulation and closure optimizers (LBFGS), replayed exactly."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, FAST, TESTS, Workspace, train_in_process



@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Workspace:
    """One workspace (and one SQLite store) for the recordings of this module: each test reads its own run by id."""
    return Workspace(tmp_path_factory.mktemp("own-loop"))


def _project(workspace, source: Path) -> Path:
    target = workspace.path / source.name
    if not target.exists():
        shutil.copytree(source, target)
    return target


def _record(workspace, folder: Path, script: str, *args: str, expect_failure: bool = False) -> tuple[str, subprocess.CompletedProcess]:
    done = subprocess.run([sys.executable, script, *args], cwd=folder, env=workspace.env(), capture_output=True, text=True, timeout=300)
    assert (done.returncode != 0) == expect_failure, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)
    return run_id, done


def _record_in_process(workspace, folder: Path, monkeypatch, capsys, *args, script: str = "tiny_loop") -> tuple[str, str]:
    """script.main(ARGS) in this process (the script's own code, without the interpreter's start-up): the run id
    and what it printed. The runs recorded from `python tiny_loop.py` (a `__main__` module) are the nan and check
    tests' own."""
    import importlib

    monkeypatch.setenv("MLFLOW_TRACKING_URI", workspace.tracking_uri)
    monkeypatch.setenv("REPLAYBISECT_CACHE", str(workspace.path / ".cache"))
    monkeypatch.delitem(sys.modules, script, raising=False)  # this folder's copy, not one imported before
    monkeypatch.syspath_prepend(str(folder))
    module = importlib.import_module(script)
    assert Path(module.__file__).parent == folder
    capsys.readouterr()
    module.main(*args)
    printed = capsys.readouterr().out
    return re.search(r"^run ([0-9a-f]{32})$", printed, re.MULTILINE).group(1), printed


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_own_loop_replays_every_loss_exactly(shared, monkeypatch, capsys, precision):
    """Dropout, micro-batches, a scheduler the recorder steps, a GradScaler, and batches drawn from the global RNG
    between steps: replaying from every snapshot gives == losses."""
    from replaybisect.replay.restore import logged_losses, replay, restore, run_config

    folder = _project(shared, TESTS / "user_loop")
    run_id, printed = _record_in_process(shared, folder, monkeypatch, capsys, precision, 30, -1)
    assert printed.count("loss ") == 30  # the user's prints stay theirs
    store = shared.store()
    assert run_config(store, run_id).train.precision == precision  # noted from the autocast the step entered
    logged = logged_losses(store, run_id)
    assert len(logged) == 30
    for step in (0, 10, 20):
        restored = restore(store, run_id, step)
        replayed = replay(restored, 30, logged=logged)
        assert replayed.reproduced == "exact", replayed.mismatches[:3]
        assert replayed.losses == {s: logged[s] for s in range(step, 30)}


def test_an_lr_the_loop_sets_between_steps_is_replayed(shared, monkeypatch, capsys):
    """nanoGPT's way: no scheduler, the loop sets each step's lr (warmup, then decay) before calling the step.
    The recorder stores each step's lr with its batch and a replay sets it again: every loss is reproduced."""
    from replaybisect.replay.restore import logged_losses, replay, restore

    folder = _project(shared, TESTS / "user_loop")
    run_id, _ = _record_in_process(shared, folder, monkeypatch, capsys, "fp32", 30, -1, "loop")
    store = shared.store()
    logged = logged_losses(store, run_id)
    for step in (10, 20):  # the lr changes every step: the snapshot's lr alone would not reproduce the next one
        replayed = replay(restore(store, run_id, step), 30, logged=logged)
        assert replayed.reproduced == "exact", replayed.mismatches[:3]


def test_state_carried_between_steps_is_replayed_and_recomputed_by_each_arm(shared, monkeypatch, capsys):
    """An RNN's hidden state, carried from step to step in `carry`: replays from every snapshot are exact (each
    starts from the hidden state its first step recorded), `replay nan` calls the overflow a divergence that began in
    `recur`, and an ablation arm computes its own hidden states
    instead of replaying the recorded ones, so lr x0.1 fixes the overflow that plain PyTorch at that lr avoids
    (fed the recorded, exploding states, the arm would overflow too)."""
    from replaybisect.core.trust import Trust
    from replaybisect.replay.restore import logged_losses, replay, restore
    from replaybisect.verbs.ablate.engine import ablate
    from replaybisect.verbs.nan.engine import find_nan

    folder = _project(shared, TESTS / "user_loop")
    healthy, _ = _record_in_process(shared, folder, monkeypatch, capsys, 0.5, 20, script="rnn_loop")
    store = shared.store()
    logged = logged_losses(store, healthy)
    for step in (5, 10, 15):
        replayed = replay(restore(store, healthy, step), 20, logged=logged)
        assert replayed.reproduced == "exact", replayed.mismatches[:3]

    diverged, printed = _record_in_process(shared, folder, monkeypatch, capsys, 1.0, 40, script="rnn_loop")
    assert "stopped replaybisect.NonFiniteStep: loss is nan" in printed, printed
    report = find_nan(store, diverged, trust=Trust.from_user([folder])).to_json()
    assert (report["reproduced"], report["category"], report["module"]) == ("exact", "divergence", "recur"), report["headline"]
    ablation = ablate(store, diverged, "lr", horizon=30, trust=Trust.from_user([folder])).to_json()
    (arm,) = [arm for arm in ablation["arms"] if arm["name"] == "lr"]
    assert arm["verdict"] == "fixes", ablation["arms"]


@pytest.fixture(scope="module")
def planted(shared) -> tuple[Path, str, subprocess.CompletedProcess]:
    """`python tiny_loop.py` with a NaN planted at its 27th call (step 13): the folder, the run id, the process."""
    folder = _project(shared, TESTS / "user_loop")
    return folder, *_record(shared, folder, "tiny_loop.py", "fp32", "30", "27", expect_failure=True)


def test_own_loop_planted_nan_is_found_by_replay_nan(shared, planted):
    _, run_id, done = planted
    assert "NonFiniteStep" in done.stderr and f"replay nan --run-id {run_id}" in done.stderr
    store = shared.store()
    assert store.tags(run_id)["first_nonfinite_step"] == "13"
    result = shared.replay("nan", "--run-id", run_id, "--json")
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["reproduced"] == "exact"
    assert report["category"] == "forward" and report["failing_step"] == 13
    assert report["op"] == "torch.sqrt" and "tiny_loop.py" in report["source"]
    assert report["state_match"].startswith("bit-identical")
    assert set(json.loads(store.tags(run_id)["source_sha256"])) == {"tiny_loop"}  # the step's module, hashed
    assert not [line for line in report["warnings"] if "changed since" in line]


def test_a_script_changed_since_the_run_is_said(shared, planted, monkeypatch):
    """The run records the sha256 of the module defining its step and build (here the script itself); a replay after
    an edit says so (it runs today's code: a replay that no longer reproduces may be why)."""
    import replaybisect as rb

    folder, run_id, _ = planted
    script = folder / "tiny_loop.py"
    original = script.read_text()
    try:
        script.write_text(original + "\n# tuned the schedule after the run\n")
        monkeypatch.chdir(folder)
        report = rb.find_nan(run_id, tracking_uri=shared.tracking_uri, publish=False)
    finally:
        script.write_text(original)
    (said,) = [line for line in report.warnings if "changed since" in line]
    assert "tiny_loop.py changed since the run was recorded (sha256 " in said and "today's code" in said
    assert report.reproduced == "exact"  # a comment changes nothing the step computes


def test_hand_written_gpt_loop_nan_and_ablate(shared):
    """The example: a ~40-line GPT loop (causal mask, 4 micro-batches, configure_optimizers, bf16 autocast) in a
    Hydra app, recorded with a handful of added lines. Its planted overflow (a hand-written softmax at 10x the
    learning rate) is found exactly, and ablation says the learning rate fixes it. (`replay nan` through the API from
    the project's folder, as the command runs there, and the ablation through the engine `replay ablate` calls,
    trusting the folder as the command does from it: the commands run end to end in the test above, test_ablate*.py,
    and on a user's own module in test_trust.py.)"""
    from replaybisect.core.trust import Trust
    from replaybisect.verbs.ablate.engine import ablate

    folder = _project(shared, EXAMPLES / "own_loop")
    added = [line for line in (folder / "gpt_loop.py").read_text().splitlines() if "# replaybisect" in line]
    assert 0 < len(added) <= 10
    run_id, _ = _record(shared, folder, "gpt_loop.py", "hydra.run.dir=outputs", expect_failure=True)

    nan = shared.answer_here("find_nan", run_id, folder=folder)  # from the project's folder (the CLI: the test above)
    assert nan["reproduced"] == "exact"
    assert nan["category"] == "forward"
    assert nan["module"].endswith(".attn") and nan["op"] == "torch.exp"
    assert "gpt_loop.py" in nan["source"]

    ablation = ablate(shared.store(), run_id, "lr,clip,precision", horizon=30, trust=Trust.from_user([folder])).to_json()
    verdicts = {arm["name"]: arm["verdict"] for arm in ablation["arms"]}
    assert verdicts["lr"] == "fixes", verdicts
    assert verdicts["precision"] != "fixes", verdicts  # bf16 has fp32's range: fp32 does not cure an exp overflow
    assert any("reuse the recorded batches" in warning for warning in ablation["warnings"])  # past the failure: said


def _replay_in(workspace, folder: Path, *args: str) -> dict:
    """`replay ARGS` run in the project's folder (its code is trusted there, as for a user)."""
    done = subprocess.run([shutil.which("replay") or str(Path(sys.executable).with_name("replay")), *args], cwd=folder,
                          env=workspace.env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


def test_recorder_refuses_what_a_replay_could_not_import(tmp_path, monkeypatch):
    import torch

    import replaybisect
    from replaybisect.errors import ConfigError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="module-level function"):
        replaybisect.Recorder(model, optimizer, step_fn=lambda model, batch: 0, build=lambda c: None)
    sys.path.insert(0, str(TESTS / "user_loop"))
    try:
        import tiny_loop

        def local_step(model, optimizer, batch):
            return 0.0

        with pytest.raises(ConfigError, match="module-level function"):
            replaybisect.Recorder(model, optimizer, step_fn=local_step, build=tiny_loop.build)
        with pytest.raises(ConfigError, match="not one replaybisect can pass"):
            replaybisect.Recorder(model, optimizer, step_fn=tiny_loop.main, build=tiny_loop.build)
    finally:
        sys.path.remove(str(TESTS / "user_loop"))
    assert not (tmp_path / "mlflow.db").exists()  # refused before any run exists


def test_a_script_that_trains_on_import_is_refused(workspace):
    script = workspace.path / "loop.py"
    script.write_text(
        "import torch, replaybisect\n"
        "def build(config):\n    m = torch.nn.Linear(2, 1)\n    return m, torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "def step(model, optimizer, batch):\n    loss = model(batch).pow(2).mean()\n    loss.backward()\n    optimizer.step()\n    return loss\n"
        "model, optimizer = build({})\n"
        "rec = replaybisect.Recorder(model, optimizer, step_fn=step, build=build)\n"
    )
    done = subprocess.run([sys.executable, "loop.py"], cwd=workspace.path, env=workspace.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "loop.py line 10 runs code when imported" in done.stderr and 'if __name__ == "__main__":' in done.stderr


def _train_here(workspace, *overrides: str) -> str:
    """`replay train` in this process (what the CLI does, without its start-up): the run id."""
    return train_in_process(workspace.store(), *FAST, *overrides, code_folder=workspace.path).run_id


@pytest.mark.parametrize("overrides", [
    pytest.param(("train.accumulate=4",), id="accumulate"),
    pytest.param(("optim._target_=torch.optim.LBFGS", "~optim.weight_decay", "optim.lr=0.5", "+optim.max_iter=3"), id="lbfgs"),
])
def test_builtin_step_variants_replay_exactly(shared, overrides):
    from replaybisect.replay.restore import logged_losses, replay, restore

    run_id = _train_here(shared, "train.steps=20", *overrides)
    store = shared.store()
    logged = logged_losses(store, run_id)
    assert len(logged) == 20 and all(value == value for value in logged.values())
    assert logged[19] < logged[0]  # it learns
    for step in (0, 10):
        replayed = replay(restore(store, run_id, step), 20, logged=logged)
        assert replayed.reproduced == "exact", replayed.mismatches[:3]


def test_accumulation_keeps_the_batch_and_the_mean_loss(shared):
    """accumulate=K splits each step's batch in K micro-batches: same data, same mean loss up to rounding
    (dropout off: its masks differ in shape)."""
    from replaybisect.replay.restore import logged_losses

    store = shared.store()
    plain = logged_losses(store, _train_here(shared, "train.steps=1", "model.dropout=0"))
    split = logged_losses(store, _train_here(shared, "train.steps=1", "model.dropout=0", "train.accumulate=4"))
    assert split[0] == pytest.approx(plain[0], rel=1e-5)


def test_check_on_an_own_loop_run(shared):
    """`replay check --run-id` on a run from the user's loop: the overfit test and the gradient probes run the
    user's step (the loss floor is assumed 0: the loss is theirs)."""
    folder = _project(shared, TESTS / "user_loop")
    run_id, _ = _record(shared, folder, "tiny_loop.py", "fp32", "12")
    report = _replay_in(shared, folder, "check", "--run-id", run_id, "--json", "--only", "overfit.one_batch,grad.missing,data.finite")
    statuses = {check["name"]: check for check in report["checks"]}
    assert statuses["grad.missing"]["status"] == "pass", statuses["grad.missing"]
    assert statuses["data.finite"]["status"] == "pass"
    assert statuses["overfit.one_batch"]["status"] in ("pass", "warn") and "your own step" in statuses["overfit.one_batch"]["detail"]
