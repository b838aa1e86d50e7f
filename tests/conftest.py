"""Fixtures and hooks only (what tests share besides them is in helpers.py): a real SQLite MLflow store per test,
the suite's own trusted code folders and signing key, the modules' order, and tests/e2e/ marked `slow`."""

from __future__ import annotations

import os
import signal
from pathlib import Path

# A suite started in the background (`.ci/run &` from a script) inherits SIGINT ignored, and so would every `replay`
# it starts: the Ctrl-C tests need the signal delivered as a terminal would.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Tiny test models run fastest on one thread, and a 2-core CI machine runs several processes at once.
# Runs record their thread count and replays restore it, so this changes speed, not results.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from tests.helpers import EXAMPLES, Workspace

E2E = Path(__file__).resolve().parent / "e2e"


@pytest.fixture(scope="session", autouse=True)
def trusted_code_dirs(tmp_path_factory):
    """The examples and the tests' own temporary projects are this suite's own code: stored runs may build their
    `_target_`s from there (replaybisect/trust.py), as a user would say with --code-dir. test_trust.py unsets it."""
    from unittest import mock

    folders = os.pathsep.join([str(EXAMPLES), str(tmp_path_factory.getbasetemp())])
    with mock.patch.dict(os.environ, {"REPLAYBISECT_CODE_DIR": folders}):
        yield


@pytest.fixture(scope="session", autouse=True)
def signing_key_folder(tmp_path_factory):
    """The user's config folder, where the key that signs runs is made on first use (core/provenance.py): the suite's
    own, never the developer's."""
    from unittest import mock

    from replaybisect.core import provenance

    with mock.patch.dict(os.environ, {"XDG_CONFIG_HOME": str(tmp_path_factory.mktemp("config"))}):
        os.environ.pop("REPLAYBISECT_KEY", None)
        os.environ.pop("REPLAYBISECT_KEY_FILE", None)
        provenance.signing_key(create=True)  # as after the user's first recording (test_provenance: before it)
        yield


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    return Workspace(tmp_path)


# The longest modules first: pytest-xdist (`-n N --dist loadfile --no-loadscope-reorder`) hands modules out in
# collection order, and a long one handed out last runs alone at the end while the other workers sit idle (measured:
# the suite's last minutes). Without --no-loadscope-reorder xdist orders modules by their number of tests instead.
# The order: each module's summed test time on a 2-core machine, longest first.
LONGEST_FIRST = [
    "test_inline_loop.py", "test_distributed.py", "test_watch.py", "test_watch_units.py", "test_bisect_train.py",
    "test_provenance.py", "test_trust.py", "test_script_loop.py", "test_memory.py", "test_docs.py",
    "test_user_loop.py", "test_train.py", "test_healthy_scripts.py", "test_ablate.py", "test_bisect.py",
    "test_trust_static.py", "test_data_rows.py", "test_hf.py", "test_step_guard.py", "test_several.py",
    "test_zero_grad.py", "test_signals.py", "test_train_modes.py", "test_loop_ends.py", "test_watch_jobs.py",
    "test_out_of_memory.py", "test_cli_errors.py", "test_check.py", "test_diagnose.py", "test_snapshots.py",
    "test_divergence.py", "test_check_run_state.py", "test_zoo.py", "test_verify.py", "test_crash.py",
    "test_bad_input.py", "test_nan.py", "test_ablate_patch.py", "test_user_stdout.py", "test_store_safety.py",
    "test_markup.py", "test_lightning.py", "test_workers.py", "test_profile.py", "test_bisect_printing.py",
    "test_processes.py", "test_metrics_process.py", "test_store_location.py", "test_host_reads.py", "test_runs.py",
    "test_store_race.py", "test_ablate_values.py", "test_optim_factory.py", "test_disk_full.py", "test_snapshot_fuzz.py",
    "test_nan_fix.py", "test_snapshot_tampered.py", "test_refused_before_torch.py",
]


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by the marker added here
def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its own order
    for item in items:
        if E2E in item.path.parents:  # what drives the installed `replay`, scripts, torchrun or servers
            item.add_marker(pytest.mark.slow)
