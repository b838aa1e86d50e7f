"""`replay memory --run-id X`: what keeps the run's memory growing, or where a step that ran out of memory put it."""

from __future__ import annotations

import typer

from replaybisect.options import JSON_OUTPUT, finish, request_command, stderr_console
from replaybisect.verbs.memory.request import MemoryRequest


def memory(request: MemoryRequest, as_json: bool) -> None:
    """Replay a few recorded steps and name what the loop keeps across them: a list or dict of its code that gains
    tensors each step (each holding its step's autograd graph, when it does), or a tensor whose autograd graph gains
    nodes each step (a running sum of losses); with the line that adds to it and the fix. The process's growth per
    step is measured too. `replay diagnose` says when memory grows; this says what holds it.

    On a run whose step ran out of memory: that step replayed under the memory profiler (its peak by kind, the
    activations each module saved, the largest tensors and their line), the bytes a sample adds, and a batch size
    that fits the recorded cap, proven by running the step at that size under the cap (on CPU: RLIMIT_AS).

    \b
        replay memory --run-id 3f2a...
        replay memory --run-id 3f2a... --step 400 --steps 6
    """
    from replaybisect.options import run_store
    from replaybisect.verbs.nan.command import progress_log

    store = run_store(request.tracking_uri, request.run_id)  # an unknown run is answered before torch is imported
    from replaybisect.verbs.memory.engine import memory as run_memory
    from replaybisect.verbs.memory.report import print_report, publish

    report = run_memory(store, request.run_id, request.step, steps=request.steps, device=request.torch_device,
                        trust=request.trusted, log=progress_log(stderr_console()))
    finish(report, store=store, publishing=request.publish, publish=publish, render=print_report, as_json=as_json)


def register(app: typer.Typer) -> None:
    command = request_command(MemoryRequest, memory, extras=[JSON_OUTPUT])
    app.command("memory", short_help="What holds growing memory; after an OOM, what fits.")(command)
