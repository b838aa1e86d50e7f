"""Stored text is never markup: what a store, the user's code or its config wrote (a script's args, a run's name and
tags, a commit's subject, a layer's name, a watcher event's run id) is printed as it is, through report.plain. A `[/x]`
in it crashed rich (MarkupError, a traceback), a `[red]...[/red]` or `[/dim]` restyled our lines (a run could fake
the `running ... again` line), and a layer printed as `[net.0]` vanished."""

from __future__ import annotations

import io
import re
import shlex
import shutil
import subprocess
import sys
from types import SimpleNamespace

from rich.console import Console

from tests.helpers import TESTS, Workspace

MARKUP = "[/x] [red]FAKE[/red] [/dim]"  # an unmatched closing tag (MarkupError), a style, and the end of our dim


def _console() -> tuple[Console, io.StringIO]:
    """A console as ours are when piped (no colour, long lines unbroken)."""
    printed = io.StringIO()
    return Console(file=printed, width=400, soft_wrap=True, color_system=None), printed


def test_replay_nan_prints_a_scripts_stored_args_as_they_are(workspace):
    """The reported case: a script run whose recorded args hold markup; `replay nan` says the command line it runs
    again literally, answers and exits 0 (it crashed with a MarkupError traceback)."""
    project = workspace.path / "project"
    project.mkdir()
    shutil.copy(TESTS / "user_loop" / "script_loop.py", project / "train.py")
    args = ["--optim=sgd", "--learning_rate=30", "--max_iters=30", "--eval_interval=4", f"--softmax={MARKUP}"]  # not `hand`
    done = subprocess.run([sys.executable, "train.py", *args], cwd=project, env=workspace.env(), capture_output=True,
                          text=True, timeout=300)
    assert "stopped: loss is nan at step 9" in done.stdout + done.stderr, done.stdout + done.stderr[-2000:]
    run_id = re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1)

    result = Workspace(project).replay("nan", "--run-id", run_id, "--no-child-run", env=workspace.env())
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "MarkupError" not in result.stderr
    assert f"running {shlex.join(['train.py', *args])} again in {project}" in result.stderr, result.stderr
    assert f"replay nan  run {run_id}  divergence" in result.stdout, result.stdout


def test_the_nan_progress_line_prints_what_it_quotes_as_it_is():
    from replaybisect.verbs.nan.command import progress_log

    console, printed = _console()
    line = f"running train.py lr=0.3 '{MARKUP}' again in /work/[bold]proj"
    progress_log(console)(line)
    assert printed.getvalue() == line + "\n"

    coloured = io.StringIO()  # on a terminal: the whole line dim, nothing of it red
    progress_log(Console(file=coloured, width=400, force_terminal=True, color_system="standard"))(line)
    assert "FAKE" in coloured.getvalue() and "\x1b[31m" not in coloured.getvalue()
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured.getvalue()) == line + "\n"


def test_runs_and_diagnose_print_a_runs_name_and_tags_as_they_are(workspace):
    """A run's name and status tag with markup (a store anyone can write): `replay runs` and `replay diagnose` print
    them literally, exit 0, no traceback."""
    store = workspace.store()
    name = f"train {MARKUP}"
    status = "[/x]crashed"
    run_id = store.create_run("train", run_name=name)
    store.log_metrics(run_id, [("loss", 2.0 - step * 0.01, step) for step in range(30)])
    store.finish_run(run_id, status, "FAILED")

    listed = workspace.replay("runs", env=workspace.env(COLUMNS="400"))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if run_id in line)
    cells = [cell.strip() for cell in row.split("│")]
    assert status in cells and name in cells, listed.stdout

    diagnosed = workspace.replay("diagnose", "--run-id", run_id, "--no-artifacts")
    assert diagnosed.returncode == 0 and "Traceback" not in diagnosed.stderr, diagnosed.stderr
    assert f"diagnosis of run {run_id} ({name})  status {status}" in diagnosed.stdout, diagnosed.stdout


def test_the_watch_log_and_bisect_progress_print_stored_text_as_it_is():
    from replaybisect.verbs.bisect.command import _Progress
    from replaybisect.verbs.watch.engine import Event
    from replaybisect.verbs.watch.report import _rich_line

    console, printed = _console()
    console.print(_rich_line(Event("claimed", f"claimed {MARKUP}", f"run{MARKUP}")), highlight=False)
    assert printed.getvalue().endswith(f"claimed  run{MARKUP}  claimed {MARKUP}\n"), printed.getvalue()

    console, printed = _console()
    progress = _Progress(console)
    progress.event("phase", text=f"  abc1234567 seed 0: {MARKUP}; trying once more")  # a trial's detail: the user's output
    progress.event("trial", trial=SimpleNamespace(position=3, sha="abc1234567ff", verdict="bad", note=MARKUP))
    assert printed.getvalue() == f"  abc1234567 seed 0: {MARKUP}; trying once more\n  #3 abc1234567 bad {MARKUP}\n"


def test_a_diagnosis_names_its_layer_and_a_check_its_detail_as_they_are(monkeypatch):
    """A finding's layer is printed in brackets (`[net.0]`: rich took it for a style and dropped it); a check's detail
    and a note quote the user's module names and values."""
    from replaybisect.verbs.check import report as check_report
    from replaybisect.verbs.check.engine import Check
    from replaybisect.verbs.diagnose.report import print_diagnosis

    finding = SimpleNamespace(pattern="dead layer", layer="net.0", summary=f"{MARKUP} stopped learning", evidence={},
                              source="", next=f"replay check --run-id x {MARKUP}")
    result = SimpleNamespace(run_id="abc", run_name=MARKUP, status="ok", healthy=False, findings=[finding],
                             verdict="1 finding", summary={}, skipped={f"plateau {MARKUP}": MARKUP}, artifacts=[])
    console, printed = _console()
    print_diagnosis(result, console=console)
    text = printed.getvalue()
    assert f"diagnosis of run abc ({MARKUP})  status ok" in text
    assert f"1. dead layer [net.0]  {MARKUP} stopped learning" in text
    assert f"next: replay check --run-id x {MARKUP}" in text and f"not checked: plateau {MARKUP} ({MARKUP})" in text

    checks = [Check("act.dead", "warn", 0.5, f"module {MARKUP}: half its units never fire")]
    report = SimpleNamespace(checked_run_id=None, checks=checks, counts=lambda: {"pass": 0, "warn": 1, "fail": 0, "skip": 0},
                             status="warn", seconds=1.0, lr_range=None, warnings=[f"note {MARKUP}"],
                             find=lambda name: None, configured_lr=None, run_id="def", tracking_uri="sqlite:////tmp/[bold]x/mlflow.db",
                             artifacts=["check.md", "check.json"])
    console, printed = _console()
    monkeypatch.setattr(check_report, "console", console)
    check_report.print_check_report(report)
    text = printed.getvalue()
    assert f"module {MARKUP}: half its units never fire" in text and f"note: note {MARKUP}" in text
    assert "sqlite:////tmp/[bold]x/mlflow.db" in text
    assert "check run def (check.md);" in text  # the files it recorded: no LR plot when the LR test did not run
