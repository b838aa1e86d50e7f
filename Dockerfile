# replaybisect in a container, run against a mounted MLflow store:
#   docker build -t replaybisect .
#   docker run --rm -v "$PWD":/work replaybisect runs                      # reads /work/mlflow.db
#   docker run --rm -v "$PWD":/work replaybisect nan --run-id RUN_ID
#   docker run --rm -e MLFLOW_TRACKING_URI=http://host.docker.internal:5000 replaybisect runs
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
# The CPU build of torch first: a plain `pip install torch` pulls gigabytes of CUDA packages.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /opt/replaybisect
COPY pyproject.toml README.md ./
COPY replaybisect ./replaybisect
RUN pip install --no-cache-dir .

# An unprivileged user for the service: `replay watch` will not triage as root (a stored run's config is untrusted
# input). deploy/compose.yaml runs the watcher as it; `docker run --user replay ... watch` does too. The CLI verbs keep
# the image's default user, so they can write to the mounted folder.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/replay --shell /usr/sbin/nologin replay

# The user's folder (MLflow store, configs, code) is mounted here; `sqlite:///mlflow.db` resolves in it.
WORKDIR /work
ENV MLFLOW_TRACKING_URI=sqlite:///mlflow.db
ENTRYPOINT ["replay"]
CMD ["--help"]
