"""`replay watch` on a team server: how long from a run failing to its triage tags, and what an idle watcher costs.

    python benchmarks/watch_latency.py [--interval 2] [--idle-seconds 60] [--runs 3]

Starts PostgreSQL, an S3 server (moto) and `mlflow server` as the tests do (tests/watch_servers.py), one watcher
(`replay watch --interval 2 --json`), then:
1. idle: the watcher's CPU seconds (user + system, from /proc) per minute of polling an empty experiment;
2. latency: trains failing runs one at a time (a crashing model -> diagnose; nan_forward -> nan + ablate) and, for
   each, the time from the run's end (MLflow's end_time) to the watcher's claim and to its triage tags being written
   (the watcher's `done` event comes after the tags).
Figures are from one run on this machine; the claim latency is bounded by interval + settle + one poll.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import watch_servers  # noqa: E402

REPLAY = shutil.which("replay") or str(Path(sys.executable).with_name("replay"))
EXPERIMENT = "watch-benchmark"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def crashing_project(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.e2e import test_watch  # noqa: E402  (pytest is importable wherever the tests run)

    (folder / "crash").mkdir(parents=True)
    (folder / "crash" / "crashing.py").write_text(test_watch.CRASHING_MODEL)
    (folder / "crash" / "config.yaml").write_text(test_watch.CRASHING_CONFIG)
    return folder / "crash"


def read_events(stream, events: queue.Queue) -> None:
    for line in stream:
        if line.strip().startswith("{"):
            events.put(json.loads(line))


def event_time(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["time"]).timestamp()


def wait_for(events: queue.Queue, run_id: str, kinds: tuple[str, ...], timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        event = events.get(timeout=max(0.1, deadline - time.time()))
        if event.get("run_id") == run_id and event["event"] in kinds:
            return event
    raise TimeoutError(f"no {kinds} event for {run_id}")


def train(server, env: dict, config_dir: Path) -> str:
    done = subprocess.run([REPLAY, "train", "--json", "--tracking-uri", server.tracking_uri, "--config-dir", str(config_dir),
                           "train.steps=30"], env=env, capture_output=True, text=True, timeout=600)
    if done.stdout.strip():
        return json.loads(done.stdout)["run_id"]
    from mlflow import MlflowClient  # the crashing model: exit 1, its run is the newest crashed one

    client = MlflowClient(server.tracking_uri)
    experiment_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    return client.search_runs([experiment_id], "tags.`replaybisect.status` = 'crashed'", order_by=["attributes.start_time DESC"],
                              max_results=1)[0].info.run_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=3, help="failing runs of each kind")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="watch-bench-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", MLFLOW_EXPERIMENT_NAME=EXPERIMENT, PYTHONUNBUFFERED="1",
               REPLAYBISECT_CODE_DIR=os.pathsep.join([str(ROOT / "examples"), str(folder)]))
    crash_dir = crashing_project(folder / "project")
    with watch_servers.team_server(folder) as server:
        from mlflow import MlflowClient

        client = MlflowClient(server.tracking_uri)
        client.create_experiment(EXPERIMENT)
        watcher = subprocess.Popen([REPLAY, "watch", *watch_servers.ALLOW_ROOT, "--tracking-uri", server.tracking_uri, "--experiment", EXPERIMENT, "--json",
                                    "--interval", str(args.interval), "--horizon", "5"], cwd=folder, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        events: queue.Queue = queue.Queue()
        threading.Thread(target=read_events, args=(watcher.stdout, events), daemon=True).start()
        try:
            events.get(timeout=120)  # start
            time.sleep(args.interval * 2)  # past start-up
            cpu_before, wall_before = cpu_seconds(watcher.pid), time.monotonic()
            time.sleep(args.idle_seconds)
            idle_cpu = cpu_seconds(watcher.pid) - cpu_before
            idle_wall = time.monotonic() - wall_before
            per_minute = idle_cpu / idle_wall * 60
            print(f"idle: {idle_cpu:.2f} CPU s over {idle_wall:.0f} s of polling every {args.interval:g} s "
                  f"= {per_minute:.2f} CPU s per minute ({per_minute / 60:.2%} of one core)", flush=True)

            rows = []
            for kind, config_dir in [("crashed -> diagnose", crash_dir), ("nonfinite -> nan + ablate", ROOT / "examples" / "nan_forward")]:
                for _ in range(args.runs):
                    run_id = train(server, env, config_dir)
                    ended = client.get_run(run_id).info.end_time / 1000
                    claimed = wait_for(events, run_id, ("claimed",))
                    finished = wait_for(events, run_id, ("done", "failed"))
                    tags = client.get_run(run_id).data.tags
                    assert tags.get("replaybisect.triage") in ("done", "failed"), tags
                    rows.append((kind, event_time(claimed) - ended, event_time(finished) - ended))
                    print(f"{kind:<26} claim {rows[-1][1]:5.2f} s   tags {rows[-1][2]:6.2f} s after the run ended", flush=True)
            print()
            for kind in dict.fromkeys(row[0] for row in rows):
                claims = sorted(row[1] for row in rows if row[0] == kind)
                tags = sorted(row[2] for row in rows if row[0] == kind)
                print(f"{kind:<26} claim median {claims[len(claims) // 2]:.2f} s (max {claims[-1]:.2f}, "
                      f"{claims[-1] / args.interval:.2f}x the interval); tags median {tags[len(tags) // 2]:.2f} s (max {tags[-1]:.2f})")
        finally:
            watcher.terminate()
            watcher.wait(timeout=60)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
