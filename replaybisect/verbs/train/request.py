"""What `replay train` and `replaybisect.train` are asked: checked when built (replaybisect/request.py). The config
itself (its values, devices, optimizer) is checked where it is composed (core/config.py), by both front doors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence, Union, get_args

from replaybisect import request as checks
from replaybisect.errors import ReplayError
from replaybisect.request import option
from replaybisect.store import OLD_SERVER_TAG_VALUE

RunKind = Literal["train", "bisect-trial"]  # a run `replay train` records: yours, or one of a bisect's trials
RUN_KINDS: tuple[str, ...] = get_args(RunKind)


@dataclass(frozen=True)
class TrainRequest:
    """The Hydra config (`config_dir`: your config folder, None: the built-in example; `config_name`; `overrides`),
    where the run is recorded (`tracking_uri`, `run_name`), and, for a run another command trains (a bisect's trial):
    its parent run, kind and extra tags (`key=value`)."""

    overrides: Sequence[str] = checks.hydra_overrides()
    config_dir: Union[str, Path, None] = option(None, "--config-dir", help="Your Hydra config folder (default: the built-in example).")
    config_name: str = option("config", "--config-name", help="Primary config in --config-dir.")
    tracking_uri: Optional[str] = checks.tracking_uri_option()
    run_name: Optional[str] = option(None, "--run-name", help="MLflow run name.")
    parent_run_id: Optional[str] = option(None, "--parent-run-id", hidden=True, help="The run this one is a trial of.")
    kind: RunKind = option("train", "--kind", hidden=True, help="train | bisect-trial.")
    tags: Sequence[str] = option((), "--tag", hidden=True, help="key=value, repeated")
    extra_tags: dict[str, str] = field(init=False, repr=False, compare=False)  # the tags, as a dict

    def __post_init__(self) -> None:
        checks.setattrs(
            self, tracking_uri=checks.tracking_uri(self.tracking_uri),
            run_name=checks.named(self.run_name, "run_name", "--run-name", "name the run, or leave it out for its config's name",
                                  optional=True),
            overrides=checks.strings(self.overrides, "overrides", what="Hydra overrides"),
            config_dir=checks.config_folder(self.config_dir),
            config_name=checks.named(self.config_name, "config_name", "--config-name",
                                     "name a YAML file of the config folder without .yaml, or leave it out for `config`"),
            parent_run_id=checks.run_id(self.parent_run_id) if self.parent_run_id is not None else None,
            kind=checks.text(self.kind, "kind"), tags=checks.strings(self.tags, "tags", what="key=value tags"),
        )
        if self.kind not in RUN_KINDS:
            raise ReplayError(f"--kind {self.kind[:80]!r} is not a kind of run `replay train` records; use {' or '.join(RUN_KINDS)}")
        extra_tags = {}
        for item in self.tags:
            key, sep, value = item.partition("=")
            if not sep:
                raise ReplayError(f"--tag {item!r} is not key=value")
            extra_tags[key] = value
        checks.setattrs(self, extra_tags=extra_tags)

    def run_tags(self) -> dict[str, str]:
        """The extra tags, and how to train the run again (`replay watch` proposes a proven fix as that command
        plus an override): the overrides, and the config folder and name when they are not the defaults."""
        import json

        tags = {"replaybisect.overrides": json.dumps(list(self.overrides))}
        if len(tags["replaybisect.overrides"]) > OLD_SERVER_TAG_VALUE:
            return dict(self.extra_tags)  # without its overrides, no command would train it again
        if self.config_dir is not None:
            tags["replaybisect.config_dir"] = str(self.code_folder)
        if self.config_name != "config":
            tags["replaybisect.config_name"] = self.config_name
        return {**self.extra_tags, **tags}

    @property
    def code_folder(self) -> Path:
        """The folder the run's code is recorded from: the config folder, else the working folder."""
        return self.config_dir.expanduser().resolve() if self.config_dir is not None else Path.cwd()  # as compose reads it
