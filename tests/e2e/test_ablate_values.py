"""`replay ablate` arms with values, the suggested clip threshold proven by an arm that ran, `--sweep lr|clip`, and
run names that carry the answer in MLflow's default runs view. One recorded LR explosion (a warmup to an lr too
high, examples/ablate_lr_explosion) is shared by the module; the arms replay short horizons one after another (--workers 1)."""

from __future__ import annotations

import math

import pytest

from tests import helpers
from tests.helpers import Workspace, assert_one_line_error

HORIZON = "8"


@pytest.fixture(scope="module")
def exploded(tmp_path_factory):
    ws = Workspace(tmp_path_factory.mktemp("lr_values"))
    run = helpers.train_example(ws.store(), "ablate_lr_explosion", "train.steps=60")
    assert run.status == "nonfinite", run
    return ws, run


def ablate_json(ws: Workspace, run_id: str, arms: str | None = None, sweep: str | None = None) -> dict:
    """`replay ablate ARMS|--sweep S --run-id RUN_ID --horizon HORIZON --workers 1 --json` computed in this process
    (the command's request, engine and report; the clip sweep's printed answer and the refusals run the command)."""
    return ws.answer_here("ablate", run_id, publish=True, arms=arms.split(",") if arms else None, sweep=sweep,
                          horizon=int(HORIZON), workers=1)


def by_name(data: dict) -> dict[str, dict]:
    return {arm["name"]: arm for arm in data["arms"]}


def test_arms_run_at_their_values_and_the_suggested_clip_is_an_arm_that_ran(exploded):
    ws, run = exploded
    data = ablate_json(ws, run.run_id, "lr=x0.3,lr,clip,precision=fp32")
    assert data["baseline"]["verdict"] == "fails-again" and data["baseline"]["reproduced"] == "exact"
    arms = by_name(data)
    assert arms["lr=x0.3"]["change"] == "optim.lr 0.6 -> 0.18" and arms["lr=x0.3"]["value"] == 0.3
    assert arms["lr"]["label"] == "lr=x0.1" and arms["lr"]["change"] == "optim.lr 0.6 -> 0.06"
    assert arms["clip"]["label"] == "clip=1" and arms["precision=fp32"]["change"] == "train.precision bf16 -> fp32"
    # the threshold the report suggests ran as an arm of its own, and is printed with that arm's verdict
    suggested = [arm for arm in data["arms"] if arm.get("suggested")]
    assert len(suggested) == 1, data["arms"]
    clip = suggested[0]
    assert clip["name"] == f"clip={data['suggested_clip']:.4g}" and clip["run_id"] and clip["steps_run"] > 0
    assert clip["change"] == f"train.clip_grad_norm off -> {data['suggested_clip']:.4g}"
    assert data["suggested_clip_verdict"] == clip["verdict"] in ("fixes", "delays", "no-effect", "worse")
    assert f"run as arm {clip['name']}: {clip['verdict']}" in data["conclusion"]
    fixed = [arm["label"] for arm in data["arms"] if arm["verdict"] == "fixes"]
    assert {"lr=x0.1", "clip=1"} <= set(fixed) and data["conclusion"].startswith(f"fixed by: {', '.join(fixed)}")
    assert data["replays"] == 1 + len(data["arms"])

    # MLflow's runs view always shows the run name (not the Description) and cuts it at 190 px: ~16 characters for
    # the ablation (nested once), ~11 for an arm (twice). The verdict's mark and the arm come first
    store = ws.store()
    ablation = store.get_run(data["report_run_id"])
    assert ablation.info.run_name.startswith(f"✓ {', '.join(fixed)} · ablate @ step {run.first_nonfinite_step} (lr=x0.3, lr, ")
    names = {child.data.params["arm"]: child.info.run_name for child in store.child_runs(data["report_run_id"], "ablation-arm")}
    assert names["lr"] == f"✓ lr=x0.1: fixes · ablate @ step {run.first_nonfinite_step}"
    assert names["baseline"].startswith("✗ baseline: fails-again · ")
    mark = {"fixes": "✓", "delays": "~"}.get(clip["verdict"], "✗")
    assert names[clip["name"]].startswith(f"{mark} {clip['name']}: {clip['verdict']} · ")


def test_sweep_lr_finds_the_largest_factor_that_fixes_it_with_the_arms_that_prove_it(exploded):
    ws, run = exploded
    data = ablate_json(ws, run.run_id, sweep="lr")
    sweep = data["sweep"]
    arms = by_name(data)
    stable, failing = sweep["stable_max"], sweep["fails_min"]
    assert stable is not None and failing is not None and stable < failing <= 1.0
    assert failing / stable <= sweep["precision"] == 1.25
    # both ends of the answer are arms that ran: the stable one fixes, the next one up does not
    assert arms[sweep["stable_arm"]]["verdict"] == "fixes" and arms[sweep["stable_arm"]]["value"] == stable
    if sweep["fails_arm"] != "baseline":
        assert arms[sweep["fails_arm"]]["verdict"] != "fixes" and arms[sweep["fails_arm"]]["value"] == failing
    assert all(arm["verdict"] == "fixes" for arm in data["arms"] if arm["value"] <= stable)
    # bisection in log: one round for the safe end, then about log2(log(1000) / log(1.25)) = 5
    rounds = math.ceil(math.log2(math.log(1000) / math.log(1.25))) + 1
    assert len(sweep["rounds"]) <= rounds and all(len(names) == 1 for names in sweep["rounds"])
    # the cost, in replays and seconds, in the JSON and the answer
    assert sweep["replays"] == data["replays"] == 1 + len(data["arms"]) and sweep["seconds"] > 0
    assert data["conclusion"].startswith(f"the largest lr factor that fixes it: x{stable:.4g} ({sweep['stable_arm']} fixes")
    assert f"{sweep['replays']} replays" in data["conclusion"]
    # each arm is a child run of the sweep's run; the stable one is linked
    store = ws.store()
    children = {child.data.params["arm"]: child for child in store.child_runs(data["report_run_id"], "ablation-arm")}
    assert set(children) == {"baseline", *arms}
    assert children[sweep["stable_arm"]].info.run_id == sweep["stable_run_id"]
    name = store.get_run(data["report_run_id"]).info.run_name
    assert name == f"✓ lr <= x{stable:.4g} · ablate @ step {run.first_nonfinite_step} (sweep lr, {len(data['arms'])} arms)"


def test_sweep_clip_prints_the_stable_range_and_its_cost(exploded):
    ws, run = exploded
    result = ws.replay("ablate", "--sweep", "clip", "--run-id", run.run_id, "--horizon", HORIZON, "--workers", "1",
                       env=ws.env(COLUMNS="400"))
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "the largest clip threshold that fixes it: " in text, text
    assert "sweep clip over " in text and "round 1: clip=" in text
    assert " replays (baseline + " in text and "s of replays" in text


# ---- bad input: one line, exit 2, before any run is read -----------------------------------------------------------
@pytest.mark.parametrize("args, fragments", [
    (["lr=abc"], ["arm 'lr=abc'", "give a factor such as x0.3"]),
    (["clip=-1"], ["arm 'clip=-1'", "must be a positive number"]),
    (["lr,fp8=1"], ["unknown arm 'fp8'", "valid arms: lr, clip"]),
    (["skip-batch=soon"], ["must be a step number"]),
    (["--sweep", "precision"], ["--sweep 'precision' cannot be swept", "lr or clip", "or try precision as an arm"]),
    (["lr", "--sweep", "lr"], ["--sweep lr runs its own arms"]),
])
def test_bad_arms_and_sweeps_are_one_line(workspace, args, fragments):
    assert_one_line_error(workspace.replay("ablate", *args, "--run-id", "0123"), *fragments)
    assert not (workspace.path / "mlflow.db").exists()


def test_a_sweep_of_what_is_no_arm_suggests_no_arm():
    """`--sweep bogus`: the one line says what --sweep takes, and suggests running it as an arm only for a real arm."""
    from replaybisect.errors import ReplayError
    from replaybisect.verbs.ablate.request import DEFAULT_HORIZON, check_options

    with pytest.raises(ReplayError) as refused:
        check_options(None, horizon=DEFAULT_HORIZON, workers=None, executor="local", from_step=None, sweep="bogus")
    assert str(refused.value) == "--sweep 'bogus' cannot be swept; --sweep takes lr or clip (a number to search)"

