"""A long run's metric points are logged by a process of their own (record/metrics_process.py): every point reaches
the store, before and after the hand-off; a failure there is the recorder's one line; the logger ends at its END
line or when its recorder is gone, even while a forked DataLoader worker holds its pipe."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from replaybisect.record import metrics_process
from replaybisect.store import open_store
from tests.helpers import EXAMPLES


def _gone(pid: int) -> bool:
    """The process exited (a zombie no one reaps counts: a container's PID 1 may not reap)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


def _run(tmp_path: Path) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = open_store(uri)
    run_id = store.client.create_run(store.client.create_experiment("handoff")).info.run_id
    return uri, run_id


STEPS = 120


def test_every_point_of_a_run_reaches_the_store_before_and_after_the_hand_off(tmp_path, monkeypatch):
    import torch

    import replaybisect

    sys.path.insert(0, str(EXAMPLES / "own_loop"))
    try:
        import gpt_loop
    finally:
        sys.path.remove(str(EXAMPLES / "own_loop"))
    from omegaconf import OmegaConf

    monkeypatch.setattr(metrics_process, "HANDOFF_SECONDS", 0.0)  # the first flush in this process, the others in the logger's
    cfg = OmegaConf.merge(OmegaConf.load(EXAMPLES / "own_loop" / "config.yaml"),
                          {"d": 16, "layers": 1, "heads": 2, "T": 8, "micro_batch": 2})
    generator = torch.Generator().manual_seed(0)
    model, optimizer = gpt_loop.build(cfg)
    rec = replaybisect.Recorder(model, optimizer, step_fn=gpt_loop.train_step, build=gpt_loop.build, config=cfg,
                                tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    losses = [float(rec.step(gpt_loop.get_batch(cfg, generator))) for _ in range(STEPS)]  # flushed at 50, 100 and the end
    logger = rec._hooks._logging.process
    rec.close()

    assert logger is not None and logger._process.returncode == 0  # handed off, and ended at close
    store = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert store.metric_history(rec.run_id, "loss") == list(enumerate(losses))  # bit for bit, every step
    assert len(store.client.get_metric_history(rec.run_id, "loss")) == STEPS  # each once
    for name in ("lr", "step_time", "data_time", "grad_norm"):
        assert [step for step, _ in store.metric_history(rec.run_id, name)] == list(range(STEPS)), name


def test_a_failure_in_the_logger_is_one_line_raised_by_the_recorder(tmp_path):
    uri, _ = _run(tmp_path)
    logger = metrics_process.MetricsProcess(uri, "0" * 32)  # no such run: MLflow refuses its points
    logger.log([("loss", 1.0, 0)])
    # (ended: its Popen's wait, not /proc, which shows a leader thread as a zombie while the process still exits)
    assert logger._process.wait(60) == 1
    with pytest.raises(RuntimeError) as at_next_flush:  # the writer's next flush raises it (training stops at its next step)
        logger.log([("loss", 1.0, 1)])
    with pytest.raises(RuntimeError) as at_close:
        logger.close()
    message = str(at_next_flush.value)
    assert message.startswith(f"logging metrics to {uri} failed: ") and "\n" not in message
    assert str(at_close.value) == message


def test_a_stop_signal_sent_as_the_logger_starts_does_not_end_it(tmp_path):
    """A job's scheduler signals every process: one that reaches the logger before it ignores it (it was starting
    Python) is held until then, so the recorder still ends it with every point logged."""
    import signal

    uri, run_id = _run(tmp_path)
    logger = metrics_process.MetricsProcess(uri, run_id)
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        os.kill(logger._process.pid, stop)
    logger.log([("loss", 0.25, 0)])
    logger.close()
    assert logger._process.returncode == 0
    assert open_store(uri).metric_history(run_id, "loss") == [(0, 0.25)]


SCRIPT = """
    import os, sys, time
    from replaybisect.record.metrics_process import MetricsProcess

    logger = MetricsProcess({uri!r}, {run_id!r})
    logger.log([("loss", 0.25, 0), ("loss", 0.5, 1)])
    if os.fork() == 0:  # a DataLoader worker forked from the training process: it holds the logger's pipe
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1), os.dup2(devnull, 2)  # (not the test's: it reads this script's output to its end)
        time.sleep(60)
        os._exit(0)
    print(logger._process.pid, flush=True)
    if {close}:
        started = time.monotonic()
        logger.close()
        print(round(time.monotonic() - started, 1), flush=True)
    os._exit(0)  # (without close: the recorder's process is gone)
"""


@pytest.mark.parametrize("close", [True, False], ids=["closed", "recorder-gone"])
def test_the_logger_ends_with_its_recorder_while_a_forked_worker_holds_its_pipe(tmp_path, close):
    uri, run_id = _run(tmp_path)
    script = tmp_path / "recorder.py"
    script.write_text(textwrap.dedent(SCRIPT.format(uri=uri, run_id=run_id, close=close)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = done.stdout.split()
    try:
        assert _wait_gone(int(said[0]), 30), "the logger process outlived its recorder"
        if close:
            assert float(said[1]) < 30  # ended by its END line, not by the pipe's end the worker holds
        assert open_store(uri).metric_history(run_id, "loss") == [(0, 0.25), (1, 0.5)]
    finally:
        subprocess.run(["pkill", "-f", str(script)], capture_output=True)


TERMINATED = """
    import sys
    import torch
    import replaybisect
    from replaybisect.record import metrics_process

    metrics_process.HANDOFF_SECONDS = 0.0
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = replaybisect.Recorder(model, optimizer, tracking_uri={uri!r})
    said = False
    for step in range(10**9):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        logging = rec._hooks._logging
        if logging.process is not None and not said:
            print(logging.process._process.pid, flush=True)
            said = True
"""


def test_a_sigterm_to_every_process_of_the_job_ends_the_run_with_every_point_logged(tmp_path):
    """A scheduler's SIGTERM reaches the logger too: it stays for its recorder, which ends the run and then it. The
    script ends in one line, as SIGTERM ends a process (it printed "Error in sys.excepthook" and two tracebacks)."""
    import signal

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TERMINATED.format(uri=uri)))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logger = int(process.stdout.readline())
    time.sleep(1.0)  # a few more flushes' points on their way
    os.kill(logger, signal.SIGTERM)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)

    assert process.returncode == -signal.SIGTERM and "Traceback" not in stderr, stderr  # ended as SIGTERM ends a process
    assert stderr.splitlines()[-1] == "replaybisect: terminated (SIGTERM); the run ended KILLED with what it recorded"
    assert _wait_gone(logger, 30)
    (run,) = open_store(uri).search_runs("")
    assert run.info.status == "KILLED", stderr
    losses = open_store(uri).metric_history(run.info.run_id, "loss")
    assert [step for step, _ in losses] == list(range(len(losses))) and len(losses) > 100
