"""Real servers for the `replay watch` tests and benchmark, started on 127.0.0.1 in temporary folders:
PostgreSQL (Debian's `postgresql` package), an S3-compatible object store (moto's server) and `mlflow server`
with the PostgreSQL backend and artifacts proxied to the object store (`--serve-artifacts`)."""

from __future__ import annotations

import glob
import os
import shutil
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


@contextmanager
def postgres():
    """A PostgreSQL server on a free 127.0.0.1 port with a fresh data folder; yields its SQLAlchemy URI."""
    bin_dir = postgres_bin()
    # /tmp itself, not pytest's 0700 root-owned tmp tree: the postgres user must reach the folder
    folder = Path(tempfile.mkdtemp(prefix="replaybisect-pg-"))
    port = free_port()
    try:
        if os.geteuid() == 0:
            shutil.chown(folder, "postgres", "postgres")
        data = folder / "data"
        subprocess.run(_as_postgres_user([str(bin_dir / "initdb"), "-D", str(data), "-U", "mlflow", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True, timeout=120)
        options = f"-h 127.0.0.1 -p {port} -k {folder} -c fsync=off"
        subprocess.run(_as_postgres_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(folder / "log"), "-w", "-t", "60",
                                          "-o", options, "start"]), check=True, capture_output=True, timeout=90)
        subprocess.run(_as_postgres_user([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "mlflow", "mlflow"]),
                       check=True, capture_output=True, timeout=60)
        yield f"postgresql+psycopg2://mlflow@127.0.0.1:{port}/mlflow"  # the driver named: SQLAlchemy 2.1 defaults to psycopg 3
    finally:
        subprocess.run(_as_postgres_user([str(bin_dir / "pg_ctl"), "-D", str(folder / "data"), "-m", "immediate", "stop"]),
                       capture_output=True, timeout=60)
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


@dataclass
class TeamServer:
    tracking_uri: str  # http://127.0.0.1:PORT
    backend_uri: str  # postgresql://...
    artifacts_destination: str  # s3://bucket/ (or a folder when no S3 server could start)
    s3_endpoint: str | None


@contextmanager
def team_server(folder: Path, *, s3: bool = True):
    """`mlflow server` on PostgreSQL with artifacts proxied (--serve-artifacts) to S3 (moto) or, with s3=False or
    when no S3 server can run here, to a local folder (the server's proxied artifact store)."""
    with postgres() as backend_uri, ExitStack() as stack:
        endpoint = None
        if s3:
            try:
                endpoint = stack.enter_context(s3_server(folder))
            except Unavailable:
                pass
        destination = f"s3://{BUCKET}/" if endpoint else str(folder / "artifacts")
        with _mlflow_server(folder, backend_uri, destination, endpoint) as server:
            yield server


@contextmanager
def _mlflow_server(folder: Path, backend_uri: str, destination: str, s3_endpoint: str | None):
    port = free_port()
    env = dict(os.environ)
    if s3_endpoint:
        env.update(S3_CREDENTIALS, MLFLOW_S3_ENDPOINT_URL=s3_endpoint)
    log = open(folder / "mlflow-server.log", "wb")
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", backend_uri, "--serve-artifacts", "--artifacts-destination", destination],
        cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_http(uri + "/health", process, "mlflow server")
        yield TeamServer(uri, backend_uri, destination, s3_endpoint)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
