"""`replay nan` end to end: planted failures (examples/nan_*), one per category, diagnosed against a real SQLite
MLflow store; bad input; probe isolation.

Runs are trained once per module (in-process, through the same `train()` that `replay train` calls) and
shared between tests; the JSON reports come from `rb.find_nan` in this process (the command's request and engine),
the rich report, bad input and corrupt snapshots from the real `replay nan` command in a subprocess.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import helpers
from tests.helpers import CliResult, EXAMPLES, Workspace, as_printed, assert_one_line_error


def _train(store, example: str, *overrides: str, env: dict | None = None):
    return helpers.train_example(store, example, *overrides, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every planted failure trained once: {name: TrainResult}, plus the workspace that holds them."""
    workspace = Workspace(tmp_path_factory.mktemp("nan"))
    store = workspace.store()
    sys.path.insert(0, str(EXAMPLES / "nan_data"))
    import planted_data

    csv = workspace.path / "rows.csv"
    nan_row = planted_data.write_dataset(csv, nan_at_step=12)
    trained = {
        "data": _train(store, "nan_data", f"data.path={csv}"),
        "forward": _train(store, "nan_forward"),
        "forward_bf16": _train(store, "nan_forward", "train.precision=bf16"),
        "forward_fp16": _train(store, "nan_forward", "train.precision=fp16"),
        "loss": _train(store, "nan_loss"),
        "backward": _train(store, "nan_backward"),
        "optimizer": _train(store, "nan_optimizer"),
        "corrupt": _train(store, "nan_corrupt"),
        "transient": _train(store, "nan_transient", env={"NAN_TRANSIENT_FAULT_STEP": "17"}),
        "healthy": _train(store, "nan_forward", "model.decay=1.0", "train.steps=8"),
        "no_periodic": _train(store, "nan_backward", "snapshot.every=0"),
        "unrecorded": _train(store, "nan_backward", "snapshot.enabled=false"),
        "for_corruption": _train(store, "nan_backward", "model.eps_steps=16"),
    }
    csv.unlink()  # the data source is gone: `replay nan` must work from the stored batches
    for name, result in trained.items():
        expected = "ok" if name == "healthy" else "nonfinite"
        assert result.status == expected, (name, result)
    return workspace, trained, nan_row


def _corruption_sequence(workspace: Workspace, run) -> tuple:
    """Flip a byte in the snapshot `replay nan` would use (fall back, say so), then in every snapshot (exit 2)."""
    folder = workspace.store().local_artifact_dir(run.run_id) / "snapshots"

    def flip(step: int) -> None:
        path = folder / f"step-{step:06d}" / "tensors.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))

    flip(15)
    fallback = workspace.replay("nan", "--run-id", run.run_id)
    for step in (0, 5, 10, 16):
        flip(step)
    none_verifies = workspace.replay("nan", "--run-id", run.run_id, "--json")
    return fallback, none_verifies


def _nan_here(workspace: Workspace, run_id: str) -> CliResult:
    """What `replay nan --run-id RUN_ID --json --no-child-run` prints, computed in this process (`rb.find_nan`: the
    command's request and engine; a `replay` start-up costs seconds)."""
    import replaybisect as rb

    return CliResult(0, json.dumps(as_printed(rb.find_nan(run_id, tracking_uri=workspace.tracking_uri, publish=False))), "")


@pytest.fixture(scope="module")
def cli(runs):
    """Every `replay nan` of this module: the reports read as JSON computed in this process, the rich report, the
    bad input and the corrupt snapshots through the installed CLI (subprocesses, a few at a time, meanwhile)."""
    workspace, trained, _ = runs
    jobs = {"backward_rich": ("nan", "--run-id", trained["backward"].run_id),
            "unknown": ("nan", "--run-id", "0123456789abcdef", "--json"),
            "healthy": ("nan", "--run-id", trained["healthy"].run_id, "--json"),
            "unrecorded": ("nan", "--run-id", trained["unrecorded"].run_id, "--json")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        corruption = pool.submit(_corruption_sequence, workspace, trained["for_corruption"])
        futures = {name: pool.submit(workspace.replay, *args) for name, args in jobs.items()}
        results = {name: _nan_here(workspace, trained[name].run_id)
                   for name in ("data", "forward", "forward_bf16", "forward_fp16", "loss", "optimizer", "corrupt", "transient", "no_periodic")}
        results.update({name: future.result() for name, future in futures.items()})
        results["corruption"] = corruption.result()
    return results


def report_of(cli, name: str) -> dict:
    result = cli[name]
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.json()


def test_data_nan_row_found_from_stored_batches_after_the_source_is_deleted(runs, cli):
    _, _, nan_row = runs
    report = report_of(cli, "data")
    assert report["category"] == "data"
    assert report["failing_step"] == 12 and report["snapshot_step"] == 10
    assert report["reproduced"] == "exact"
    assert report["module"] == "net.0"
    (finding,) = report["batch"]
    assert finding["field"].startswith("batch[0]")
    assert finding["rows"] == [5] and finding["dataset_rows"] == [nan_row]
    assert "stored batch" in report["evidence"][0]
    assert report["arms"] == ["skip-batch"]


@pytest.mark.parametrize("name,precision", [("forward", "fp32"), ("forward_bf16", "bf16"), ("forward_fp16", "fp16")])
def test_forward_overflow_exact_replay_in_every_precision(cli, name, precision):
    report = report_of(cli, name)
    assert report["precision"] == precision
    assert report["reproduced"] == "exact", report["replay"]
    assert report["snapshot_step"] < report["failing_step"]
    assert report["state_match"].startswith("bit-identical"), report["state_match"]
    assert (report["category"], report["phase"], report["module"], report["op"]) == ("forward", "forward", "gate", "torch.exp")
    assert "planted_forward.py" in report["source"] and "torch.exp" in report["source"]
    first = report["forward"]["first_nonfinite_from_finite"]
    assert first["type"] == "NaiveSoftmaxGate"
    assert all(i["nan"] == 0 and i["inf"] == 0 for i in first["inputs"])
    assert any(o["nan"] or o["inf"] for o in first["outputs"])
    assert (precision != "fp32") == ("precision" in report["arms"])
    assert report["isolation"] == {"state_unchanged": True, "rng_unchanged": True, "step_repeatable": True}
    assert report["replay_run_id"] is None  # --no-child-run


def test_loss_log_of_zero(cli):
    report = report_of(cli, "loss")
    assert report["category"] == "loss"
    assert report["module"] == "loss (SigmoidBCE)"
    assert report["op"] == "torch.log"
    assert report["forward"]["model_output_finite"] is True
    assert report["reproduced"] == "exact"
    # the logit scale grows 30% a step, and so does the gradient norm: named as exploding, with its rate
    assert report["history"]["exploding"] is True
    assert 0.05 < report["history"]["growth_per_step"] < 1.0
    assert "exploding gradients" in report["history"]["summary"]
    assert {"lr", "clip"} <= set(report["arms"])


def test_backward_only_failure_rich_report_and_child_run(runs, cli):
    workspace, trained, _ = runs
    result = cli["backward_rich"]
    assert result.returncode == 0, result.stderr
    for text in ("backward", "act", "_SqrtBackward", "replay ablate", "reproduced exact"):
        assert text in result.stdout, text
    store = workspace.store()
    (child,) = store.child_runs(trained["backward"].run_id, "replay")
    assert child.info.status == "FINISHED" and child.data.tags["replaybisect.category"] == "backward"
    # readable in the MLflow UI: named after what it did, its one-line answer and report as its description
    step = trained['backward'].first_nonfinite_step
    assert child.info.run_name == f"backward _SqrtBackward in act · nan @ step {step}"  # the answer first in the always-shown name
    note = child.data.tags["mlflow.note.content"]
    assert note.startswith(f"backward at step {step}: _SqrtBackward in act made a non-finite value from finite inputs at ")
    assert "(replay exact)\n\n# replay nan" in note
    assert f"nan: backward at step {step}: _SqrtBackward in act" in store.get_run(trained["backward"].run_id).data.tags["mlflow.note.content"]
    assert {"report.md", "report.json", "nan_report.png"} <= {info.path for info in store.list_artifacts(child.info.run_id)}
    report = json.loads(store.read_artifact_text(child.info.run_id, "report.json"))
    assert report["replay_run_id"] == child.info.run_id
    assert (report["category"], report["module"], report["op"]) == ("backward", "act", "_SqrtBackward")
    assert "_Sqrt.apply" in report["source"]
    assert report["forward"]["first_nonfinite_output"] is None  # the forward was finite
    assert report["reproduced"] == "exact"
    assert "backward" in store.read_artifact_text(child.info.run_id, "report.md")


def test_optimizer_eps_zero_traced_to_the_update_that_made_nan(cli):
    report = report_of(cli, "optimizer")
    assert report["category"] == "optimizer"
    assert report["phase"] == "update"
    assert report["failing_step"] == 1 and report["origin_step"] == 0
    assert report["module"] == "net.0"
    assert report["op"] == "Adam.step"
    assert any("eps=0" in line and "exp_avg_sq == 0" in line for line in report["evidence"])
    assert report["arms"][0] == "eps"
    assert report["suggestion"].startswith("replay ablate eps")


def test_corrupt_state_from_a_module_writing_its_own_weight(cli):
    report = report_of(cli, "corrupt")
    assert report["category"] == "corrupt-state"
    assert report["failing_step"] == 14 and report["origin_step"] == 13
    assert report["module"] == "encoder"
    assert report["state_findings"][0]["name"] == "encoder.weight"
    assert any("not `optimizer`" in line for line in report["evidence"])


def test_transient_when_the_failing_step_is_finite_on_replay(cli):
    report = report_of(cli, "transient")
    assert report["category"] == "transient"
    assert report["failing_step"] == 17 and report["reproduced"] == "exact"
    assert report["state_match"].startswith("bit-identical")
    assert "hardware" in " ".join(report["evidence"])
    assert report["arms"] == [] and "resume" in report["suggestion"]
    # recorded and replayed here: the machine does not reproduce its own recording, and verify is the next check
    assert any("recorded and replayed on the same machine" in line and "replay verify" in line for line in report["evidence"])


def test_no_periodic_snapshots_uses_the_emergency_snapshot(cli):
    report = report_of(cli, "no_periodic")
    assert report["reproduced"] == "unchecked"
    assert report["snapshot_step"] == report["failing_step"]
    assert report["category"] == "backward" and report["module"] == "act"
    assert any("cannot prove" in w for w in report["warnings"])


def test_corrupt_snapshot_falls_back_and_says_so_then_fails_when_none_verifies(runs, cli):
    workspace, trained, _ = runs
    assert trained["for_corruption"].first_nonfinite_step == 16
    fallback, none_verifies = cli["corruption"]
    assert fallback.returncode == 0, fallback.stderr
    assert "step-000015" in fallback.stdout and "fails verification" in fallback.stdout
    assert "snapshot 10 -> reproduced exact" in fallback.stdout
    store = workspace.store()
    (child,) = store.child_runs(trained["for_corruption"].run_id, "replay")
    report = json.loads(store.read_artifact_text(child.info.run_id, "report.json"))
    assert report["snapshot_step"] == 10 and report["category"] == "backward" and report["module"] == "act"
    assert any("step-000015" in w and "fails verification" in w for w in report["warnings"])
    assert "step-000015" in store.read_artifact_text(child.info.run_id, "report.md")
    assert_one_line_error(none_verifies, "verif", "cannot be replayed")


def test_bad_input_is_one_line_exit_2(runs, cli):
    _, trained, _ = runs
    assert_one_line_error(cli["unknown"], "no run", "0123456789abcdef")
    healthy = trained["healthy"].run_id
    assert_one_line_error(cli["healthy"], "never went non-finite", f"replay diagnose --run-id {healthy}")
    assert_one_line_error(cli["unrecorded"], "snapshot")


def test_step_option_refuses_a_finite_step(runs):
    from replaybisect.errors import ReplayError
    from replaybisect.verbs.nan.engine import find_nan

    workspace, trained, _ = runs
    with pytest.raises(ReplayError, match="step 3 .* was finite"):
        find_nan(workspace.store(), trained["forward"].run_id, 3)


def test_same_step_twice_gives_identical_reports(runs):
    from replaybisect.verbs.nan.engine import find_nan

    workspace, trained, _ = runs
    store = workspace.store()
    first = find_nan(store, trained["forward"].run_id).to_json()
    second = find_nan(store, trained["forward"].run_id).to_json()
    for report in (first, second):
        report.pop("timings")
    assert first == second
    assert first["isolation"] == {"state_unchanged": True, "rng_unchanged": True, "step_repeatable": True}


def test_probes_never_change_state_or_rng(runs):
    """Probes and detect_anomaly on copies leave the live state and every RNG stream as they were, and the
    plain step gives bit-identical results before and after them."""
    from replaybisect.core import loop
    from replaybisect.core.rng import capture_raw, to_json
    from replaybisect.verbs.nan import engine as nan
    from replaybisect.verbs.nan import anomaly, step_probe
    from replaybisect.replay import restore as restore_mod

    workspace, trained, _ = runs
    restored = restore_mod.restore(workspace.store(), trained["backward"].run_id, step=10)
    restore_mod.replay(restored, 12)
    state = restored.state
    batch = loop.to_device(restored.batch(12), state.device)
    rng_at_step = capture_raw()
    before = nan.fingerprint(state)
    first = nan.on_copy(state, rng_at_step, nan.plain_run(12, batch))[1]
    nan.on_copy(state, rng_at_step, lambda copy: step_probe.StepProbe(copy).run(12, batch))
    nan.on_copy(state, rng_at_step, lambda copy: anomaly.anomaly_pass(copy, 12, batch))
    assert nan.fingerprint(state) == before
    assert to_json(capture_raw()) == to_json(rng_at_step)
    assert nan.on_copy(state, rng_at_step, nan.plain_run(12, batch))[1] == first
    # and the live state still steps exactly like the recorded run: a non-finite grad norm at 12
    assert loop.run_step(state, 12, batch).nonfinite == "grad_norm"
