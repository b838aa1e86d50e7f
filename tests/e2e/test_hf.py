"""Hugging Face Trainer runs recorded with `replaybisect.hf.ReplayCallback` (the real transformers and accelerate; a
tiny GPT-2 built from a small config, nothing downloaded): bf16, gradient accumulation 2 and max_grad_norm replay
bit for bit without a Trainer, a diverging lr is a divergence fixed by `ablate lr`, a planted inf in one example's
embedding path is found at its op, and with the Trainer's own MLflowCallback both live in one run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TESTS, Workspace, as_printed, in_folder

SCRIPT = TESTS / "user_loop" / "hf_trainer.py"
ACCELERATE_SCRIPT = SCRIPT.with_name("accelerate_loop.py")  # the same model in a loop written with accelerate


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Workspace:
    workspace = Workspace(tmp_path_factory.mktemp("hf"))
    shutil.copy(SCRIPT, workspace.path)
    shutil.copy(ACCELERATE_SCRIPT, workspace.path)
    return workspace


def _trainer(workspace: Workspace, *args: str, expect_failure: bool = True, script: Path = SCRIPT,
             **env: str) -> tuple[str, subprocess.CompletedProcess]:
    done = subprocess.run([sys.executable, script.name, *args], cwd=workspace.path, env=workspace.env(**env),
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode != 0) == expect_failure, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    found = re.search(r"recording (?:into the Trainer's MLflow )?run ([0-9a-f]{32})", done.stderr)
    return (found.group(1) if found else ""), done


@pytest.fixture(scope="module")
def lr_explosion(shared) -> tuple[str, subprocess.CompletedProcess, list]:
    """The Trainer diverging at too high an lr with its own MLflow callback on (report_to="mlflow"), as a team that
    already logs to MLflow runs it: the run id, the process, and the runs it added to the store."""
    client = shared.store().client
    every_run = lambda: client.search_runs([e.experiment_id for e in client.search_experiments()])
    runs_before = {run.info.run_id for run in every_run()}
    run_id, done = _trainer(shared, "--steps", "60", "--lr", "3", "--optim", "sgd", "--clip", "0", "--report-to", "mlflow")
    return run_id, done, [run for run in every_run() if run.info.run_id not in runs_before]


def test_a_trainer_lr_explosion_replays_exact_and_ablate_fixes_it_by_lr(shared, lr_explosion):
    run_id, done, _ = lr_explosion
    assert re.search(r"replaybisect.NonFiniteStep: (loss|grad_norm) is (nan|inf) at step \d+", done.stderr), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    store = shared.store()
    assert store.get_run(run_id).info.status == "FAILED" and store.tags(run_id)["trainer"] == "transformers"
    report = shared.answer_here("find_nan", run_id)
    assert report["reproduced"] == "exact" and report["state_match"].startswith("bit-identical")
    assert report["category"] == "divergence" and report["precision"] == "bf16"
    answer = shared.answer_here("ablate", run_id, arms=["lr"], workers=1)
    assert answer["baseline"]["verdict"] == "fails-again"
    assert {arm["name"]: arm["verdict"] for arm in answer["arms"]}["lr"] == "fixes"
    findings = shared.answer_here("diagnose", run_id)["findings"]
    assert findings[0]["pattern"] == "nan-after-k" and "divergence" in findings[0]["summary"]
    import replaybisect as rb

    with in_folder(shared.path):
        checked = as_printed(rb.check(run_id=run_id, tracking_uri=shared.tracking_uri, only=["grad"], publish=False))
    statuses = {item["name"]: item["status"] for item in checked["checks"]}
    assert statuses["grad.missing"] == "pass"  # the Trainer run's state rebuilt: every parameter gets a gradient


def test_an_inf_in_one_examples_embedding_path_is_found_at_its_op_with_the_clip_and_accumulation(shared):
    """max_grad_norm=1.0, accumulation 2 and bf16 on the steps before the failure: the replay is exact."""
    run_id, done = _trainer(shared, "--steps", "40", "--plant", "37")
    report = shared.answer_here("find_nan", run_id)
    assert report["reproduced"] == "exact" and report["category"] == "forward"
    assert report["op"] == "Tensor.div" and "hf_trainer.py:" in report["source"]
    assert "self.token_counts.mean() / self.token_counts[input_ids]" in report["source"]


def test_with_the_trainers_mlflow_callback_one_run_holds_both_records(shared, lr_explosion):
    run_id, done, runs = lr_explosion
    assert "recording into the Trainer's MLflow run" in done.stderr
    client = shared.store().client
    assert [run.info.run_id for run in runs] == [run_id] and runs[0].info.status == "FAILED"
    metrics = set(runs[0].data.metrics)
    assert {"loss", "grad_norm", "trainer/loss", "trainer/grad_norm", "trainer/learning_rate"} <= metrics
    assert "learning_rate" in runs[0].data.params  # the Trainer's params kept beside ours
    losses = [metric.step for metric in client.get_metric_history(run_id, "loss")]
    assert losses == sorted(set(losses)) and losses[0] == 0  # one exact loss per step, ours (replayed exactly: above)


def test_a_trainer_with_its_own_training_step_is_refused_before_anything_is_recorded(shared):
    runs_before = len(shared.store().search_runs())
    _, done = _trainer(shared, "--steps", "4", "--own-training-step")
    assert done.stderr.strip().splitlines()[-1].startswith("replaybisect")
    assert "OwnStepTrainer overrides Trainer.training_step, which a replay does not run" in done.stderr
    assert "Traceback" not in done.stderr
    assert len(shared.store().search_runs()) == runs_before


def test_an_accelerate_loop_recorded_in_three_lines_replays_exact_and_its_planted_inf_is_found(shared):
    """accelerate's prepare, accumulate (2), backward and clip_grad_norm_ under bf16: a replay runs the script again."""
    run_id, done = _trainer(shared, "--steps", "40", "--plant", "37", script=ACCELERATE_SCRIPT)
    assert "replaybisect.NonFiniteStep: loss is nan at step 14" in done.stderr
    assert "step 13 loss" in done.stdout and "step 14 loss" not in done.stdout
    grad_norms = [value for _, value in shared.store().metric_history(run_id, "grad_norm")]
    assert len(set(grad_norms)) > 1 and max(grad_norms) > 1.0  # before accelerate's clip at 1.0, not after it
    report = shared.answer_here("find_nan", run_id)
    assert report["reproduced"] == "exact" and report["category"] == "forward" and report["op"] == "Tensor.div"
    assert "accelerate_loop.py:" in report["source"]


@pytest.mark.parametrize("scaled", [False, True], ids=["fp32", "fp16-gradscaler"])
def test_the_trainers_clip_takes_the_recorders_norm_and_clips_as_the_trainer_does(scaled, tmp_path, monkeypatch):
    """The Trainer clips (accelerate's clip: get_total_norm, then clip_grads_with_norm_) just after the step's gradients
    moment: recorded, it takes the norm the recorder took there, one pass over the gradients a step, and trains to
    the same parameters as the Trainer alone. With a GradScaler (fp16 on a GPU; here accelerate's own scaler made on
    the CPU) accelerate unscales inside its clip, after that moment: the clip takes its own norm."""
    import accelerate
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from replaybisect.hf import ReplayCallback

    if scaled:
        made = accelerate.Accelerator.__init__

        def with_scaler(self, *args, **kwargs):
            made(self, *args, **kwargs)
            self.native_amp, self.scaler = True, torch.amp.GradScaler("cpu", init_scale=1024.0)

        monkeypatch.setattr(accelerate.Accelerator, "__init__", with_scaler)

    class Norms(TorchDispatchMode):
        each = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Norms.each += func.overloadpacket is torch.ops.aten._foreach_norm
            return func(*args, **(kwargs or {}))

    class Counted(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.mode = Norms()
            self.mode.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            self.mode.__exit__(None, None, None)

    monkeypatch.chdir(tmp_path)
    ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trained = []
    for recorded in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=8, vocab_size=32))
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, max_grad_norm=0.5, report_to="none", save_strategy="no",
                                 use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0, fp16=scaled)
        callbacks = [ReplayCallback(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", layer_stats_every=0)] if recorded else []
        Norms.each = 0
        Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks + [Counted()]).train()
        trained.append(([param.detach().clone() for param in model.parameters()], Norms.each))
    (plain, plain_norms), (recorded, recorded_norms) = trained
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    assert plain_norms == 2 and recorded_norms == (4 if scaled else 2)
