"""A loop recorded as it is written (tests/user_loop/inline_script.py, nanoGPT's train.py shape): three added lines,
nothing re-indented, no step function. The Recorder watches the model and optimizer while the script trains; a
replay runs the script again and its own loop runs each step the replay asks for, fed the stored inputs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TESTS, Workspace

SCRIPT = TESTS / "user_loop" / "inline_script.py"
MNIST_SCRIPT = SCRIPT.with_name("mnist_script.py")  # pytorch/examples mnist/main.py: a StepLR made after the recorder
WLM_SCRIPT = SCRIPT.with_name("wlm_script.py")  # word_language_model's main.py shape: updates by hand, carries its hidden state
DIVERGING = ("--optim=sgd", "--learning_rate=30", "--max_iters=40", "--eval_interval=4")  # NaN at step 9; snapshots every 5 steps
HAND_SOFTMAX = ("--softmax=hand", "--logit_scale=90")  # exp() overflows at the first step


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> tuple[Workspace, Path]:
    """The user's project folder (train.py) and a store beside it."""
    workspace = Workspace(tmp_path_factory.mktemp("inline-loop"))
    folder = workspace.path / "project"
    folder.mkdir()
    shutil.copy(SCRIPT, folder / "train.py")
    return workspace, folder


def _train(workspace: Workspace, folder: Path, *args: str, script: str = "train.py") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], cwd=folder, env=workspace.env(), capture_output=True, text=True,
                          timeout=300)


def _run_id(done: subprocess.CompletedProcess) -> str:
    return re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)


@pytest.fixture(scope="module")
def diverged(project) -> str:
    workspace, folder = project
    done = _train(workspace, folder, *DIVERGING)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]  # the script ends with the one line, not a traceback
    assert last.startswith("replaybisect.NonFiniteStep: loss is nan at step 9") and "Traceback" not in done.stderr, done.stderr
    return _run_id(done)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_the_script_as_written_takes_three_lines_and_trains_the_same(project):
    """The marked lines are all recording adds (none re-indented), and with them the script trains exactly as without."""
    workspace, folder = project
    lines = SCRIPT.read_text().splitlines()
    added = [line for line in lines if line.endswith("# replaybisect")]
    assert len(added) == 3 and all(not line.startswith(" ") for line in added)
    (folder / "plain.py").write_text("\n".join(line for line in lines if not line.endswith("# replaybisect")) + "\n")
    settings = ("--max_iters=12", "--dropout=0.1", "--out_dir=healthy")
    plain, recorded = _train(workspace, folder, *settings, script="plain.py"), _train(workspace, folder, *settings)
    assert plain.returncode == 0 and recorded.returncode == 0, recorded.stderr[-2000:]
    losses = [line for line in plain.stdout.splitlines() if line.startswith(("iter ", "step "))]
    assert len(losses) == 15 and losses == [line for line in recorded.stdout.splitlines() if line.startswith(("iter ", "step "))]
    from replaybisect.replay.restore import run_config

    cfg = run_config(workspace.store(), _run_id(recorded))
    assert cfg.train.script.path == str(folder / "train.py") and cfg.train.step_fn is None and cfg.train.build is None
    (folder / "plain.py").unlink()


def test_replay_verify_replays_a_scripts_intervals_up_to_its_nan_bit_for_bit(project, diverged):
    """Each snapshot interval is replayed inside the script, run again; the failing step's NaN loss comes back from the
    script's process as JSON text (it ended verify with a TypeError) and is compared as the NaN it is."""
    workspace, folder = project
    report = workspace.answer_here("verify", diverged, steps="5:10")  # `replay verify --json --no-child-run`, in this process
    assert (report["verdict"], report["steps_compared"], report["differences"]) == ("exact", 5, []), report


def test_replay_nan_runs_the_scripts_loop_exactly_and_writes_nothing_in_its_folder(project, diverged):
    workspace, folder = project
    before = _tree(folder)
    assert "out/ckpt.pt" in before  # the run's own checkpoint, saved at its evaluation
    result = Workspace(folder).replay("nan", "--run-id", diverged, "--json", env=workspace.env())
    assert result.returncode == 0, result.stderr
    report = result.json()  # the script prints every iteration: none of it reaches our stdout
    assert (report["reproduced"], report["snapshot_step"], report["failing_step"]) == ("exact", 5, 9)
    assert report["category"] == "divergence", report["headline"]
    assert report["isolation"]["state_unchanged"] and report["isolation"]["step_repeatable"]
    assert _tree(folder) == before  # its checkpoints went to the replay's temp folder


def test_ablate_runs_the_arms_in_the_scripts_loop_and_the_lr_arm_fixes_it(project, diverged, monkeypatch):
    import replaybisect as rb

    workspace, folder = project
    monkeypatch.chdir(folder)
    before = _tree(folder)
    result = rb.ablate(diverged, ["lr", "clip", "precision"], horizon=60, workers=2, tracking_uri=workspace.tracking_uri,
                       publish=False)
    verdicts = result.verdicts()
    assert result.baseline.verdict == "fails-again" and result.baseline.first_nonfinite_step == 9
    assert verdicts["lr"] == "fixes" and verdicts["precision"] == "not-applicable", result.conclusion
    lr_arm = next(arm for arm in result.arms if arm.name == "lr")
    assert max(lr_arm.losses) == 40  # the script's loop ends at its own max_iters, short of the horizon: said, judged on that
    assert any("the script's own loop ended after step 40" in warning for warning in result.warnings)
    assert _tree(folder) == before


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_runs_replay_exactly(project, dtype):
    import replaybisect as rb

    workspace, folder = project
    done = _train(workspace, folder, *DIVERGING, f"--dtype={dtype}", f"--out_dir=out-{dtype}")
    assert "replaybisect.NonFiniteStep" in done.stderr, done.stderr[-2000:]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        report = rb.find_nan(_run_id(done), tracking_uri=workspace.tracking_uri, publish=False)
    assert report.reproduced == "exact", report.headline


@pytest.fixture(scope="module")
def hand_softmax(project) -> str:
    """A hand-written softmax whose exp() overflows at the first step, trained in bf16 with `with ctx:` entered
    before the model's call."""
    workspace, folder = project
    done = _train(workspace, folder, *HAND_SOFTMAX, "--dtype=bfloat16", "--out_dir=out-hand")
    assert "replaybisect.NonFiniteStep: loss is inf at step 0" in done.stderr, done.stderr[-2000:]
    return _run_id(done)


def test_a_hand_written_softmax_is_found_at_its_op(project, hand_softmax):
    import replaybisect as rb

    workspace, folder = project
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        report = rb.find_nan(hand_softmax, tracking_uri=workspace.tracking_uri, publish=False)
    assert report.category == "forward" and report.module == "(root) TinyLM", report.headline
    assert report.op == "torch.log" and "work in log space (F.log_softmax" in report.suggestion  # the fix for a log
    # a script's run: its arms run the script's own code, so no `--patch` is proposed and one given is refused unread
    assert report.fix is not None and "prove" not in report.fix and "--patch" not in report.suggestion, report.suggestion
    (folder / "fixed").mkdir(exist_ok=True)
    shutil.copy(folder / "train.py", folder / "fixed" / "train.py")
    runs_before = len(workspace.store().search_runs(max_results=1000))
    from replaybisect.errors import ReplayError

    with pytest.MonkeyPatch.context() as patch, pytest.raises(ReplayError) as refused:
        patch.chdir(folder)
        rb.ablate(hand_softmax, patch="fixed/train.py", tracking_uri=workspace.tracking_uri, publish=False)
    assert refused.value.exit_code == 2 and "was recorded from a script" in str(refused.value) and "leave out --patch" in str(refused.value)
    assert len(workspace.store().search_runs(max_results=1000)) == runs_before  # nothing trained
    shutil.rmtree(folder / "fixed")


def test_what_the_inline_form_refuses(tmp_path):
    """One line each, before anything is recorded."""
    import torch

    import replaybisect as rb
    from replaybisect.errors import ConfigError

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(ConfigError, match="pass no build="):
        rb.Recorder(model, optimizer, build=lambda config: (model, optimizer), tracking_uri=uri)
    with pytest.raises(ConfigError, match="on_nonfinite"):
        rb.Recorder(model, optimizer, on_nonfinite="continue", tracking_uri=uri)
    assert not (tmp_path / "mlflow.db").exists()


def _status(workspace: Workspace, run_id: str) -> str:
    return workspace.store().client.get_run(run_id).info.status


def test_low_precision_is_noted_when_autocast_is_entered_before_the_models_call(project, hand_softmax):
    """The loop enters `with ctx:` before calling the model: the run's precision is still bf16, at its first step."""
    from replaybisect.replay.restore import run_config

    workspace, _ = project
    assert run_config(workspace.store(), hand_softmax).train.precision == "bf16"


def test_a_script_that_crashes_fails_its_run_and_one_without_close_finishes_it(project):
    workspace, folder = project
    crashed = _train(workspace, folder, "--crash_at=3", "--max_iters=8", "--out_dir=out-crash")
    assert crashed.returncode == 1 and "corrupt shard at iteration 3" in crashed.stderr
    assert _status(workspace, _run_id(crashed)) == "FAILED"
    lines = SCRIPT.read_text().splitlines()
    (folder / "no_close.py").write_text("\n".join(line for line in lines if not line.startswith("rec.close()")) + "\n")
    ended = _train(workspace, folder, "--max_iters=4", "--out_dir=out-no-close", script="no_close.py")
    assert ended.returncode == 0, ended.stderr[-2000:]
    run_id = _run_id(ended)
    assert _status(workspace, run_id) == "FINISHED"
    assert len(workspace.store().client.get_metric_history(run_id, "loss")) == 5  # iterations 0..4, the last closed at exit
    # its replay: an ablation arm that reaches the end of the script's loop is judged on the steps it ran, as with close
    import replaybisect as rb

    diverged = _train(workspace, folder, *DIVERGING[:2], "--max_iters=14", "--eval_interval=4", "--out_dir=out-no-close-nan",
                      script="no_close.py")
    assert "loss is nan at step 9" in diverged.stderr, diverged.stderr[-2000:]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        result = rb.ablate(_run_id(diverged), ["lr"], horizon=60, workers=1, tracking_uri=workspace.tracking_uri, publish=False)
    lr_arm = next(arm for arm in result.arms if arm.name == "lr")
    assert result.verdicts() == {"lr": "fixes"} and max(lr_arm.losses) == 14, result.conclusion
    from replaybisect.verbs.ablate.report import to_markdown  # its header and legend say where the loop ended

    assert "the loop ended at step 14" in to_markdown(result) and "fixes: finite through step 14 " in to_markdown(result)
    (folder / "no_close.py").unlink()


def test_a_loop_that_trains_outside_train_mode_is_told_at_its_first_step(tmp_path):
    workspace = Workspace(tmp_path)
    (tmp_path / "eval_loop.py").write_text(
        "import torch, replaybisect\n"
        "model = torch.nn.Linear(4, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "rec = replaybisect.Recorder(model, optimizer)\n"
        "model.eval()\n"
        "for _ in range(3):\n"
        "    model(torch.randn(8, 4)).pow(2).mean().backward()\n"
        "    optimizer.step()\n")
    done = _train(workspace, tmp_path, script="eval_loop.py")
    assert done.returncode == 1 and "no training call of the model" in done.stderr, done.stderr[-2000:]
    assert _status(workspace, _run_id(done)) == "FAILED"


def test_a_loop_that_stops_itself_on_a_nan_loss_is_told_to_skip_that_check_in_a_replay(project):
    """The recording stops at the NaN before the script's own check runs; a replay halts the step and the script's
    code after it sees the NaN loss and ends the loop: one line says which check to skip."""
    workspace, folder = project
    done = _train(workspace, folder, *DIVERGING, "--stop_on_nan=1", "--out_dir=out-stop")
    assert "replaybisect.NonFiniteStep: loss is nan at step 9" in done.stderr, done.stderr[-2000:]
    import replaybisect as rb
    from replaybisect.errors import ReplayError

    with pytest.MonkeyPatch.context() as patch, pytest.raises(ReplayError) as refused:
        patch.chdir(folder)
        rb.find_nan(_run_id(done), tracking_uri=workspace.tracking_uri, publish=False)
    line = str(refused.value)  # what `replay nan` prints as its one line
    assert refused.value.exit_code == 2 and "\n" not in line
    assert "right after a step the replay halted" in line and "replaybisect.replaying()" in line


# ---- word_language_model's main.py as written ----------------------------------------------------------------------
def _losses(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stdout.splitlines() if " batches " in line]


def test_word_language_model_as_written_records_replays_and_its_lr_arm_fixes_what_plain_pytorch_fixes(tmp_path):
    """No optimizer (the update by hand), the hidden state repackaged each chunk, the loss taken outside the model,
    an evaluation and a checkpoint written with open() each epoch: three added lines; the replay is exact and
    names the divergence; the lr arm (x0.01) recomputes its own hidden states and fixes it, as the script itself at
    a hundredth of the lr trains through the arm's horizon."""
    import replaybisect as rb

    workspace = Workspace(tmp_path)
    folder = tmp_path / "wlm"
    folder.mkdir()
    shutil.copy(WLM_SCRIPT, folder / "main.py")
    lines = WLM_SCRIPT.read_text().splitlines()
    added = [line for line in lines if line.endswith("# replaybisect")]
    assert len(added) == 3 and all(not line.startswith(" ") for line in added)
    (folder / "plain.py").write_text("\n".join(line for line in lines if not line.endswith("# replaybisect")) + "\n")
    plain, recorded = (_train(workspace, folder, "--lr=20", "--epochs=2", script=name) for name in ("plain.py", "main.py"))
    assert recorded.returncode == 0 and len(_losses(plain)) == 20 and _losses(plain) == _losses(recorded), recorded.stderr[-2000:]

    # (an lr at which it blows up within a few steps: near the edge, lr=210 say, whether and when it does depends on
    # the CPU's kernels, its rounding: NaN at step 17 on one machine, trained through on another)
    diverged = _train(workspace, folder, "--lr=400", "--epochs=40", script="main.py")
    stopped = re.search(r"replaybisect.NonFiniteStep: loss is (?:nan|inf) at step (\d+)", diverged.stderr)
    assert stopped and 4 < int(stopped.group(1)) < 12, diverged.stderr[-2000:]
    failing, run_id = int(stopped.group(1)), _run_id(diverged)
    store = workspace.store()
    assert store.metric_history(run_id, "lr") == [] and len(store.metric_history(run_id, "grad_norm")) == failing  # no lr of its own
    before = _tree(folder)
    assert "model.pt" in before  # saved at the end of the first epoch
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        report = rb.find_nan(run_id, tracking_uri=workspace.tracking_uri, publish=False)
        assert (report.reproduced, report.snapshot_step, report.category) == ("exact", failing // 4 * 4, "divergence"), report.headline
        result = rb.ablate(run_id, ["lr=x0.01"], horizon=30, workers=1, tracking_uri=workspace.tracking_uri, publish=False)
    assert result.verdicts() == {"lr=x0.01": "fixes"}, result.conclusion
    assert _tree(folder) == before  # its checkpoints went to the replay's temp folder

    tenth = _train(workspace, folder, "--lr=4", "--epochs=5", script="plain.py")  # 50 steps: past the arm's horizon
    assert len(_losses(tenth)) == 50 and "nan" not in tenth.stdout and "inf" not in tenth.stdout


def test_a_float_the_loop_changes_between_steps_is_set_again_in_a_replay(tmp_path):
    """The loop's own lr grows every step and is applied by hand: a replay from a snapshot sets the recorded value
    again before each step (its script starts counting from its first value), so its losses are exact."""
    import replaybisect as rb

    workspace = Workspace(tmp_path)
    (tmp_path / "warmup.py").write_text(
        "import torch, replaybisect\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(4, 1)\n"
        "x = torch.randn(64, 4)\n"
        "y = x.sum(1, keepdim=True)\n"
        "rec = replaybisect.Recorder(model, snapshot_every=3)\n"
        "lr = 0.01\n"
        "for step in range(100):\n"
        "    model.zero_grad()\n"
        "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "    loss.backward()\n"
        "    for p in model.parameters():\n"
        "        p.data.add_(p.grad, alpha=-lr)\n"
        "    lr *= 1.5\n")
    done = _train(workspace, tmp_path, script="warmup.py")
    failing = int(re.search(r"loss is (?:nan|inf) at step (\d+)", done.stderr).group(1))
    assert failing > 6, done.stderr[-2000:]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        report = rb.find_nan(_run_id(done), tracking_uri=workspace.tracking_uri, publish=False)
    assert report.reproduced == "exact" and report.snapshot_step > 0 and report.category == "divergence", report.headline


def test_an_optimizer_keeping_state_of_its_own_is_recorded_and_replayed_exactly(tmp_path):
    """A custom optimizer that keeps a step counter in optimizer.state["global_step"] (no parameter's entry) and makes
    its lr from it: the run records (it crashed at its first snapshot after the first update), and `replay nan` from
    the snapshot before the failure restores the counter, so the replayed losses are exact."""
    import replaybisect as rb

    workspace = Workspace(tmp_path)
    (tmp_path / "warm.py").write_text(
        "import torch, replaybisect\n"
        "class WarmSGD(torch.optim.SGD):\n"
        "    @torch.no_grad()\n"
        "    def step(self, closure=None):\n"
        "        self.state['global_step'] = self.state.get('global_step', 0) + 1\n"
        "        for group in self.param_groups:\n"
        "            group['lr'] = 0.05 * min(1.0, self.state['global_step'] / 20)\n"
        "        return super().step(closure)\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
        "optimizer = WarmSGD(model.parameters(), lr=0.05, momentum=0.9)\n"
        "rec = replaybisect.Recorder(model, optimizer, snapshot_every=5)\n"
        "for step in range(30):\n"
        "    x = torch.randn(16, 4)\n"
        "    if step == 17:\n"
        "        x[3, 1] = float('nan')\n"
        "    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))\n"
        "    optimizer.zero_grad()\n"
        "    loss.backward()\n"
        "    optimizer.step()\n")
    done = _train(workspace, tmp_path, script="warm.py")
    assert "loss is nan at step 17" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        report = rb.find_nan(_run_id(done), tracking_uri=workspace.tracking_uri, publish=False)
    assert (report.reproduced, report.snapshot_step, report.category) == ("exact", 15, "data"), report.headline


CRASH_AFTER_BACKWARD = (  # the loop's own code raises between the backward and the update, on the state (loss < 1 at step 9)
    "import torch, replaybisect\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Linear(4, 1)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if {optimizer} else None\n"
    "rec = replaybisect.Recorder(model, optimizer, snapshot_every=4)\n"
    "for step in range(12):\n"
    "    x = torch.randn(8, 4)\n"
    "    model.zero_grad()\n"
    "    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))\n"
    "    loss.backward()\n"
    "    if optimizer is not None:\n"
    "        assert loss.item() >= 1.0, 'a loss under 1'\n"
    "        optimizer.step()\n"
    "        continue\n"
    "    for index, p in enumerate(model.parameters()):\n"
    "        if index == {raised_at} and loss.item() < 1.0:\n"
    "            raise ValueError('a loss under 1')\n"
    "        p.data.add_(p.grad, alpha=-0.05)\n")


@pytest.mark.parametrize("optimizer, raised_at, kept", [
    (False, 0, "the state before step 9"),  # updating by hand, before any parameter changed
    (False, 1, "step 9's batch (its update had begun"),  # after the first parameter's update
    (True, 0, "the state before step 9"),  # a check between backward and optimizer.step()
], ids=["by-hand-before", "by-hand-midway", "optimizer"])
def test_a_step_that_raises_after_its_backward_is_the_runs_failing_step_and_replays_its_crash(tmp_path, optimizer, raised_at, kept):
    """An exception the loop's own code raises after the step's backward (in its update by hand, or a check before
    optimizer.step()) makes that step the run's failing step, with the gradients it began with; `replay nan` runs the
    script's loop to it, which raises it again: the step's crash, reproduced from the snapshot before it."""
    import replaybisect as rb

    workspace = Workspace(tmp_path)
    (tmp_path / "crash.py").write_text(CRASH_AFTER_BACKWARD.format(optimizer=optimizer, raised_at=raised_at))
    done = _train(workspace, tmp_path, script="crash.py")
    assert f"step 9 raised {'AssertionError' if optimizer else 'ValueError'}" in done.stderr and kept in done.stderr, done.stderr[-2000:]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        report = rb.find_nan(_run_id(done), tracking_uri=workspace.tracking_uri, publish=False)
    assert (report.category, report.reproduced, report.snapshot_step) == ("exception", "exact", 8), report.headline
    assert "a loss under 1" in report.headline and "crash.py" in report.headline, report.headline
    if kept.startswith("the state"):
        assert report.state_match.startswith("bit-identical"), report.state_match


def test_a_loop_updating_by_hand_replays_a_nan_gradient_and_is_told_it_cannot_accumulate(tmp_path):
    """A finite loss with NaN gradients (sqrt(0) in the loss) halts the replayed step inside its backward: the
    script's own update then runs on and is undone, and the replay is exact. Two backwards before an update by hand
    are refused in one line at the second micro-batch."""
    import replaybisect as rb

    workspace = Workspace(tmp_path)
    head = ("import torch, replaybisect\n"
            "torch.manual_seed(0)\n"
            "model = torch.nn.Linear(4, 1)\n"
            "xs = [torch.randn(16, 4) for _ in range(80)]\n"
            "xs[8] = torch.zeros(16, 4)\n"
            "rec = replaybisect.Recorder(model, snapshot_every=3)\n"
            "for step in range(30):\n"
            "    model.zero_grad()\n")
    update = ("    for p in model.parameters():\n"
              "        p.data.add_(p.grad, alpha=-0.01)\n")
    (tmp_path / "gradnan.py").write_text(
        head + "    x = xs[step]\n"
        "    out = model(x)\n"
        "    loss = torch.nn.functional.mse_loss(out, x.sum(1, keepdim=True)) + 1e-6 * torch.sqrt((out * x).pow(2).sum())\n"
        "    loss.backward()\n" + update)
    (tmp_path / "accumulate.py").write_text(
        head + "    for k in range(2):\n"
        "        x = xs[2 * step + k]\n"
        "        (torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)) / 2).backward()\n" + update)
    done = _train(workspace, tmp_path, script="gradnan.py")
    assert "replaybisect.NonFiniteStep: grad_norm is nan at step 8" in done.stderr, done.stderr[-2000:]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        report = rb.find_nan(_run_id(done), tracking_uri=workspace.tracking_uri, publish=False)
    assert (report.reproduced, report.failing_step, report.category) == ("exact", 8, "backward"), report.headline
    refused = _train(workspace, tmp_path, script="accumulate.py")
    lines = refused.stderr.strip().splitlines()  # the one line, and the run's end
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert lines[-2].startswith("replaybisect: your loop backpropagated again before it updated the parameters")
    assert lines[-1].endswith("ended as crashed (FAILED); what it recorded is kept")
    assert _status(workspace, _run_id(refused)) == "FAILED"


def test_a_loops_data_time_is_its_own_time_from_an_update_to_its_next_training_call(tmp_path):
    """The loop's time between an update and its next training call (a slow data pipeline, planted as a sleep) is
    the next step's data time, and no step's time; the recorder's own work at a step's start and end is in neither.
    With a GradScaler the update ends when its `step` returns. (One script, a run each way.)"""
    workspace = Workspace(tmp_path)
    (tmp_path / "slow_data.py").write_text(
        "import time, torch, replaybisect\n"
        "for scaled in (False, True):\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "    scaler = torch.amp.GradScaler('cpu') if scaled else None\n"
        "    rec = replaybisect.Recorder(model, optimizer, scaler=scaler, snapshot_every=2)\n"
        "    for _ in range(4):\n"
        "        time.sleep(0.2)  # the loop fetching its next batch\n"
        "        optimizer.zero_grad()\n"
        "        loss = model(torch.randn(8, 4)).pow(2).mean()\n"
        "        if scaler:\n"
        "            scaler.scale(loss).backward()\n"
        "            scaler.step(optimizer)\n"
        "            scaler.update()\n"
        "        else:\n"
        "            loss.backward()\n"
        "            optimizer.step()\n"
        "    rec.close()\n")
    done = _train(workspace, tmp_path, script="slow_data.py")
    assert done.returncode == 0, done.stderr[-2000:]
    store = workspace.store()
    run_ids = re.findall(r"recording run ([0-9a-f]{32})", done.stderr)
    assert len(run_ids) == 2, done.stderr[-2000:]
    for run_id in run_ids:
        data_time, step_time = (dict(store.metric_history(run_id, name)) for name in ("data_time", "step_time"))
        assert sorted(data_time) == sorted(step_time) == [0, 1, 2, 3]
        assert all(0.2 <= data_time[step] < 0.7 for step in (1, 2, 3)), data_time
        assert all(step_time[step] < 0.2 for step in (1, 2, 3)), step_time


def test_pytorch_examples_mnist_as_written_replays_with_its_lr_scheduler(tmp_path):
    """Its StepLR is made after the recorder and wraps `optimizer.step` by its `__func__`: the replay's watch on the
    step must stay a bound method (a plain function ended the re-entered script with an AttributeError before its
    first step). The planted log(softmax) is found at its line, the replay exact."""
    import replaybisect as rb

    workspace = Workspace(tmp_path)
    folder = tmp_path / "mnist"
    folder.mkdir()
    shutil.copy(MNIST_SCRIPT, folder / "main.py")
    diverged = _train(workspace, folder, "--lr", "1e3", "--epochs", "4", script="main.py")
    assert "replaybisect.NonFiniteStep: loss is inf at step 1" in diverged.stderr, diverged.stderr[-2000:]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        report = rb.find_nan(_run_id(diverged), tracking_uri=workspace.tracking_uri, publish=False)
    assert (report.reproduced, report.category, report.op) == ("exact", "forward", "torch.log"), report.headline
    assert "main.py:" in report.headline


RAGGED = """\
import torch, torch.nn.functional as F, replaybisect
torch.manual_seed(0)
x, y = torch.randn(87, 8), torch.randint(0, 3, (87,))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=30, shuffle=True,  # 30, 30, 27
                                     num_workers=WORKERS)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
rec = replaybisect.Recorder(model, optimizer, snapshot_every=4)
step = 0
for epoch in range(4):
    for xb, yb in loader:
        if step == 10:
            xb = xb.clone(); xb[3] = float("nan")
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        step += 1
rec.close()
"""


def test_a_loader_that_keeps_its_ragged_last_batch_replays_exact(tmp_path):
    """DataLoader's default drop_last=False: the replay from snapshot 8 feeds step 8's stored 27 rows while the re-run
    script's loader is at a 30-row batch; the stored targets that fit the model's outputs stand for the live ones (the
    replay ended with 'Expected input batch_size (27) to match target batch_size (30)' before). With loader workers,
    the re-run script forks them as `python train.py` does (they ran the script again as __mp_main__, and the
    replay ended before its first step: 'DataLoader worker exited unexpectedly'); persistent workers and pinned
    memory too."""
    workspace = Workspace(tmp_path)
    (tmp_path / "train.py").write_text(RAGGED.replace("WORKERS", "2, persistent_workers=True, pin_memory=True"))
    done = _train(workspace, tmp_path)
    assert "loss is nan at step 10" in done.stderr, done.stderr[-2000:]
    report = workspace.answer_here("find_nan", _run_id(done))  # `replay nan --json --no-child-run` here, in this process
    assert (report["snapshot_step"], report["reproduced"], report["category"]) == (8, "exact", "data")
    assert report["batch"][0]["rows"] == [3]
    assert report["batch"][0]["field"] == "model(arg 0)" and "(model(arg 0))" in report["headline"]  # as the loop called it
