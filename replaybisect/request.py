"""What the verbs' requests share: each verb's input is one frozen dataclass (`verbs/<verb>/request.py`) that checks
itself when it is built, used by both front doors (`replay VERB` in command.py, `replaybisect.VERB(...)` in
__init__.py), so both refuse the same input with the same one-line ReplayError. Light: no torch, no MLflow.

A number's allowed range is declared once, as a `Bound`: command.py hands it to typer (the option's help shows it and
click refuses a value outside it while parsing), and the request checks it in the same words for the Python API.
A value of the wrong kind (a string where a count goes) cannot come from the command line, whose parser converts
types; from Python it is refused in the API's words (`step='3' is not an integer >= 0`), naming the argument.

A verb's option is declared once, as its request's field: `option(default, "--flag", help=...)` (or with a `Bound`)
carries the flag and the help text, and the typer command is made from the fields (options.request_command), so
adding an option to a verb is adding one field."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import MISSING, Field, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from replaybisect.core.arguments import run_id, shown, tracking_uri  # (one home: the Recorder checks with them too)
from replaybisect.errors import ReplayError

Number = Union[int, float]
MAX_STEPS = 1_000_000  # bound on step-count options: a typo (1e20) is bad input, not hours of work or memory
MAX_WORKERS = 256  # bound on parallel workers (processes, worktrees or SLURM jobs)


@dataclass(frozen=True)
class Bound:
    """The range an option allows, worded as typer refuses a value outside it:
    `Invalid value for '--steps': Input should be greater than or equal to 1 (allowed: 1 to 1000000); see ...`."""

    verb: str
    flags: tuple[str, ...]  # the option's names, as typer declares them: ("--workers", "-w")
    low: Optional[Number] = None
    high: Optional[Number] = None

    @property
    def limits(self) -> dict[str, Number]:
        """typer.Option's min=/max= (only the bounds there are)."""
        return {key: value for key, value in (("min", self.low), ("max", self.high)) if value is not None}

    def refusal(self, value: Number) -> Optional[str]:
        """The line the command prints for `value` (without `replay: error: `), or None when it is in range."""
        if self.low is not None and value < self.low:
            said = f"greater than or equal to {self.low}"
        elif self.high is not None and value > self.high:
            said = f"less than or equal to {self.high}"
        else:
            return None
        allowed = f" (allowed: {self.low} to {self.high})" if self.low is not None and self.high is not None else ""
        shown = " / ".join(f"'{flag}'" for flag in self.flags)
        return f"Invalid value for {shown}: Input should be {said}{allowed}; see `replay {self.verb} --help`"

    def check(self, value: Number) -> None:
        refused = self.refusal(value)
        if refused is not None:
            raise ReplayError(refused)


REQUIRED: Any = MISSING  # option(REQUIRED, "--run-id", ...): a field with no default


@dataclass(frozen=True)
class Cli:
    """How a request's field is given on the command line (options.request_command reads it)."""

    flags: tuple[str, ...]  # the option's names; () for a positional argument
    help: str
    kind: Any = None  # the command line's type, where the field's is not one typer reads (a path, a list)
    negated: bool = False  # a --no-X flag: the field is True unless it is given
    hidden: bool = False
    metavar: Optional[str] = None
    bound: Optional[Bound] = None
    extra_args: bool = False  # the command's extra arguments (Hydra overrides), not an option
    parse: Optional[Callable[[Any], Any]] = None  # the field's value from the command line's
    group: Optional[type] = None  # a dataclass whose own option fields are this field's options (JobSettings)
    envvar: Optional[str] = None  # the environment variable that gives the option when the command line does not

    def parameter_name(self, field_name: str) -> str:
        return self.flags[0].lstrip("-").replace("-", "_") if self.negated else field_name


def option(default: Any = MISSING, *flags: str, help: str, bound: Optional[Bound] = None, kind: Any = None,
           negated: bool = False, hidden: bool = False, metavar: Optional[str] = None,
           parse: Optional[Callable[[Any], Any]] = None, envvar: Optional[str] = None) -> Any:
    """A request field that is also a command-line option (`flags`, or the bound's): one declaration for both doors."""
    cli = Cli(flags or (bound.flags if bound else ()), help, kind, negated, hidden, metavar, bound, parse=parse, envvar=envvar)
    return field(default=default, metadata={"cli": cli})


def option_group(group: type, default: Any = None) -> Any:
    """A request field whose value is a `group` dataclass (JobSettings) made from that dataclass's own options."""
    return field(default=default, metadata={"cli": Cli((), group.__doc__ or "", group=group)})


def argument(default: Any = MISSING, *, help: str, kind: Any = None) -> Any:
    """A request field that is a positional argument of the command."""
    return field(default=default, metadata={"cli": Cli((), help, kind)})


def hydra_overrides() -> Any:
    """The Hydra overrides: the command's arguments after its options."""
    return field(default=(), metadata={"cli": Cli((), "Hydra overrides", extra_args=True)})


def cli_of(request_field: Field) -> Optional[Cli]:
    return request_field.metadata.get("cli")


def front_door(request_type: type, *, positional: tuple[str, ...] = (), internal: tuple[str, ...] = (),
               aliases: Optional[dict[str, tuple[str, Callable[[Any], Any], Any]]] = None) -> Callable:
    """The Python API function of a verb, its signature made from `request_type`'s fields (`positional` first, in that
    order; the rest keyword-only; `internal` fields left out): the decorated body takes the built request. `aliases`:
    an argument the function takes in place of a field, {name: (field, conversion, annotation)} (`submitit={...}`
    for `jobs`). An option added to the request is an argument of the function, with its default."""
    import functools
    import inspect
    import typing

    hints = typing.get_type_hints(request_type)
    aliases = aliases or {}
    replaced = {target for target, _, _ in aliases.values()}

    def parameter(request_field, kind) -> inspect.Parameter:
        default = inspect.Parameter.empty if request_field.default is MISSING else request_field.default
        return inspect.Parameter(request_field.name, kind, default=default, annotation=hints[request_field.name])

    def decorate(body: Callable) -> Callable:
        fields = {f.name: f for f in dataclasses.fields(request_type) if f.init and f.name not in internal and f.name not in replaced}
        parameters = [parameter(fields[name], inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in positional]
        parameters += [parameter(f, inspect.Parameter.KEYWORD_ONLY) for name, f in fields.items() if name not in positional]
        parameters += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
                       for name, (_, _, annotation) in aliases.items()]
        returned = body.__annotations__.get("return", inspect.Signature.empty)  # a name as text: the result types load late
        signature = inspect.Signature(parameters, return_annotation=returned.strip("'\"") if isinstance(returned, str) else returned)

        @functools.wraps(body)
        def function(*args: Any, **kwargs: Any) -> Any:
            given = dict(signature.bind(*args, **kwargs).arguments)
            for name, (target, conversion, _) in aliases.items():
                if given.get(name) is not None:
                    given[target] = conversion(given.pop(name))
                given.pop(name, None)
            return body(request_type(**given))

        function.__signature__ = signature
        del function.__wrapped__  # (documentation tools read the signature, not the body's)
        return function

    return decorate


# the options several verbs share, worded once
def tracking_uri_option() -> Any:
    return option(None, "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the nearest "
                  "mlflow.db in this folder or above, else ./mlflow.db).")


def code_dirs_option() -> Any:
    return option((), "--code-dir", help="A folder of your own code the run's `_target_`s may import from "
                  "(repeatable; the working folder always counts).")


def trust_option() -> Any:
    return option((), "--trust", help="Trust `_target_`s under this module prefix, e.g. mypkg (repeatable; also "
                  "$REPLAYBISECT_TRUST=a,b).")


def executor_option() -> Any:
    """Where a verb's work runs (ablate's arms, bisect's trials, watch's triage steps): core/jobs.py."""
    return option("local", "--executor", help="local (processes here) | submitit (jobs: SLURM when sbatch exists, else "
                  "submitit's local executor).")


def allow_unsigned_option() -> Any:
    return option(None, "--allow-unsigned", metavar="RUN_ID", help="Replay this run (its id again) although its "
                  "signature does not verify, e.g. one recorded before runs were signed: you vouch that its config.yaml "
                  "and tags are as recorded.")


def _kind(name: str, value: Any, what: str, optional: bool) -> ReplayError:
    return ReplayError(f"{name}={shown(value)} is not {what}{' or None' if optional else ''}")


def integer(value: Any, name: str, bound: Optional[Bound] = None, *, optional: bool = False) -> Optional[int]:
    """An int (not a bool) within `bound`; None too when optional."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        low = bound.low if bound is not None else None
        raise _kind(name, value, "an integer" + (f" >= {low}" if low is not None else ""), optional)
    if bound is not None:
        bound.check(value)
    return value


def number(value: Any, name: str, bound: Optional[Bound] = None, *, optional: bool = False) -> Optional[float]:
    """An int or float (not a bool) within `bound`; None too when optional. NaN is a number here: the verb says
    where it is no value."""
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _kind(name, value, "a number", optional)
    if bound is not None and not math.isnan(value):
        bound.check(value)
    return value


def text(value: Any, name: str, *, optional: bool = False) -> Optional[str]:
    if value is None and optional:
        return None
    if isinstance(value, str):
        return value
    raise _kind(name, value, "a string", optional)


def named(value: Any, name: str, flag_name: str, hint: str, *, optional: bool = False) -> Optional[str]:
    """A name (a run's, a config's): a string with more than blanks in it (None too when optional)."""
    value = text(value, name, optional=optional)
    if value is not None and not value.strip():
        raise ReplayError(f"{flag_name} {value!r} is empty; {hint}")
    return value


def flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ReplayError(f"{name}={shown(value)} is not True or False")


def strings(value: Any, name: str, *, what: str = "strings") -> tuple[str, ...]:
    """A list (tuple, ...) of strings, as a tuple; one string alone is refused (it would be read letter by letter)."""
    if isinstance(value, (str, bytes)) or not _iterable(value):
        raise ReplayError(f"{name}={shown(value)} is not a list of {what}; pass a list, e.g. [{shown(value)}]"
                          if isinstance(value, str) else f"{name}={shown(value)} is not a list of {what}")
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise ReplayError(f"{name} holds {shown(item)}, not a string; pass a list of {what}")
    return items


def path(value: Any, name: str, *, optional: bool = False) -> Optional[str]:
    """A str or os.PathLike (a pathlib.Path), as a str."""
    if value is None and optional:
        return None
    if isinstance(value, (str, os.PathLike)) and not isinstance(value, bytes):
        text_value = os.fspath(value)
        if isinstance(text_value, str):
            return text_value
    raise _kind(name, value, "a path (a str or pathlib.Path)", optional)


def paths(value: Any, name: str) -> tuple[str, ...]:
    """A list of paths (str or pathlib.Path), as str; one path alone is refused (a str would be read letter by letter)."""
    if isinstance(value, (str, bytes, os.PathLike)) or not _iterable(value):
        raise ReplayError(f"{name}={shown(value)} is not a list of folders; pass a list, e.g. [{shown(value)}]")
    return tuple(path(item, name) for item in value)


def _iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def trust_of(code_dirs: tuple[str, ...], prefixes: tuple[str, ...], run_id: Optional[str] = None,
             allow_unsigned: Optional[str] = None):
    """The trust decision for a stored run's `_target_`s (core/trust.py), from --code-dir and --trust (and the
    environment's): a folder that is not one, a prefix that is not a module name, refused in one line; and
    --allow-unsigned, which must name the run replayed (the user vouches for that one run)."""
    from replaybisect.core.trust import Trust

    if allow_unsigned is not None and allow_unsigned != run_id:
        raise ReplayError(f"--allow-unsigned {str(allow_unsigned)[:80]!r} is not the run replayed ({run_id}); pass "
                          f"--allow-unsigned {run_id} to vouch for that run")
    return Trust.from_user(list(code_dirs), list(prefixes), [allow_unsigned] if allow_unsigned else [])


def setattrs(request: Any, **values: Any) -> None:
    """Set fields of a frozen request while it is being built (__post_init__): the checked, normalized values."""
    for name, value in values.items():
        object.__setattr__(request, name, value)


def config_folder(value: Any, name: str = "config_dir") -> Optional[Path]:
    """A config folder given as str or pathlib.Path (None: the built-in example), as a Path."""
    folder = path(value, name, optional=True)
    return Path(folder) if folder is not None else None


@dataclass(frozen=True)
class ReplayRequest:
    """What every verb that replays a recorded run is asked (nan, profile, memory, verify): the run, the device to
    replay on (default: the run's train.device), whether the report is recorded as a child run, where the store is,
    and which of the stored config's `_target_`s may be built. A verb's request adds its own fields after these, and
    may declare one of these again for its own help text."""

    run_id: str = option(REQUIRED, "--run-id", help="The run to replay (see `replay runs`).")
    device: Optional[str] = option(None, "--device", help="Replay on this device (default: the run's train.device).")
    publish: bool = option(True, "--no-child-run", negated=True, help="Do not record the report as a child run.")
    tracking_uri: Optional[str] = tracking_uri_option()
    code_dirs: Sequence[str] = code_dirs_option()
    trust: Sequence[str] = trust_option()
    allow_unsigned: Optional[str] = allow_unsigned_option()  # this run's id: replayed without a signature that verifies
    # built from the fields above when the request is: the trust decision, the device (a torch.device, or None)
    trusted: Any = field(init=False, repr=False, compare=False)
    torch_device: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        setattrs(self, tracking_uri=tracking_uri(self.tracking_uri), run_id=run_id(self.run_id),
                 device=text(self.device, "device", optional=True), publish=flag(self.publish, "publish"),
                 code_dirs=paths(self.code_dirs, "code_dirs"), trust=strings(self.trust, "trust", what="module prefixes"))
        torch_device = None
        if self.device:  # a device this machine lacks is bad input before the store is opened (imports torch)
            from replaybisect.core.device import resolve_device

            torch_device = resolve_device(self.device, "--device")
        setattrs(self, torch_device=torch_device, trusted=trust_of(self.code_dirs, self.trust, self.run_id, self.allow_unsigned))
