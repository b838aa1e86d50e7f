"""One request per verb (verbs/<verb>/request.py), used by both front doors: every input `replay VERB` refuses is
refused by `replaybisect.VERB(...)` too, in the same words.

Each case runs the command in this process (replaybisect.cli, as `replay` runs it: the line it prints, exit 2) and
the function, in an empty folder with no store: the function's ReplayError must be the command's line, word for
word, and neither may create anything. The command-line cases are cli_cases.py's (USAGE, CONFIG; e2e/test_cli_errors.py
runs them through `replay`), so a case added there needs its Python counterpart here (or a reason it has none); the
rest are the checks the command.py files made before the requests did. No training: the few cases that import torch
(a device, a check name, a config) do it once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import subprocess
import sys

import pytest

import replaybisect as rb
from replaybisect.cli import app as APP
from tests.cli_cases import BROKEN_YAML, CONFIG, USAGE

RUN = "0123456789abcdef"  # no such run: every case is refused before a store is looked up

# cli_cases.USAGE id -> the same input through the Python API: the same words
SAME = {
    "nan-negative-step": lambda: rb.find_nan(RUN, step=-1),
    "ablate-horizon-huge": lambda: rb.ablate(RUN, ["lr"], horizon=10_000_001),
    "ablate-workers-huge": lambda: rb.ablate(RUN, ["lr"], workers=100_000),
    "ablate-gpus-negative": lambda: rb.ablate(RUN, ["lr"], submitit={"gpus": -1}),
    "bisect-steps-zero": lambda: rb.bisect("a", "b", steps=0),
    "bisect-steps-huge": lambda: rb.bisect("a", "b", steps=100000000000000000000),
    "bisect-seeds-zero": lambda: rb.bisect("a", "b", seeds=0),
    "bisect-seeds-huge": lambda: rb.bisect("a", "b", seeds=1000),
    "bisect-max-seeds-zero": lambda: rb.bisect("a", "b", max_seeds=0),
    "bisect-workers-zero": lambda: rb.bisect("a", "b", workers=0),
    "bisect-workers-huge": lambda: rb.bisect("a", "b", workers=100000),
    "bisect-threshold-nan": lambda: rb.bisect("a", "b", threshold=math.nan),
    "check-overfit-steps-zero": lambda: rb.check(overfit_steps=0),
    "check-overfit-steps-huge": lambda: rb.check(overfit_steps=1000000000),
    "check-overfit-samples-one": lambda: rb.check(overfit_samples=1),
    "check-lr-steps-huge": lambda: rb.check(lr_steps=100000000000000000000),
    "check-only-unknown": lambda: rb.check(only=["bogus"]),
    "nan-device-unknown": lambda: rb.find_nan("x", device="bogus"),
    "check-lr-min-nan": lambda: rb.check(lr_min=math.nan),
    "check-lr-max-inf": lambda: rb.check(lr_max=math.inf),
}

# USAGE cases whose command-line input is text the parser could not convert: from Python the value has a type, and a
# wrong one is refused in the API's words, naming the argument (argument name, the call)
KIND = {
    "nan-missing-run-id": ("run_id", lambda: rb.find_nan(None)),
    "nan-step-not-int": ("step", lambda: rb.find_nan(RUN, step="one")),
    "diagnose-missing-run-id": ("run_id", lambda: rb.diagnose(None)),
    "ablate-mem-not-number": ("mem_gb", lambda: rb.ablate(RUN, ["lr"], submitit={"mem_gb": "lots"})),
    "check-lr-steps-float": ("lr_steps", lambda: rb.check(lr_steps=1e20)),
}

# USAGE cases with no Python counterpart
NO_FUNCTION = {
    "unknown-verb": "Python has no verbs to mistype (an AttributeError)",
    "unknown-root-option": "a `replay` option",
    "train-option-needs-value": "command-line syntax: an option without its value",
    "nan-run-id-without-value": "command-line syntax: an option without its value",
    "ablate-horizon-without-value": "command-line syntax: an option without its value",
    "diagnose-extra-argument": "command-line syntax: a stray argument (a TypeError in Python)",
    "bisect-missing-good": "a missing positional argument is Python's TypeError",
    "bisect-missing-bad": "a missing positional argument is Python's TypeError",
    **{i: "`replay runs` has no Python function" for i, args, _ in USAGE if args[0] == "runs"},
}

# The checks command.py made itself before the requests (tested end to end in the verbs' modules): command line,
# and the same input through the API (a callable), or through the request where the API does not take the option
MADE_BY_COMMANDS = [
    ("check-step-without-run", ["check", "--step", "3"], lambda: rb.check(step=3)),
    ("check-run-and-config", ["check", "--run-id", RUN, "model=cnn"], lambda: rb.check(["model=cnn"], run_id=RUN)),
    ("check-run-and-config-dir", ["check", "--run-id", RUN, "--config-dir", "conf"], lambda: rb.check(run_id=RUN, config_dir="conf")),
    ("check-run-and-config-name", ["check", "--run-id", RUN, "--config-name", "other"], lambda: rb.check(run_id=RUN, config_name="other")),
    ("check-code-dir-without-run", ["check", "--code-dir", "."], lambda: rb.check(code_dirs=["."])),
    ("check-trust-without-run", ["check", "--trust", "mypkg"], lambda: rb.check(trust=["mypkg"])),
    ("check-lr-min-over-max", ["check", "--lr-min", "1", "--lr-max", "0.1"], lambda: rb.check(lr_min=1, lr_max=0.1)),
    ("check-lr-min-zero", ["check", "--lr-min", "0"], lambda: rb.check(lr_min=0.0)),
    ("check-step-negative", ["check", "--run-id", RUN, "--step", "-1"], lambda: rb.check(run_id=RUN, step=-1)),
    ("ablate-no-run", ["ablate", "lr"], lambda: _request("ablate", run_id=None, arms="lr")),
    ("ablate-empty-run", ["ablate", "lr", "--run-id", ""], lambda: rb.ablate("", ["lr"])),
    ("ablate-sweep-unknown", ["ablate", "--run-id", RUN, "--sweep", "precision"], lambda: rb.ablate(RUN, sweep="precision")),
    ("ablate-sweep-and-arms", ["ablate", "lr", "--run-id", RUN, "--sweep", "lr"], lambda: rb.ablate(RUN, "lr", sweep="lr")),
    ("ablate-horizon-zero", ["ablate", "lr", "--run-id", RUN, "--horizon", "0"], lambda: rb.ablate(RUN, ["lr"], horizon=0)),
    ("ablate-workers-zero", ["ablate", "lr", "--run-id", RUN, "--workers", "0"], lambda: rb.ablate(RUN, ["lr"], workers=0)),
    ("ablate-from-step-negative", ["ablate", "lr", "--run-id", RUN, "--from-step", "-1"], lambda: rb.ablate(RUN, ["lr"], from_step=-1)),
    ("ablate-executor-unknown", ["ablate", "lr", "--run-id", RUN, "--executor", "ray"], lambda: rb.ablate(RUN, ["lr"], executor="ray")),
    ("ablate-arm-value", ["ablate", "lr=abc", "--run-id", RUN], lambda: rb.ablate(RUN, ["lr=abc"])),
    ("ablate-arm-negative", ["ablate", "clip=-1", "--run-id", RUN], lambda: rb.ablate(RUN, "clip=-1")),
    ("ablate-arm-unknown", ["ablate", "lr,fp8=1", "--run-id", RUN], lambda: rb.ablate(RUN, ["lr", "fp8=1"])),
    ("ablate-no-arms", ["ablate", ",", "--run-id", RUN], lambda: rb.ablate(RUN, ",")),
    ("ablate-patch-missing", ["ablate", "--run-id", RUN, "--patch", "nope.py"], lambda: rb.ablate(RUN, patch="nope.py")),
    ("ablate-time-zero", ["ablate", "lr", "--run-id", RUN, "--time", "0"], lambda: rb.ablate(RUN, ["lr"], submitit={"time_min": 0})),
    ("ablate-cpus-zero", ["ablate", "lr", "--run-id", RUN, "--cpus", "0"], lambda: rb.ablate(RUN, ["lr"], submitit={"cpus": 0})),
    ("ablate-mem-zero", ["ablate", "lr", "--run-id", RUN, "--mem-gb", "0"], lambda: rb.ablate(RUN, ["lr"], submitit={"mem_gb": 0})),
    ("ablate-cluster-unknown", ["ablate", "lr", "--run-id", RUN, "--executor", "submitit", "--cluster", "bogus"],
     lambda: rb.ablate(RUN, ["lr"], executor="submitit", submitit={"cluster": "bogus"})),
    ("ablate-executor-folder-file", ["ablate", "lr", "--run-id", RUN, "--executor", "submitit", "--executor-folder", "jobs"],
     lambda: rb.ablate(RUN, ["lr"], executor="submitit", submitit={"executor_folder": "jobs"})),
    ("ablate-code-dir-not-a-folder", ["ablate", "lr", "--run-id", RUN, "--code-dir", "nope"], lambda: rb.ablate(RUN, ["lr"], code_dirs=["nope"])),
    ("nan-code-dir-not-a-folder", ["nan", "--run-id", RUN, "--code-dir", "jobs"], lambda: rb.find_nan(RUN, code_dirs=["jobs"])),
    ("nan-trust-not-a-module", ["nan", "--run-id", RUN, "--trust", "my-pkg"], lambda: rb.find_nan(RUN, trust=["my-pkg"])),
    ("nan-empty-run", ["nan", "--run-id", ""], lambda: rb.find_nan("")),
    ("nan-nproc-zero", ["nan", "--run-id", RUN, "--nproc", "0"], lambda: rb.find_nan(RUN, nproc=0)),
    ("nan-nproc-huge", ["nan", "--run-id", RUN, "--nproc", "65"], lambda: rb.find_nan(RUN, nproc=65)),
    ("diagnose-blank-run", ["diagnose", "--run-id", " "], lambda: rb.diagnose(" ")),
    ("verify-sample-and-steps", ["verify", "--run-id", RUN, "--sample", "5", "--steps", "0:10"],
     lambda: rb.verify(RUN, sample=5, steps="0:10")),
    ("verify-sample-zero", ["verify", "--run-id", RUN, "--sample", "0"], lambda: rb.verify(RUN, sample=0)),
    ("verify-cross-check-cluster-unknown", ["verify", "--run-id", RUN, "--cross-check", "--cluster", "bogus"],
     lambda: rb.verify(RUN, cross_check=True, submitit={"cluster": "bogus"})),
    ("nan-uri-empty", ["nan", "--run-id", RUN, "--tracking-uri", ""], lambda: rb.find_nan(RUN, tracking_uri="")),
    ("bisect-threshold-inf", ["bisect", "a", "b", "--threshold", "inf"], lambda: rb.bisect("a", "b", threshold=math.inf)),
    ("bisect-cmd-empty", ["bisect", "a", "b", "--cmd", " "], lambda: rb.bisect("a", "b", cmd=" ")),
    ("bisect-config-dir-absolute", ["bisect", "a", "b", "--config-dir", "/conf"], lambda: rb.bisect("a", "b", config_dir="/conf")),
    ("bisect-metric-unknown", ["bisect", "a", "b", "--metric", "bogus"], lambda: rb.bisect("a", "b", metric="bogus")),
    ("train-tag-not-key-value", ["train", "--tag", "abc"], lambda: _request("train", tags=["abc"])),
    ("train-kind-unknown", ["train", "--kind", "bogus"], lambda: _request("train", kind="bogus")),
]


def _request(verb: str, **fields):
    """A request built directly, for an option the Python function does not take (hidden, or the command's own)."""
    from replaybisect.verbs.ablate.request import AblateRequest
    from replaybisect.verbs.train.request import TrainRequest

    return {"ablate": AblateRequest, "train": TrainRequest}[verb](**fields)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """An empty working folder with no store (a file `jobs`, a config folder with a broken YAML, as the cases need),
    whose contents are checked unchanged after each case."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("REPLAYBISECT_FULL_ERROR", raising=False)
    monkeypatch.delenv("REPLAYBISECT_TRUST", raising=False)
    monkeypatch.setenv("REPLAYBISECT_CACHE", str(tmp_path / ".cache"))
    (tmp_path / "jobs").write_text("a file, not a folder")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "broken.yaml").write_text(BROKEN_YAML)
    before = _contents(tmp_path)
    yield tmp_path
    assert _contents(tmp_path) == before  # no mlflow.db, no run, no cache


def _contents(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _command_line(monkeypatch, capsys, args) -> str:
    """`replay ARGS` in this process: its one line on stderr, exit 2, nothing on stdout."""
    from replaybisect import cli

    monkeypatch.setattr(sys, "argv", ["replay", *args])
    # click names the program after the interpreter's argv (pytest's, here): named as installed
    monkeypatch.setattr(cli, "app", functools.partial(APP, prog_name="replay"))
    code = cli._outcome()
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and captured.out == "", f"exit {code}\n{captured.out}\n{captured.err}"
    return lines[0]


def _refusal(call) -> str:
    """The call's ReplayError, as the command prints it (one line, after `replay: error: `)."""
    with pytest.raises(rb.ReplayError) as refused:
        call()
    assert refused.value.exit_code == 2
    return "replay: error: " + " ".join(str(refused.value).split())


def test_every_command_line_case_has_its_python_counterpart():
    ids = [i for i, _, _ in USAGE]
    assert sorted(ids) == sorted([*SAME, *KIND, *NO_FUNCTION]), "a cli_cases.USAGE case needs a counterpart here"
    assert not set(SAME) & set(KIND) and not set(SAME) & set(NO_FUNCTION) and not set(KIND) & set(NO_FUNCTION)


@pytest.mark.parametrize("case", sorted(SAME))
def test_a_value_the_command_refuses_the_function_refuses_in_the_same_words(folder, monkeypatch, capsys, case):
    args = next(args for i, args, _ in USAGE if i == case)
    assert _refusal(SAME[case]) == _command_line(monkeypatch, capsys, args)


@pytest.mark.parametrize("case", sorted(KIND))
def test_a_value_of_the_wrong_kind_is_refused_naming_the_argument(folder, case):
    name, call = KIND[case]
    assert _refusal(call).startswith(f"replay: error: {name}=")


@pytest.mark.parametrize("case, args, call", MADE_BY_COMMANDS, ids=[case for case, _, _ in MADE_BY_COMMANDS])
def test_what_the_commands_checked_is_the_requests_to_check(folder, monkeypatch, capsys, case, args, call):
    assert _refusal(call) == _command_line(monkeypatch, capsys, args)


# Config values: both front doors compose with core/config.py's compose (test_cli_errors.py runs every CONFIG case
# through the command): a value, a config file, and an optimizer's own bound.
CONFIG_CASES = ["lr-not-number", "yaml-syntax", "lr-negative"]


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_config_the_command_refuses_the_function_refuses_in_the_same_words(folder, monkeypatch, capsys, case):
    args = next(args for i, args, _ in CONFIG if i == case)
    options = {"config_dir": "conf", "config_name": "broken"} if "--config-dir" in args else {}
    overrides = [arg for arg in args if not arg.startswith("--") and arg not in ("conf", "broken")]
    for verb in ("train", "check"):
        call = getattr(rb, verb)
        assert _refusal(lambda: call(overrides, **options)) == _command_line(monkeypatch, capsys, [verb, *args])


# ---- the requests themselves ----------------------------------------------------------------------------------
def test_requests_are_frozen_and_normalize_what_either_door_gives():
    from replaybisect.verbs.check.request import CheckRequest
    from replaybisect.verbs.nan.request import NanRequest

    from_cli = CheckRequest(only="data, lr,", config_dir="conf")
    from_python = CheckRequest(only=["data", "lr"], config_dir=__import__("pathlib").Path("conf"))
    assert from_cli == from_python and from_cli.only == ("data", "lr")
    request = NanRequest(run_id=RUN, step=3, code_dirs=[__import__("pathlib").Path(".")])
    assert request.code_dirs == (".",) and request.trusted is not None and request.torch_device is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.step = 4


def test_closed_choices_are_typed_and_checked():
    from typing import get_args, get_type_hints

    from replaybisect.verbs.ablate.request import EXECUTORS, SWEEPS, AblateRequest
    from replaybisect.verbs.train.request import RUN_KINDS, TrainRequest

    hints = get_type_hints(AblateRequest)
    assert get_args(hints["executor"]) == EXECUTORS == ("local", "submitit")
    assert SWEEPS == ("lr", "clip") and get_args(get_type_hints(TrainRequest)["kind"]) == RUN_KINDS


def test_the_requests_import_neither_torch_nor_mlflow():
    modules = ", ".join(f"replaybisect.verbs.{verb}.request" for verb in ("train", "nan", "ablate", "bisect", "check", "diagnose"))
    code = f"import sys, replaybisect.cli, {modules}; print(sorted(m for m in ('torch', 'mlflow') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_both_front_doors_default_every_shared_option_the_same():
    """What a user leaves out means the same through `replay VERB` and `replaybisect.VERB(...)`: every option the
    command and the function share has one default (the arms `replay ablate` runs when none are named included: the
    function used to default to lr,clip,precision, the command to every arm)."""
    import inspect
    from pathlib import Path

    import typer

    command = typer.main.get_command(APP)
    verbs = {"nan": rb.find_nan, "ablate": rb.ablate, "check": rb.check, "diagnose": rb.diagnose, "bisect": rb.bisect,
             "train": rb.train}

    def same(value):  # () and None and "" are all "not given"; a path and its text are one path
        if value in (None, (), [], ""):
            return None
        return tuple(value) if isinstance(value, (list, tuple)) else str(value) if isinstance(value, Path) else value

    differ = {}
    for name, function in verbs.items():
        cli = {param.name: param.default for param in command.commands[name].params}
        api = {key: param.default for key, param in inspect.signature(function).parameters.items()
               if param.default is not inspect.Parameter.empty}
        differ.update({f"{name} {key}": (cli[key], api[key]) for key in set(cli) & set(api) if same(cli[key]) != same(api[key])})
    assert differ == {}


def test_the_function_runs_the_arms_the_command_runs_when_none_are_named(monkeypatch):
    from replaybisect.verbs.ablate import engine
    from replaybisect.verbs.ablate.request import parse_arms

    asked = []

    def captured(store, request, **_):
        asked.append([spec.name for spec in request.specs])
        raise KeyboardInterrupt  # (nothing past the request is wanted)

    monkeypatch.setattr(rb, "_run_store", lambda uri, run_id: None)
    monkeypatch.setattr(engine, "ablate_request", captured)
    with pytest.raises(KeyboardInterrupt):
        rb.ablate(RUN)
    assert asked == [[spec.name for spec in parse_arms(None)]]  # every arm that runs bare, as `replay ablate`


def test_an_option_is_one_field_and_both_doors_take_it_with_its_default_bound_and_help():
    """A verb's option is declared once, in its request: the command's option (flag, help, bound) and the function's
    argument (default) are made from that field, and a value out of range is refused in the same words by both."""
    import inspect

    import typer
    from typer.testing import CliRunner

    from replaybisect import request as checks
    from replaybisect.options import JSON_OUTPUT, request_command

    LAPS = checks.Bound("demo", ("--laps",), low=1, high=9)

    @dataclasses.dataclass(frozen=True)
    class DemoRequest:
        run_id: str = checks.option(checks.REQUIRED, "--run-id", help="The run.")
        laps: int = checks.option(3, bound=LAPS, help="How many laps.")  # the one line that adds an option

        def __post_init__(self):
            checks.integer(self.laps, "laps", LAPS)

    seen = []
    demo = typer.Typer()
    demo.command("demo")(request_command(DemoRequest, lambda request, as_json: seen.append((request, as_json)), extras=[JSON_OUTPUT]))
    function = checks.front_door(DemoRequest, positional=("run_id",))(lambda request: request)

    assert inspect.signature(function).parameters["laps"].default == 3
    assert function("r").laps == 3 and function("r", laps=5).laps == 5
    runner = CliRunner()
    assert runner.invoke(demo, ["--run-id", "r", "--laps", "5", "--json"]).exit_code == 0 and seen == [(DemoRequest("r", 5), True)]
    shown = runner.invoke(demo, ["--help"]).output
    assert "--laps" in shown and "How many laps." in shown and "1<=x<=9" in shown
    refused = runner.invoke(demo, ["--run-id", "r", "--laps", "10"])
    assert refused.exit_code == 2 and "Invalid value for '--laps'" in refused.output
    with pytest.raises(rb.ReplayError, match=r"Invalid value for '--laps': Input should be less than or equal to 9"):
        function("r", laps=10)
