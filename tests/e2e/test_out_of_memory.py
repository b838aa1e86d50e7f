"""A step that runs out of memory is a failure like the others: recorded with the cap it ran under, and `replay
memory` replays it to say where the memory went (by kind, by module, the tensors and their line) and a batch size
that fits, proven by running the step at that size under the same cap, where the recorded batch runs out again.
tests/user_loop/oom_loop.py trains an MLP under an address-space cap (RLIMIT_AS) and feeds its step 6 a batch 2,048
times larger than the others."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import TESTS, Workspace


@pytest.fixture(scope="module")
def ran_out(tmp_path_factory) -> tuple[Workspace, str, subprocess.CompletedProcess]:
    workspace = Workspace(tmp_path_factory.mktemp("oom"))
    shutil.copy(TESTS / "user_loop" / "oom_loop.py", workspace.path)
    done = subprocess.run([sys.executable, "oom_loop.py"], cwd=workspace.path, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    return workspace, re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1), done


def test_the_step_that_ran_out_of_memory_is_the_failing_step_with_its_cap(ran_out):
    workspace, run_id, done = ran_out
    assert done.returncode == 1 and done.stdout.count("loss") == 6  # steps 0..5 trained
    assert f"step 6 ran out of memory (RuntimeError); run {run_id} ended as crashed (FAILED)" in done.stderr
    assert f"replay it with: replay memory --run-id {run_id}" in done.stderr
    tags = workspace.store().tags(run_id)
    assert tags["failing_step"] == "6" and tags["failure_kind"] == "out_of_memory"
    assert int(tags["memory_limit"]) > int(tags["memory_at_failure"]) > 0
    assert int(tags["failed_allocation"]) == 16384 * 1024 * 4  # the first wide activation of the big batch


def test_replay_memory_names_the_module_and_a_batch_size_proven_to_fit_under_the_cap(ran_out):
    workspace, run_id, _ = ran_out
    result = workspace.replay("memory", "--run-id", run_id, "--json")
    assert result.returncode == 0, result.stderr
    failed = result.json()["out_of_memory"]
    assert failed["step"] == 6 and failed["rows"] == 16384
    assert failed["at_peak"]["activations"] > 3 * 64 * 2**20  # three ReLU outputs of 64 MiB, and more
    assert failed["modules"][0][0].endswith("(ReLU)") and failed["modules"][0][1] == 64 * 2**20
    assert all(tensor["line"].startswith("oom_loop.py:") for tensor in failed["tensors"])
    assert 0 < failed["per_sample"] < 64 * 2**10
    assert failed["reproduced"] is True and failed["proven"] is True  # the recorded batch fails under the cap, this one runs
    assert 8 <= failed["fits"] < 16384 and failed["fits"] * failed["per_sample"] < failed["headroom"]
    assert f"train with batch size {failed['fits']}" in failed["suggestion"]
    printed = workspace.store().read_artifact_text(result.json()["report_run_id"], "memory.md")  # as printed, in the child run
    assert "step 6 ran out of memory at batch size 16384" in printed and "step 6 (16384 samples) ran out of memory under a cap" in printed
    assert f"step 6 at batch size {failed['fits']} ran under the same cap" in printed


def test_nan_and_diagnose_send_the_out_of_memory_step_to_replay_memory(ran_out):
    workspace, run_id, _ = ran_out
    nan = workspace.replay("nan", "--run-id", run_id, "--json", "--no-child-run")
    assert nan.returncode == 0, nan.stderr
    report = nan.json()
    assert report["category"] == "out-of-memory" and report["failing_step"] == 6  # not "transient": no cap holds it here
    assert report["suggestion"].startswith(f"replay memory --run-id {run_id}")
    diagnosis = workspace.answer_here("diagnose", run_id)  # `replay diagnose --json` (it reads the curves), in this process
    [crash] = [finding for finding in diagnosis["findings"] if finding["pattern"] == "exception"]
    assert "step 6 ran out of memory" in crash["summary"] and crash["next"] == f"replay memory --run-id {run_id}"
