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


def test_a_process_ended_without_teardown_ends_as_sys_exit_would(tmp_path):
    """end_process (how `replay` ends): its threads joined, its exit handlers run, what it printed flushed, its status."""
    marker = tmp_path / "thread-finished"
    code = textwrap.dedent(f"""
        import atexit, sys, threading, time
        from replaybisect.core.processes import end_process

        atexit.register(lambda: print("exit handlers ran"))
        threading.Thread(target=lambda: (time.sleep(0.3), open({str(marker)!r}, "w").close())).start()
        sys.stdout.write("buffered, no newline")
        end_process(sys.argv[1] if sys.argv[1] == "a message" else int(sys.argv[1]))
    """)
    for argument, status in (("3", 3), ("0", 0), ("a message", 1)):
        marker.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-c", code, argument], capture_output=True, text=True, timeout=120)
        assert done.returncode == status, done.stderr
        assert done.stdout == "buffered, no newlineexit handlers ran\n" and marker.exists()
        assert done.stderr == ("a message\n" if status == 1 else "")


def test_the_preloaded_server_ends_at_its_last_clients_exit_and_nowhere_else(tmp_path):
    """The server ends with status 0 once its client is gone (without tearing torch and MLflow down); importing its
    exit module anywhere else changes nothing (a process still ends with its own status)."""
    code = textwrap.dedent("""
        import os
        from multiprocessing import forkserver
        from replaybisect.core.processes import Forked

        child = Forked(print, ("forked",), "probe")
        assert child.wait() == 0
        server = forkserver._forkserver._forkserver_pid
        os.close(forkserver._forkserver._forkserver_alive_fd)  # the last client gone
        _, status = os.waitpid(server, 0)
        print("server status", os.waitstatus_to_exitcode(status))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "server status 0" in done.stdout, done.stdout + done.stderr
    elsewhere = subprocess.run([sys.executable, "-c", "import sys, replaybisect.core.server_exit; sys.exit(4)"],
                               capture_output=True, text=True, timeout=60)
    assert elsewhere.returncode == 4, elsewhere.stderr
