"""What `replay check` and `replaybisect.check` are asked: checked when built (replaybisect/request.py), before any
store is opened or created."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from replaybisect import request as checks
from replaybisect.errors import ReplayError
from replaybisect.request import MAX_STEPS, Bound, option

STEP = Bound("check", ("--step",), low=0)
OVERFIT_STEPS = Bound("check", ("--overfit-steps",), low=1, high=MAX_STEPS)
OVERFIT_SAMPLES = Bound("check", ("--overfit-samples",), low=2, high=32)
LR_STEPS = Bound("check", ("--lr-steps",), low=2, high=MAX_STEPS)


@dataclass(frozen=True)
class CheckRequest:
    """A config to check (`overrides`, `config_dir`, `config_name`) or a recorded run (`run_id`, at a healthy
    snapshot or the one at or before `step`), the checks to run (`only`: names or groups, a list or "data,lr";
    None: all) and their sizes, and which of a stored config's `_target_`s may be built (`code_dirs`, `trust`)."""

    overrides: Sequence[str] = checks.hydra_overrides()
    config_dir: Union[str, Path, None] = option(None, "--config-dir", help="Your Hydra config folder (default: the built-in example).")
    config_name: str = option("config", "--config-name", help="Primary config in --config-dir.")
    run_id: Optional[str] = option(None, "--run-id", help="Check a recorded run: its config, at a healthy snapshot (the "
                                   "last before its growth began).")
    step: Optional[int] = option(None, bound=STEP, help="With --run-id: check the snapshot at or before this step.")
    tracking_uri: Optional[str] = checks.tracking_uri_option()
    code_dirs: Sequence[str] = checks.code_dirs_option()
    trust: Sequence[str] = checks.trust_option()
    allow_unsigned: Optional[str] = checks.allow_unsigned_option()  # the run's id: replayed without a signature that verifies
    overfit_steps: int = option(300, bound=OVERFIT_STEPS, help="Steps of the overfit-one-batch check.")
    overfit_samples: int = option(16, bound=OVERFIT_SAMPLES, help="Samples in the overfit batch (2-32).")
    lr_steps: int = option(100, bound=LR_STEPS, help="Steps of the LR range test.")
    lr_min: float = option(1e-7, "--lr-min", help="First learning rate of the LR range test.")
    lr_max: float = option(10.0, "--lr-max", help="Last learning rate of the LR range test.")
    only: Union[str, Sequence[str], None] = option(None, "--only", kind=Optional[str], help="Comma list of checks or "
                                                   "groups: overfit,data,loss,init,act,grad,lr.")
    publish: bool = True
    trusted: Any = field(init=False, repr=False, compare=False)  # the trust decision (a run's), None for a config

    def __post_init__(self) -> None:
        checks.setattrs(
            self, tracking_uri=checks.tracking_uri(self.tracking_uri),
            run_id=checks.run_id(self.run_id) if self.run_id is not None else None,
            step=checks.integer(self.step, "step", STEP, optional=True),
            overrides=checks.strings(self.overrides, "overrides", what="Hydra overrides"),
            config_dir=checks.config_folder(self.config_dir), config_name=checks.text(self.config_name, "config_name"),
            only=names_shown(self.only), code_dirs=checks.paths(self.code_dirs, "code_dirs"),
            trust=checks.strings(self.trust, "trust", what="module prefixes"),
            overfit_steps=checks.integer(self.overfit_steps, "overfit_steps", OVERFIT_STEPS),
            overfit_samples=checks.integer(self.overfit_samples, "overfit_samples", OVERFIT_SAMPLES),
            lr_steps=checks.integer(self.lr_steps, "lr_steps", LR_STEPS),
            lr_min=checks.number(self.lr_min, "lr_min"), lr_max=checks.number(self.lr_max, "lr_max"),
            publish=checks.flag(self.publish, "publish"),
        )
        if self.step is not None and not self.run_id:
            raise ReplayError("--step picks a snapshot of a recorded run: pass it with --run-id")
        if self.run_id and (self.config_dir is not None or self.overrides or self.config_name != "config"):
            raise ReplayError("pass either --run-id or a config (--config-dir/--config-name/overrides), not both")
        if not self.run_id and (self.code_dirs or self.trust or self.allow_unsigned):
            raise ReplayError("--code-dir, --trust and --allow-unsigned apply to --run-id (a stored config); a config you "
                              "compose is your own code")
        if not (0 < self.lr_min < self.lr_max < math.inf):
            raise ReplayError(f"--lr-min {float(self.lr_min)} and --lr-max {float(self.lr_max)} must be finite with 0 < lr-min < lr-max")
        if self.only:  # an unknown check is bad input before a store is opened (or created); the checks import torch
            from replaybisect.verbs.check.engine import select

            select(list(self.only))
        checks.setattrs(self, trusted=checks.trust_of(self.code_dirs, self.trust, self.run_id, self.allow_unsigned) if self.run_id else None)

    def options(self):
        """The engine's CheckOptions (imports torch)."""
        from replaybisect.verbs.check.engine import CheckOptions

        return CheckOptions(overfit_steps=self.overfit_steps, overfit_samples=self.overfit_samples, lr_steps=self.lr_steps,
                            lr_min=float(self.lr_min), lr_max=float(self.lr_max),
                            only=list(self.only) if self.only else None)

    @property
    def code_folder(self) -> Optional[Path]:
        """The folder a composed config's code is recorded from (None for a run: its own tags say)."""
        if self.run_id:
            return None
        return self.config_dir.resolve() if self.config_dir is not None else Path.cwd()


def names_shown(only: Any) -> Optional[tuple[str, ...]]:
    """--only's checks and groups: "data,lr" or a list (None or empty: all)."""
    if only is None:
        return None
    if isinstance(only, str):
        return tuple(part.strip() for part in only.split(",") if part.strip()) or None
    return checks.strings(only, "only", what="checks or groups") or None
