"""What `replay runs` is asked: filters checked when built, before the store is looked for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from replaybisect import request as checks
from replaybisect.request import Bound, option
from replaybisect.verbs.runs.engine import KINDS, MAX_LIMIT, STATUSES, check_filters


@dataclass(frozen=True)
class RunsRequest:
    """How many recent runs, of which kind (`all`: every kind) and status, from which store."""

    limit: int = option(20, bound=Bound("runs", ("--limit", "-n"), low=1, high=MAX_LIMIT), help="How many runs, newest first.")
    kind: str = option("train", "--kind", help=" | ".join((*KINDS, "all")))
    status: Optional[str] = option(None, "--status", help=" | ".join(STATUSES))
    tracking_uri: Optional[str] = checks.tracking_uri_option()

    def __post_init__(self) -> None:
        check_filters(self.limit, self.kind_filter, self.status)

    @property
    def kind_filter(self) -> Optional[str]:
        return None if self.kind == "all" else self.kind
