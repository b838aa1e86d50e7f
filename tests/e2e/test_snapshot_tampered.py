"""`replay nan` on a run whose snapshots were tampered with (re-signed, so every checksum verifies): it reports the
tampered snapshot and replays from an earlier one, then refuses in one line when none is usable. The generated
corruptions themselves, in this process: unit/test_snapshot_fuzz.py."""

from __future__ import annotations

import pytest

from replaybisect.core import snapshot as fmt
from tests import helpers
from tests.helpers import Workspace, assert_one_line_error, resign


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    """nan_backward failing at step 10, snapshots at 0, 4, 8 (and the emergency one at 10)."""
    workspace = Workspace(tmp_path_factory.mktemp("fuzz-cli"))
    result = helpers.train_example(workspace.store(), "nan_backward", "model.eps_steps=10", "train.steps=16",
                                    "snapshot.every=4")
    assert result.status == "nonfinite" and result.first_nonfinite_step == 10
    return workspace, result.run_id, workspace.store().local_artifact_dir(result.run_id) / fmt.SNAPSHOTS


def test_replay_nan_reports_a_tampered_snapshot_and_uses_an_earlier_one_then_fails_when_none_is_usable(failing_run):
    workspace, run_id, root = failing_run
    # a re-signed batches file whose header runs past its end: checksums pass, parsing does not
    batches = root / fmt.folder_name(8) / fmt.BATCHES
    batches.write_bytes((10**9).to_bytes(8, "little") + batches.read_bytes()[8:])
    resign(batches.parent, fmt.BATCHES)
    report = workspace.answer_here("find_nan", run_id)  # the refusal below through the CLI
    assert report["snapshot_step"] == 4 and report["reproduced"] == "exact"
    assert any("step-000008" in w and fmt.BATCHES in w for w in report["warnings"]), report["warnings"]

    for step in (0, 4, 10):
        state = root / fmt.folder_name(step) / fmt.STATE
        state.write_text(state.read_text().replace('"num_threads": ', '"num_threads": 1000'))
        resign(state.parent, fmt.STATE)
    none_usable = workspace.replay("nan", "--run-id", run_id, "--json", "--no-child-run")
    assert_one_line_error(none_usable, "verif", "num_threads")
