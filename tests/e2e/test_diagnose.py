"""`replay diagnose` end to end: planted pathologies trained for real, read back through the installed CLI.

Every planted run is a real training through `rb.train` (built-in config with overrides, or a small user module in
examples/diagnose_pathologies/ via its config folder) recorded into a real SQLite MLflow store. The runs are
trained once per module, in this process (one torch thread), then each test diagnoses one of them.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import REPLAY, ROOT, Workspace, assert_one_line_error, in_folder

EXAMPLES = ROOT / "examples" / "diagnose_pathologies"
COMMON = ("train.num_threads=1", "snapshot.every=100")


def user(config_name: str) -> dict[str, object]:
    """rb.train's arguments for a config of examples/diagnose_pathologies (the built-in config: {})."""
    return {"config_dir": EXAMPLES, "config_name": config_name}


# name -> (rb.train config arguments, overrides, expected `replay train` exit status)
PLANTS: dict[str, tuple[dict[str, object], tuple[str, ...], int]] = {
    # healthy built-in configs: must get a clean bill
    "healthy_mlp_digits": ({}, ("train.steps=300", "train.batch_size=32", "train.val_every=30", "snapshot.layer_stats_every=10"), 0),
    "healthy_cnn_blobs": ({}, ("model=cnn", "data=blobs", "model.channels=8", "train.steps=150", "train.val_every=30", "snapshot.layer_stats_every=10"), 0),
    "nan_init": (user("nan_init"), (), 3),  # a NaN weight at initialisation
    "nan_lr": (user("nan_lr"), ("snapshot.layer_stats_every=2",), 3),  # SGD regression at too high an LR diverges to inf
    "detached": (user("detached"), ("train.steps=120",), 0),  # detached logits: no gradient anywhere
    "spikes": (user("spikes"), (), 0),  # garbage rows come round once an epoch
    "plateau": (user("plateau"), (), 0),  # the LR drops 1000x after 15 steps
    "oscillation": (user("oscillation"), (), 0),  # a cyclical LR that peaks too high
    "overfit": (user("overfit"), (), 0),  # 64 training digits
    "mismatch": (user("mismatch"), (), 0),  # validation digits mirrored and inverted
    # a deep sigmoid MLP: vanishing gradients
    "vanishing": ({}, ("train.steps=60", "model.activation=sigmoid", "model.depth=10", "model.hidden=32", "model.dropout=0", "snapshot.layer_stats_every=10"), 0),
    "dead_relu": (user("dead_relu"), ("train.steps=60",), 0),  # a huge negative bias
    "tiny_lr": (user("base"), ("optim.lr=1e-10", "train.steps=60"), 0),  # update/weight ratio below 1e-8
    "slow_data": (user("slow_data"), (), 0),  # a blocking read per item
}
# Besides `diagnose --run-id X --json` for every run: the rich report (with artifacts) and --no-artifacts.
EXTRA = {"dead_relu": [("--json", "--no-artifacts"), ()]}
# Diagnosed by the installed CLI (its JSON, report and artifacts are what these tests read); the other runs by the
# same three calls `replay diagnose --json` makes, in this process (a `replay` start-up imports MLflow: ~3 s a run).
CLI_DIAGNOSED = {"healthy_mlp_digits", "dead_relu"}


def _diagnose_here(workspace: Workspace, run_id: str) -> str:
    """What `replay diagnose --run-id RUN_ID --json` prints, computed in this process (its command's three calls)."""
    from replaybisect.core.jsonutil import strict_json
    from replaybisect.verbs.diagnose.engine import analyse, load_curves
    from replaybisect.verbs.diagnose.report import publish

    store = workspace.store()
    curves = load_curves(store, run_id)
    result = analyse(curves)
    with in_folder(workspace.path):
        report_run_id = publish(store, result, curves)
    return strict_json({**result.to_json(), "report_run_id": report_run_id})


def _train_here(workspace: Workspace, name: str) -> tuple[int, dict]:
    """`replay train --json --run-name NAME CONFIG COMMON OVERRIDES` in this process (`rb.train`, the command's request
    and engine; a `replay` start-up costs seconds): (the command's exit status, its JSON)."""
    import replaybisect as rb

    config, overrides, _ = PLANTS[name]
    with in_folder(workspace.path):
        result = rb.train([*COMMON, *overrides], **config, tracking_uri=workspace.tracking_uri, run_name=name)
    return (3 if result.stopped else 0), result.to_json()


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Train every planted run here, one after another, and diagnose it: CLI_DIAGNOSED through the installed CLI (a
    subprocess that runs while the next runs train), the others in this process.
    name -> {"train": (exit, JSON), "diagnose": [(args, exit, stdout, stderr), ...]}."""
    workspace = Workspace(tmp_path_factory.mktemp("diagnose"))
    env = workspace.env()
    results: dict[str, dict] = {name: {"diagnose": []} for name in PLANTS}
    commands: list[tuple[str, tuple[str, ...], subprocess.Popen]] = []
    for name in PLANTS:
        results[name]["train"] = returncode, trained = _train_here(workspace, name)
        if name not in CLI_DIAGNOSED:
            results[name]["diagnose"].append((("--json",), 0, _diagnose_here(workspace, trained["run_id"]), ""))
            continue
        for args in [("--json",), *EXTRA.get(name, [])]:
            process = subprocess.Popen([REPLAY, "diagnose", "--run-id", trained["run_id"], *args], cwd=workspace.path, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            commands.append((name, args, process))
    for name, args, process in commands:
        stdout, stderr = process.communicate(timeout=600)
        results[name]["diagnose"].append((args, process.returncode, stdout, stderr))
    return workspace, results


def diagnose(planted, name: str, args: tuple[str, ...] = ("--json",)):
    """The planted run's `replay diagnose --run-id X ARGS` result (JSON decoded for --json)."""
    workspace, results = planted
    returncode, trained = results[name]["train"]
    assert returncode == PLANTS[name][2], f"training {name}: exit {returncode}\n{trained}"
    matches = [r for r in results[name]["diagnose"] if r[0] == args]
    assert matches, f"diagnose {args} did not run for {name}"
    _, code, stdout, stderr = matches[0]
    assert code == 0, f"exit {code}\n{stdout}\n{stderr}"
    if "--json" not in args:
        return stdout
    data = json.loads(stdout)
    assert data["run_id"] == trained["run_id"]
    for finding in data["findings"]:
        assert set(finding) >= {"pattern", "evidence", "next"}
        assert finding["next"].startswith(("replay ", "python ")), finding["next"]
    return data


def only(data: dict, pattern: str) -> dict:
    matches = [f for f in data["findings"] if f["pattern"] == pattern]
    assert matches, f"no {pattern} finding in {[f['pattern'] for f in data['findings']]}:\n{json.dumps(data, indent=1)}"
    return matches[0]


@pytest.mark.parametrize("name", ["healthy_mlp_digits", "healthy_cnn_blobs"])
def test_healthy_run_gets_a_clean_bill(planted, name):
    data = diagnose(planted, name)
    assert data["healthy"] is True, json.dumps(data["findings"], indent=1)
    assert data["findings"] == []
    assert data["verdict"] == "no pathology found"
    assert data["summary"]["loss_end"] < data["summary"]["loss_start"]
    # every detector ran: a clean bill is not "nothing was checked"
    assert not data["skipped"], data["skipped"]


def test_healthy_report_and_artifacts_on_the_run(planted):
    """The report is a child run of the diagnosed run (`healthy · diagnose`, the answer first); a second diagnosis is a second child."""
    workspace, results = planted
    data = diagnose(planted, "healthy_mlp_digits")
    run_id, report_run_id = data["run_id"], data["report_run_id"]
    assert sorted(data["artifacts"]) == ["diagnosis.json", "diagnosis.md", "diagnosis_loss.png"]
    store = workspace.store()
    report_run = store.get_run(report_run_id)
    assert report_run.data.tags["mlflow.parentRunId"] == run_id and report_run.info.run_name == "healthy · diagnose"
    assert report_run.data.tags["mlflow.note.content"].startswith("no pathology found\n\n")
    assert "diagnose: no pathology found." in store.get_run(run_id).data.tags["mlflow.note.content"]
    names = {info.path for info in store.list_artifacts(report_run_id)}
    assert {"diagnosis.md", "diagnosis_loss.png", "diagnosis.json"} <= names
    assert "No pathology found" in store.read_artifact_text(report_run_id, "diagnosis.md")
    assert json.loads(store.read_artifact_text(report_run_id, "diagnosis.json"))["healthy"] is True
    assert store.tags(run_id)["diagnosis"] == "healthy"
    png = store.local_artifact_dir(report_run_id) / "diagnosis_loss.png"
    assert workspace.path in png.parents
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = json.loads(_diagnose_here(workspace, run_id))
    assert again["report_run_id"] != report_run_id and store.list_artifacts(report_run_id)  # nothing overwritten


def test_nan_at_the_first_step(planted):
    data = diagnose(planted, "nan_init")
    finding = only(data, "nan-at-start")
    assert finding["step"] == 0
    assert finding["next"] == f"replay nan --run-id {data['run_id']}"
    assert [f["pattern"] for f in data["findings"]] == ["nan-at-start"]


def test_nan_after_k_steps(planted):
    data = diagnose(planted, "nan_lr")
    _, trained = planted[1]["nan_lr"]["train"]
    finding = only(data, "nan-after-k")
    assert finding["step"] == trained["first_nonfinite_step"] > 0
    assert finding["next"].startswith(f"replay nan --run-id {data['run_id']}")
    assert finding["evidence"]["grad_norm_growth"] > 10  # the gradient norm blew up before it


def test_exploding_gradients_name_the_layer(planted):
    data = diagnose(planted, "nan_lr")
    finding = only(data, "exploding-gradients")
    assert finding["layer"] == "linear"  # the regressor's only layer
    assert finding["evidence"]["layers"]["linear"]["growth"] > 70
    assert finding["step"] < data["findings"][0]["step"]  # seen before the NaN it leads to


def test_update_ratio_too_large_synthetic(workspace):
    """Synthetic history (logged with the MLflow client into a real store): an update/weight ratio above
    10 for a whole run cannot be trained cheaply without the run turning NaN first."""
    import math

    with in_folder(workspace.path):
        store = workspace.store()
        run_id = store.create_run("train", run_name="synthetic-huge-updates")
    points = []
    for step in range(200):
        points += [("loss", 2.3 * math.exp(-step / 60) + 0.2 + 0.05 * math.sin(step), step), ("grad_norm", 1.0, step), ("lr", 5.0, step)]
        if step % 10 == 0:
            points.append(("update_ratio", 40.0 + (step % 7), step))
    store.log_metrics(run_id, points)
    store.finish_run(run_id, "ok")
    data = json.loads(_diagnose_here(workspace, run_id))
    assert [f["pattern"] for f in data["findings"]] == ["update-ratio"]
    finding = data["findings"][0]
    assert finding["evidence"]["update_ratio_median"] > 10
    assert finding["next"] == f"replay ablate lr,warmup --run-id {run_id}"


def test_flat_from_the_first_step(planted):
    data = diagnose(planted, "detached")
    finding = only(data, "flat-from-start")
    assert finding["step"] == 0
    assert finding["evidence"]["grad_norm_median"] == 0
    assert "check" in finding["next"]


def test_spikes_name_their_steps(planted):
    data = diagnose(planted, "spikes")
    finding = only(data, "spikes")
    workspace, _ = planted
    losses = dict(workspace.store().metric_history(data["run_id"], "loss"))
    evidence = finding["evidence"]["loss"]
    # the baseline is the early loss of a 10-class model (~ln 10), not the early spikes themselves
    assert 2.0 < evidence["baseline_max"] < 2.6
    assert evidence["count"] >= 2  # the garbage rows come back every epoch
    for step in evidence["spike_steps"]:
        assert losses[step] >= 10 * evidence["baseline_max"]
    assert finding["step"] == min(finding["steps"] if "steps" in finding else evidence["spike_steps"])


def test_plateau_after_a_decrease(planted):
    data = diagnose(planted, "plateau")
    finding = only(data, "plateau")
    # the LR drops to 1e-5 at step 15: the plateau starts right after it, far before the end
    assert 15 <= finding["step"] <= 100
    assert finding["evidence"]["lr_at_plateau"] < 1e-4
    assert finding["evidence"]["plateau_level"] > 0.5 * finding["evidence"]["loss_start"]
    assert "check" in finding["next"]
    assert [f["pattern"] for f in data["findings"]] == ["plateau"]


def test_oscillation(planted):
    data = diagnose(planted, "oscillation")
    finding = only(data, "oscillation")
    evidence = finding["evidence"]
    assert evidence["swing_p10_p90"] > 0.5 * evidence["level"]
    assert evidence["net_decrease"] < 0.25 * evidence["swing_p10_p90"]
    assert "ablate lr" in finding["next"]


def test_overfitting_names_the_step(planted):
    data = diagnose(planted, "overfit")
    finding = only(data, "overfitting")
    evidence = finding["evidence"]
    assert finding["step"] == evidence["best_val_step"]
    assert evidence["last_val_loss"] > 1.1 * evidence["best_val_loss"]
    assert all(gap > 0.1 for gap in evidence["gap_last"])
    assert "distribution-mismatch" not in [f["pattern"] for f in data["findings"]]


def test_distribution_mismatch(planted):
    data = diagnose(planted, "mismatch")
    finding = only(data, "distribution-mismatch")
    assert finding["evidence"]["train_gain"] > 0.5 > finding["evidence"]["val_gain"]
    assert "overfitting" not in [f["pattern"] for f in data["findings"]]


def test_vanishing_gradients_name_the_layer(planted):
    data = diagnose(planted, "vanishing")
    finding = only(data, "vanishing-gradients")
    assert finding["layer"] == "net.0"  # the first Linear of the deep sigmoid stack, furthest from the loss
    assert finding["evidence"]["layers"]["net.0"]["ratio_to_largest"] < 1e-3


def test_dead_relu_names_the_layer(planted):
    data = diagnose(planted, "dead_relu")
    finding = only(data, "dead-relu")
    assert finding["layer"] == "net.1"
    assert finding["evidence"]["zero_fraction_median"] == 1.0
    assert [f["layer"] for f in data["findings"] if f["pattern"] == "dead-relu"] == ["net.1"]  # net.3 is alive


def test_update_ratio_out_of_range(planted):
    data = diagnose(planted, "tiny_lr")
    finding = only(data, "update-ratio")
    assert finding["evidence"]["update_ratio_median"] < 1e-8
    assert "check" in finding["next"]


def test_input_pipeline_bound(planted):
    data = diagnose(planted, "slow_data")
    finding = only(data, "input-pipeline-bound")
    assert finding["evidence"]["data_share"] > 0.5
    assert finding["evidence"]["dataset"] == "pathologies.SlowDigits"


def test_rich_report_and_no_artifacts(planted):
    workspace, results = planted
    run_id = results["dead_relu"]["train"][1]["run_id"]
    quiet = diagnose(planted, "dead_relu", ("--json", "--no-artifacts"))
    assert quiet["artifacts"] == [] and quiet["report_run_id"] is None
    assert [f["pattern"] for f in quiet["findings"]] == [f["pattern"] for f in diagnose(planted, "dead_relu")["findings"]]
    report = diagnose(planted, "dead_relu", ())
    assert "dead-relu" in report and "net.1" in report
    assert f"replay check --run-id {run_id}" in report
    assert "diagnosis.md" in report  # where the report was attached


def test_unknown_run_id_is_one_line_exit_2(workspace):
    result = workspace.replay("diagnose", "--run-id", "0123456789abcdef0123456789abcdef")
    assert_one_line_error(result, "no run", "0123456789abcdef")


def test_run_without_metrics_is_one_line_exit_2(workspace):
    with in_folder(workspace.path):
        store = workspace.store()
        run_id = store.create_run("train", run_name="empty")
    store.finish_run(run_id, "ok")
    result = workspace.replay("diagnose", "--run-id", run_id, "--json")
    assert_one_line_error(result, "no metrics", run_id)
    assert result.stdout == ""
