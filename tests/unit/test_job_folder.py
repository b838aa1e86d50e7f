"""submitit hands each job's result back through a pickle in the job folder, which the submitting process loads: a
folder other users can write is refused for every verb that submits jobs (ablate, bisect, verify --cross-check, watch),
before anything is submitted, and one that does not exist yet is made private to this user."""

from __future__ import annotations

import pytest

import replaybisect as rb
from replaybisect.core.jobs import JobSettings, private_folder
from replaybisect.errors import ReplayError

RUN = "0123456789abcdef"


@pytest.mark.parametrize("submit", [
    lambda folder: rb.verify(RUN, cross_check=True, submitit={"executor_folder": folder}),
    lambda folder: rb.ablate(RUN, ["lr"], executor="submitit", submitit={"executor_folder": folder}),
], ids=["verify-cross-check", "ablate"])
def test_a_job_folder_others_can_write_is_refused_before_anything_runs(tmp_path, submit):
    folder = tmp_path / "jobs"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(ReplayError, match="is open to other users"):
        submit(str(folder))


def test_a_new_job_folder_is_made_private():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as parent:
        made = private_folder(str(Path(parent) / "a" / "jobs"))
        assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
        assert JobSettings(folder=str(made)).checked("verify").folder == str(made)
