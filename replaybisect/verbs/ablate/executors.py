"""Where the arms run: in this process, a pool of local workers forked from the preloaded server, or submitit
jobs; each reports its progress per replayed step."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Optional

from replaybisect.core.jobs import JobSettings
from replaybisect.verbs.ablate.arm import init_worker, run_arm


# ---- executors ---------------------------------------------------------------------------------------
ProgressFn = Callable[[str, str, int], None]  # (arm, event: "step"|"done", value)


def run_here(specs: list[dict], progress: Optional[ProgressFn]) -> dict[str, dict]:
    """--workers 1: the arms one after another in this process (no interpreter to start). Each arm restores
    everything a step reads (model, optimizer, RNG streams, thread count), so the order does not matter."""
    from replaybisect.core.rng import isolated_rng

    import torch

    results = {}
    threads = torch.get_num_threads()
    for spec in specs:
        arm = spec["arm"]
        on_step = (lambda step, arm=arm: progress(arm, "step", step)) if progress else None
        try:
            with isolated_rng():
                results[arm] = run_arm(spec, on_step)
        finally:
            torch.set_num_threads(threads)
        if progress:
            progress(arm, "done", 0)
    return results


@contextlib.contextmanager
def local_pool(workers: int):
    """A process pool and its progress channel. The workers are forked from a server that has imported torch and
    MLflow and nothing else (core/processes.py): no torch or MLflow state of this process, and no seconds of imports
    each. multiprocessing hands them this process's working folder and sys.path; the environment is handed here.
    A sweep keeps one pool across its rounds."""
    from concurrent.futures import ProcessPoolExecutor

    from replaybisect.core.processes import preloaded_forkserver

    context = preloaded_forkserver()
    channel = context.Queue()
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=init_worker,
                             initargs=(channel, dict(os.environ))) as pool:
        yield pool, channel


def run_local(specs: list[dict], workers: int, progress: Optional[ProgressFn], pool=None) -> dict[str, dict]:
    """The arms on a local process pool (this call's, or `pool` from `local_pool`); each worker applies the recorded
    thread count when it restores, so verdicts do not depend on --workers."""
    if pool is None:
        with local_pool(max(1, min(workers, len(specs)))) as own:
            return run_local(specs, workers, progress, own)
    import queue as queue_mod
    from concurrent.futures import FIRST_COMPLETED, wait

    pool, channel = pool
    results: dict[str, dict] = {}

    def drain() -> None:
        while True:
            try:
                arm, step = channel.get_nowait()
            except queue_mod.Empty:
                return
            if progress:
                progress(arm, "step", step)

    pending = {pool.submit(run_arm, spec): spec["arm"] for spec in specs}
    while pending:
        done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
        drain()
        for future in done:
            arm = pending.pop(future)
            try:
                results[arm] = future.result()
            except Exception as error:  # the worker process died (BrokenProcessPool, killed)
                results[arm] = {"arm": arm, "error": f"{type(error).__name__}: {error}"}
            if progress:
                progress(arm, "done", 0)
    drain()
    return results


def run_submitit(specs: list[dict], workers: int, options: JobSettings, progress: Optional[ProgressFn]) -> dict[str, dict]:
    executor = options.executor("replay-ablate", parallelism=workers)
    jobs = executor.map_array(run_arm, specs)
    results: dict[str, dict] = {}
    pending = {job.job_id: (job, spec["arm"]) for job, spec in zip(jobs, specs)}
    while pending:
        for job_id, (job, arm) in list(pending.items()):
            if not job.done():
                continue
            del pending[job_id]
            try:
                results[arm] = job.result()
            except Exception as error:  # the job failed outside run_arm (scheduler, timeout, node)
                first = str(error).strip().splitlines()
                results[arm] = {"arm": arm, "error": f"submitit job {job_id} failed: {first[-1] if first else type(error).__name__}"}
            if progress:
                progress(arm, "done", 0)
        if pending:
            time.sleep(0.25)
    return results
