"""Real servers for the `replay watch` tests and benchmark, started on 127.0.0.1 in temporary folders:
PostgreSQL (Debian's `postgresql` package), an S3-compatible object store (moto's server) and `mlflow server`
with the PostgreSQL backend and artifacts proxied to the object store (`--serve-artifacts`)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

BUCKET = "replaybisect-artifacts"
# `replay watch` will not triage as root without --allow-root; the suite runs as root in CI containers
ALLOW_ROOT = ("--allow-root",) if os.geteuid() == 0 else ()
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class Unavailable(Exception):
    """A server's software is not installed here (the tests skip with this reason)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or ([shutil.which("initdb")] if shutil.which("initdb") else [])
    if not found:
        raise Unavailable("PostgreSQL is not installed (apt-get install -y postgresql)")
    return Path(found[-1]).parent


def _as_postgres_user(argv: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: run them as the `postgres` user the Debian package creates."""
    if os.geteuid() != 0:
        return argv
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--", *argv]
    return ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(argv)]


def _wait_http(url: str, process: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited at start (status {process.returncode})")
            time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer {url} in {timeout:.0f} s")


@dataclass
class Postgres:
    """A running PostgreSQL server: its SQLAlchemy URI, and stop/start for the outage tests (same port and data)."""

    uri: str
    bin_dir: Path
    folder: Path
    options: str

    def _pg_ctl(self, *args: str, check: bool = True) -> None:
        subprocess.run(_as_postgres_user([str(self.bin_dir / "pg_ctl"), "-D", str(self.folder / "data"), *args]),
                       check=check, capture_output=True, timeout=90)

    def start(self) -> None:
        for attempt in range(3):  # just after an immediate stop, the old postmaster may not have let go yet
            try:
                return self._pg_ctl("-l", str(self.folder / "log"), "-w", "-t", "60", "-o", self.options, "start")
            except subprocess.CalledProcessError as error:
                if attempt == 2:
                    log = (self.folder / "log").read_text(errors="replace")[-2000:] if (self.folder / "log").exists() else ""
                    raise RuntimeError(f"PostgreSQL did not start: {error.stderr!r} {error.stdout!r}\n{log}") from None
                time.sleep(1)

    def stop(self) -> None:
        """Stopped at once (`-m immediate`), as a crashed or restarting database looks to its clients."""
        self._pg_ctl("-m", "immediate", "stop", check=False)


@contextmanager
def postgres():
    """A PostgreSQL server on a free 127.0.0.1 port with a fresh data folder; yields a Postgres (its `.uri`)."""
    bin_dir = postgres_bin()
    # /tmp itself, not pytest's 0700 root-owned tmp tree: the postgres user must reach the folder
    folder = Path(tempfile.mkdtemp(prefix="replaybisect-pg-"))
    port = free_port()
    server = Postgres(f"postgresql+psycopg2://mlflow@127.0.0.1:{port}/mlflow",  # the driver named: SQLAlchemy 2.1 defaults to psycopg 3
                      bin_dir, folder, f"-h 127.0.0.1 -p {port} -k {folder} -c fsync=off")
    try:
        if os.geteuid() == 0:
            shutil.chown(folder, "postgres", "postgres")
        subprocess.run(_as_postgres_user([str(bin_dir / "initdb"), "-D", str(folder / "data"), "-U", "mlflow", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True, timeout=120)
        server.start()
        subprocess.run(_as_postgres_user([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "mlflow", "mlflow"]),
                       check=True, capture_output=True, timeout=60)
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def s3_server(folder: Path):
    """moto's S3-compatible server with one bucket; yields its endpoint URL."""
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as missing:
        raise Unavailable(f"no S3-compatible server here ({missing.name} is not installed)") from None
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], cwd=folder,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_http(endpoint + "/moto-api/", process, "moto S3 server", timeout=60)
        import boto3

        boto3.client("s3", endpoint_url=endpoint, **boto_credentials()).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        process.terminate()
        process.wait(timeout=30)


def boto_credentials() -> dict[str, str]:
    return {"aws_access_key_id": S3_CREDENTIALS["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "region_name": S3_CREDENTIALS["AWS_DEFAULT_REGION"]}


# MLflow 3's server also starts a job runner process (for GenAI jobs): nothing here uses it, and its start-up costs seconds.
NO_JOB_RUNNER = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


class MlflowServer:
    """`mlflow server` on a fixed port; stop() and start() restart it there (the outage tests)."""

    def __init__(self, folder: Path, backend_uri: str, destination: str, s3_endpoint: str | None):
        self.folder, self.backend_uri, self.destination, self.s3_endpoint = folder, backend_uri, destination, s3_endpoint
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, **NO_JOB_RUNNER)
        if self.s3_endpoint:
            env.update(S3_CREDENTIALS, MLFLOW_S3_ENDPOINT_URL=self.s3_endpoint)
        with open(self.folder / "mlflow-server.log", "ab") as log:
            self.process = subprocess.Popen(
                [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(self.port),
                 "--workers", "1", "--backend-store-uri", self.backend_uri, "--serve-artifacts",
                 "--artifacts-destination", self.destination],
                cwd=self.folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        _wait_http(self.uri + "/health", self.process, "mlflow server")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # its group: uvicorn's worker too, so the port is free again
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


@dataclass
class TeamServer:
    tracking_uri: str  # http://127.0.0.1:PORT
    backend_uri: str  # postgresql://...
    artifacts_destination: str  # s3://bucket/ (or a folder when no S3 server could start)
    s3_endpoint: str | None
    database: Postgres | None = None  # stop()/start(): a database outage
    server: MlflowServer | None = None  # stop()/start(): the tracking server restarting


@contextmanager
def team_server(folder: Path, *, s3: bool = True):
    """`mlflow server` on PostgreSQL with artifacts proxied (--serve-artifacts) to S3 (moto) or, with s3=False or
    when no S3 server can run here, to a local folder (the server's proxied artifact store)."""
    with postgres() as database, ExitStack() as stack:
        endpoint = None
        if s3:
            try:
                endpoint = stack.enter_context(s3_server(folder))
            except Unavailable:
                pass
        destination = f"s3://{BUCKET}/" if endpoint else str(folder / "artifacts")
        server = MlflowServer(folder, database.uri, destination, endpoint)
        try:
            server.start()
            yield TeamServer(server.uri, database.uri, destination, endpoint, database, server)
        finally:
            server.stop()
