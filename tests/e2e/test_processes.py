"""A process forked from the preloaded server (core/processes.py) starts as `python -m MODULE` would: without the
launching script run again, with a fresh interpreter's sys.path, its own stdout, its exit handlers and exit status."""

from __future__ import annotations

import os
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
    """end_process (how `replay` ends): its threads joined, its exit handlers run, every open file's buffer written
    (stdout, a module-level log file), its status kept; and no teardown (a module-level object's __del__ never runs,
    as it does after sys.exit)."""
    marker, log = tmp_path / "thread-finished", tmp_path / "module.log"
    code = textwrap.dedent(f"""
        import atexit, sys, threading, time
        from replaybisect.core.processes import end_process

        class TornDown:
            def __del__(self):
                sys.__stdout__.write(" torn down")
                sys.__stdout__.flush()

        kept = TornDown()
        module_log = open({str(log)!r}, "w")
        module_log.write("written at the end")  # buffered, never flushed or closed by this code
        atexit.register(lambda: print("exit handlers ran"))
        threading.Thread(target=lambda: (time.sleep(0.3), open({str(marker)!r}, "w").close())).start()
        sys.stdout.write("buffered, no newline")
        ending = sys.argv[1]
        if ending == "sys.exit":
            sys.exit(3)
        end_process(ending if ending == "a message" else int(ending))
        print("after the end")
    """)
    for argument, status in (("3", 3), ("0", 0), ("a message", 1)):
        marker.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-c", code, argument], capture_output=True, text=True, timeout=120)
        assert done.returncode == status, done.stderr
        assert done.stdout == "buffered, no newlineexit handlers ran\n", done.stdout
        assert marker.exists() and log.read_text() == "written at the end"
        assert done.stderr == ("a message\n" if status == 1 else "")
    interrupted = code.replace("time.sleep(0.3)", "time.sleep(5)").replace(  # Ctrl-C while its thread is joined
        "ending = sys.argv[1]", "ending = sys.argv[1]; threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()")
    interrupted = interrupted.replace("import atexit, sys", "import atexit, os, signal, sys")
    done = subprocess.run([sys.executable, "-c", interrupted, "3"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (3, ""), done.stderr  # the status stands, no traceback
    assert done.stdout == "buffered, no newlineexit handlers ran\n", done.stdout
    torn_down = subprocess.run([sys.executable, "-c", code, "sys.exit"], capture_output=True, text=True, timeout=120)
    assert torn_down.stdout.endswith(" torn down"), torn_down.stdout  # what the check above would see without it


def test_the_preloaded_server_ends_at_its_last_clients_exit_without_teardown(tmp_path):
    """The server ends with status 0 once its client is gone, without tearing down what it imported (a preloaded
    module's object is not finalized, as it is without server_exit); importing the exit module anywhere else changes
    nothing (a process still ends with its own status)."""
    (tmp_path / "probe_teardown.py").write_text(textwrap.dedent("""
        import os
        class TornDown:  # what it calls at the teardown is its own: the teardown may have cleared the globals
            def __init__(self):
                self.path, self.open, self.close, self.flags = os.environ["TORN_DOWN"], os.open, os.close, os.O_CREAT | os.O_WRONLY
            def __del__(self):
                self.close(self.open(self.path, self.flags, 0o600))
        kept = TornDown()
    """))
    code = textwrap.dedent("""
        import os, sys
        from multiprocessing import forkserver
        from replaybisect.core import processes

        if sys.argv[1] == "without":
            processes.PRELOAD = [name for name in processes.PRELOAD if name != "replaybisect.core.server_exit"]
        processes.PRELOAD = [*processes.PRELOAD, "probe_teardown"]
        child = processes.Forked(print, ("forked",), "probe")
        assert child.wait() == 0
        server = forkserver._forkserver._forkserver_pid
        os.close(forkserver._forkserver._forkserver_alive_fd)  # the last client gone
        _, status = os.waitpid(server, 0)
        print("server status", os.waitstatus_to_exitcode(status))
    """)
    for preload, torn_down in (("with", False), ("without", True)):
        marker = tmp_path / f"torn-down-{preload}"
        env = {**os.environ, "PYTHONPATH": str(tmp_path), "TORN_DOWN": str(marker)}
        done = subprocess.run([sys.executable, "-c", code, preload], capture_output=True, text=True, timeout=300, env=env)
        assert "server status 0" in done.stdout, done.stdout + done.stderr
        assert marker.exists() == torn_down, preload
    elsewhere = subprocess.run([sys.executable, "-c", "import sys, replaybisect.core.server_exit; sys.exit(4)"],
                               capture_output=True, text=True, timeout=60)
    assert elsewhere.returncode == 4, elsewhere.stderr
