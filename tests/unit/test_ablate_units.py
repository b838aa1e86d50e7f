"""`replay ablate`'s pieces that need no training: the interventions on real configs, the verdict rules,
where the arms start."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from replaybisect.core import config as config_mod
from replaybisect.errors import ReplayError
from replaybisect.verbs.ablate import engine as ablate_mod
from replaybisect.verbs.ablate import interventions
from replaybisect.verbs.ablate.interventions import ArmContext


@pytest.fixture(scope="module")
def adamw_cfg():
    return config_mod.compose(None, None, ["optim=adamw", "optim.lr=0.01", "train.precision=bf16"])


@pytest.fixture(scope="module")
def sgd_cfg():
    return config_mod.compose(None, None, ["optim=sgd", "train.clip_grad_norm=0.5"])


CTX = ArmContext(failing_step=30, start_step=20, end_step=80, grad_norms=[float(v) for v in range(1, 101)] + [math.inf])


def test_each_intervention_changes_one_thing(adamw_cfg):
    lr = interventions.get("lr").apply(adamw_cfg, CTX, None)
    assert lr.cfg.optim.lr == pytest.approx(0.001) and lr.lr_factor(25) == pytest.approx(0.1)
    assert adamw_cfg.optim.lr == 0.01  # the run's config is not touched
    clip = interventions.get("clip").apply(adamw_cfg, CTX, None)
    assert clip.cfg.train.clip_grad_norm == 1.0
    assert interventions.suggested_clip(CTX.grad_norms) == 95.0  # numpy's 95th percentile of 1..100 (95.05; inf ignored), 3 digits
    assert interventions.get("precision").apply(adamw_cfg, CTX, None).cfg.train.precision == "fp32"
    eps = interventions.get("eps").apply(adamw_cfg, CTX, None)
    assert eps.cfg.optim.eps == pytest.approx(1e-5) and eps.group_scale == {"eps": 1000.0}  # AdamW's default 1e-8 x1000
    warmup = interventions.get("warmup").apply(adamw_cfg, CTX, None)
    assert warmup.params["warmup_steps"] == 30
    assert [warmup.lr_factor(s) for s in (20, 34, 49, 50, 79)] == pytest.approx([1 / 30, 0.5, 1.0, 1.0, 1.0])
    assert interventions.get("skip-batch").apply(adamw_cfg, CTX, None).skip_steps == frozenset({30})
    seed = interventions.get("seed").apply(adamw_cfg, CTX, None)
    assert seed.cfg.seed == adamw_cfg.seed + 1 and seed.reseed == adamw_cfg.seed + 1


def test_interventions_that_mean_nothing_for_a_run_say_why(sgd_cfg):
    assert interventions.get("eps").apply(sgd_cfg, CTX, None).not_applicable == "SGD has no eps"
    assert "already trains in fp32" in interventions.get("precision").apply(sgd_cfg, CTX, None).not_applicable
    assert "already clips at 0.5" in interventions.get("clip").apply(sgd_cfg, CTX, None).not_applicable
    healthy = ArmContext(failing_step=None, start_step=0, end_step=10)
    assert "never failed" in interventions.get("skip-batch").apply(sgd_cfg, healthy, None).not_applicable


def test_parse_arms():
    assert [spec.name for spec in ablate_mod.parse_arms("lr, clip,lr,lr=x0.1")] == ["lr", "clip"]  # lr is lr=x0.1
    # the default arms: not skip-rows (it needs its rows) nor zero-grad (only for a loop that carries its gradients)
    assert [spec.name for spec in ablate_mod.parse_arms(None)] == [name for name in interventions.names()
                                                                   if name not in ("skip-rows", "zero-grad")]
    assert [spec.name for spec in ablate_mod.parse_arms("lr[D]=x0.5,lr[G]")] == ["lr[D]=x0.5", "lr[G]"]
    assert [spec.name for spec in ablate_mod.parse_arms("skip-rows=8+3")] == ["skip-rows=3+8"]
    with pytest.raises(ReplayError, match=r"'8,' must be row numbers|'x' must be row numbers"):
        ablate_mod.parse_arms("skip-rows=x")
    with pytest.raises(ReplayError, match="unknown arm 'fp8'; valid arms: lr, clip"):
        ablate_mod.parse_arms("lr,fp8")


def outcome(first=None, mean=1.0, what="loss"):
    arm = ablate_mod.ArmOutcome(name="x", change="")
    arm.first_nonfinite_step, arm.nonfinite_what, arm.final_loss_mean = first, (what if first is not None else None), mean
    return arm


@pytest.mark.parametrize(
    "first, mean, verdict",
    [(None, 1.0, "fixes"), (None, 9.0, "delays"), (35, 1.0, "delays"), (30, 1.0, "no-effect"), (22, 1.0, "worse")],
)
def test_verdicts_against_a_baseline_that_failed_at_30(first, mean, verdict):
    arm = outcome(first, mean)
    ablate_mod.judge_arm(arm, failing_step=30, baseline_failed=True, threshold=8.0, end=80)
    assert arm.verdict == verdict, arm.reason


def test_the_baseline_must_fail_at_the_recorded_step():
    ok, why = ablate_mod.judge_baseline(outcome(30), 30, 8.0, 80)
    assert ok and why is None
    ok, why = ablate_mod.judge_baseline(outcome(None), 30, 8.0, 80)
    assert not ok and "stayed finite through step 79" in why
    ok, why = ablate_mod.judge_baseline(outcome(33), 30, 8.0, 80)
    assert not ok and "failed at step 33, not at the recorded step 30" in why


def test_divergence_onset_finds_the_start_of_the_climb():
    healthy = {s: 2.0 + 0.1 * (s % 3) for s in range(40)}
    assert ablate_mod.divergence_onset(healthy, 40) is None  # NaN out of the blue: no climb
    climbing = dict(healthy)
    climbing.update({s: 2.0 * 3 ** (s - 29) for s in range(30, 40)})  # 2, 6, 18, ... from step 30
    assert ablate_mod.divergence_onset(climbing, 40) == 31  # the first loss above 4x the median before it
    spike_then_calm = dict(healthy)
    spike_then_calm[10] = 100.0
    assert ablate_mod.divergence_onset(spike_then_calm, 40) is None  # one spike is not a climb


def test_conclusion_reads_the_seed_arm_as_a_noise_test():
    arms = []
    for name, verdict, first in [("lr", "fixes", None), ("seed", "worse", 28), ("warmup", "delays", 40)]:
        arm = outcome(first)
        arm.name, arm.verdict = name, verdict
        arms.append(arm)
    text = ablate_mod.conclusion_text(arms, 30, None)
    assert text == "fixed by: lr; another seed fails too at step 28: the failure is systematic, not noise; delayed by: warmup"
    assert ablate_mod.conclusion_text(arms, 30, "the baseline replay stayed finite").startswith("inconclusive: ")


# ---- arms with values ------------------------------------------------------------------------------------------
def test_arms_take_values(adamw_cfg, sgd_cfg):
    specs = {spec.name: spec for spec in ablate_mod.parse_arms("lr=x0.3,clip=265,precision=fp32,eps=x100,warmup=5,seed=7,skip-batch=25")}
    assert list(specs) == ["lr=x0.3", "clip=265", "precision=fp32", "eps=x100", "warmup=5", "seed=7", "skip-batch=25"]
    change = lambda name, cfg=adamw_cfg: interventions.get(specs[name].intervention).apply(cfg, CTX, specs[name].value)  # noqa: E731
    lr = change("lr=x0.3")
    assert lr.cfg.optim.lr == pytest.approx(0.003) and lr.lr_factor(40) == pytest.approx(0.3) and lr.summary == "optim.lr 0.01 -> 0.003"
    assert change("clip=265").cfg.train.clip_grad_norm == 265.0
    assert change("precision=fp32").cfg.train.precision == "fp32"
    assert change("eps=x100").cfg.optim.eps == pytest.approx(1e-6)
    assert change("warmup=5").lr_factor(22) == pytest.approx(3 / 5)
    assert change("seed=7").reseed == 7
    assert change("skip-batch=25").skip_steps == frozenset({25})
    assert "already clips at 0.5 <= 265" in change("clip=265", sgd_cfg).not_applicable
    # a bare name is its default value: its label says which
    assert [spec.label for spec in ablate_mod.parse_arms("lr,clip,precision,eps")] == ["lr=x0.1", "clip=1", "precision=fp32", "eps=x1000"]


@pytest.mark.parametrize("arms, message", [
    ("lr=abc", "arm 'lr=abc': 'abc' is not a factor; give a factor such as x0.3"),
    ("lr=x0", "the factor must be positive"),
    ("clip=-1", "arm 'clip=-1': '-1' must be a positive number"),
    ("clip=inf", "'inf' is not a finite number"),
    ("precision=fp8", "'fp8' is not a precision; use one of fp32, bf16, fp16"),
    ("warmup=0", "must be a positive number of steps"),
    ("bogus=3", "unknown arm 'bogus'"),
])
def test_bad_values_are_one_line(arms, message):
    with pytest.raises(ReplayError, match=message.replace("(", r"\(")):
        ablate_mod.parse_arms(arms)


# ---- the sweep's bisection ---------------------------------------------------------------------------------------
def _sweep_until_done(search, first_failing: float, workers: int) -> None:
    """Play the search against a run that is stable for every value below `first_failing`."""
    while values := search.next_values(workers):
        assert len(values) <= workers
        search.rounds.append(values)
        for value in values:
            search.tested[value] = ablate_mod.ArmOutcome(name=str(value), change="", verdict="fixes" if value < first_failing else "delays")


@pytest.mark.parametrize("workers, max_rounds", [(1, 5), (3, 3)])
def test_the_lr_sweep_brackets_the_boundary_in_log2_rounds(workers, max_rounds):
    from replaybisect.verbs.ablate import sweep

    search = sweep._Search("lr", *sweep.LR_FACTOR_RANGE, risky_known_to_fail=True)
    _sweep_until_done(search, 0.137, workers)
    low, high = search.bracket()
    assert low < 0.137 <= high and high / low <= sweep.PRECISION
    # ~log2(log(1000) / log(1.25)) = 5 rounds with one worker, log4(...) = 3 with three
    assert len(search.rounds) <= max_rounds, search.rounds


def test_a_sweep_with_no_stable_value_ends_on_the_safe_end_it_ran():
    from replaybisect.verbs.ablate import sweep

    search = sweep._Search("clip", 0.5, 500.0, risky_known_to_fail=False)
    _sweep_until_done(search, 0.1, 2)
    assert search.rounds[-1] == [0.5] and search.bracket() == (None, 0.5)  # "even clip=0.5 fails" is an arm that ran


def test_a_sweep_stable_up_to_the_risky_end_runs_it():
    from replaybisect.verbs.ablate import sweep

    search = sweep._Search("clip", 0.5, 500.0, risky_known_to_fail=False)
    _sweep_until_done(search, 1e9, 1)
    assert search.rounds[-1] == [500.0] and search.bracket() == (500.0, None)


def test_skip_rows_bare_or_on_a_run_that_never_failed_is_not_applicable():
    cfg = None  # the arm reads no config
    apply = interventions.get("skip-rows").apply
    bare = apply(cfg, interventions.ArmContext(failing_step=7, start_step=6, end_step=20), None)
    assert bare.not_applicable.startswith("name the rows to drop: skip-rows=3+17")
    healthy = apply(cfg, interventions.ArmContext(failing_step=None, start_step=6, end_step=20), (3,))
    assert healthy.not_applicable == "the run never failed: there is no failing batch to drop rows from"
    outside = apply(cfg, interventions.ArmContext(failing_step=30, start_step=6, end_step=20), (3,))
    assert outside.not_applicable == "step 30 is outside the replay (6..19)"
    dropped = apply(cfg, interventions.ArmContext(failing_step=7, start_step=6, end_step=20), (3, 17))
    assert dropped.skip_rows == (7, (3, 17)) and dropped.summary == "rows 3+17 of step 7's batch dropped"


def test_zero_grad_applies_only_to_a_loop_that_carried_its_gradients():
    cfg = OmegaConf.create({"train": {"loop": "user"}})
    context = dict(failing_step=9, start_step=5, end_step=20)
    zero_grad = interventions.get("zero-grad")
    assert "cleared its gradients before every step's backward" in zero_grad.apply(cfg, interventions.ArmContext(**context), None).not_applicable
    change = zero_grad.apply(cfg, interventions.ArmContext(**context, carried_gradients=True), None)
    assert change.not_applicable is None and change.clear_grads
