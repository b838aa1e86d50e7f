"""The docs a newcomer reads: a README of at most 200 lines whose links all land, and the site under docs/ built
with MkDocs in strict mode (a broken link, a missing page or a docstring the API reference cannot read fails it),
its CLI reference generated from the commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def test_the_readme_is_short_and_its_links_land():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    targets = [match.group(1) for match in LINK.finditer(text) if "://" not in match.group(1)]
    assert targets and [target for target in targets if not (ROOT / target).exists()] == []
    # the test command CI runs is the README's
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = next(line for line in ci.splitlines() if line.startswith("python -m pytest"))
    assert command in text


def test_the_paths_the_docs_name_exist():
    """Every examples/... and tests/... path a page names (a recipe's script, an example folder) is in the repository."""
    named = set()
    for page in (ROOT / "docs").rglob("*.md"):
        named |= set(re.findall(r"`((?:examples|tests)/[\w./-]+?)`", page.read_text(encoding="utf-8")))
    assert named and sorted(path for path in named if not (ROOT / path.rstrip(".")).exists()) == []


def test_the_site_builds_strict(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    for command in ("train", "runs", "nan", "ablate", "bisect", "check", "diagnose", "watch"):
        assert f'id="replay-{command}"' in cli
    assert "--horizon" in cli and "Replay this many steps past the failing step" in cli  # ablate's own --help
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "find_nan" in api and "Recorder" in api


def test_the_readme_quickstart_runs_as_written_and_the_command_pages_show_what_the_commands_print():
    """The README's quickstart block runs as a user copies it (its `replay` commands in order, `<run id>` the run the
    train before made), its comments' claims held by the outputs (nan: a divergence that began in net.2; ablate: fixed
    by lr=x0.1 and clip=1); the output on the nan, ablate and diagnose pages is what `replay` prints now (normalised:
    run ids, folders and timings); a change in what a command says fails here first."""
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "_hooks" / "command_outputs.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_whole_scripts_the_pages_show_are_the_ones_the_tests_run():
    """A recording page shows its whole script by including the file a test runs (pymdownx.snippets), so the code a
    reader copies is code the suite trains and replays."""
    included = set()
    for page in (ROOT / "docs").rglob("*.md"):
        included |= set(re.findall(r'--8<-- "([^"]+)"', page.read_text(encoding="utf-8")))
    assert {"tests/user_loop/gan_script.py", "tests/user_loop/lightning_script.py", "tests/user_loop/vae_script.py"} <= included
    tests = " ".join(path.read_text(encoding="utf-8") for path in (ROOT / "tests").rglob("test_*.py"))
    assert [path for path in included if Path(path).name not in tests] == []
