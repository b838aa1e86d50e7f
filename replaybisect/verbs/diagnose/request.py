"""What `replay diagnose` and `replaybisect.diagnose` are asked: checked when built (replaybisect/request.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from replaybisect import request as checks


@dataclass(frozen=True)
class DiagnoseRequest:
    """The run whose recorded curves are read, where the store is, and whether the report is recorded."""

    run_id: str
    tracking_uri: Optional[str] = None
    publish: bool = True  # record diagnosis.md and the plot as a child run (--no-artifacts: False)

    def __post_init__(self) -> None:
        checks.setattrs(self, tracking_uri=checks.tracking_uri(self.tracking_uri), run_id=checks.run_id(self.run_id),
                        publish=checks.flag(self.publish, "publish"))
