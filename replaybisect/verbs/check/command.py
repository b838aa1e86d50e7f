"""`replay check [hydra overrides | --run-id X]`: the five-minute checklist."""

from __future__ import annotations

import typer

from replaybisect.options import HYDRA_CONTEXT, JSON_OUTPUT, print_json, request_command
from replaybisect.verbs.check.request import CheckRequest


def check(request: CheckRequest, as_json: bool) -> None:
    """Run the checklist: overfit one batch, data sanity, loss/output mismatch, initialization, activations,
    gradient flow and an LR range test. Each check is pass | warn | fail with the number behind it.

    Check a config before a long run (same options and overrides as `replay train`), or a recorded run:

    \b
        replay check model=cnn optim.lr=3e-3
        replay check --config-dir conf --config-name config
        replay check --run-id 3f2a...   (its config, at the last snapshot before its growth began)
        replay check --run-id 3f2a... --step 200   (the snapshot at or before step 200)

    Nothing is changed: the checks run on copies of the model and optimizer, and the RNG streams are
    left as they were. The result is recorded as a child run (kind=check) with check.md and lr_range.png.

    Exit status: 0 the checks ran (failing checks are a result), 2 bad input.
    """
    from replaybisect.options import recording_store, run_store

    # an unknown run is answered before torch is imported
    store = run_store(request.tracking_uri, request.run_id) if request.run_id else None
    from replaybisect.core import config as config_mod
    from replaybisect.verbs.check.engine import check as run_check

    cfg = None if request.run_id else config_mod.compose(request.config_dir, request.config_name, list(request.overrides))

    from replaybisect.verbs.check.report import print_check_report, publish

    # a config's checks need no store: it is opened (created) only to record the report, so a config that does not
    # build creates nothing
    open_later = None if store else recording_store(request.tracking_uri, later=True)
    from replaybisect.options import say

    report = run_check(store, cfg=cfg, run_id=request.run_id, step=request.step, options=request.options(),
                   trust=request.trusted, progress=lambda name: say(f"check: {name}"))
    store = store or open_later()
    publish(store, report, cfg, code_folder=request.code_folder)
    if as_json:
        print_json(report.to_json())
    else:
        print_check_report(report)


def register(app: typer.Typer) -> None:
    # bad input (a step without a run, a run and a config, an unknown check) is refused as the request is built,
    # before any store is opened
    command = request_command(CheckRequest, check, extras=[JSON_OUTPUT])
    app.command("check", context_settings=HYDRA_CONTEXT, short_help="The 5-minute checklist on a config or a run.")(command)
