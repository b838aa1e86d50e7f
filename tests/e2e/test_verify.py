"""`replay verify`: recorded steps replayed from their snapshots and compared bit for bit with the logged losses and
gradient norms, proven on each verdict with the fault injector (core/faults.py: one bit flipped at a chosen step,
while recording, or whenever a given device label is active):
- no fault: exact;
- a loss bit flipped while recording: transient at that step, only that step differs, two replays here agree;
- a gradient bit flipped while recording: transient at that step, the steps after it differ until the next snapshot;
- a fault of one device (label gpuA, flipped whenever it runs): exact on gpuA, `device` on gpuB."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import Workspace, in_folder

STEPS = ("train.steps=20", "snapshot.every=5")
FAULT, LABEL = "REPLAYBISECT_INJECT_FAULT", "REPLAYBISECT_DEVICE_LABEL"


def _recorded(workspace: Workspace, monkeypatch, **env: str) -> str:
    """A run trained in this process (as `replay train` trains it) with the fault and the label of `env`."""
    with monkeypatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return workspace.train_here(*STEPS)["run_id"]


def _verified(workspace: Workspace, monkeypatch, run_id: str, steps=None, **env: str):
    import replaybisect as rb

    with monkeypatch.context() as patch, in_folder(workspace.path):
        for name, value in env.items():
            patch.setenv(name, value)
        return rb.verify(run_id, steps=steps, tracking_uri=workspace.tracking_uri, publish=False)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("verify"))


@pytest.fixture(scope="module")
def clean(workspace) -> str:
    with pytest.MonkeyPatch.context() as patch:
        return _recorded(workspace, patch)


def test_a_run_without_a_fault_is_exact_and_the_verdict_is_on_the_run(workspace, clean):
    result = workspace.replay("verify", "--run-id", clean, "--json")  # the command, as a user runs it
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert (report["verdict"], report["steps_compared"], report["differences"]) == ("exact", 20, [])
    assert [segment["snapshot"] for segment in report["segments"]] == [0, 5, 10, 15]
    assert workspace.store().tags(clean)["verify"] == "exact"


def test_a_loss_bit_flipped_while_recording_is_transient_at_that_step_only(workspace, monkeypatch):
    run_id = _recorded(workspace, monkeypatch, **{FAULT: "step=7,what=loss,bit=20"})
    report = _verified(workspace, monkeypatch, run_id, "5:12")
    assert (report.verdict, report.second_replay) == ("transient", "same")
    assert [(d.step, d.metric) for d in report.differences] == [(7, "loss")]
    assert "only that step differs" in report.sentence and [s["snapshot"] for s in report.segments] == [5, 10]


def test_a_gradient_bit_flipped_while_recording_is_transient_and_the_state_goes_on_from_it(workspace, monkeypatch):
    run_id = _recorded(workspace, monkeypatch, **{FAULT: "step=7,what=grad,bit=28"})
    report = _verified(workspace, monkeypatch, run_id, "5:15")
    first = report.differences[0]
    assert (report.verdict, first.step, first.metric) == ("transient", 7, "grad_norm")
    # the run went on from the corrupted update: later steps differ, until snapshot 10 (which holds that state)
    assert {d.step for d in report.differences} == {7, 8, 9}


def test_a_fault_of_one_device_is_exact_there_and_a_device_difference_elsewhere(workspace, monkeypatch):
    fault = {FAULT: "step=7,what=loss,bit=20,device=gpuA"}
    run_id = _recorded(workspace, monkeypatch, **fault, **{LABEL: "gpuA"})
    there = _verified(workspace, monkeypatch, run_id, "5:10", **fault, **{LABEL: "gpuA"})
    elsewhere = _verified(workspace, monkeypatch, run_id, "5:10", **fault, **{LABEL: "gpuB"})
    assert there.verdict == "exact" and (there.recorded_on, there.replayed_on) == ("gpuA", "gpuA")
    assert elsewhere.verdict == "device" and "gpuA" in elsewhere.sentence and "gpuB" in elsewhere.sentence


@pytest.mark.parametrize("steps, said", [("7", "is not a range of steps"), ("500:600", "holds no step run")])
def test_bad_steps_are_one_line(workspace, clean, monkeypatch, steps, said):
    import replaybisect as rb

    with pytest.raises(rb.ReplayError, match=said):
        _verified(workspace, monkeypatch, clean, steps)


def test_a_snapshot_that_does_not_verify_leaves_its_interval_uncompared_and_says_so(workspace, monkeypatch):
    """A corrupt snapshot (a flipped byte: its hash no longer matches) is not replayed from; the other intervals are
    compared, and the report says which steps were not."""
    run_id = _recorded(workspace, monkeypatch)
    tensors = workspace.store().local_artifact_dir(run_id) / "snapshots" / "step-000010" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    report = _verified(workspace, monkeypatch, run_id)
    assert report.verdict == "exact" and report.steps_compared == 15
    assert [segment["differences"] for segment in report.segments] == [0, 0, None, 0]
    assert any("steps 10..14 not compared" in warning for warning in report.warnings), report.warnings
    import replaybisect as rb

    with pytest.raises(rb.ReplayError, match="no snapshot covering steps 12..13 verifies"):  # only that interval
        _verified(workspace, monkeypatch, run_id, "12:14")


def _cross_checked(workspace: Workspace, monkeypatch, run_id: str, cluster: str = "local", **env: str):
    """Verified on this machine, a difference replayed again by a submitit job (its local executor: another process
    here, which does not inherit this machine's label, so its own is the host's)."""
    import replaybisect as rb

    with monkeypatch.context() as patch, in_folder(workspace.path):
        for name, value in env.items():
            patch.setenv(name, value)
        return rb.verify(run_id, steps="5:10", tracking_uri=workspace.tracking_uri, publish=False, cross_check=True,
                         submitit={"cluster": cluster, "executor_folder": str(workspace.path / "jobs")})


def test_a_device_that_computes_a_step_wrong_is_named_when_another_machine_reproduces_the_recording(workspace, monkeypatch):
    fault = {FAULT: "step=7,what=loss,bit=20,device=gpuA"}  # gpuA's fault; the run was recorded on a good gpuB
    run_id = _recorded(workspace, monkeypatch, **fault, **{LABEL: "gpuB"})
    report = _cross_checked(workspace, monkeypatch, run_id, **fault, **{LABEL: "gpuA"})
    assert report.verdict == "hardware" and report.elsewhere["verdict"] == "exact"
    assert report.elsewhere["label"] not in ("gpuA", "gpuB") and "this machine (gpuA)" in report.sentence


def test_a_cross_check_whose_job_dies_keeps_this_machines_replays_and_says_why(workspace, monkeypatch, tmp_path):
    """The other machine's job ends before it answers (here its Python dies at start, as on a lost node): the verdict
    is the one this machine's replays give, and a warning names the job and its last line."""
    fault = {FAULT: "step=7,what=loss,bit=20,device=gpuA"}
    run_id = _recorded(workspace, monkeypatch, **fault, **{LABEL: "gpuB"})
    lost = tmp_path / "lost-node"
    lost.mkdir()
    (lost / "sitecustomize.py").write_text(f"import os, sys\nif '{LABEL}' not in os.environ:\n    sys.exit('node lost')\n")
    report = _cross_checked(workspace, monkeypatch, run_id, **fault, **{LABEL: "gpuA"}, PYTHONPATH=str(lost))
    assert (report.verdict, report.elsewhere, report.steps_compared, report.second_replay) == ("device", None, 5, "same")
    assert any("cross-check's job" in warning and "node lost" in warning and "this machine's replays alone" in warning
               for warning in report.warnings), report.warnings


def test_a_cross_check_whose_job_cannot_be_submitted_keeps_this_machines_replays_and_says_why(workspace, monkeypatch, tmp_path):
    """SLURM named where there is no sbatch (as on a login node whose PATH lacks it): one warning line, the verdict
    from this machine's replays."""
    fault = {FAULT: "step=7,what=loss,bit=20,device=gpuA"}
    run_id = _recorded(workspace, monkeypatch, **fault, **{LABEL: "gpuB"})
    no_slurm = tmp_path / "bin"
    no_slurm.mkdir()
    (no_slurm / "python").symlink_to(sys.executable)
    report = _cross_checked(workspace, monkeypatch, run_id, cluster="slurm", **fault, **{LABEL: "gpuA"},
                            PATH=f"{no_slurm}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert (report.verdict, report.elsewhere, report.steps_compared) == ("device", None, 5)
    (warning,) = [warning for warning in report.warnings if "cross-check's job" in warning]
    assert warning.startswith("the cross-check's job could not be submitted: ") and "\n" not in warning, warning
    assert "this machine's replays alone" in warning


def test_a_recording_that_two_other_machines_agree_against_is_the_recorders(workspace, monkeypatch):
    fault = {FAULT: "step=7,what=loss,bit=20,device=gpuA"}  # recorded on the faulty gpuA, verified on gpuB and a job
    run_id = _recorded(workspace, monkeypatch, **fault, **{LABEL: "gpuA"})
    report = _cross_checked(workspace, monkeypatch, run_id, **fault, **{LABEL: "gpuB"})
    assert report.verdict == "recorder" and report.elsewhere["verdict"] == "device"
    assert report.elsewhere["first"]["step"] == 7 and "(gpuA) computed it differently" in report.sentence
