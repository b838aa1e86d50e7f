"""What `replay diagnose` and `replaybisect.diagnose` are asked: checked when built (replaybisect/request.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from replaybisect import request as checks
from replaybisect.request import REQUIRED, option


@dataclass(frozen=True)
class DiagnoseRequest:
    """The run whose recorded curves are read, where the store is, and whether the report is recorded."""

    run_id: str = option(REQUIRED, "--run-id", help="The run to read (see `replay runs`).")
    tracking_uri: Optional[str] = checks.tracking_uri_option()
    publish: bool = option(True, "--no-artifacts", negated=True,
                           help="Do not record the report (no child run with diagnosis.md and the plot).")

    def __post_init__(self) -> None:
        checks.setattrs(self, tracking_uri=checks.tracking_uri(self.tracking_uri), run_id=checks.run_id(self.run_id),
                        publish=checks.flag(self.publish, "publish"))
