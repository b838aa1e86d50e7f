"""Everything that talks to MLflow. Explicit run ids through MlflowClient; no fluent active-run stack."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional
from urllib.parse import urlparse

from replaybisect.errors import RunNotFound, StoreUnreachable
from replaybisect.store.sqlite import SQLITE_MAGIC, SqliteState, inspect_sqlite, prepare_sqlite, refusal, sqlite_path  # noqa: F401  (SqliteState, inspect_sqlite: store.X as before)

STORE_FILE = "mlflow.db"  # the SQLite store replay finds upward from the working folder, like git finds .git
DEFAULT_TRACKING_URI = f"sqlite:///{STORE_FILE}"
DEFAULT_EXPERIMENT = "replaybisect"
TAG = "replaybisect."  # prefix of every tag we write
DESCRIPTION_TAG = "mlflow.note.content"  # a run's description in the MLflow UI
MAX_DESCRIPTION = 8000  # MLflow's MAX_TAG_VAL_LENGTH
OLD_SERVER_TAG_VALUE = 4000  # the longest tag value we write where older MLflow servers must keep it (under 5000)
# MLflow 3 opens an experiment of this kind on its runs table (untagged ones may open on the GenAI overview)
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
ANSWERING_VERBS = ("nan", "ablate", "diagnose", "check", "memory", "verify")  # whose latest answer the examined run's description lists
MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call


@dataclass(frozen=True)
class StoreLocation:
    """Where a command records to and why: the rule users can predict (README, "Where runs are recorded")."""

    uri: str  # absolute for SQLite and file stores
    source: str  # "--tracking-uri" | "MLFLOW_TRACKING_URI" | "found" (nearest mlflow.db upward) | "new" (./mlflow.db)

    @property
    def shown(self) -> str:
        """The store as users should read it: the database file's absolute path, or the URI."""
        database = sqlite_path(self.uri)
        return str(database) if database is not None else self.uri

    @property
    def exists(self) -> bool:
        """False for a SQLite file or file-store folder not created yet (a server always exists)."""
        database = sqlite_path(self.uri)
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
    database = sqlite_path(location.uri)
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
    # a command that examines a run reads it once: each run it reads is kept until this process writes to it (another
    # process writing to a run a command examines is not a case: the examined run has ended)
    read_once: bool = False
    _artifact_uris: dict[str, str] = field(default_factory=dict, repr=False)
    _runs: dict[str, Any] = field(default_factory=dict, repr=False)

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
        database = sqlite_path(self.uri)
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

        if run_id in self._runs:
            return self._runs[run_id]
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            raise RunNotFound(f"no run {run_id!r} in {StoreLocation(self.uri, 'found').shown}; "
                              "list runs with `replay runs`") from None
        if self.read_once:
            self._runs[run_id] = run
        return run

    def finish_run(self, run_id: str, status: str, mlflow_status: str = "FINISHED") -> None:
        self.set_tags(run_id, {"status": status})
        self.client.set_terminated(run_id, mlflow_status)

    def set_tags(self, run_id: str, tags: dict[str, Any], prefix: str = TAG) -> None:
        from mlflow.entities import RunTag

        self._runs.pop(run_id, None)
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
        self._runs.pop(run_id, None)
        from mlflow.entities import Param, RunTag

        items = [Param(key, str(value)[:6000]) for key, value in params.items()]
        extra = [RunTag(TAG + key, str(value)) for key, value in (tags or {}).items()]
        for start in range(0, max(len(items), 1), 100):  # MLflow's limit of params per batch
            self.client.log_batch(run_id, params=items[start : start + 100], tags=extra if start == 0 else [])

    def log_metrics(self, run_id: str, points: Iterable[tuple[str, float, int]]) -> None:
        """Log (key, value, step) points in batches of at most 1000: never one call per value."""
        self._runs.pop(run_id, None)
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


def check_store(tracking_uri: str | None = None, create: bool = True) -> str:
    """The checks of open_store that need neither MLflow nor a write (an unreachable server, a missing folder, a
    file that is not a SQLite database), for a command to say them before it builds anything; the URI."""
    uri = resolve_tracking_uri(tracking_uri)
    _check_reachable(uri, writing=create)
    database = sqlite_path(uri)
    if database is not None and database.is_file():
        try:
            with open(database, "rb") as handle:
                header = handle.read(len(SQLITE_MAGIC))
        except OSError:
            return uri
        if header and header != SQLITE_MAGIC:
            raise StoreUnreachable(refusal(database, SqliteState("not-sqlite"), create))
    return uri


def open_store(tracking_uri: str | None = None, create: bool = True, read_once: bool = False) -> Store:
    """Open the tracking store named by `--tracking-uri` / MLFLOW_TRACKING_URI / the nearest mlflow.db upward /
    ./mlflow.db. `create=True` (the commands that record): a new SQLite store is created atomically. `create=False`
    (reading): nothing is ever created, migrated or locked; a file that is not a whole store is one line.
    `read_once`: a command examining a run reads each run once (Store.read_once)."""
    from replaybisect.errors import ReplayError

    uri = resolve_tracking_uri(tracking_uri)
    _quiet_mlflow()
    _check_reachable(uri, writing=create)
    import mlflow
    from mlflow import MlflowClient

    try:
        with prepare_sqlite(uri, create):
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
    return Store(uri=uri, client=client, read_once=read_once)


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
