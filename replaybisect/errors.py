"""The one exception family for what a user can fix (printed on one line, exit status 2)."""


class ReplayError(Exception):
    """Bad input: the message says what is wrong and what to do."""

    exit_code = 2


class ConfigError(ReplayError):
    """The config does not compose, validate or instantiate."""


class RunNotFound(ReplayError):
    """No such run in the tracking store."""


class StoreUnreachable(ReplayError):
    """The tracking store cannot be reached or opened."""


class SnapshotError(ReplayError):
    """A snapshot is missing, incomplete, fails verification or is unsafe to load."""


class GitError(ReplayError):
    """A git input (repository, SHA, range) is not usable."""


class NonFiniteStop(Exception):
    """Training stopped on a non-finite loss or gradient norm (exit status 3)."""

    exit_code = 3

    def __init__(self, step: int, what: str, run_id: str):
        super().__init__(f"step {step}: non-finite {what}; run {run_id} stopped (snapshot of the state before step {step} saved)")
        self.step = step
        self.what = what
        self.run_id = run_id
