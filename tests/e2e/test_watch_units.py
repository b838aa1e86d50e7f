"""`replay watch` without a server: bad input, the claim format, failure reasons, the notification shape, and the
child limits (memory, time), signals, who triage runs as and where, and a trickling webhook, on a real SQLite store
with the installed command."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import EXAMPLES, REPLAY, ROOT, assert_one_line_error, sign_as_recorder, train_example
from watch_servers import ALLOW_ROOT
from replaybisect.core.jobs import JobSettings
from replaybisect.errors import ReplayError
from replaybisect.verbs.watch.engine import (
    Claim, Event, TriageResult, Watcher, WatchOptions, outage,
)
from replaybisect.verbs.watch.steps import failure_reason
from replaybisect.verbs.watch.answer import ablate_args, conclude, step_lines
from replaybisect.verbs.watch.report import EventLog, markdown, notification, post_json



@pytest.mark.parametrize("args, fragment", [
    (["--interval", "0"], "--interval"),
    (["--lease", "4", "--settle", "3"], "--settle"),
    (["--workers", "0"], "--workers"),
    (["--memory-mb", "100"], "--memory-mb"),
    (["--notify-url", "ftp://hooks.example/x"], "--notify-url"),
    (["--interval", "inf"], "--interval"),
    (["--notify-url", "http://[::1"], "--notify-url"),
    (["--executor", "submitit", "--gpus", "-1"], "--gpus"),
    (["--executor", "submitit", "--slurm", "qoz=high"], "--slurm 'qoz' is not a SLURM parameter"),
    (["--executor", "slurm"], "--executor 'slurm' is not one of local, submitit"),
])
def test_bad_options_are_one_line_and_exit_2(workspace, args, fragment):
    assert_one_line_error(workspace.replay("watch", "--once", *args), fragment)
    assert not (workspace.path / "mlflow.db").exists()


BAD_OPTIONS = [  # (WatchOptions fields, environment, what the one line names): each failed every run it touched, or crashed
    ({"code_dirs": ["/nonexistent"]}, {}, "--code-dir"),
    ({}, {"REPLAYBISECT_CODE_DIR": "/nonexistent"}, "REPLAYBISECT_CODE_DIR"),
    ({"trust_prefixes": ["1bad"]}, {}, "--trust"),
    ({}, {"REPLAYBISECT_TRUST": "1bad"}, "REPLAYBISECT_TRUST"),
    ({"memory_mb": 99999999999999999999}, {}, "--memory-mb"),
    ({"interval": float("inf")}, {}, "--interval"),
    ({"time_limit": float("inf")}, {}, "--time-limit"),
    ({"lease": float("inf")}, {}, "--lease"),
    ({"grace": 1e300}, {}, "--grace"),
    ({"notify_timeout": float("inf")}, {}, "--notify-timeout"),
    ({"notify_url": "http://"}, {}, "--notify-url"),
    ({"notify_url": "http://[::1"}, {}, "--notify-url"),
    ({"notify_url": "http://exa mple.com/x"}, {}, "--notify-url"),
    ({"notify_url": "https://hooks.example:99999/x"}, {}, "--notify-url"),
    ({"ui_url": "http://"}, {}, "--ui-url"),
    ({"executor": "submitit", "jobs": JobSettings(cluster="moon")}, {}, "--cluster"),
]


@pytest.mark.parametrize("fields, environment, fragment", BAD_OPTIONS)
def test_a_watchers_own_bad_options_are_refused_at_start(monkeypatch, fields, environment, fragment):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ReplayError, match=fragment.replace("$", r"\$")) as refused:
        WatchOptions(tracking_uri="sqlite:///unused.db", **fields).check()
    assert "\n" not in str(refused.value)


def test_no_store_and_an_unreachable_server_are_bad_input(workspace):
    env = workspace.env()
    env.pop("MLFLOW_TRACKING_URI")
    assert_one_line_error(workspace.replay("watch", "--once", *ALLOW_ROOT, env=env), "no tracking store")
    assert not (workspace.path / "mlflow.db").exists()
    assert_one_line_error(workspace.replay("watch", "--once", *ALLOW_ROOT, "--tracking-uri", "http://127.0.0.1:9"), "unreachable")


def test_an_outage_is_told_from_a_missing_run_by_the_servers_answer(workspace, monkeypatch):
    """Real errors: a server that does not answer is an outage (waited out); a run the store says does not exist is not."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(Exception) as down:
        MlflowClient("http://127.0.0.1:9").get_run("0" * 32)
    assert outage(down.value)
    with pytest.raises(ReplayError) as missing:
        workspace.store().get_run("0" * 32)
    assert not outage(missing.value)


def test_a_lease_that_lapsed_in_an_outage_is_left_to_its_watcher():
    """Another watcher's lapsed claim is taken over only after a lease without an outage (its watcher may be alive
    and renew it as soon as the server answers); a released claim is free at once."""
    watcher = Watcher(None, WatchOptions(tracking_uri="sqlite:///unused.db", lease=60), on_event=lambda event: None)
    now = time.time()
    lapsed = {"replaybisect.triage": "running", "replaybisect.triage.claim": Claim("other-1", now - 5).render()}
    released = {"replaybisect.triage": "running", "replaybisect.triage.claim": Claim("other-1", 0.0).render()}
    assert watcher.claims.claimable(lapsed, now) and watcher.claims.claimable(released, now)
    watcher.claims.outage_seen = now - 10
    assert not watcher.claims.claimable(lapsed, now) and watcher.claims.claimable(released, now)
    assert watcher.claims.claimable(lapsed, now + 60)


def test_claim_round_trip_and_expiry():
    claim = Claim("host-12-abc123", time.time() + 60)
    parsed = Claim.parse(claim.render())
    assert parsed.watcher_id == "host-12-abc123" and parsed.live()
    assert not Claim.parse(Claim("w until x", 0.0).render()).live()  # a watcher id may contain the separator
    assert Claim.parse("garbage") is None and Claim.parse(None) is None and Claim.parse("w until soon") is None


def test_failure_reasons_are_one_line():
    assert failure_reason(-9, "", 8192) == "killed by SIGKILL"
    assert failure_reason(1, "Traceback...\nMemoryError\n", 2048) == "ran out of memory (limit 2048 MiB, --memory-mb)"
    assert failure_reason(2, "store: x\nreplay: error: no snapshot before step 3; record with snapshot.every\n", 0) == \
        "exit 2: no snapshot before step 3; record with snapshot.every"
    assert failure_reason(1, "", 0) == "exit 1: no output"


NAN_FORWARD = {  # replay nan --json on examples/nan_forward (the fields a triage reads, and a long history it must not print)
    "run_id": "R", "failing_step": 20, "snapshot_step": 15, "reproduced": "exact", "category": "forward", "phase": "forward",
    "module": "gate", "op": "torch.exp", "source": "/p/nan_forward/planted_forward.py:24 in forward: weights = torch.exp(x)",
    "evidence": ["replayed 5 step(s) 15..19 from the snapshot of step 15: losses exact",
                 "the batch is finite; parameters, buffers and optimizer state before the step are finite",
                 "forward: gate (NaiveSoftmaxGate) is the first module whose output is non-finite while its inputs were finite",
                 "  input input[0]: float32[32, 32] range [-0.932, 1.1]",
                 "the first op to make a non-finite value its inputs do not explain: torch.exp in gate"],
    "suggestion": "replay ablate lr,clip --run-id R   # lr / clip: smaller updates keep activations in range longer",
    "ablate_command": "replay ablate lr,clip --run-id R", "arms": ["lr", "clip"], "replay_run_id": "N1",
    "fix": {"op": "torch.exp", "change": "subtract the max before exp", "prove": "replay ablate --patch fixed/planted_forward.py --run-id R"},
    "loss_history": [[step, 2.3 - step / 100] for step in range(400)], "layer_grad_norms": {f"l{i}": 0.1 for i in range(50)},
}


def _arm(name: str, change: str, verdict: str, **extra) -> dict:
    return {"name": name, "change": change, "verdict": verdict, "first_nonfinite_step": None if verdict == "fixes" else 20,
            "final_loss": 0.53, "steps_run": 10, "run_id": f"arm-{name}", **extra}


def _ablation(*arms: dict, conclusion: str = "fixed by: lr") -> dict:
    return {"run_id": "R", "failing_step": 20, "start_step": 15, "end_step": 25, "status": "conclusive", "conclusion": conclusion,
            "baseline": _arm("baseline", "none", "fails-again"), "arms": list(arms), "report_run_id": "A1"}


def _lines(*results: tuple[str, dict]) -> dict:
    lines = {}
    for step, result in results:
        lines.update(step_lines(step, result))
    return lines


TRAINED = {"replaybisect.config_dir": "/p/nan_forward", "replaybisect.overrides": '["train.steps=30", "optim.lr=3e-3"]'}


def test_the_next_command_is_the_proven_fix_as_a_replay_train_override():
    lr_fixes = _ablation(_arm("precision", "train.precision is already fp32", "not-applicable"),
                         _arm("lr", "optim.lr 0.003 -> 0.0003", "fixes"), _arm("clip", "train.clip_grad_norm off -> 1", "fixes"))
    lines = _lines(("nan", NAN_FORWARD), ("ablate", lr_fixes))
    concluded = conclude("nonfinite", "R", lines, "train nan_forward", TRAINED, ["nan", "ablate"])
    assert concluded.verdict == "forward"
    assert concluded.summary == "forward in gate (torch.exp) at step 20; ablate: fixed by: lr"
    # the run's own config folder and overrides, its lr replaced by the proven one
    assert concluded.next_command == "replay train --config-dir /p/nan_forward train.steps=30 optim.lr=0.0003"
    assert concluded.fix == "lr: optim.lr 0.003 -> 0.0003 (finite over steps 15..24, final loss 0.53; without it the replay goes non-finite at step 20)"
    assert concluded.headline == "lr fixes · triage: forward in gate (torch.exp) at step 20"  # the triage run's name
    # a value the ablation suggested and proved (its clip threshold) is preferred over the first fixing arm
    suggested = _arm("clip=0.489", "train.clip_grad_norm off -> 0.489", "fixes", label="clip=0.489", suggested="95th percentile")
    lines = _lines(("nan", NAN_FORWARD), ("ablate", _ablation(*lr_fixes["arms"], suggested)))
    assert conclude("nonfinite", "R", lines, "x", TRAINED, ["nan", "ablate"]).next_command.endswith(" train.clip_grad_norm=0.489")
    # a run recorded before `replay train` tagged its arguments: its name and code folder say the config folder
    older = {"replaybisect.code_dir": "/p/nan_forward"}
    lines = _lines(("nan", NAN_FORWARD), ("ablate", lr_fixes))
    assert conclude("nonfinite", "R", lines, "train nan_forward", older, ["nan", "ablate"]).next_command == \
        "replay train --config-dir /p/nan_forward optim.lr=0.0003"
    assert conclude("nonfinite", "R", lines, "train mlp/digits", {"replaybisect.code_dir": "/home/me"}, ["nan", "ablate"]).next_command == \
        "replay train optim.lr=0.0003"
    # your own loop (or Lightning): the change to make in your code, proven
    # a key the run's config lacks (a class default, such as AdamW's eps) is added: ++key=value
    eps_fixes = _lines(("nan", NAN_FORWARD), ("ablate", _ablation(_arm("eps", "optim.eps 1e-08 -> 1e-05", "fixes"))))
    assert conclude("nonfinite", "R", eps_fixes, "x", TRAINED, ["nan", "ablate"], {"optim.lr": "0.003"}).next_command == \
        "replay train --config-dir /p/nan_forward train.steps=30 optim.lr=3e-3 ++optim.eps=1e-05"
    assert conclude("nonfinite", "R", lines, "x", TRAINED, ["nan", "ablate"], {"optim.lr": "0.003"}).next_command.endswith(" optim.lr=0.0003")
    own = conclude("nonfinite", "R", lines, "train gpt_loop (own loop)", {"replaybisect.loop": "user"}, ["nan", "ablate"])
    assert own.next_command == "in your training code: optim.lr 0.003 -> 0.0003 (the ablation's lr arm trains past the failure)"
    # a bad batch: dropping it is how the ablation proves the cause, not the fix to make
    dropped = _lines(("nan", NAN_FORWARD), ("ablate", _ablation(_arm("skip-batch", "batch of step 25 dropped", "fixes"))))
    for tags in ({"replaybisect.loop": "user"}, TRAINED):
        assert conclude("nonfinite", "R", dropped, "x", tags, ["nan", "ablate"]).next_command == (
            "fix the data: the batch of step 25 is what fails (the ablation's skip-batch arm, which drops it, trains past "
            "the failure); inspect that batch and your data pipeline")
    rows = _lines(("nan", NAN_FORWARD), ("ablate", _ablation(_arm("skip-rows=8", "row 8 of step 25's batch dropped", "fixes"))))
    assert conclude("nonfinite", "R", rows, "x", {"replaybisect.loop": "user"}, ["nan", "ablate"]).next_command == (
        "fix the data: the row 8 of step 25's batch is what fails (the ablation's skip-rows=8 arm, which drops it, trains "
        "past the failure); inspect those rows and your data pipeline")
    clipped = _lines(("nan", NAN_FORWARD), ("ablate", _ablation(_arm("clip", "clip the gradient norm at 1 before each update", "fixes", label="clip=1"))))
    lightning = {"replaybisect.loop": "user", "replaybisect.trainer": "lightning"}
    assert conclude("nonfinite", "R", clipped, "train lit", lightning, ["nan", "ablate"]).next_command == \
        "pass gradient_clip_val=1 to your Trainer (the ablation's clip=1 arm trains past the failure)"
    transformers = {"replaybisect.loop": "user", "replaybisect.trainer": "transformers"}
    assert conclude("nonfinite", "R", clipped, "train gpt2", transformers, ["nan", "ablate"]).next_command == \
        "set max_grad_norm=1 in your TrainingArguments (the ablation's clip=1 arm trains past the failure)"
    scaled = _lines(("nan", NAN_FORWARD), ("ablate", _ablation(_arm("lr", "scale the learning rate by 0.1", "fixes", label="lr=x0.1"))))
    assert conclude("nonfinite", "R", scaled, "train gpt2", transformers, ["nan", "ablate"]).next_command == \
        "multiply learning_rate in your TrainingArguments by 0.1 (the ablation's lr=x0.1 arm trains past the failure)"


NAN_DIVERGENCE = {  # replay nan --json on examples/ablate_lr_explosion (its newer shape: a headline, category divergence)
    "run_id": "R", "failing_step": 57, "snapshot_step": 50, "reproduced": "exact", "category": "divergence", "phase": "loss",
    "module": "net.2", "op": None, "source": None,
    "headline": "divergence at step 57: grad norm x3.8e+16 over 43 steps; the climb began in net.2 (Linear) (learning rate, clipping or init, not an op)",
    "evidence": ["replayed 7 step(s) 50..56 from the snapshot of step 50: losses exact; step 57 uses the stored batch",
                 "divergence: grad norm x3.8e+16 over 43 steps (step 11: 16.9 -> step 54: 6.42e+17), an exponential climb that ended in the overflow",
                 "per-layer norms exist from step 50 on: net.2's grad norm climbed first and most (x1.1e+03 by step 56)",
                 "the weights grew with it: weight norm of net.2 x9.4e+02 over 6 steps",
                 "the batch is finite; parameters, buffers and optimizer state before the step are finite",
                 "  loss input input[0]: bfloat16[32, 1] range [-1.02e+19, 1.02e+19]",
                 "where the runaway values first overflowed: loss (MSELoss): a symptom of the divergence; no op is at fault"],
    "suggestion": "replay ablate lr,clip --run-id R   # lr / clip: a divergence is stopped by smaller or bounded updates",
    "ablate_command": "replay ablate lr,clip --run-id R", "arms": ["lr", "clip"], "replay_run_id": "N2",
}


def test_a_divergence_concludes_in_nans_words_with_the_proven_lr():
    ablation = _ablation(_arm("lr", "optim.lr 0.6 -> 0.06", "fixes", label="lr=x0.1"), _arm("clip", "train.clip_grad_norm off -> 1", "fixes", label="clip=1"),
                         _arm("precision=fp32", "train.precision bf16 -> fp32", "worse", label="precision=fp32"),
                         _arm("clip=47.9", "train.clip_grad_norm off -> 47.9", "delays", label="clip=47.9", suggested="95th percentile"),
                         conclusion="fixed by: lr=x0.1, clip=1; suggested clip 47.9 (95th percentile), run as arm clip=47.9: delays; made worse by: precision=fp32")
    trained = {"replaybisect.config_dir": "/p/ablate_lr_explosion", "replaybisect.overrides": "[]"}
    concluded = conclude("nonfinite", "R", _lines(("nan", NAN_DIVERGENCE), ("ablate", ablation)), "train ablate_lr_explosion", trained, ["nan", "ablate"])
    assert concluded.verdict == "divergence"
    assert concluded.summary == NAN_DIVERGENCE["headline"] + "; ablate: fixed by: lr=x0.1, clip=1"  # the rest is evidence
    assert concluded.next_command == "replay train --config-dir /p/ablate_lr_explosion optim.lr=0.06"
    assert concluded.headline == "lr=x0.1 fixes · triage: " + NAN_DIVERGENCE["headline"]
    assert concluded.evidence[1].startswith("divergence: grad norm x3.8e+16 over 43 steps")
    assert concluded.evidence[-2].startswith("where the runaway values first overflowed") and concluded.evidence[-1].startswith("ablate: fixed by")
    assert not any(line.startswith("  ") for line in concluded.evidence)


@pytest.mark.parametrize("failure, results, expected", [
    # no arm fixes: the op and line nan named, with its fix (it used to say `replay nan --run-id R`, a verb the triage had run)
    ("nonfinite", [("nan", NAN_FORWARD), ("ablate", _ablation(_arm("lr", "optim.lr 0.001 -> 0.0001", "no-effect"), conclusion="no single change fixes the failure"))],
     "change torch.exp in gate at /p/nan_forward/planted_forward.py:24 in forward: subtract the max before exp"),
    ("nonfinite", [("nan", NAN_FORWARD | {"fix": None}), ("ablate", _ablation(conclusion="no single change fixes the failure"))],
     "change torch.exp in gate at /p/nan_forward/planted_forward.py:24 in forward: it makes the first non-finite value"),
    # no op named, no fix: nan's `replay ablate` already ran; the checklist of the run's state has not
    ("nonfinite", [("nan", NAN_FORWARD | {"op": None, "module": None, "category": "divergence"}), ("ablate", _ablation(conclusion="no single change fixes the failure"))],
     "replay check --run-id R"),
    # a transient failure: nan's advice, which is no command
    ("nonfinite", [("nan", NAN_FORWARD | {"op": None, "category": "transient", "suggestion": "no code change needed: resume from the snapshot of step 15", "ablate_command": None}),
                   ("ablate", _ablation(conclusion="the run did not fail; no arm changed that"))],
     "no code change needed: resume from the snapshot of step 15"),
    ("failed", [("diagnose", {"verdict": "spikes", "findings": [{"summary": "3 spikes", "next": "replay diagnose --run-id R  # again"}], "report_run_id": "D1"})],
     "replay check --run-id R"),
    ("failed", [("diagnose", {"verdict": "plateau", "findings": [{"summary": "flat", "next": "replay check --run-id R --only lr"}]})],
     "replay check --run-id R --only lr"),
])
def test_the_next_command_is_never_a_verb_the_triage_ran(failure, results, expected):
    ran = [step for step, _ in results]
    concluded = conclude(failure, "R", _lines(*results), "train x", TRAINED, ran)
    assert concluded.next_command == expected
    assert concluded.headline.split(" · ")[0] in ("fix torch.exp", "divergence: no single fix", "transient: no single fix", "spikes", "plateau")
    assert concluded.next_command.split()[:2] not in (["replay", step] for step in ran)


def test_ablate_tries_the_arms_nan_suggests_and_the_standard_ones():
    assert ablate_args(_lines(("nan", NAN_FORWARD))) == ["lr,clip,precision"]
    optimizer = NAN_FORWARD | {"ablate_command": "replay ablate eps,lr=x0.3,clip --run-id R --from-step 3"}
    assert ablate_args(_lines(("nan", optimizer))) == ["eps,lr=x0.3,clip,precision", "--from-step", "3"]
    assert ablate_args({}) == ["lr,clip,precision"]  # nan gave no command (transient)


def test_triage_md_is_a_short_report_not_json():
    lines = _lines(("nan", NAN_FORWARD), ("ablate", _ablation(_arm("lr", "optim.lr 0.003 -> 0.0003", "fixes"))))
    concluded = conclude("nonfinite", "R", lines, "train nan_forward", TRAINED, ["nan", "ablate"])
    links = [{"step": "nan", "name": "nan @ step 20", "run_id": "N1", "url": "http://mlflow:5000/#/experiments/1/runs/N1", "path": "#/experiments/1/runs/N1"},
             {"step": "fix", "name": "ablate @ step 20 / lr", "run_id": "arm-lr", "url": None, "path": "#/experiments/1/runs/arm-lr"}]
    result = TriageResult(run_id="R", run_name="train nan_forward", experiment_id="1", failure="nonfinite", state="done",
                          verdict=concluded.verdict, summary=concluded.summary, next_command=concluded.next_command,
                          evidence=concluded.evidence, fix=concluded.fix, links=links, steps=["nan", "ablate"],
                          results={"nan": NAN_FORWARD, "ablate": _ablation()}, seconds=41.5, watcher_id="w-1")
    text = markdown(result)
    assert not re.search(r'^\s*[{\[]\s*$|^\s*"[^"]+": ', text, re.M) and "```" not in text and len(text.splitlines()) < 40, text
    assert f"**{concluded.summary}**" in text and f"`{concluded.next_command}`" in text and concluded.fix in text
    assert "- the first op to make a non-finite value its inputs do not explain: torch.exp in gate" in text
    assert "  input input[0]" not in text  # nan's indented detail stays in its own report
    assert "- replay nan: `nan @ step 20`, run N1, http://mlflow:5000/#/experiments/1/runs/N1" in text
    assert "- the fixing arm: `ablate @ step 20 / lr`, run arm-lr, MLflow UI #/experiments/1/runs/arm-lr" in text
    # no arm fixed it: the op's change is the next step, and the command that proves it is in the report
    lines = _lines(("nan", NAN_FORWARD), ("ablate", _ablation(conclusion="no single change fixes the failure")))
    concluded = conclude("nonfinite", "R", lines, "train nan_forward", TRAINED, ["nan", "ablate"])
    result.fix, result.to_prove = concluded.fix, concluded.to_prove
    assert "prove the change to the op on this failure with `replay ablate --patch fixed/planted_forward.py --run-id R`" in markdown(result)


def test_notification_is_webhook_shaped():
    result = TriageResult(run_id="abc", run_name="brave-owl", experiment_id="1", failure="nonfinite", state="done",
                          verdict="forward", summary="forward in gate at step 20", next_command="replay nan --run-id abc",
                          run_url="http://mlflow:5000/#/experiments/1/runs/abc")
    message = notification(result)
    assert json.loads(json.dumps(message)) == message
    assert message["text"].splitlines() == ["replay watch: nonfinite run brave-owl (abc): forward in gate at step 20",
                                            "next: `replay nan --run-id abc`", "http://mlflow:5000/#/experiments/1/runs/abc"]
    assert {message[key] for key in ("run_id", "verdict", "next_command", "run_url")} == \
        {"abc", "forward", "replay nan --run-id abc", "http://mlflow:5000/#/experiments/1/runs/abc"}


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_memory_and_time_limits_fail_the_triage_once_with_the_reason(workspace):
    store = workspace.store()
    run_id = train_example(store, "nan_optimizer", "train.steps=5").run_id
    low_memory = workspace.replay("watch", "--once", *ALLOW_ROOT, "--json", "--memory-mb", "1024", "--settle", "0.2")
    assert low_memory.returncode == 0, low_memory.stderr
    tags = store.tags(run_id)
    assert tags["triage"] == "failed" and tags["triage.reason"] == "nan: ran out of memory (limit 1024 MiB, --memory-mb)"

    other = _crashed_run(store)  # any step's child outlives 1 s (no training needed)
    slow = workspace.replay("watch", "--once", *ALLOW_ROOT, "--json", "--time-limit", "1", "--settle", "0.2")
    assert [e["run_id"] for e in _events(slow.stdout) if e["event"] == "failed"] == [other]  # the first is not retried
    assert store.tags(other)["triage.reason"] == "diagnose: stopped at the time limit (1 s)"


def test_sigusr1_logs_a_health_line_and_sigterm_stops_an_idle_watcher(workspace):
    workspace.store()  # an empty store: nothing to triage
    watcher = subprocess.Popen([REPLAY, "watch", *ALLOW_ROOT, "--json", "--interval", "60"], cwd=workspace.path, env=workspace.env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = json.loads(watcher.stdout.readline())
    assert first["event"] == "start"
    time.sleep(1)
    watcher.send_signal(signal.SIGUSR1)
    health = json.loads(watcher.stdout.readline())
    assert health["event"] == "health" and health["watcher_id"] == first["watcher_id"] and health["polls"] == 1
    watcher.send_signal(signal.SIGTERM)
    stdout, stderr = watcher.communicate(timeout=60)
    assert watcher.returncode == 143, stderr
    assert _events(stdout)[-1]["event"] == "stop"


def _crashed_run(store) -> str:
    """A crashed run's record: metrics only, which is all diagnose reads."""
    run_id = store.create_run("train")
    store.log_metrics(run_id, [("loss", 2.0 - step * 0.01, step) for step in range(30)])
    store.finish_run(run_id, "crashed", "FAILED")
    return run_id


def _watcher_diagnosing(workspace, *args: str) -> subprocess.Popen:
    """`replay watch --json ARGS`, returned once it has started diagnosing a run."""
    watcher = subprocess.Popen([REPLAY, "watch", *ALLOW_ROOT, "--json", "--settle", "0.2", *args], cwd=workspace.path,
                               env=workspace.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in watcher.stdout:
        if json.loads(line)["message"] == "diagnose started":
            break
    return watcher


class TricklingWebhook:
    """A webhook on 127.0.0.1 that reads the POST, then answers a header byte every `every` seconds for `lasting`
    seconds: no socket read ever waits long, so only a total deadline ends the request."""

    def __init__(self, every: float = 0.5, lasting: float = 60.0):
        self.received: list[bytes] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/hooks/triage"
        self.every, self.lasting = every, lasting
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            data = b""
            while b"\r\n\r\n" not in data:
                data += connection.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += connection.recv(65536)
            self.received.append(body)
            answer = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: yes\r\n" * 1000
            deadline = time.monotonic() + self.lasting
            for byte in answer:
                if self.closed.is_set() or time.monotonic() > deadline:
                    return
                try:
                    connection.sendall(bytes([byte]))
                except OSError:
                    return
                time.sleep(self.every)

    def close(self) -> None:
        self.closed.set()
        self.server.close()


def test_a_trickling_webhook_is_cut_at_its_deadline_and_never_holds_a_triage(capsys):
    hook = TricklingWebhook()
    try:
        started = time.monotonic()
        with pytest.raises(OSError, match="no answer within 1.5 s"):
            post_json(hook.url, {"text": "hello"}, 1.5)
        assert time.monotonic() - started < 4

        log = EventLog(as_json=True, notify_url=hook.url, notify_timeout=1.5)
        result = TriageResult(run_id="abc", run_name="", experiment_id="1", failure="failed", state="done", verdict="v",
                              summary="failed run: v", next_command="")
        started = time.monotonic()
        log(Event("done", result.summary, "abc", result=result))
        assert time.monotonic() - started < 0.5  # the triage thread that logged its result goes on at once
        log.close()
        assert time.monotonic() - started < 4
    finally:
        hook.close()
    events = _events(capsys.readouterr().out)
    assert [e["event"] for e in events] == ["done", "error"], events
    assert events[1]["message"] == "notification to " + hook.url.split("/")[2] + " failed: no answer within 1.5 s"
    assert len(hook.received) == 2 and json.loads(hook.received[1])["run_id"] == "abc"


def test_sigterm_lets_a_running_triage_finish_within_the_grace(workspace):
    """... and a webhook that trickles its answer holds neither the triage nor the exit (--notify-timeout)."""
    store = workspace.store()
    run_id = _crashed_run(store)
    hook = TricklingWebhook(lasting=110)  # closed at the end of the test: it costs no time
    try:
        watcher = _watcher_diagnosing(workspace, "--grace", "120", "--notify-url", hook.url, "--notify-timeout", "3")
        watcher.send_signal(signal.SIGTERM)
        stdout, stderr = watcher.communicate(timeout=120)
    finally:
        hook.close()
    assert watcher.returncode == 143, stderr
    events = _events(stdout)
    assert [e["event"] for e in events][-4:] == ["step", "done", "error", "stop"], events
    assert events[-2]["message"].endswith("no answer within 3 s") or "not sent" in events[-2]["message"]
    took = (_time(events[-1]) - _time(events[-3])).total_seconds()
    # the webhook answers for 110 s: an exit within half of that was cut by the 3 s deadline, not the answer's end
    # (under a loaded 2-core machine the exit took up to 23 s; the events' times say where, if it ever takes longer)
    timeline = [(e["event"], e["message"][:60], str(_time(e).time())) for e in events[-5:]]
    assert took < hook.lasting / 2, f"{took:.1f} s from the triage's end to the exit: {timeline}"
    assert store.tags(run_id)["triage"] == "done" and len(hook.received) == 1


@pytest.mark.parametrize("moment, after", [
    ("start", 1.0),  # the run claimed, the claim's re-read after --settle not made yet
    ("diagnose started", 0.0),  # the step's child starting: a fresh watcher's process server is still importing torch
])
def test_sigterm_at_any_moment_of_a_triage_exits_within_the_grace_and_the_notify_timeout(workspace, moment, after):
    """The promise: a SIGTERMed watcher exits within --grace + --notify-timeout + 1 s, its claim released. It waited
    for its triage threads (30 s, then without end) while one slept out --settle or waited for its child to start."""
    store = workspace.store()
    run_id = _crashed_run(store)
    grace, notify_timeout = 1, 1
    settle = "8" if moment == "start" else "0.2"  # long only where the SIGTERM is to find it sleeping out --settle
    watcher = subprocess.Popen([REPLAY, "watch", *ALLOW_ROOT, "--json", "--settle", settle, "--lease", "60", "--grace", str(grace),
                                "--notify-timeout", str(notify_timeout)], cwd=workspace.path, env=workspace.env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in watcher.stdout:
        if moment in (json.loads(line)["event"], json.loads(line)["message"]):
            break
    time.sleep(after)
    watcher.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    returncode = watcher.wait(timeout=60)
    took = time.monotonic() - signalled
    stdout, stderr = watcher.communicate(timeout=60)
    assert returncode == 143, stderr
    assert took < grace + notify_timeout + 1, f"exited {took:.1f} s after SIGTERM: {[e['message'][:60] for e in _events(stdout)]}"
    assert "released" in [e["event"] for e in _events(stdout)]
    tags = store.tags(run_id)
    assert Claim.parse(tags["triage.claim"]).expires == 0 and tags["triage.attempts"] == "0", tags


def _time(event: dict):
    import datetime

    return datetime.datetime.fromisoformat(event["time"])


def test_a_watcher_frozen_past_its_lease_loses_the_run_and_writes_nothing(workspace):
    store = workspace.store()
    run_id = _crashed_run(store)
    frozen = _watcher_diagnosing(workspace, "--lease", "2")
    frozen.send_signal(signal.SIGSTOP)  # a stalled VM or a long GC pause: the lease lapses
    try:
        time.sleep(2.5)
        other = workspace.replay("watch", "--once", *ALLOW_ROOT, "--json", "--settle", "0.2", "--lease", "2")
        assert [e["event"] for e in _events(other.stdout)].count("done") == 1, other.stdout
        summary = store.tags(run_id)["triage.summary"]
    finally:
        frozen.send_signal(signal.SIGCONT)
    # it wakes: its diagnose child's answer or its next lease renewal finds the claim taken (read until it says so,
    # at most 60 s: the timer ends a watcher that never does, and the assertion below names what it logged instead)
    woken = []
    stop = threading.Timer(60, frozen.send_signal, (signal.SIGTERM,))
    stop.start()
    try:
        for line in frozen.stdout:
            woken.append(json.loads(line)["event"])
            if woken[-1] == "lost":
                break
    finally:
        stop.cancel()
    frozen.send_signal(signal.SIGTERM)
    stdout, _ = frozen.communicate(timeout=60)
    woken += [e["event"] for e in _events(stdout)]
    assert "lost" in woken and "done" not in woken, woken
    assert store.tags(run_id)["triage.summary"] == summary and store.tags(run_id)["triage.attempts"] == "2"


# ---- who triage runs as, and where ----------------------------------------------------------------------
def _replace_config(workspace, run_id: str, config: dict) -> None:
    """What any user who can write runs can do: replace a run's config.yaml (MLflow has no write protection)."""
    from mlflow import MlflowClient

    folder = workspace.path / "upload"
    folder.mkdir(exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    MlflowClient(workspace.tracking_uri).log_artifact(run_id, str(folder / "config.yaml"))


@pytest.mark.parametrize("value", ["abc", "1e5", "-1", "9" * 40])
def test_a_malformed_attempts_tag_fails_the_triage_with_the_reason(workspace, value):
    """Anyone who writes runs can write the tag: a run whose count is no count is given up once, said on the run,
    never a `claim failed` at every poll."""
    store = workspace.store()
    run_id = _crashed_run(store)
    store.set_tags(run_id, {"triage.attempts": value})
    result = workspace.replay("watch", "--once", *ALLOW_ROOT, "--json", "--settle", "0.2")
    assert result.returncode == 0, result.stderr
    tags = store.tags(run_id)
    assert tags["triage"] == "failed" and "is not a count of claims" in tags["triage.reason"], tags
    assert not any(event["event"] == "error" for event in _events(result.stdout)), result.stdout


def test_a_refused_start_touches_no_run(workspace):
    """A hostile run waits (its config.yaml replaced: a torch function that runs a shell command). A watcher whose own
    options are bad (they used to fail every run they touched, for good), or one started as root without
    --allow-root, says so in one line, exit 2: nothing run, the run untouched."""
    store = workspace.store()
    run_id = _crashed_run(store)
    marker = workspace.path / "MARKER"
    _replace_config(workspace, run_id, {"model": {"_target_": "torch.nn.Sequential", "_args_": [
        {"_target_": "torch.utils.collect_env.run", "_args_": [f"touch {marker}"]}]}})
    for args, fragment in ((["--code-dir", "/nonexistent"], "--code-dir"), (["--memory-mb", "99999999999999999999"], "--memory-mb")):
        assert_one_line_error(workspace.replay("watch", "--once", *ALLOW_ROOT, *args), fragment)
    if os.geteuid() == 0:
        assert_one_line_error(workspace.replay("watch", "--once"), "root", "--allow-root")
    assert not marker.exists()
    assert not any(key.startswith("triage") for key in store.tags(run_id))


EVIL_MODULE = """
import torch

open({marker!r}, "w").write("imported")


class Boom(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
"""


def test_triage_runs_in_a_scratch_folder_not_the_watchers(workspace):
    """A module lying in the folder the watcher was started in is not the user's code to a triage child: the child
    works in a fresh scratch folder, so a stored config naming it is refused and the module never imported."""
    from replaybisect.core import config as config_mod

    store = workspace.store()
    config = yaml.safe_load(config_mod.to_yaml(config_mod.compose(EXAMPLES / "nan_optimizer", "config", [])))
    config["model"] = {"_target_": "evilmod.Boom"}
    run_id = store.create_run("train")  # a non-finite run's record, as far as nan reads before the config
    store.set_tags(run_id, {"first_nonfinite_step": 3})
    store.finish_run(run_id, "nonfinite", "FAILED")
    _replace_config(workspace, run_id, config)
    sign_as_recorder(store, run_id)  # signed, so the triage runs: the scratch folder is the wall tested here
    marker = workspace.path / "MARKER"
    (workspace.path / "evilmod.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    # the examples are the only code folder (conftest's default also trusts every temporary folder, this one too)
    result = workspace.replay("watch", "--once", *ALLOW_ROOT, "--json", "--settle", "0.5",
                              env=workspace.env(REPLAYBISECT_CODE_DIR=str(EXAMPLES)))
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    tags = store.tags(run_id)
    assert tags["triage"] == "failed" and tags["triage.reason"].startswith("nan: exit 2: ") and "evilmod" in tags["triage.reason"], tags
    watcher_pid = _events(result.stdout)[0]["watcher_id"].split("-")[-2]
    assert not list(Path(tempfile.gettempdir()).glob(f"replay-triage-*-{watcher_pid}-*"))  # its scratch folder removed


def test_the_compose_file_runs_the_watcher_as_the_images_unprivileged_user():
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    watch = compose["services"]["watch"]
    assert watch.get("user") not in (None, "root", "0", 0) and not str(watch["user"]).startswith(("0:", "root:"))
    assert "--allow-root" not in watch["command"]
    user = str(watch["user"]).split(":")[0]
    assert "useradd" in (ROOT / "Dockerfile").read_text() and f" {user}" in (ROOT / "Dockerfile").read_text()


def test_a_job_folder_others_can_write_is_refused_the_watcher_loads_results_from_it(tmp_path):
    folder = tmp_path / "jobs"
    folder.mkdir()
    folder.chmod(0o777)
    options = WatchOptions(tracking_uri="sqlite:///x.db", executor="submitit", jobs=JobSettings(folder=str(folder)))
    with pytest.raises(ReplayError, match="is open to other users"):
        options.check()
    folder.chmod(0o700)
    options.check()


def test_a_job_is_followed_only_from_the_watchers_own_notes_and_only_inside_its_job_folder(tmp_path):
    """A stored run's tags never name a job to follow (anyone who writes runs could make the watcher load a pickle or
    signal a process); a note naming a folder outside the job folder, or an id that is no job's, is ignored."""
    from replaybisect.core import jobs

    settings = JobSettings(cluster="local", folder=str(tmp_path / "jobs"))
    notes = tmp_path / "jobs" / "running"
    notes.mkdir(parents=True)
    for name, reference in (("outside", f"local:{tmp_path / 'elsewhere' / '4242'}:4242"), ("everyone", f"local:{tmp_path / 'jobs' / '-1'}:-1"),
                            ("init", f"local:{tmp_path / 'jobs' / '1'}:1"), ("cluster", f"moon:{tmp_path / 'jobs' / '7'}:7")):
        (notes / name).write_text(reference)
        assert jobs.recall(settings, name) is None, name
    (notes / "ours").write_text(f"local:{tmp_path / 'jobs' / '4242'}:4242")
    assert jobs.recall(settings, "ours").job_id == "4242"
    assert jobs.recall(settings, "missing") is None
