"""`replay verify --cross-check`: a differing interval replayed once more on another machine, as a submitit job
(core/jobs.py: SLURM when sbatch exists, else submitit's local executor). The job runs `replay verify` on the same
steps with the same store and the same trust, and its JSON answer is read back. It does not inherit this machine's
device label ($REPLAYBISECT_DEVICE_LABEL names this machine): its own is its host's, or what its node sets."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from replaybisect.core.faults import LABEL_ENV
from replaybisect.core.jsonutil import from_jsonable
from replaybisect.core.trust import BUILTIN_PREFIXES, CODE_DIR_ENV, TRUST_ENV
from replaybisect.errors import ReplayError


def replayed_elsewhere(store, run_id: str, snapshot: int, end: int, trust, device, settings) -> dict:
    """{"label", "verdict", "first"} of the other machine's replay of steps snapshot..end-1."""
    from replaybisect.core import jobs

    argv = [sys.executable, "-m", "replaybisect", "verify", "--run-id", run_id, "--steps", f"{snapshot}:{end}", "--json",
            "--no-child-run", "--tracking-uri", store.uri]
    if device is not None:
        argv += ["--device", str(device)]
    env = {key: value for key, value in os.environ.items() if key != LABEL_ENV}
    if trust is not None:
        env[CODE_DIR_ENV] = os.pathsep.join(str(root) for root in trust.roots)
        env[TRUST_ENV] = ",".join(prefix for prefix in trust.prefixes if prefix not in BUILTIN_PREFIXES)
        argv += [item for run in trust.unsigned for item in ("--allow-unsigned", run)]
    try:
        job = jobs.submit_command(settings, f"replay-verify-{run_id[:8]}", argv, os.getcwd(), env)
    except Exception as error:  # noqa: BLE001 - sbatch refused it, the executor could not start: one line
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        raise ReplayError(f"the cross-check's job could not be submitted: {(lines[-1] if lines else type(error).__name__)[:300]}") from None
    status, stdout, stderr = job.communicate()
    answer = _json_answer(stdout)  # (a NaN comes as the text JSON spells it)
    if status != 0 or answer is None:
        why = (stderr.strip().splitlines() or [f"exit status {status}"])[-1]
        raise ReplayError(f"the cross-check's job {job.job_id} ({job.cluster}) gave no answer: {why[:300]}")
    return {"label": answer.get("replayed_on"), "verdict": answer.get("verdict"), "job": job.job_id,
            "first": (answer.get("differences") or [None])[0]}


def _json_answer(stdout: str) -> Optional[dict]:
    """The JSON object `replay verify --json` printed last (the replayed script may print before it)."""
    start = stdout.rfind("\n{\n") + 1 if not stdout.startswith("{") else 0
    try:
        return from_jsonable(json.loads(stdout[start:])) if stdout[start:].startswith("{") else None
    except json.JSONDecodeError:
        return None
