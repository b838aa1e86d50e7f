"""Every GPU check in one command, for a machine with a CUDA device:

    python benchmarks/gpu_checks.py [--out gpu_checks.json]

1. replay exactness with CUDA RNG, fp32/bf16/fp16 (gpu_replay.py: the built-in loop, deterministic algorithms off
   and on; gpu_user_loop.py: a Recorder-style step). Each recorded as a recorded step runs (reads deferred) and
   replayed from the snapshot format; a loss that differs is reported with its relative error;
2. host syncs per recorded step (gpu_syncs.py);
3. the recorder's overhead, recorded/plain step time, with the metrics read every 1, 10 and 50 steps
   (recorder_overhead.py, `replay train`'s loop on the GPU);
4. the snapshot stall against state size, 21 MB to 1 GB (snapshot_stall.py);
5. `replay verify` over a 100-step run on the device, fp32/bf16/fp16, deterministic algorithms off and on
   (gpu_verify.py: `exact` expected).

Each part's output is printed as it comes and kept in `--out` (JSON). Exit status 1 when a replay was not exact
or a part failed.
Without a CUDA device it says so and runs nothing (`--cpu` runs the same parts on the CPU, to try the script).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parts(on_cpu: bool, repeats: int) -> list[tuple[str, list[str]]]:
    overhead = [(f"recorder overhead, metrics read every {flush}",
                 ["recorder_overhead.py", "--steps", "200", "--repeats", str(repeats), "--flush", str(flush)]) for flush in (1, 10, 50)]
    verify = ["gpu_verify.py"] + (["--device", "cpu", "--steps", "30"] if on_cpu else [])
    return ([] if on_cpu else [("replay exactness, built-in loop", ["gpu_replay.py"])]) + [
        ("replay verify over a recorded run", verify),
        ("replay exactness, Recorder-style step", ["gpu_user_loop.py"]),
        ("host syncs per step", ["gpu_syncs.py"]),
        *overhead,
        ("snapshot stall against state size", ["snapshot_stall.py"] + (["--sizes", "21,100"] if on_cpu else [])),
    ]


def not_exact(lines: list[str]) -> list[dict]:
    """The replay checks' JSON lines that report a difference."""
    failed = []
    for line in lines:
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if result.get("exact") is False or result.get("loss_mismatches", 0) > 0:
            failed.append(result)
    return failed


def run_part(title: str, command: list[str]) -> dict:
    print(f"\n== {title}: python benchmarks/{' '.join(command)}", flush=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(HERE / command[0]), *command[1:]], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    print("\n".join(lines), flush=True)
    if done.returncode != 0:
        print(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}", flush=True)
    return {"part": title, "command": command, "exit": done.returncode, "seconds": round(time.perf_counter() - started, 1),
            "output": lines, "not_exact": not_exact(lines)}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_checks.json")
    parser.add_argument("--cpu", action="store_true", help="run the parts on the CPU (to try this script)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each overhead configuration")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("no CUDA device here: nothing run (the README says where the GPU figures were measured; --cpu tries the parts on the CPU)")
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__} on {device}")
    results = [run_part(title, command) for title, command in parts(args.cpu, args.repeats)]
    Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__, "parts": results}, indent=1))
    failed = [result for result in results if result["not_exact"] or result["exit"] != 0]
    print(f"\n{len(results) - len(failed)} of {len(results)} parts ran clean; kept in {args.out}")
    for result in failed:
        print(f"  {result['part']}: exit {result['exit']}, not exact: {result['not_exact']}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
