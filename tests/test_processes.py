"""A process forked from the preloaded server (core/processes.py) starts as `python -m MODULE` would: without the
launching script run again, with a fresh interpreter's sys.path, its own stdout, its exit handlers and exit status."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_forked_module_runs_as_python_m_would_from_an_unguarded_script(tmp_path):
    launcher, work = tmp_path / "launcher", tmp_path / "work"
    launcher.mkdir()
    work.mkdir()
    (launcher / "go.py").write_text(textwrap.dedent("""
        import os, sys
        from replaybisect.core.processes import Forked, InheritedFd, run_module

        print("the launching script ran", flush=True)  # no main guard: a forked process must not run this again
        output = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        environment = {**os.environ, "PROBE": "from the launcher"}
        process = Forked(run_module, ("probe", ["a", "b"], environment, InheritedFd(output), InheritedFd(output), sys.argv[2]),
                         "probe")
        sys.exit(process.wait())
    """))
    (work / "probe.py").write_text(textwrap.dedent("""
        import atexit, os, sys
        atexit.register(lambda: print("exit handlers ran"))
        print("argv", sys.argv[1:], "env", os.environ["PROBE"], "cwd", os.getcwd())
        print("path0", sys.path[0])
        print("launcher on path", any(entry.endswith("launcher") for entry in sys.path))
        print("stdout", type(sys.stdout.buffer).__name__, sys.stdout.fileno())  # as `python -u` has it
        sys.exit(5)
    """))
    output = tmp_path / "probe.out"
    done = subprocess.run([sys.executable, str(launcher / "go.py"), str(output), str(work)], cwd=launcher,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 5, done.stderr
    assert done.stdout.count("the launching script ran") == 1, done.stdout
    lines = output.read_text().splitlines()
    assert lines == [f"argv ['a', 'b'] env from the launcher cwd {work}", f"path0 {work}", "launcher on path False",
                     "stdout FileIO 1", "exit handlers ran"], lines
