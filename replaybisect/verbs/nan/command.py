"""`replay nan --run-id X`: where the first NaN/Inf came from, and why."""

from __future__ import annotations

import typer

from replaybisect.options import JSON_OUTPUT, finish, request_command, stderr_console
from replaybisect.verbs.nan.request import NanRequest


def nan(request: NanRequest, as_json: bool) -> None:
    """Replay the failing step from the newest snapshot before it and probe it: the batch, the state, every
    module's forward and backward, the loss, the optimizer update, then detect_anomaly for the op.

    Example:

    \b
        $ replay nan --run-id 3f33...
        replay nan  run 3f33...  optimizer at step 0: AdamW.step made net.0's weights or moments non-finite ...
                               op  AdamW.step
          state corrupted at step  0
                           replay  snapshot 0 -> reproduced exact
        evidence
          - AdamW with eps=0: 607 entries of net.0.weight have exp_avg_sq == 0 ... 0/0 = NaN
        next  replay ablate eps,lr,clip --run-id 3f33...

    Categories: divergence (the loss / grad norm climbed by orders of magnitude until the values overflowed:
    learning rate, clipping or init; next `replay ablate lr,clip`) | data | forward | loss | backward | optimizer
    (an op or the update made a non-finite value from finite, moderate values: the op and its line) |
    corrupt-state | transient.
    Exit status 0 with a diagnosis; 2 for an unknown run, a run that never failed, no usable snapshot.
    """
    from replaybisect.options import run_store

    store = run_store(request.tracking_uri, request.run_id)  # an unknown run is answered before torch is imported
    from replaybisect.core.tags import failing_step
    from replaybisect.verbs.nan.request import target_step

    if request.step is None:  # a run that never failed, a damaged tag: one line before torch is imported
        target_step(request.run_id, None, failing_step(store, request.run_id), store.tags(request.run_id), {}, {})
    from replaybisect.verbs.nan.ranked import answer
    from replaybisect.verbs.nan.report import print_rich, publish

    report = answer(store, request, log=progress_log(stderr_console()))
    finish(report, store=store, publishing=request.publish, publish=publish, render=lambda report: print_rich(report, store.uri),
           as_json=as_json)


def progress_log(console):
    """The progress lines of a replay (`running train.py lr=0.3 again in ...`, a script's own lines relayed from its
    process), dimmed on stderr: what they quote (stored args, paths, the script's output) is printed as it is."""
    from replaybisect.report import plain

    return lambda message: console.print(f"[dim]{plain(message)}[/dim]")


def register(app: typer.Typer) -> None:
    # bad input (a device this machine lacks, a --code-dir that is no folder) is refused as the request is built,
    # before the store is opened
    command = request_command(NanRequest, nan, extras=[JSON_OUTPUT])
    app.command("nan", short_help="Where the first NaN/Inf came from, and why.")(command)
