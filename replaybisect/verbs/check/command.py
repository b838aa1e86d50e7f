"""`replay check [hydra overrides | --run-id X]`: the five-minute checklist."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from replaybisect.options import HYDRA_CONTEXT, MAX_STEPS, CodeDirs, JsonFlag, TrackingUri, TrustPrefixes, print_json


def check_command(
    ctx: typer.Context,
    config_dir: Optional[Path] = typer.Option(None, "--config-dir", help="Your Hydra config folder (default: the built-in example)."),
    config_name: str = typer.Option("config", "--config-name", help="Primary config in --config-dir."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Check a recorded run: its config, at a healthy snapshot (the last before its growth began)."),
    step: Optional[int] = typer.Option(None, "--step", help="With --run-id: check the snapshot at or before this step."),
    tracking_uri: Optional[str] = TrackingUri,
    as_json: bool = JsonFlag,
    code_dirs: Optional[list[str]] = CodeDirs,
    trust_prefixes: Optional[list[str]] = TrustPrefixes,
    overfit_steps: int = typer.Option(300, "--overfit-steps", min=1, max=MAX_STEPS, help="Steps of the overfit-one-batch check."),
    overfit_samples: int = typer.Option(16, "--overfit-samples", min=2, max=32, help="Samples in the overfit batch (2-32)."),
    lr_steps: int = typer.Option(100, "--lr-steps", min=2, max=MAX_STEPS, help="Steps of the LR range test."),
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
    from replaybisect.errors import ReplayError

    if step is not None and not run_id:
        raise ReplayError("--step picks a snapshot of a recorded run: pass it with --run-id")
    if run_id and (config_dir is not None or ctx.args or config_name != "config"):
        raise ReplayError("pass either --run-id or a config (--config-dir/--config-name/overrides), not both")
    if not run_id and (code_dirs or trust_prefixes):
        raise ReplayError("--code-dir and --trust apply to --run-id (a stored config); a config you compose is your own code")
    if not (0 < lr_min < lr_max < math.inf):
        raise ReplayError(f"--lr-min {lr_min} and --lr-max {lr_max} must be finite with 0 < lr-min < lr-max")

    from replaybisect.options import recording_store, run_store

    store = run_store(tracking_uri, run_id) if run_id else None  # an unknown run is answered before torch is imported
    from replaybisect.core import config as config_mod
    from replaybisect.verbs.check.engine import CheckOptions, check, select

    options = CheckOptions(
        overfit_steps=overfit_steps, overfit_samples=overfit_samples, lr_steps=lr_steps, lr_min=lr_min, lr_max=lr_max,
        only=[part.strip() for part in only.split(",") if part.strip()] if only else None,
    )
    select(options.only)  # an unknown check is bad input before the store is opened (or created)
    cfg = None if run_id else config_mod.compose(config_dir, config_name, list(ctx.args))

    from replaybisect.verbs.check.report import print_check_report, publish
    from replaybisect.core.trust import Trust

    trust = Trust.from_user(code_dirs or (), trust_prefixes or ()) if run_id else None
    # a config's checks need no store: it is opened (created) only to record the report, so a config that does not
    # build creates nothing
    open_later = None if store else recording_store(tracking_uri, later=True)
    code_folder = None if run_id else (config_dir.resolve() if config_dir else Path.cwd())
    from replaybisect.options import say

    report = check(store, cfg=cfg, run_id=run_id, step=step, options=options, trust=trust, progress=lambda name: say(f"check: {name}"))
    store = store or open_later()
    publish(store, report, cfg, code_folder=code_folder)
    if as_json:
        print_json(report.to_json())
    else:
        print_check_report(report)


def register(app: typer.Typer) -> None:
    app.command("check", context_settings=HYDRA_CONTEXT, short_help="The 5-minute checklist on a config or a run.")(check_command)
