"""What ending a process costs once it has imported torch and MLflow: the interpreter's teardown of every module
(`sys.exit`) against `end_process` (threads joined, exit handlers run, streams flushed, no teardown), and the same
for the preloaded server, with and without its last exit handler (core/server_exit.py). CPU seconds (user + system)
of the process, read by wait4; the two ways alternate so a busy machine weighs on both alike.

    python benchmarks/process_exit.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

IMPORTS = "import torch, torch._dynamo, mlflow, mlflow.store.tracking.sqlalchemy_store, hydra"
ENDINGS = {
    "sys.exit": "import sys; sys.exit(0)",
    "end_process": "from replaybisect.core.processes import end_process; end_process(0)",
}
SERVER = """
import multiprocessing, os, sys
from multiprocessing import forkserver
from replaybisect.core import processes
without = "replaybisect.core.server_exit" if sys.argv[1] == "sys.exit" else None
preload = [name for name in processes.PRELOAD if name != without]
context = multiprocessing.get_context("forkserver")
context.set_forkserver_preload(preload)
process = context.Process(target=print, args=("forked",))
process.start()
process.join()
server = forkserver._forkserver._forkserver_pid
os.close(forkserver._forkserver._forkserver_alive_fd)  # its last client gone: the server ends
_, status, usage = os.wait4(server, 0)
print(round(usage.ru_utime + usage.ru_stime, 3), os.waitstatus_to_exitcode(status))
"""


def process_cpu(code: str) -> float:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, code
    return usage.ru_utime + usage.ru_stime


def server_cpu(ending: str) -> float:
    done = subprocess.run([sys.executable, "-c", SERVER, ending], capture_output=True, text=True, check=True)
    seconds, status = done.stdout.split()[-2:]
    assert status == "0", done.stdout + done.stderr
    return float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    processes = {name: [] for name in ENDINGS}
    servers = {name: [] for name in ENDINGS}
    for _ in range(args.repeats):
        for name, ending in ENDINGS.items():
            processes[name].append(process_cpu(f"{IMPORTS}; {ending}"))
            servers[name].append(server_cpu(name))
    for label, figures in (("a process importing torch and MLflow", processes), ("the preloaded server", servers)):
        teardown, direct = statistics.median(figures["sys.exit"]), statistics.median(figures["end_process"])
        print(f"{label}: {teardown:.2f} CPU-s ending with its teardown, {direct:.2f} without "
              f"({direct / teardown:.2f}x; medians of {args.repeats})")


if __name__ == "__main__":
    main()
