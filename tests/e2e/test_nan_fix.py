"""An op-level fault of a known pattern: `replay nan` proposes the change and the command that proves it, and that
command, run on the user's fixed copy of the file, proves it (`replay ablate --patch`: fixed by your patch)."""

from __future__ import annotations

import shlex
import shutil

from tests import helpers
from tests.helpers import EXAMPLES, Workspace

OVERFLOWING = "weights = torch.exp(x / self.temperature)  # the bug: no x.max() subtracted first"
MAX_SUBTRACTED = "scaled = x / self.temperature\n        weights = torch.exp(scaled - scaled.max(-1, keepdim=True).values)"


def test_the_proposed_fix_is_proven_by_the_proposed_command(tmp_path):
    from replaybisect.core.trust import Trust
    from replaybisect.verbs.nan.engine import find_nan

    ws = Workspace(tmp_path)
    project = tmp_path / "nan_forward"
    shutil.copytree(EXAMPLES / "nan_forward", project)
    run = helpers.train_example(ws.store(), "nan_forward", "model.decay=0.3", "snapshot.every=2", "snapshot.layer_stats_every=0")
    assert run.status == "nonfinite"
    report = find_nan(ws.store(), run.run_id, trust=Trust.from_user([EXAMPLES]))
    assert (report.category, report.op) == ("forward", "torch.exp")
    assert "subtract the max before exp" in report.fix["change"]
    assert report.fix["prove"] == f"replay ablate --patch fixed/planted_forward.py --run-id {run.run_id}"
    assert report.headline.endswith("made a non-finite value from finite inputs at planted_forward.py:24")
    assert "prove the fix on this failure" in report.suggestion

    fixed = tmp_path / "fixed" / "planted_forward.py"  # the user's copy, changed as proposed
    fixed.parent.mkdir()
    source = (EXAMPLES / "nan_forward" / "planted_forward.py").read_text()
    assert OVERFLOWING in source
    fixed.write_text(source.replace(OVERFLOWING, MAX_SUBTRACTED))
    result = ws.replay(*shlex.split(report.fix["prove"])[1:], "--horizon", "5", "--json")
    assert result.returncode == 0, result.stderr
    data = result.json()
    assert data["conclusion"].startswith("fixed by your patch"), data["conclusion"]
