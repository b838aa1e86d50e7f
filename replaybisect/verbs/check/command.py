"""`replay check [hydra overrides | --run-id X]`: the five-minute checklist."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from replaybisect.options import HYDRA_CONTEXT, CodeDirs, JsonFlag, TrackingUri, AllowUnsigned, TrustPrefixes, print_json
from replaybisect.verbs.check.request import LR_STEPS, OVERFIT_SAMPLES, OVERFIT_STEPS, STEP, CheckRequest


def check_command(
    ctx: typer.Context,
    config_dir: Optional[Path] = typer.Option(None, "--config-dir", help="Your Hydra config folder (default: the built-in example)."),
    config_name: str = typer.Option("config", "--config-name", help="Primary config in --config-dir."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Check a recorded run: its config, at a healthy snapshot (the last before its growth began)."),
    step: Optional[int] = typer.Option(None, "--step", **STEP.limits, help="With --run-id: check the snapshot at or before this step."),
    tracking_uri: Optional[str] = TrackingUri,
    as_json: bool = JsonFlag,
    code_dirs: Optional[list[str]] = CodeDirs,
    trust_prefixes: Optional[list[str]] = TrustPrefixes,
    allow_unsigned: Optional[str] = AllowUnsigned,
    overfit_steps: int = typer.Option(300, "--overfit-steps", **OVERFIT_STEPS.limits, help="Steps of the overfit-one-batch check."),
    overfit_samples: int = typer.Option(16, "--overfit-samples", **OVERFIT_SAMPLES.limits, help="Samples in the overfit batch (2-32)."),
    lr_steps: int = typer.Option(100, "--lr-steps", **LR_STEPS.limits, help="Steps of the LR range test."),
    lr_min: float = typer.Option(1e-7, "--lr-min", help="First learning rate of the LR range test."),
    lr_max: float = typer.Option(10.0, "--lr-max", help="Last learning rate of the LR range test."),
    only: Optional[str] = typer.Option(None, "--only", help="Comma list of checks or groups: overfit,data,loss,init,act,grad,lr."),
):
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
    # bad input (a step without a run, a run and a config, an unknown check) is refused before any store is opened
    request = CheckRequest(
        overrides=list(ctx.args), run_id=run_id, step=step, config_dir=config_dir, config_name=config_name, only=only,
        tracking_uri=tracking_uri, code_dirs=code_dirs or (), trust=trust_prefixes or (), allow_unsigned=allow_unsigned, overfit_steps=overfit_steps,
        overfit_samples=overfit_samples, lr_steps=lr_steps, lr_min=lr_min, lr_max=lr_max,
    )
    from replaybisect.options import recording_store, run_store

    # an unknown run is answered before torch is imported
    store = run_store(request.tracking_uri, request.run_id) if request.run_id else None
    from replaybisect.core import config as config_mod
    from replaybisect.verbs.check.engine import check

    cfg = None if request.run_id else config_mod.compose(request.config_dir, request.config_name, list(request.overrides))

    from replaybisect.verbs.check.report import print_check_report, publish

    # a config's checks need no store: it is opened (created) only to record the report, so a config that does not
    # build creates nothing
    open_later = None if store else recording_store(request.tracking_uri, later=True)
    from replaybisect.options import say

    report = check(store, cfg=cfg, run_id=request.run_id, step=request.step, options=request.options(),
                   trust=request.trusted, progress=lambda name: say(f"check: {name}"))
    store = store or open_later()
    publish(store, report, cfg, code_folder=request.code_folder)
    if as_json:
        print_json(report.to_json())
    else:
        print_check_report(report)


def register(app: typer.Typer) -> None:
    app.command("check", context_settings=HYDRA_CONTEXT, short_help="The 5-minute checklist on a config or a run.")(check_command)
