"""The zoo (tests/zoo/): realistic models, healthy and with the plants real runs suffer from. `replay nan` must
name the category, module, op and source line; `replay ablate` the arm that helps; `replay diagnose` the
finding; and a healthy model gets no finding at all.

Every run is trained once per module, in this process, through the same `train()` that `replay train` calls;
the verbs' engines are called directly, and one `replay nan --json` runs as a user would. Five-seed false-alarm
calibration of the healthy zoo: benchmarks/zoo_calibration.py (one seed here, to keep the suite fast).
"""

from __future__ import annotations

import shutil
import sys

import pytest

from tests.helpers import EXAMPLES, ROOT, TESTS, Workspace, train_in_process

ZOO = TESTS / "zoo"

# name: (config, overrides). Healthy models first; failing plants stop early, so they cost a few steps each.
RUNS = {
    "gpt": ("gpt", ()),
    "lstm": ("lstm", ()),
    "cnn": ("cnn", ()),
    "ownloss": ("ownloss", ()),
    "handwritten_softmax": ("gpt", ("model.plant=handwritten_softmax", "optim.lr=0.1")),
    "fp16_attention": ("gpt", ("model.plant=fp16_attention", "train.precision=fp16", "optim.lr=0.1")),
    "layernorm_overflow": ("gpt", ("model.plant=layernorm_overflow",)),
    "nan_row": ("cnn", ("data.nan_row=700",)),
    "detached": ("gpt", ("model.plant=detached_attention",)),
    "softmax_ce": ("gpt", ("model.plant=softmax_output",)),
    "lr_typo": ("gpt", ("optim.lr=3",)),
    "lstm_lr_typo": ("lstm", ("optim.lr=2000",)),
    "frozen": ("cnn", ("model.plant=frozen_first",)),
}
HEALTHY = ("gpt", "lstm", "cnn", "ownloss")
FAILING = ("handwritten_softmax", "fp16_attention", "layernorm_overflow", "nan_row")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """Every zoo run trained once: (workspace, project folder, {name: TrainResult})."""
    workspace = Workspace(tmp_path_factory.mktemp("zoo"))
    project = workspace.path / "zoo"  # inside the suite's trusted temp folder (conftest)
    shutil.copytree(ZOO, project, ignore=shutil.ignore_patterns("__pycache__"))
    store = workspace.store()
    trained = {}
    for name, (config, overrides) in RUNS.items():
        # only the failing runs are replayed (nan, ablate); the others are diagnosed from their logged curves, which
        # snapshots do not change: they write none (24 snapshots a run, half of its time on a busy machine)
        snapshots = () if name in FAILING else ("snapshot.every=0",)
        trained[name] = train_in_process(store, *overrides, *snapshots, config_dir=project, config_name=config)
    for name, result in trained.items():
        assert result.status == ("nonfinite" if name in FAILING else "ok"), (name, result)
    return workspace, project, trained


@pytest.fixture(scope="module")
def nan_reports(zoo):
    from replaybisect.core.trust import Trust
    from replaybisect.verbs.nan.engine import find_nan

    workspace, project, trained = zoo
    store = workspace.store()
    return {name: find_nan(store, trained[name].run_id, trust=Trust.from_user([project])) for name in FAILING}


@pytest.fixture(scope="module")
def diagnoses(zoo):
    from replaybisect.verbs.diagnose.engine import diagnose

    workspace, _, trained = zoo
    store = workspace.store()
    return {name: diagnose(store, result.run_id) for name, result in trained.items()}


# ---- replay nan: the op that really went non-finite, not the causal mask's -inf -------------------------------
NAN_EXPECTED = {
    # name: (category, module (suffix), ops, source fragment)
    "handwritten_softmax": ("forward", ".attn", ("torch.exp",), "att = torch.exp(att)"),
    "fp16_attention": ("forward", ".attn", ("Tensor.matmul", "Tensor.__matmul__", "torch.matmul"), "@ k.transpose(-2, -1)"),
    "layernorm_overflow": ("forward", "h.1.ln_2", ("torch.nn.functional.layer_norm",), "self.ln_2(x)"),
    "nan_row": ("data", "conv1", (None,), None),
}


@pytest.mark.parametrize("name", list(NAN_EXPECTED))
def test_nan_names_the_category_module_op_and_line(nan_reports, name):
    report = nan_reports[name]
    category, module, ops, source = NAN_EXPECTED[name]
    assert report.category == category, report.evidence
    assert report.module is not None and report.module.endswith(module), report.module
    assert report.op in ops, (report.op, report.evidence)
    assert report.op != "Tensor.masked_fill"  # the causal mask's -inf was asked for: never the fault
    if source:
        assert report.source and "zoo_models.py" in report.source and source in report.source, report.source
    assert report.reproduced == "exact"


def test_module_and_op_agree(nan_reports):
    """The module reported is the one whose forward ran the op (the issue: module ln_2, op masked_fill in attn)."""
    for name in ("handwritten_softmax", "fp16_attention", "layernorm_overflow"):
        report = nan_reports[name]
        assert report.forward["op"]["module"] == report.module, (name, report.module, report.forward["op"])


def test_nan_cli_end_to_end(zoo):
    """`replay nan --json` as a user runs it, from the project folder."""
    workspace, project, trained = zoo
    result = workspace.replay("nan", "--json", "--run-id", trained["handwritten_softmax"].run_id, "--code-dir", str(project))
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert (report["category"], report["op"]) == ("forward", "torch.exp")
    assert "att = torch.exp(att)" in report["source"]


# ---- replay ablate: which single change helps ------------------------------------------------------------------
@pytest.mark.parametrize("name, arms, helps", [
    ("fp16_attention", "precision,lr", {"precision": ("fixes",)}),
    ("handwritten_softmax", "lr,clip", {"lr": ("delays", "fixes"), "clip": "no-effect"}),  # lr/10: later or never
    ("nan_row", "skip-batch", {"skip-batch": ("delays",)}),  # the row comes back next epoch: clean the data
])
def test_ablate_finds_the_arm(zoo, name, arms, helps):
    from replaybisect.core.trust import Trust
    from replaybisect.verbs.ablate.engine import ablate

    workspace, project, trained = zoo
    result = ablate(workspace.store(), trained[name].run_id, arms, workers=1, trust=Trust.from_user([project]))
    verdicts = {arm.name: arm.verdict for arm in result.arms}
    for arm, verdict in helps.items():
        assert verdicts[arm] in ((verdict,) if isinstance(verdict, str) else verdict), verdicts


# ---- replay diagnose: the finding, and none on healthy models ---------------------------------------------------
@pytest.mark.parametrize("name", HEALTHY)
def test_diagnose_healthy_models_have_no_finding(diagnoses, name):
    diagnosis = diagnoses[name]
    assert diagnosis.healthy, [f.summary for f in diagnosis.findings]


DIAGNOSE_EXPECTED = {
    "detached": ("no-gradient", "attn"),
    "frozen": ("no-gradient", "1"),  # conv1 / bn1
    "softmax_ce": ("slow-learning", None),
    "lr_typo": ("divergence", None),
    "lstm_lr_typo": ("divergence", None),
    "handwritten_softmax": ("nan-after-k", None),
    "nan_row": ("nan-after-k", None),
}


@pytest.mark.parametrize("name", list(DIAGNOSE_EXPECTED))
def test_diagnose_names_the_plant(diagnoses, name):
    pattern, layer = DIAGNOSE_EXPECTED[name]
    findings = [f for f in diagnoses[name].findings if f.pattern == pattern]
    assert findings, [f.summary for f in diagnoses[name].findings]
    if layer:
        assert layer in findings[0].layer, findings[0].layer


def test_diagnose_reports_no_exploding_gradient_for_a_small_clipped_lstm(diagnoses):
    """LSTM with clip 0.25: a layer's grad norm growing from ~1e-3 to ~0.1 is not an explosion."""
    assert not [f for f in diagnoses["lstm"].findings if f.pattern == "exploding-gradients"]


# ---- weight tying ----------------------------------------------------------------------------------------------
def test_tied_weights_belong_to_one_module():
    """grad.vanishing compares layers: GPT's lm_head.weight is wte.weight, so it is counted once, not compared with itself."""
    sys.path.insert(0, str(ZOO))
    try:
        import zoo_models
    finally:
        sys.path.remove(str(ZOO))
    from replaybisect.core.layer_stats import parameter_owners

    model = zoo_models.GPT()
    owners = dict(parameter_owners(model))
    assert "wte" in owners and "lm_head" not in owners
    ids = [id(p) for params in owners.values() for p in params]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))


# ---- a failure at step 0 is reproduced from the config ----------------------------------------------------------
def test_step0_failure_is_reproduced_from_the_config(tmp_path):
    """No snapshot before step 0: rebuild the state from the config, compare it with the step-0 snapshot bit for bit,
    run step 0 from both: `reproduced: exact`, not `unchecked`."""
    from replaybisect.core.trust import Trust
    from replaybisect.verbs.nan.engine import find_nan

    store = Workspace(tmp_path).store()
    folder = EXAMPLES / "diagnose_pathologies"
    run = train_in_process(store, "train.steps=3", config_dir=folder, config_name="nan_init")
    assert run.status == "nonfinite" and run.first_nonfinite_step == 0
    report = find_nan(store, run.run_id, trust=Trust.from_user([folder]))
    assert report.reproduced == "exact", report.evidence[0]
    assert report.replay["reproduced_from"] == "config" and report.replay["same_outcome"] and report.replay["as_logged"]
    assert "rebuilt the state from the config" in report.evidence[0]


# ---- citations ---------------------------------------------------------------------------------------------------
def test_reports_cite_public_sources_only():
    """Reports and the code they come from cite public sources, never the team's internal notes."""
    package = ROOT / "replaybisect"
    internal = [f"{path.relative_to(package)}:{number}" for path in package.rglob("*.py")
                for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if "field-notes" in line.lower() or "field notes" in line.lower()]
    assert not internal, internal


def test_diagnose_findings_cite_a_source(diagnoses):
    findings = [f for diagnosis in diagnoses.values() for f in diagnosis.findings]
    assert findings and all(f.source for f in findings), [f.pattern for f in findings if not f.source]


def test_final_loss_agrees_between_train_and_diagnose(zoo, diagnoses):
    """`replay diagnose`'s final loss is `replay train`'s: the last logged loss (the medians are named as such)."""
    _, _, trained = zoo
    for name in HEALTHY:
        assert diagnoses[name].summary["loss_end"] == trained[name].final_loss, name


# ---- diagnose on synthetic curves: a climb into the NaN, and what the plot says went non-finite ----------------------
def _climbing_curves():
    """Loss and grad norm healthy for 40 steps, then the grad norm climbs x1.5 a step for 22 steps and goes NaN."""
    import numpy as np

    from replaybisect.verbs.diagnose.engine import Curves, Series

    rng = np.random.default_rng(0)
    steps = np.arange(63)
    grad = np.concatenate([0.5 * np.exp(0.1 * rng.standard_normal(40)), 0.5 * 1.5 ** np.arange(1, 23), [np.nan]])
    loss = np.concatenate([2.3 * np.exp(-steps[:40] / 30) + 0.05 * rng.random(40), 0.7 + 0.02 * 1.3 ** np.arange(1, 23), [3.0]])
    metrics = {"loss": Series(steps, loss), "grad_norm": Series(steps, grad), "lr": Series(steps, np.full(63, 1e-3))}
    return Curves(run_id="synthetic", metrics=metrics, tags={"status": "nonfinite", "first_nonfinite_step": "62",
                                                             "nonfinite_what": "grad_norm"}, params={})


def test_an_exponential_climb_into_nan_is_one_divergence_not_spikes():
    from replaybisect.verbs.diagnose.engine import analyse

    diagnosis = analyse(_climbing_curves())
    patterns = [f.pattern for f in diagnosis.findings]
    assert "divergence" in patterns and "spikes" not in patterns, [f.summary for f in diagnosis.findings]
    divergence = next(f for f in diagnosis.findings if f.pattern == "divergence")
    assert divergence.evidence["metric"] == "grad_norm" and divergence.evidence["failing_step"] == 62


def test_a_smooth_loss_climb_under_a_noisy_grad_norm_dates_the_divergence_from_the_loss():
    """A warmup into an unstable LR: the loss rises x5 a step from step 12, the grad norm climbs too but jumps
    around; the climb starts where the loss began rising, and the values on the way up are not spikes."""
    import numpy as np

    from replaybisect.verbs.diagnose.engine import Curves, Series, analyse

    rng = np.random.default_rng(1)
    steps = np.arange(48)
    loss = np.concatenate([20 * np.exp(0.3 * rng.standard_normal(12)), 14.0 * 5.0 ** np.arange(35), [np.inf]])
    grad = np.concatenate([10 * np.exp(0.3 * rng.standard_normal(12)), 20 * 3.0 ** np.arange(35) * np.exp(2 * rng.standard_normal(35)),
                           [np.inf]])
    curves = Curves(run_id="synthetic", metrics={"loss": Series(steps, loss), "grad_norm": Series(steps, grad),
                                                 "lr": Series(steps, np.linspace(0.01, 0.6, 48))},
                    tags={"status": "nonfinite", "first_nonfinite_step": "47", "nonfinite_what": "grad_norm"}, params={})
    diagnosis = analyse(curves)
    patterns = [f.pattern for f in diagnosis.findings]
    assert "divergence" in patterns and "spikes" not in patterns, [f.summary for f in diagnosis.findings]
    divergence = next(f for f in diagnosis.findings if f.pattern == "divergence")
    assert divergence.evidence["metric"] == "loss" and divergence.evidence["from_step"] == 12


def test_a_climb_after_a_plateau_starts_where_the_rise_does():
    """Flat within 1% for 40 steps, then x3 a step into inf: the divergence starts at the plateau's end (not at
    step 0 at a slower rate), and the climb's swings are not also called an oscillation."""
    import numpy as np

    from replaybisect.verbs.diagnose.engine import Curves, Series, analyse

    rng = np.random.default_rng(0)
    steps = np.arange(61)
    loss = np.concatenate([2.3 * (1 + 0.01 * rng.standard_normal(40)), 2.3 * 3.0 ** np.arange(1, 21), [np.inf]])
    curves = Curves(run_id="synthetic", metrics={"loss": Series(steps, loss), "lr": Series(steps, np.full(61, 1e-3))},
                    tags={"status": "nonfinite", "first_nonfinite_step": "60", "nonfinite_what": "loss"}, params={})
    findings = {f.pattern: f for f in analyse(curves).findings}
    assert set(findings) == {"nan-after-k", "divergence"}, [f.summary for f in findings.values()]
    assert findings["divergence"].evidence["from_step"] == 39 and findings["divergence"].evidence["growth_per_step"] > 2.5


def test_plot_legend_names_the_metric_that_went_nonfinite():
    from replaybisect.verbs.diagnose.engine import analyse
    from replaybisect.verbs.diagnose.report import loss_figure

    curves = _climbing_curves()
    figure = loss_figure(analyse(curves), curves)
    labels = [text.get_text() for ax in figure.axes if ax.get_legend() for text in ax.get_legend().get_texts()]
    assert any("grad_norm non-finite at step 62" in label for label in labels), labels
    assert not any(label.startswith("NaN at step") for label in labels), labels
