"""A policy-gradient loop recorded as written (tests/user_loop/reinforce_script.py, pytorch/examples' REINFORCE): a
step is an episode, with one training call of the policy per environment step and as many calls as the episode
lasts, and the loss meets the discounted returns, made outside the model from the rewards."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from tests.helpers import TESTS, Workspace

SCRIPT = TESTS / "user_loop" / "reinforce_script.py"


def test_a_nan_reward_is_found_in_the_returns_and_a_repeat_of_another_length_is_said(tmp_path):
    """Episode 9's reward is NaN: the run stops at step 8. `replay verify` replays the episodes before it exact from the
    run's first snapshot (each as long as recorded: the environment is seeded by the episode number); step 8 replayed
    from its own snapshot runs in the script's first iteration, another episode: verdict `loop`, not a fault of the
    machine. `replay nan` finds the NaN in the returns the
    loss met, named in a headline of a few fields. Its probes repeat the step in later iterations of the script's
    loop, whose episodes are other lengths: the report says so, instead of asking for a bug report."""
    workspace = Workspace(tmp_path)
    shutil.copy(SCRIPT, tmp_path / "reinforce.py")
    done = subprocess.run([sys.executable, "reinforce.py", "--bad-reward-at", "9"], cwd=tmp_path, env=workspace.env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "NonFiniteStep: loss is nan at step 8" in done.stderr, done.stderr[-2000:]
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)

    verified = workspace.replay("verify", "--run-id", run_id, "--steps", "0:8", "--no-child-run")
    assert verified.returncode == 0 and f"run {run_id}: exact" in verified.stdout, verified.stdout + verified.stderr[-2000:]
    # step 8 replayed from its own snapshot (the state before it) runs in the script's first iteration: another episode
    looped = workspace.replay("verify", "--run-id", run_id, "--no-child-run", "--json")
    answer = looped.json()
    assert (answer["verdict"], answer["differences"][0]["step"]) == ("loop", 8), looped.stdout + looped.stderr[-2000:]
    assert answer["calls_differ"]["8"][1] > answer["calls_differ"]["8"][0] > 0

    found = workspace.replay("nan", "--run-id", run_id, "--json", "--no-child-run")
    assert found.returncode == 0, found.stderr[-2000:]
    report = found.json()
    assert (report["category"], report["reproduced"], report["failing_step"]) == ("data", "exact", 8)
    targets = [finding["field"] for finding in report["batch"]]
    assert len(targets) > 10 and all(re.fullmatch(r"micro-batch \d+: loss target \d+", field) for field in targets)
    assert report["headline"].endswith(f"{targets[2]} and {len(targets) - 3} more)"), report["headline"]
    [warning] = report["warnings"]
    assert re.match(r"a repeat of step 8 made \d+ training calls of the model where the recording made "
                    rf"{len(targets)}: the script's loop decides them", warning), warning
