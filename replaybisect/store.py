"""Everything that talks to MLflow. Explicit run ids through MlflowClient; no fluent active-run stack."""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional
from urllib.parse import urlparse

from replaybisect.errors import RunNotFound, StoreUnreachable

STORE_FILE = "mlflow.db"  # the SQLite store replay finds upward from the working folder, like git finds .git
DEFAULT_TRACKING_URI = f"sqlite:///{STORE_FILE}"
DEFAULT_EXPERIMENT = "replaybisect"
TAG = "replaybisect."  # prefix of every tag we write
DESCRIPTION_TAG = "mlflow.note.content"  # a run's description in the MLflow UI
MAX_DESCRIPTION = 8000  # MLflow's MAX_TAG_VAL_LENGTH
OLD_SERVER_TAG_VALUE = 4000  # the longest tag value we write where older MLflow servers must keep it (under 5000)
# MLflow 3 opens an experiment of this kind on its runs table (untagged ones may open on the GenAI overview)
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
ANSWERING_VERBS = ("nan", "ablate", "diagnose", "check")  # whose latest answer the examined run's description lists
MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call


@dataclass(frozen=True)
class StoreLocation:
    """Where a command records to and why: the rule users can predict (README, "Where runs are recorded")."""

    uri: str  # absolute for SQLite and file stores
    source: str  # "--tracking-uri" | "MLFLOW_TRACKING_URI" | "found" (nearest mlflow.db upward) | "new" (./mlflow.db)

    @property
    def shown(self) -> str:
        """The store as users should read it: the database file's absolute path, or the URI."""
        database = _sqlite_path(self.uri)
        return str(database) if database is not None else self.uri

    @property
    def exists(self) -> bool:
        """False for a SQLite file or file-store folder not created yet (a server always exists)."""
        database = _sqlite_path(self.uri)
        if database is not None:
            return database.is_file()
        parsed = urlparse(self.uri)
        if parsed.scheme in ("", "file"):
            return Path(parsed.path if parsed.scheme == "file" else self.uri).expanduser().exists()
        return True

    def line(self, creating: bool = False) -> str:
        why = {"--tracking-uri": "from --tracking-uri", "MLFLOW_TRACKING_URI": "from MLFLOW_TRACKING_URI",
               "found": "nearest mlflow.db", "new": "new" if creating else "none here or above yet"}[self.source]
        return f"store: {self.shown} ({why})"


def find_store_upward(start: Path | None = None) -> Path | None:
    """The nearest `mlflow.db` in the working folder or a folder above it."""
    folder = (start or Path.cwd()).resolve()
    for candidate in (folder, *folder.parents):
        if (candidate / STORE_FILE).is_file():
            return candidate / STORE_FILE
    return None


def locate_store(cli_value: str | None = None, start: Path | None = None) -> StoreLocation:
    """`--tracking-uri`, else MLFLOW_TRACKING_URI, else the nearest `mlflow.db` upward, else `./mlflow.db` (created
    only by a command that records)."""
    if cli_value:
        return StoreLocation(absolute_uri(cli_value), "--tracking-uri")
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return StoreLocation(absolute_uri(os.environ["MLFLOW_TRACKING_URI"]), "MLFLOW_TRACKING_URI")
    found = find_store_upward(start)
    if found is not None:
        return StoreLocation(f"sqlite:///{found}", "found")
    return StoreLocation(f"sqlite:///{(start or Path.cwd()).resolve() / STORE_FILE}", "new")


def resolve_tracking_uri(cli_value: str | None = None) -> str:
    """The tracking URI by the rule of locate_store (absolute, so child processes in other folders agree)."""
    return locate_store(cli_value).uri


def absolute_uri(uri: str) -> str:
    """A relative SQLite or file-store path made absolute (a plain path to a SQLite file: that SQLite store); other
    URIs unchanged."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path = uri[len("sqlite:///"):]
        if path and path != ":memory:":
            return "sqlite:///" + str(Path(path).expanduser().resolve())
    if urlparse(uri).scheme == "" and "://" not in uri:
        path = Path(uri).expanduser().resolve()
        return f"sqlite:///{path}" if _is_sqlite_file(path) else str(path)  # a plain path to an mlflow.db is that store
    return uri


def _is_sqlite_file(path: Path) -> bool:
    if not path.is_file():  # a folder (a file store), nothing there yet, a pipe
        return False
    try:
        with open(path, "rb") as file:
            return file.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:  # unreadable: the store's own checks say so
        return False


def require_run(location: StoreLocation, run_id: str) -> None:
    """A run id not in the store is bad input, answered before MLflow or torch is imported and without creating
    a store: a SQLite file is read directly (read-only); other stores are asked by open_store's client."""
    if not location.exists:
        raise RunNotFound(f"no run {run_id!r} in {location.shown}: no runs recorded there yet "
                          "(record one with `replay train`, or pass --tracking-uri)")
    database = _sqlite_path(location.uri)
    if database is None:
        return
    import sqlite3

    try:
        connection = sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True, timeout=10)
        try:
            found = connection.execute("SELECT 1 FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
        finally:
            connection.close()
    except sqlite3.Error:
        return  # not a schema we know: MLflow's client answers
    if found is None:
        raise RunNotFound(f"no run {run_id!r} in {location.shown}; list runs with `replay runs`")


def _quiet_mlflow() -> None:
    # A fresh SQLite store runs alembic migrations that log at INFO; users see only our output.
    for name in ("alembic", "alembic.runtime.migration", "mlflow.store.db.utils", "mlflow"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # It logs every database error with its traceback, then raises it: the raised one is reported, on one line.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    # Fail fast on an unreachable server instead of MLflow's minutes of retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    # MLflow writes "View run ... at" to stdout for server stores: stdout is ours (--json).
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # Its artifact downloads draw tqdm bars on stderr: an error must stay one line, progress is ours to show.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def _check_reachable(uri: str, writing: bool = True) -> None:
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=15) as response:
                response.read()
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise StoreUnreachable(
                f"tracking server {uri} is unreachable ({reason}); start it (`mlflow server`) or pass --tracking-uri"
            ) from None
    elif parsed.scheme == "sqlite":
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        if path and path != ":memory:":
            folder = Path(path).expanduser().resolve().parent
            if not folder.is_dir():
                raise StoreUnreachable(
                    f"tracking store {uri}: folder {folder} does not exist; create it or pass another --tracking-uri"
                )
            if writing and not os.access(folder, os.W_OK):
                raise StoreUnreachable(f"tracking store {uri}: folder {folder} is not writable; pass another --tracking-uri")
    elif parsed.scheme in ("", "file"):
        folder = Path(parsed.path if parsed.scheme == "file" else uri).expanduser()
        if folder.exists() and not folder.is_dir():
            raise StoreUnreachable(f"tracking store {uri} is a file, not a folder; pass another --tracking-uri")


@dataclass
class Store:
    """A tracking store: the MLflow client plus the handful of operations replaybisect needs."""

    uri: str
    client: Any  # mlflow.MlflowClient
    _artifact_uris: dict[str, str] = field(default_factory=dict, repr=False)

    # ---- runs ---------------------------------------------------------------------------
    def experiment_id(self, name: str | None = None) -> str:
        name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            if not set(EXPERIMENT_KIND) <= set(experiment.tags):  # an experiment made before replay tagged its kind
                self.client.set_experiment_tag(experiment.experiment_id, *next(iter(EXPERIMENT_KIND.items())))
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=self._artifact_location(name), tags=EXPERIMENT_KIND)
        except Exception:  # created concurrently by another process
            return self.client.get_experiment_by_name(name).experiment_id

    def _artifact_location(self, experiment_name: str) -> str | None:
        """Artifacts of a SQLite store live beside the database file, not in whatever folder the command
        ran from (MLflow's default `./mlruns` is relative to the working folder)."""
        database = _sqlite_path(self.uri)
        if database is None:
            return None
        safe_name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in experiment_name)
        return (database.parent / "mlruns" / safe_name).as_uri()

    def create_run(
        self,
        kind: str,
        *,
        run_name: str | None = None,
        parent_run_id: str | None = None,
        experiment: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> str:
        all_tags = {TAG + "kind": kind, TAG + "status": "running"}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
            experiment_id = self.get_run(parent_run_id).info.experiment_id
        else:
            experiment_id = self.experiment_id(experiment)
        all_tags.update(tags or {})
        run = self.client.create_run(experiment_id, tags=all_tags, run_name=run_name)
        return run.info.run_id

    def get_run(self, run_id: str):
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id)
        except MlflowException:
            raise RunNotFound(f"no run {run_id!r} in {StoreLocation(self.uri, 'found').shown}; "
                              "list runs with `replay runs`") from None

    def finish_run(self, run_id: str, status: str, mlflow_status: str = "FINISHED") -> None:
        self.set_tags(run_id, {"status": status})
        self.client.set_terminated(run_id, mlflow_status)

    def set_tags(self, run_id: str, tags: dict[str, Any], prefix: str = TAG) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(prefix + key, str(value)) for key, value in tags.items()])

    def describe(self, run_id: str, text: str) -> None:
        """The run's description in the MLflow UI: its one-line answer. Written through log_batch, which retries when
        another process inserts the same tag at the same moment (two verbs answering about one run); set_tag fails."""
        self.set_tags(run_id, {DESCRIPTION_TAG: text}, prefix="")

    def record_answer(self, examined_run_id: str, verb: str, answer: str, result_run_id: str | None = None,
                      report: str = "") -> None:
        """`verb`'s one-line answer about a run: the result run's description (the answer first, the runs table shows
        it; then the markdown report, so one click on the run shows it), and a line of the examined run's description,
        which lists the latest answer of each verb (plain text)."""
        answer = answer[:1000]
        if result_run_id:
            self.describe(result_run_id, f"{answer}\n\n{report}"[:MAX_DESCRIPTION] if report else answer)
        self.set_tags(examined_run_id, {f"answer.{verb}": answer, f"answer.{verb}.run": result_run_id or ""})
        run = self.get_run(examined_run_id)
        tags = run.data.tags
        lines = []
        if tags.get(TAG + "status") == "nonfinite":
            lines.append(f"non-finite {tags.get(TAG + 'nonfinite_what', 'loss').replace('_', ' ')} at step "
                         f"{tags.get(TAG + 'first_nonfinite_step', '?')}.")
        for name in ANSWERING_VERBS:
            line = tags.get(f"{TAG}answer.{name}")
            if line:
                lines.append(f"{name}: {line.rstrip('.')}.")
        self.describe(examined_run_id, "\n".join(lines))

    def tags(self, run_id: str) -> dict[str, str]:
        """The run's replaybisect tags, without the prefix."""
        return {k[len(TAG):]: v for k, v in self.get_run(run_id).data.tags.items() if k.startswith(TAG)}

    def search_runs(self, filter_string: str = "", max_results: int = 50, experiment: str | None = None) -> list:
        if experiment:
            experiment_ids = [self.experiment_id(experiment)]
        else:
            experiment_ids = [e.experiment_id for e in self.client.search_experiments()]
        if not experiment_ids:
            return []
        return list(
            self.client.search_runs(
                experiment_ids, filter_string=filter_string, max_results=max_results, order_by=["attributes.start_time DESC"]
            )
        )

    def child_runs(self, parent_run_id: str, kind: str | None = None) -> list:
        filter_string = f"tags.mlflow.parentRunId = '{parent_run_id}'"
        if kind:
            filter_string += f" and tags.`{TAG}kind` = '{kind}'"
        return self.search_runs(filter_string, max_results=1000)

    # ---- params and metrics ------------------------------------------------------------
    def log_params(self, run_id: str, params: dict[str, Any], tags: Optional[dict[str, Any]] = None) -> None:
        """The params, in batches; `tags` (replaybisect's, without the prefix) ride in the first batch."""
        from mlflow.entities import Param, RunTag

        items = [Param(key, str(value)[:6000]) for key, value in params.items()]
        extra = [RunTag(TAG + key, str(value)) for key, value in (tags or {}).items()]
        for start in range(0, max(len(items), 1), 100):  # MLflow's limit of params per batch
            self.client.log_batch(run_id, params=items[start : start + 100], tags=extra if start == 0 else [])

    def log_metrics(self, run_id: str, points: Iterable[tuple[str, float, int]]) -> None:
        """Log (key, value, step) points in batches of at most 1000: never one call per value."""
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        batch = [Metric(key, float(value), timestamp, int(step)) for key, value, step in points]
        for start in range(0, len(batch), MAX_BATCH):
            self.client.log_batch(run_id, metrics=batch[start : start + MAX_BATCH])

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) sorted by step; the last value logged wins for a repeated step."""
        by_step = {}
        for metric in sorted(self.client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
            by_step[metric.step] = unclamped(metric.value)
        return sorted(by_step.items())

    def metric_keys(self, run_id: str) -> list[str]:
        return sorted(self.get_run(run_id).data.metrics)

    # ---- artifacts -----------------------------------------------------------------------
    def artifact_uri(self, run_id: str) -> str:
        """A run's artifact URI never changes: asked once per run, not once per snapshot read."""
        if run_id not in self._artifact_uris:
            self._artifact_uris[run_id] = self.get_run(run_id).info.artifact_uri
        return self._artifact_uris[run_id]

    def local_artifact_dir(self, run_id: str) -> Path | None:
        """The run's artifact folder when it is on this file system (write there directly), else None."""
        uri = self.artifact_uri(run_id)
        parsed = urlparse(uri)
        if parsed.scheme == "file":
            return Path(parsed.path)
        if parsed.scheme == "" and not uri.startswith("mlflow-artifacts:"):
            return Path(uri)
        return None

    def running_artifact_dirs(self, experiment_id: str) -> list[Path]:
        """The local artifact folders of the experiment's runs still marked RUNNING (live, or killed by SIGKILL)."""
        runs = self.client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000)
        folders = []
        for run in runs:
            self._artifact_uris.setdefault(run.info.run_id, run.info.artifact_uri)
            folder = self.local_artifact_dir(run.info.run_id)
            if folder is not None:
                folders.append(folder)
        return folders

    def log_artifact(self, run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(local_path), artifact_path)

    def log_artifacts(self, run_id: str, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(run_id, str(local_dir), artifact_path)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_dict(self, run_id: str, data: dict, artifact_file: str) -> None:
        """A JSON artifact in strict JSON (a NaN is "nan"; MLflow's own log_dict would write a NaN literal)."""
        from replaybisect.core.jsonutil import strict_json

        self.log_text(run_id, strict_json(data, indent=2), artifact_file)

    def log_figure(self, run_id: str, figure, artifact_file: str) -> None:
        self.client.log_figure(run_id, figure, artifact_file)

    def list_artifacts(self, run_id: str, path: str | None = None) -> list:
        return list(self.client.list_artifacts(run_id, path))

    def download_artifacts(self, run_id: str, path: str, dst_dir: str | Path) -> Path:
        return Path(self.client.download_artifacts(run_id, path, str(dst_dir)))

    def read_artifact_text(self, run_id: str, path: str) -> str:
        import mlflow.artifacts

        return mlflow.artifacts.load_text(f"{self.artifact_uri(run_id).rstrip('/')}/{path}")


def unclamped(value: float) -> float:
    """MLflow stores +-inf as +-float max; give them back as infinities."""
    if abs(value) == sys.float_info.max:
        return math.copysign(math.inf, value)
    return value


def _sqlite_path(uri: str) -> Path | None:
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


def _refusal(database: Path, state: SqliteState, create: bool) -> str | None:
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
        refused = _refusal(database, state, create=True)
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


def _prepare_sqlite(uri: str, create: bool):
    """A SQLite store is opened only when whole: a reader gets one line for a missing, half-made, empty or foreign
    file (left as it was); a recording command creates a missing one and rebuilds one that is half-made and holds
    nothing, atomically; a store holding runs is never rebuilt. Returns what to hold while MLflow opens it: the
    creation lock for MLflow's own in-place upgrade of an older store that holds runs, else nothing."""
    database = _sqlite_path(uri)
    if database is None:
        return nullcontext()
    state = inspect_sqlite(database)
    if state.kind == "current":
        return nullcontext()
    if state.kind == "missing" and not create:
        raise StoreUnreachable(f"no tracking store at {database}: no runs recorded there yet "
                               "(record one with `replay train`, or pass --tracking-uri)")
    refused = _refusal(database, state, create)
    if refused:
        raise StoreUnreachable(refused)
    if state.kind == "outdated":
        return _creation_lock(database)  # writing to an older store that holds runs: MLflow upgrades it, one at a time
    _build_sqlite_store(database)
    return nullcontext()


def check_store(tracking_uri: str | None = None, create: bool = True) -> str:
    """The checks of open_store that need neither MLflow nor a write (an unreachable server, a missing folder, a
    file that is not a SQLite database), for a command to say them before it builds anything; the URI."""
    uri = resolve_tracking_uri(tracking_uri)
    _check_reachable(uri, writing=create)
    database = _sqlite_path(uri)
    if database is not None and database.is_file():
        try:
            with open(database, "rb") as handle:
                header = handle.read(len(SQLITE_MAGIC))
        except OSError:
            return uri
        if header and header != SQLITE_MAGIC:
            raise StoreUnreachable(_refusal(database, SqliteState("not-sqlite"), create))
    return uri


def open_store(tracking_uri: str | None = None, create: bool = True) -> Store:
    """Open the tracking store named by `--tracking-uri` / MLFLOW_TRACKING_URI / the nearest mlflow.db upward /
    ./mlflow.db. `create=True` (the commands that record): a new SQLite store is created atomically. `create=False`
    (reading): nothing is ever created, migrated or locked; a file that is not a whole store is one line."""
    from replaybisect.errors import ReplayError

    uri = resolve_tracking_uri(tracking_uri)
    _quiet_mlflow()
    _check_reachable(uri, writing=create)
    import mlflow
    from mlflow import MlflowClient

    try:
        with _prepare_sqlite(uri, create):
            mlflow.set_tracking_uri(uri)
            client = MlflowClient(tracking_uri=uri)
            client.search_experiments(max_results=1)
    except ReplayError:
        raise
    except Exception as error:
        from replaybisect.errors import DiskFull, is_disk_full

        if is_disk_full(error):
            raise DiskFull(f"no space left on device opening the tracking store {uri}; free space or point the store "
                           "elsewhere (--tracking-uri)") from None
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise StoreUnreachable(f"cannot open tracking store {uri}: {first_line}; pass a working --tracking-uri") from None
    return Store(uri=uri, client=client)


# ---- replay watch: the failed runs to triage, and claims written as tags --------------------------------
WATCH_PAGE = 1000  # runs per search page


def experiment_ids_named(store: Store, names: Iterable[str]) -> dict[str, str | None]:
    """Experiment ids by name, None for one that does not exist (yet); nothing is created."""
    found = {}
    for name in names:
        experiment = store.client.get_experiment_by_name(name)
        found[name] = experiment.experiment_id if experiment is not None and experiment.lifecycle_stage == "active" else None
    return found


def all_experiment_ids(store: Store) -> list[str]:
    return [experiment.experiment_id for experiment in store.client.search_experiments()]


def search_all_runs(store: Store, experiment_ids: list[str], filter_string: str) -> list:
    """Every active run matching the filter, page by page."""
    runs, token = [], None
    while experiment_ids:
        page = store.client.search_runs(experiment_ids, filter_string=filter_string, max_results=WATCH_PAGE, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    return runs


def search_runs_without_tag(store: Store, experiment_ids: list[str], filter_string: str, tag: str) -> list:
    """Runs matching the filter that do not carry `tag` (MLflow's `IS NULL`; a server too old for it is
    searched without it and the tag checked here)."""
    from mlflow.exceptions import MlflowException

    try:
        return search_all_runs(store, experiment_ids, f"{filter_string} and tags.`{tag}` IS NULL")
    except MlflowException as error:
        if "IS NULL" not in str(error):
            raise
    return [run for run in search_all_runs(store, experiment_ids, filter_string) if tag not in run.data.tags]


# ---- the MLflow run another logger opened in this process (a transformers Trainer's MLflowCallback) -------------
def active_fluent_run() -> Optional[tuple[str, str]]:
    """(run id, tracking URI) of the run MLflow's fluent API has active in this process, if any."""
    import mlflow

    run = mlflow.active_run()
    return (run.info.run_id, mlflow.get_tracking_uri()) if run is not None else None


def end_fluent_run(run_id: Optional[str], status: str) -> None:
    """That run ended now with `status`, when it is `run_id` (else MLflow would end it FINISHED at exit)."""
    import sys

    mlflow = sys.modules.get("mlflow")
    if mlflow is None or run_id is None:
        return
    try:
        active = mlflow.active_run()
        if active is not None and active.info.run_id == run_id:
            mlflow.end_run(status)
    except Exception:  # noqa: BLE001 - the run's own end is already recorded through the store
        return
