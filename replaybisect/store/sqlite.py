"""The embedded default, MLflow's SQLite store: what a database file holds (current, half-made, outdated,
another program's), refused in one line when it cannot be used, and a new one built atomically (from a
migrated template, under a lock) so no process ever sees it half-made."""

from __future__ import annotations

import functools
import os
import re
import time
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replaybisect.errors import StoreUnreachable


def sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    return Path(uri[len("sqlite:///"):]).expanduser().resolve()


SQLITE_MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
MLFLOW_TABLES = frozenset({"experiments", "runs", "metrics", "params", "tags", "alembic_version"})
CREATING = ".{name}.creating-"  # the temp file a new store is built in, beside it: `.mlflow.db.creating-PID`


@dataclass(frozen=True)
class SqliteState:
    """What a SQLite store file is, read without changing it (see `inspect_sqlite`)."""

    kind: str  # missing | current | empty | half-made | outdated | newer | not-sqlite | not-mlflow | unreadable
    detail: str = ""  # what makes it so, for the one-line explanation
    runs: int = 0  # runs it holds
    holds_data: bool = False  # runs, experiments (other than MLflow's Default) or anything else a user put there


@functools.lru_cache(maxsize=1)
def _schema_script() -> Any:
    """MLflow's alembic script directory (reading its ~70 migration files takes most of a second); None when hidden."""
    try:
        from alembic.script import ScriptDirectory
        from mlflow.store.db.utils import _get_alembic_config

        return ScriptDirectory.from_config(_get_alembic_config(db_url=""))
    except Exception:  # noqa: BLE001 - a private MLflow API that moved: the schema is then MLflow's own business
        return None


@functools.lru_cache(maxsize=1)
def _schema_head() -> tuple[str | None, Any]:
    """(this MLflow's newest schema revision, its alembic script directory or None when not needed to find it).
    The head is kept beside the store templates, per MLflow version: every command that opens a store asks."""
    import mlflow

    kept = _stores_cache() / f"mlflow-{mlflow.__version__}.head"
    try:
        head = kept.read_text(encoding="ascii").strip()
        if re.fullmatch(r"[0-9a-f]{6,40}", head):
            return head, None
    except (OSError, UnicodeDecodeError):
        pass
    script = _schema_script()
    heads = script.get_heads() if script is not None else []
    head = heads[0] if len(heads) == 1 else None
    if head is not None:
        partial = kept.with_name(f".{kept.name}.{os.getpid()}")
        with suppress(OSError):
            kept.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(head, encoding="ascii")
            os.replace(partial, kept)
    return head, script


def _stores_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "replaybisect" / "stores"


def _known_revision(script, revision: str) -> bool:
    script = script if script is not None else _schema_script()
    try:
        return script is not None and script.get_revision(revision) is not None
    except Exception:  # noqa: BLE001 - alembic: unknown revision
        return False


def inspect_sqlite(database: Path) -> SqliteState:
    """What `database` is, by reading it (nothing is written, nothing created): a current MLflow store, one whose
    creation or migration was cut short (tables left half-made, an `_alembic_tmp_*` leftover, no schema version),
    an empty file, or not an MLflow store at all. Imports MLflow (for its schema revision)."""
    import sqlite3

    try:
        with open(database, "rb") as handle:
            header = handle.read(len(SQLITE_MAGIC))
    except FileNotFoundError:
        return SqliteState("missing")
    except OSError as error:
        return SqliteState("unreadable", error.strerror or str(error))
    if not header:
        return SqliteState("empty", "an empty file")
    if header != SQLITE_MAGIC:
        return SqliteState("not-sqlite", "not a SQLite database")
    try:
        # mode=rw: never creates the file; a read-write connection lets SQLite roll back a killed writer's journal
        connection = sqlite3.connect(f"{database.as_uri()}?mode=rw", uri=True, timeout=30)
        try:
            tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            revision = None
            if "alembic_version" in tables:
                row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
                revision = row[0] if row else None
            runs = connection.execute("SELECT COUNT(*) FROM runs").fetchone()[0] if "runs" in tables else 0
            holds_data = runs > 0
            for table in sorted(tables - {"alembic_version", "workspaces", "sqlite_sequence"}):
                if holds_data:
                    break
                quoted = table.replace('"', '""')
                if table in ("experiments", "_alembic_tmp_experiments"):  # MLflow's Default experiment (id 0) is no data
                    query = f'SELECT 1 FROM "{quoted}" WHERE experiment_id != 0 LIMIT 1'
                else:
                    query = f'SELECT 1 FROM "{quoted}" LIMIT 1'
                holds_data = connection.execute(query).fetchone() is not None
        finally:
            connection.close()
    except sqlite3.Error as error:
        return SqliteState("unreadable", str(error))
    if not tables:
        return SqliteState("empty", "a SQLite database with no tables")
    if not tables & MLFLOW_TABLES:
        return SqliteState("not-mlflow", f"a SQLite database without MLflow's tables (it has {', '.join(sorted(tables)[:3])})")
    # A migration killed midway leaves what it had done (SQLite runs MLflow's DDL outside transactions): tables made
    # but no schema version, a column added but the version not moved on, an `_alembic_tmp_*` copy of a table.
    leftovers = sorted(table for table in tables if table.startswith("_alembic_tmp_"))
    cut_short = f"a schema migration was cut short: table {leftovers[0]} left over" if leftovers else ""
    if revision is None:
        return SqliteState("half-made", cut_short or "its creation was cut short: no schema version", runs, holds_data)
    head, script = _schema_head()
    if head is not None and revision != head:
        if cut_short:
            return SqliteState("half-made", f"{cut_short}, at schema {revision}", runs, holds_data)
        if _known_revision(script, revision):
            return SqliteState("outdated", f"schema {revision}, older than this MLflow's {head}", runs, holds_data)
        return SqliteState("newer", f"schema {revision}, which this MLflow (schema {head}) does not know", runs, holds_data)
    try:
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - registers MLflow's tables on its Base
        from mlflow.store.db.base_sql_model import Base

        missing = sorted(set(Base.metadata.tables) - tables)
    except Exception:  # noqa: BLE001 - MLflow's table list moved: the core tables stand for it
        missing = sorted(MLFLOW_TABLES - tables)
    if missing:
        return SqliteState("half-made", cut_short or f"its creation was cut short: table {missing[0]} missing", runs,
                           holds_data)
    return SqliteState("current", runs=runs, holds_data=holds_data)  # at the newest schema, every table there: whole


def _held(state: SqliteState) -> str:
    return f"{state.runs} run{'s' if state.runs != 1 else ''}" if state.runs else "data (experiments, models)"


def refusal(database: Path, state: SqliteState, create: bool) -> str | None:
    """The one line for a store file that cannot be used as it is; None when it can (or, writing, can be rebuilt)."""
    where = str(database)
    if state.kind == "current":
        return None
    if state.kind == "unreadable":
        return f"{where} cannot be read ({state.detail}); it was left as it was: fix it or pass another --tracking-uri"
    if state.kind in ("not-sqlite", "not-mlflow"):
        new = " (or of a file that does not exist yet: it becomes a new store)" if create else ""
        return f"{where} is not an MLflow store ({state.detail}); it was left as it was: pass the --tracking-uri of a store{new}"
    if not state.holds_data:  # nothing of anyone's in it: a recording command rebuilds it
        if create:
            return None
        what = f"is not an MLflow store yet ({state.detail})" if state.kind == "empty" else f"is a half-made MLflow store ({state.detail})"
        return f"{where} {what} and holds no runs; reading never changes it: the next `replay train` there rebuilds it"
    if state.kind == "outdated" and create:
        return None  # MLflow upgrades an older store in place, as it always has
    held = _held(state)
    if state.kind == "outdated":
        return (f"{where} was made by an older MLflow ({state.detail}) and holds {held}; reading never migrates a store: "
                f"back it up, then run `mlflow db upgrade sqlite:///{database}`")
    if state.kind == "newer":
        return f"{where} was made by a newer MLflow ({state.detail}) and holds {held}: upgrade mlflow here to use it"
    return (f"{where} is half-made ({state.detail}) and holds {held}, so replay leaves it as it was: restore it from a "
            "backup, or record to a new store (--tracking-uri)")


def _fsync(path: Path, directory: bool = False) -> None:
    descriptor = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextmanager
def _creation_lock(database: Path):
    """`<db>.lock` beside a SQLite database, held by the one process creating (or rebuilding) it: others wait,
    then find it made. Removed once the store is whole (waiters then re-check and find it); a process that only
    reads never takes it."""
    from filelock import FileLock

    lock_path = database.with_name(f"{database.name}.lock")
    with FileLock(str(lock_path), timeout=120):
        try:
            yield
        finally:
            # Safe to remove unless a half-made store is still there: a missing one is only ever linked into place
            # (never over one that exists), and a whole one is never rebuilt, so a waiter on the removed lock or a
            # newcomer on a new one cannot undo another's work.
            if not database.exists() or inspect_sqlite(database).kind == "current":
                with suppress(OSError):
                    lock_path.unlink()


def _template_path() -> Path | None:
    """Where a freshly migrated, empty store of this MLflow's schema is kept: MLflow runs some 70 migrations to
    make a new store (seconds), and their result is the same for every new store of one MLflow version."""
    head, _ = _schema_head()
    if head is None:
        return None
    import mlflow

    return _stores_cache() / f"mlflow-{mlflow.__version__}-{head}.db"


def _copy_template(temp: Path, artifact_root: Path) -> bool:
    """Make `temp` a copy of the kept template, its Default experiment's artifact folder set as MLflow would set it
    (`<artifact root>/0`); False when there is no sound template (then MLflow migrates `temp` itself)."""
    import shutil
    import sqlite3

    template = _template_path()
    if template is None or not template.is_file():
        return False
    state = inspect_sqlite(template)
    if state.kind != "current" or state.holds_data:
        return False
    shutil.copyfile(template, temp)
    now = int(time.time() * 1000)
    connection = sqlite3.connect(temp)
    try:
        with connection:
            connection.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                               "WHERE experiment_id = 0", (str(artifact_root / "0"), now, now))
    finally:
        connection.close()
    return True


def _save_template(migrated: Path) -> None:
    """Keep a copy of a store MLflow just migrated, for the next new store (best effort: a cache)."""
    import shutil

    template = _template_path()
    if template is None or template.is_file():
        return
    partial = template.with_name(f".{template.name}.{os.getpid()}-{os.urandom(3).hex()}")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(migrated, partial)
        os.replace(partial, template)
    except OSError:  # a read-only or full home: the next store migrates again
        with suppress(OSError):
            partial.unlink()


def _build_sqlite_store(database: Path) -> None:
    """Create (or rebuild, when found half-made and holding nothing) the store at `database` atomically:
    MLflow's migrations run on a temp file beside it, which is fsynced and then renamed into place, so
    `database` is either absent, as it was, or a whole store, whenever the process is killed or the disk fills."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    with _creation_lock(database):
        state = inspect_sqlite(database)  # again, under the lock: another process may have made it meanwhile
        if state.kind == "current":
            return
        refused = refusal(database, state, create=True)
        if refused or state.kind == "outdated":
            if refused:
                raise StoreUnreachable(refused)
            return  # MLflow's own in-place upgrade of an older store that holds runs
        for stale in database.parent.glob(f"{CREATING.format(name=database.name)}*"):  # a killed creator's (we hold the lock)
            with suppress(OSError):
                stale.unlink()
        temp = database.with_name(f"{CREATING.format(name=database.name)}{os.getpid()}-{os.urandom(3).hex()}")
        temp_uri = f"sqlite:///{temp}"
        try:
            if not _copy_template(temp, database.parent / "mlruns"):
                try:
                    SqlAlchemyStore(temp_uri, str(database.parent / "mlruns"))  # every migration, and the Default experiment
                finally:  # MLflow keeps an engine per URI: closed, so no connection outlives the temp file
                    engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(temp_uri, None)
                    if engine is not None:
                        engine.dispose()
                _save_template(temp)
            _fsync(temp)
            if state.kind == "missing":
                try:
                    os.link(temp, database)  # never over a store another process made (the lock says none can)
                except FileExistsError:
                    return  # made meanwhile by a process that did not see our lock: theirs stands
                except OSError:  # a file system without hard links
                    os.replace(temp, database)
            else:
                os.replace(temp, database)  # the half-made store (holding nothing) is replaced whole
            _fsync(database.parent, directory=True)
        except Exception as error:
            from replaybisect.errors import DiskFull, is_disk_full

            if is_disk_full(error):
                raise DiskFull(f"no space left on device creating the tracking store {database}; free space or point "
                               "the store elsewhere (--tracking-uri); nothing was created") from None
            raise
        finally:
            for suffix in ("", "-journal", "-wal", "-shm"):  # the temp file (and SQLite's files beside it) if still there
                with suppress(OSError):
                    temp.with_name(temp.name + suffix).unlink()


def prepare_sqlite(uri: str, create: bool):
    """A SQLite store is opened only when whole: a reader gets one line for a missing, half-made, empty or foreign
    file (left as it was); a recording command creates a missing one and rebuilds one that is half-made and holds
    nothing, atomically; a store holding runs is never rebuilt. Returns what to hold while MLflow opens it: the
    creation lock for MLflow's own in-place upgrade of an older store that holds runs, else nothing."""
    database = sqlite_path(uri)
    if database is None:
        return nullcontext()
    state = inspect_sqlite(database)
    if state.kind == "current":
        return nullcontext()
    if state.kind == "missing" and not create:
        raise StoreUnreachable(f"no tracking store at {database}: no runs recorded there yet "
                               "(record one with `replay train`, or pass --tracking-uri)")
    refused = refusal(database, state, create)
    if refused:
        raise StoreUnreachable(refused)
    if state.kind == "outdated":
        return _creation_lock(database)  # writing to an older store that holds runs: MLflow upgrades it, one at a time
    _build_sqlite_store(database)
    return nullcontext()
