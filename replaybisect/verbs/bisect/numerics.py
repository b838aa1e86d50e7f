"""What the first bad commit changed in the numbers: its first training step and its parent's, each run once more
with every op traced (core/op_trace.py), compared op by op (`replay bisect`'s `numerics`, and ops.html)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from replaybisect.verbs.bisect.runners import _last_line


def first_changed_op(bisector, good_sha: str, bad_sha: str) -> Optional[dict]:
    """The first op of the first training step whose outputs differ between the last good commit and the first
    bad one (each trained one step with seed 0, its ops traced: core/op_trace.py), or None when every op's
    outputs are the same; a trace that could not be made is said in `error`."""
    import json
    import tempfile

    from replaybisect.core import op_trace

    traces = {}
    with tempfile.TemporaryDirectory(prefix="replaybisect-numerics-") as folder:
        for sha in (good_sha, bad_sha):
            def job(worktree: Path, sha=sha):
                env = {**bisector.trial_env(worktree, sha, 0), op_trace.ENV: str(Path(folder) / f"{sha}.json")}
                store_uri = f"sqlite:///{Path(folder) / 'numerics.db'}"  # not the bisect's: no trial is recorded
                env["MLFLOW_TRACKING_URI"] = store_uri
                process = bisector.launcher.start(bisector.runner.one_step_command(worktree, store_uri), worktree, env)
                return process.communicate()
            returncode, _, stderr = bisector.with_worktree(job)
            trace = Path(folder) / f"{sha}.json"
            if not trace.is_file():
                return {"error": f"{sha[:10]}'s first step could not be traced (exit {returncode}: {_last_line(stderr)})"}
            traces[sha] = json.loads(trace.read_text(encoding="utf-8"))
    found = op_trace.first_difference(traces[good_sha], traces[bad_sha])
    if found is None:
        return None
    return {**found, "ops": [len(traces[good_sha]), len(traces[bad_sha])], "commits": [good_sha, bad_sha],
            "rows": op_trace.aligned(traces[good_sha], traces[bad_sha])}  # (ops.html: the two steps side by side)

