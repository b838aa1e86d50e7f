"""The commands' real output on the command pages, and the README's quickstart run as written:
`python docs/_hooks/command_outputs.py` runs the quickstart's `replay` commands in order (checking what its comments
say they find) and the examples the pages show (in a temp folder, with the installed `replay`), and writes each output
between its page's markers
`<!-- output: NAME -->` and `<!-- /output -->`; with `--check` it writes nothing and exits 1 naming each page whose
output differs from what a run prints now (tests/e2e/test_docs.py runs it so). Run ids, folders and timings are
normalised, so a page changes only when what the command says changes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "commands"
BLOCK = re.compile(r"(<!-- output: (\w+) -->\n)(.*?)(<!-- /output -->)", re.S)
LINES = {"nan": 40, "ablate": 40, "diagnose": 30}  # the head of each output a page shows


def run(folder: Path, *args: str) -> str:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}", "COLUMNS": "110",
           "NO_COLOR": "1", "REPLAYBISECT_CACHE": str(folder / ".cache")}
    done = subprocess.run(["replay", *args], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    return done.stderr + done.stdout


def run_id(output: str) -> str:
    return re.search(r"run ([0-9a-f]{32})", output).group(1)


def normalised(text: str, folder: Path, keep: int) -> str:
    text = text.replace(str(folder), "/home/you/project")
    text = re.sub(r"\b[0-9a-f]{32}\b", "<run id>", text)
    text = re.sub(r"\b\d+(\.\d+)?s\b", "Ns", text)  # durations
    lines = [line.rstrip() for line in text.splitlines()]
    return "\n".join(lines[:keep])


# what the README's quickstart says each of its commands finds (after `# ->`), as words its output must hold
QUICKSTART_CLAIMS = {"nan": ["divergence", "net.2"], "ablate": ["fixed by", "lr=x0.1", "clip=1"]}


def quickstart_commands() -> list[list[str]]:
    """The `replay` commands of the README's quickstart block, in order, as written (`<run id>`: the run the last
    `replay train` recorded; `mlflow ui`, a server, is not run)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Quickstart\n.*?```\n(.*?)```", readme, re.S).group(1)
    return [line.split("#", 1)[0].split() for line in block.splitlines() if line.startswith("replay ")]


def run_quickstart(folder: Path) -> dict[str, str]:
    """The README's quickstart run as a user copies it: each command's output by verb; a claim it makes that the
    output does not hold, or a command that fails where it should not, raises."""
    found, last_run = {}, None
    for words in quickstart_commands():
        args = [last_run if word == "<run" else word for word in words if word != "id>"]
        output = run(folder, *args[1:])
        verb = args[1]
        if verb == "train":
            last_run = run_id(output)
            continue
        for claim in QUICKSTART_CLAIMS.get(verb, []):
            if claim not in output:
                raise SystemExit(f"README quickstart: `{' '.join(words)}` printed no {claim!r}:\n{output[-2000:]}")
        found[verb] = output
    return found


def outputs(folder: Path) -> dict[str, str]:
    shutil.copytree(ROOT / "examples", folder / "examples")
    found = {}
    nan_run = run_id(run(folder, "train", "--config-dir", "examples/nan_forward"))
    found["nan"] = run(folder, "nan", "--run-id", nan_run, "--no-child-run")
    quickstart = run_quickstart(folder)  # the lr explosion: its ablate and diagnose are the pages' too
    found["ablate"], found["diagnose"] = quickstart["ablate"], quickstart["diagnose"]
    return {name: "```console\n" + normalised(text, folder, LINES[name]) + "\n```\n" for name, text in found.items()}


def main(check: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="replaybisect-docs-") as scratch:
        fresh = outputs(Path(scratch))
    stale = []
    for page in sorted(PAGES.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        updated = BLOCK.sub(lambda m: m.group(1) + fresh.get(m.group(2), m.group(3)) + m.group(4), text)
        if updated != text:
            stale.append(page.name)
            if not check:
                page.write_text(updated, encoding="utf-8")
    if check and stale:
        print(f"the output on {', '.join(stale)} is not what the commands print now: run python docs/_hooks/command_outputs.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(check="--check" in sys.argv[1:]))
