"""A tracking store is made whole or not at all, and reading never writes (issue 19, items 4 and 9).

Item 4: a `replay train` killed (SIGKILL, SIGTERM) or out of disk while it creates a new SQLite store leaves no
store or a whole one (MLflow's migrations run on a temp file beside it, renamed into place), and every later
command works; a store found half-made by an older version is rebuilt by a recording command when it holds
nothing, and explained in one line (never rebuilt) when it holds runs.
Item 9: reading never creates, migrates or locks a store: a file that is not a store is one line and left as it
was, refused reads leave the folder byte for byte as it was, the Python API's reading functions create no
`./mlflow.db`, and bad input to train, check and bisect is refused before any store or run exists.

Real SQLite stores, the installed `replay` (run several at once where they are independent: the suite's budget),
real signals and a real small file system. Creating a store costs seconds: the module makes one and copies it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import REPLAY, CliResult, Workspace, assert_one_line_error, outcome_lines

BASE = ("train.steps=2", "snapshot.every=0", "snapshot.layer_stats_every=0", "train.val_every=0")
TINY = (*BASE, "train.batch_size=8", "model.hidden=8")


def _uri(path: Path) -> str:
    return f"sqlite:///{path}"


def _folder(folder: Path) -> dict[str, tuple]:
    """Everything under `folder`, byte for byte: a refused read must leave exactly this."""
    state = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        state[str(path.relative_to(folder))] = (path.is_dir(), info.st_size, info.st_mtime_ns, digest)
    return state


def _start(workspace: Workspace, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([REPLAY, *args], cwd=workspace.path, env=env or workspace.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, timeout: float = 300) -> CliResult:
    stdout, stderr = process.communicate(timeout=timeout)
    return CliResult(process.returncode, stdout, stderr)


def _at_once(*commands: tuple[Workspace, tuple[str, ...]]) -> list[CliResult]:
    """Independent `replay` commands run side by side (each imports torch or MLflow: seconds)."""
    processes = [_start(workspace, *args) for workspace, args in commands]
    return [_finish(process) for process in processes]


def _schema(database: Path) -> tuple | None:
    """(the tables, the schema version) of a SQLite file; None when there is none. A whole store has those of
    `made.blank`. (Read-write, as any reader: SQLite rolls back the journal a writer killed mid-write left.)"""
    if not database.exists():
        return None
    connection = sqlite3.connect(f"{database.as_uri()}?mode=rw", uri=True, timeout=30)
    try:
        tables = sorted(row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
        version = connection.execute("SELECT version_num FROM alembic_version").fetchall() if "alembic_version" in tables else []
        return tables, version
    except sqlite3.Error as error:
        return [], [str(error)]
    finally:
        connection.close()


def _runs_in(database: Path) -> int:
    connection = sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)
    try:
        return connection.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    finally:
        connection.close()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """`blank`: a whole store with no runs (made by open_store, the code under test); `shared`: a workspace whose
    store (a copy of it) holds one tiny trained run, `run_id`. No lock file is left beside either, as with a store
    made by MLflow itself or copied: a read that locks would leave one.
    `started`: independent `replay` commands the tests below check, started here to run while the first tests
    wait on their signals (each costs seconds of imports); `before`: the folders they run in, as they were."""
    import replaybisect as rb
    from replaybisect.store import open_store

    blank = tmp_path_factory.mktemp("blank") / "mlflow.db"
    open_store(_uri(blank))
    shared = Workspace(tmp_path_factory.mktemp("shared"))
    shutil.copy(blank, shared.path / "mlflow.db")
    layer_stats = [override for override in TINY if not override.startswith("snapshot.layer_stats_every=")]
    run_id = rb.train([*layer_stats, "snapshot.layer_stats_every=1"], tracking_uri=shared.tracking_uri).run_id
    for lock in (blank.with_name("mlflow.db.lock"), shared.path / "mlflow.db.lock"):
        lock.unlink(missing_ok=True)
    empty = Workspace(tmp_path_factory.mktemp("empty"))
    before = {"shared": _folder(shared.path), "empty": _folder(empty.path)}
    started = {
        "runs": _start(shared, "runs"),
        "check": _start(shared, "check", "--run-id", run_id, "--only", "bogus"),
        "big-batch": _start(empty, "train", *BASE, "train.batch_size=100000"),
    }
    yield SimpleNamespace(blank=blank, shared=shared, run_id=run_id, empty=empty, before=before, started=started)
    for process in started.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


# ---- item 4: creating a store is all or nothing --------------------------------------------------------------
def _creating(folder: Path) -> list[str]:
    """The temp files a new store is being built in (`.mlflow.db.creating-PID-X`), else the store file itself
    (where it is created in place)."""
    names = os.listdir(folder)
    temps = [name for name in names if re.fullmatch(r"\.mlflow\.db\.creating-\d+-[0-9a-f]+", name)]
    return temps or (["mlflow.db"] if "mlflow.db" in names else [])


def _lock_holder(folder: Path) -> str | None:
    """The PID holding `mlflow.db.lock` (Linux /proc/locks): the process creating the store in place."""
    try:
        inode = (folder / "mlflow.db.lock").stat().st_ino
        locks = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in locks:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            return fields[4]
    return None


def _creator(folder: Path, processes: list[subprocess.Popen], seen: set[str]) -> tuple[subprocess.Popen | None, str]:
    """Wait until a creation begins that was not seen yet; (the process creating: the one whose PID its temp file
    names, else the one holding the creation lock, else the first still running; the file)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and any(process.poll() is None for process in processes):
        for name in sorted(set(_creating(folder)) - seen):
            seen.add(name)
            if name == "mlflow.db" and len(seen) > 1:
                continue  # a temp file renamed into place: that creation was seen
            pid = name.rpartition("creating-")[2].split("-")[0] if "creating-" in name else _lock_holder(folder)
            running = [process for process in processes if process.poll() is None]
            return next((p for p in running if str(p.pid) == pid), running[0] if running else None), name
        time.sleep(0.005)
    return None, ""


def _signal_creators(folder: Path, processes: list[subprocess.Popen], schedule: list[tuple[int, float]],
                     states: list) -> None:
    """For each (signal, delay): when the next creation begins, send the signal `delay` seconds later to the process
    creating; after each, note the store file's schema (None: no file) and the victim."""
    seen: set[str] = set()
    for signum, delay in schedule:
        victim, name = _creator(folder, processes, seen)
        if victim is None:
            break
        time.sleep(delay)
        if victim.poll() is None:
            victim.send_signal(signum)
            victim.wait(timeout=120)
        states.append((signum, delay, name, _schema(folder / "mlflow.db"), victim))


CREATE = "import sys\nfrom replaybisect.store import open_store\nopen_store(sys.argv[1])\n"  # what `replay train` calls


def test_a_train_killed_while_creating_the_store_leaves_none_or_a_whole_one(made, tmp_path):
    """`replay train` SIGKILLed 2.5 s into creating a new store while another waits to, one SIGTERMed at 0.3 s,
    and processes creating one killed at other moments of MLflow's migrations: never a half-made store; the
    trainer that waited records its run, and `replay runs` lists it."""
    import sys

    spaces = {name: Workspace(tmp_path / name) for name in ("kill", "term", "sweep")}
    for workspace in spaces.values():
        workspace.path.mkdir()
    trainers = [_start(spaces["kill"], "train", "--json", "--run-name", name, *TINY) for name in ("first", "second")]
    # long enough that a SIGTERM noticed late on a loaded machine still lands before the run ends (never after its
    # handler is gone at exit): 0.3 s after the creation begins it lands while creating, or else while training
    termed = _start(spaces["term"], "train", "--json", *TINY, "train.steps=2000")
    # no kept template for them (a copy of it is made in milliseconds, before a watcher sees it): MLflow's migrations
    no_template = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "no-template"))
    creators = [subprocess.Popen([sys.executable, "-c", CREATE, spaces["sweep"].tracking_uri], cwd=spaces["sweep"].path,
                                 env=no_template, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    states = {name: [] for name in spaces}
    plans = {"kill": (trainers, [(signal.SIGKILL, 2.5)]), "term": ([termed], [(signal.SIGTERM, 0.3)]),
             "sweep": (creators, [(signal.SIGKILL, 0.0), (signal.SIGKILL, 1.5)])}
    watchers = [threading.Thread(target=_signal_creators, args=(spaces[name].path, processes, schedule, states[name]))
                for name, (processes, schedule) in plans.items()]
    for watcher in watchers:
        watcher.start()
    for watcher in watchers:
        watcher.join(timeout=300)
    results = {process: _finish(process) for process in (*trainers, termed)}
    for creator in creators:
        creator.communicate(timeout=120)

    # after every kill: no store, or a whole one; never a half-made one
    whole = _schema(made.blank)
    assert [len(states[name]) for name in spaces] == [1, 1, 2], states
    for name in spaces:
        for signum, delay, created, schema, _ in states[name]:
            assert schema in (None, whole), (name, signum, delay, created, schema)
    # SIGTERM: one line, exit 143, nothing left behind (no store, no temp file, no lock) when it came while creating
    assert results[termed].returncode == 143, results[termed].stderr
    assert outcome_lines(results[termed].stderr) == ["replay: terminated (SIGTERM)"], results[termed].stderr
    if not (spaces["term"].path / "mlflow.db").exists():
        assert os.listdir(spaces["term"].path) == []

    # the trainer that waited while the creator was killed made the store (the killed one's temp file removed) and
    # recorded its run; `replay runs` lists it
    victim = states["kill"][0][4]
    (survivor,) = [trainer for trainer in trainers if trainer is not victim]
    assert results[survivor].returncode == 0, results[survivor].stderr
    assert not [name for name in os.listdir(spaces["kill"].path) if name.startswith(".mlflow.db.creating-")]
    listed = spaces["kill"].replay("runs", "--json")
    assert listed.returncode == 0, listed.stderr
    assert results[survivor].json()["run_id"] in [run["run_id"] for run in listed.json()["runs"]]
    assert spaces["kill"].store().get_run(results[survivor].json()["run_id"]).info.status == "FINISHED"


def _mount_small_fs(folder: Path, size: str) -> str | None:
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True)
    return None if done.returncode == 0 else done.stderr.strip() or "mount failed"


def test_a_full_disk_while_creating_the_store_leaves_nothing_and_a_grown_disk_works(tmp_path):
    """A new store needs ~0.9 MiB: on a 600 KiB file system its creation fails; grown, the next command works."""
    from replaybisect.errors import DiskFull
    from replaybisect.store import open_store

    disk = tmp_path / "disk"
    why_not = _mount_small_fs(disk, "600K")
    if why_not:
        pytest.skip(f"no small file system can be mounted here (needs root): {why_not}")
    try:
        with pytest.raises(DiskFull) as caught:
            open_store(_uri(disk / "mlflow.db"))
        message = str(caught.value)
        assert "\n" not in message and "no space left on device creating the tracking store" in message
        assert str(disk / "mlflow.db") in message and caught.value.exit_code == 1
        assert os.listdir(disk) == []  # no half-made store, no temp file, no lock
        subprocess.run(["mount", "-o", "remount,size=4M", str(disk)], check=True, capture_output=True)
        store = open_store(_uri(disk / "mlflow.db"))
        run_id = store.create_run("train")
        assert store.get_run(run_id).info.status == "RUNNING"
        assert sorted(os.listdir(disk)) == ["mlflow.db"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _half_made_by_an_older_version(database: Path) -> None:
    """What a killed creation of an older version left: MLflow's first tables made, the first migration's column
    added and its `_alembic_tmp_` copy begun, no schema version (MLflow runs that DDL outside transactions).
    Re-running MLflow's migrations on it fails: `duplicate column name: step`."""
    import sqlalchemy
    from mlflow.store.tracking.dbmodels.initial_models import Base as InitialBase

    engine = sqlalchemy.create_engine(_uri(database))
    InitialBase.metadata.create_all(engine)
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        connection.exec_driver_sql("ALTER TABLE metrics ADD COLUMN step BIGINT DEFAULT '0' NOT NULL")
        connection.exec_driver_sql("CREATE TABLE _alembic_tmp_metrics AS SELECT * FROM metrics")
    engine.dispose()


def test_a_half_made_store_holding_nothing_is_explained_to_readers_and_rebuilt_by_a_recording_command(made, tmp_path):
    from replaybisect.errors import StoreUnreachable
    from replaybisect.store import open_store

    workspace = Workspace(tmp_path / "half")
    workspace.path.mkdir()
    _half_made_by_an_older_version(workspace.path / "mlflow.db")
    empty = tmp_path / "zero" / "mlflow.db"  # a SIGTERM of an older version just as the file was made
    empty.parent.mkdir()
    empty.write_bytes(b"")
    before = _folder(tmp_path)

    listed = workspace.replay("runs")  # reading explains and changes nothing
    assert_one_line_error(listed, str(workspace.path / "mlflow.db"), "half-made", "holds no runs", "replay train")
    for database in (workspace.path / "mlflow.db", empty):
        with pytest.raises(StoreUnreachable, match="holds no runs; reading never changes it"):
            open_store(_uri(database), create=False)
    assert _folder(tmp_path) == before

    database = workspace.path / "mlflow.db"
    store = open_store(_uri(database))  # what `replay train` opens its store with: rebuilt, whole
    assert _schema(database) == _schema(made.blank) and empty.read_bytes() == b""
    run_id = store.create_run("train")
    store.log_metrics(run_id, [("loss", 1.0, 0)])
    assert store.metric_history(run_id, "loss") == [(0, 1.0)]
    assert sorted(os.listdir(workspace.path)) == ["mlflow.db"]  # no temp file, no lock


def test_a_half_made_store_holding_runs_is_explained_and_never_rebuilt(made, tmp_path):
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config, _get_latest_schema_revision

    import replaybisect as rb
    from replaybisect.errors import StoreUnreachable
    from replaybisect.store import open_store

    database = tmp_path / "mlflow.db"
    shutil.copy(made.shared.path / "mlflow.db", database)
    script = ScriptDirectory.from_config(_get_alembic_config(db_url=""))
    older = script.get_revision(_get_latest_schema_revision()).down_revision
    connection = sqlite3.connect(database)
    with connection:  # an upgrade of a store with a run, killed in its batch copy of `runs`
        connection.execute("UPDATE alembic_version SET version_num = ?", (older,))
        connection.execute("CREATE TABLE _alembic_tmp_runs AS SELECT * FROM runs")
    connection.close()
    before = _folder(tmp_path)
    for call in (lambda: rb.diagnose(made.run_id, tracking_uri=_uri(database)),  # reading
                 lambda: open_store(_uri(database))):  # what a recording command opens its store with
        with pytest.raises(StoreUnreachable) as caught:
            call()
        message = str(caught.value)
        assert "\n" not in message and str(database) in message and "half-made" in message
        assert "_alembic_tmp_runs" in message and "holds 1 run" in message and "leaves it as it was" in message
        assert _folder(tmp_path) == before  # never rebuilt, never migrated, no lock
    assert _runs_in(database) == 1


# ---- item 9: reading never writes ------------------------------------------------------------------------------
def test_reading_a_file_that_is_not_a_store_is_one_line_and_leaves_it_as_it_was(tmp_path):
    import replaybisect as rb
    from replaybisect.errors import StoreUnreachable
    from replaybisect.store import open_store

    workspace = Workspace(tmp_path)
    one_byte = tmp_path / "a_1_byte_file"
    one_byte.write_bytes(b"x")
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n" * 20)
    other = tmp_path / "other.sqlite"  # somebody else's SQLite database
    connection = sqlite3.connect(other)
    with connection:
        connection.execute("CREATE TABLE notes (body TEXT)")
        connection.execute("INSERT INTO notes VALUES ('keep me')")
    connection.close()
    before = _folder(tmp_path)

    listed = workspace.replay("runs", "--tracking-uri", _uri(one_byte))
    assert_one_line_error(listed, str(one_byte), "is not an MLflow store", "not a SQLite database", "left as it was")
    with pytest.raises(StoreUnreachable, match="is not an MLflow store"):  # a run looked up there: the same line
        rb.diagnose("abc", tracking_uri=_uri(one_byte))
    for path, what in ((one_byte, "not a SQLite database"), (text, "not a SQLite database"),
                       (other, "without MLflow's tables")):
        for create in (False, True):  # not even a recording command makes someone's file a store
            with pytest.raises(StoreUnreachable, match=what):
                open_store(_uri(path), create=create)
    assert _folder(tmp_path) == before


def test_refused_reads_leave_the_folder_exactly_as_it_was(made):
    """Commands and functions that open an existing store to read it, then refuse: no lock file, no journal, the
    database byte for byte the same (and a read that succeeds changes nothing either)."""
    import replaybisect as rb
    from replaybisect.errors import ReplayError

    workspace, run_id, before = made.shared, made.run_id, made.before["shared"]
    listed, checked = _finish(made.started["runs"]), _finish(made.started["check"])
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert_one_line_error(checked, "unknown check bogus")
    assert _folder(workspace.path) == before

    uri = workspace.tracking_uri
    refused = [
        (lambda: rb.find_nan(run_id, tracking_uri=uri), "never went non-finite"),
        (lambda: rb.ablate(run_id, ["lr"], tracking_uri=uri), "never failed"),
        (lambda: rb.check(run_id=run_id, only=["bogus"], tracking_uri=uri), "unknown check bogus"),
        (lambda: rb.find_nan("nope", tracking_uri=uri), "no run 'nope'"),
        (lambda: rb.diagnose("", tracking_uri=uri), "''"),
        (lambda: rb.check(run_id="nope", tracking_uri=uri), "no run 'nope'"),
    ]
    for call, fragment in refused:
        with pytest.raises(ReplayError, match=fragment):
            call()
        assert _folder(workspace.path) == before, fragment


def test_the_python_api_creates_no_store_to_read_or_for_bad_input(tmp_path, monkeypatch):
    """In a folder without a store (and no MLFLOW_TRACKING_URI), functions that read, and bad input to those that
    record, raise ReplayError and create no `./mlflow.db`."""
    import replaybisect as rb
    from replaybisect.errors import ReplayError

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    refused = [
        (lambda: rb.find_nan("nope"), "no run 'nope'"),
        (lambda: rb.ablate("nope", ["lr"]), "no run 'nope'"),
        (lambda: rb.diagnose(""), "''"),
        (lambda: rb.check(run_id="nope"), "no run 'nope'"),
        (lambda: rb.check(only=["bogus"]), "unknown check bogus"),
        (lambda: rb.check(["model.hidden=-3"]), "cannot build `model`"),
        (lambda: rb.train([*BASE, "train.batch_size=100000"]), "fewer than train.batch_size=100000"),
        (lambda: rb.train([*BASE, "model.hidden=-3"]), "cannot build `model`"),
    ]
    for call, fragment in refused:
        with pytest.raises(ReplayError, match=fragment):
            call()
        assert list(tmp_path.iterdir()) == [], fragment


def test_a_config_that_does_not_build_creates_no_store(made):
    """`replay train` builds the model and data before it opens (creates) the store (the API's train and check,
    and a bad model value, above)."""
    result = _finish(made.started["big-batch"])
    # one line besides the store and progress lines printed while the model was being built
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert outcome_lines(result.stderr) == ["replay: error: the dataset has 1437 samples, fewer than train.batch_size=100000; "
                                            "lower train.batch_size"]
    assert _folder(made.empty.path) == made.before["empty"] == {}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_bisect_refuses_an_unknown_config_or_metric_before_creating_anything(tmp_path):
    repo = tmp_path / "repo"
    (repo / "conf").mkdir(parents=True)
    _git(repo, "init", "-q")
    shas = []
    for lr in ("1e-3", "1e3"):
        (repo / "conf" / "config.yaml").write_text(f"defaults: [{{model: mlp}}]\noptim: {{lr: {lr}}}\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"lr {lr}")
        shas.append(_git(repo, "rev-parse", "HEAD"))
    workspace = Workspace(tmp_path / "work")
    workspace.path.mkdir()
    before = _folder(tmp_path)
    config, metric = _at_once(
        (workspace, ("bisect", "--repo", str(repo), *shas, "--config-name", "nope")),
        (workspace, ("bisect", "--repo", str(repo), *shas, "--metric", "bogus", "--steps", "2")),
    )
    assert_one_line_error(config, "--config-name nope", "conf/nope.yaml is not in GOOD", shas[0][:10])
    assert_one_line_error(metric, "--metric 'bogus'", "loss", "grad_norm/LAYER")
    assert _folder(tmp_path) == before  # no store, no run, no cache, the repository untouched


def test_every_metric_a_train_run_logs_is_one_bisect_accepts(made):
    from replaybisect.verbs.bisect.engine import is_train_metric

    keys = made.shared.store().metric_keys(made.run_id)
    assert {"loss", "grad_norm", "update_ratio"} <= set(keys) and any(key.startswith("weight_norm/") for key in keys)
    assert [key for key in keys if not is_train_metric(key)] == []
    assert is_train_metric("grad_norm/fc1") and not is_train_metric("grad_norm/")
