"""Benchmark: what a run's signature (core/provenance.py) costs at record and at replay time.

    python benchmarks/signature_cost.py [--repeats 40]

Into a temporary SQLite store, measured in this one run, interleaved (A B A B ...):
  record   RunSession.write_config of the built-in config (params, config.yaml) with and without the signature
           (one HMAC-SHA256 of the config and one tag written)
  replay   restore.run_config of that run (tags, config.yaml, schema, trust checks) with and without verifying it
Prints one JSON object: each side's median in ms, the median of the per-pair ratios with its 10th-90th percentile
spread, and the signature's own cost in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _spread(ratios: list[float]) -> dict[str, float]:
    ordered = sorted(ratios)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median": round(statistics.median(ordered), 4), "p10": round(pick(0.1), 4), "p90": round(pick(0.9), 4)}


def _pairs(first, second, repeats: int) -> tuple[list[float], list[float]]:
    """Times of `first` and `second`, alternated: the machine's drift falls on both alike."""
    a, b = [], []
    for index in range(repeats):
        for fn, times in ((first, a), (second, b)) if index % 2 == 0 else ((second, b), (first, a)):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return a, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rb-signature-") as folder:
        os.chdir(folder)
        os.environ["XDG_CONFIG_HOME"] = str(Path(folder) / "config")
        from replaybisect.replay import restore
        from replaybisect.core import config as config_mod
        from replaybisect.core import provenance
        from replaybisect.record.session import RunSession
        from replaybisect.store import open_store

        store = open_store(f"sqlite:///{folder}/mlflow.db")
        cfg = config_mod.compose(None, "config", [])
        sessions = [RunSession.open(store, code_folder=Path(folder)) for _ in range(2 * args.repeats)]
        unsigned = iter(sessions[::2])
        signed = iter(sessions[1::2])

        def write_unsigned():
            session = next(unsigned)
            session.store.log_params(session.run_id, config_mod.flatten(cfg))
            session.store.log_text(session.run_id, config_mod.to_yaml(cfg), "config.yaml")

        def write_signed():
            next(signed).write_config(cfg)

        plain, with_signature = _pairs(write_unsigned, write_signed, args.repeats)
        run_id = sessions[1].run_id
        verify = provenance.verify

        def read(check: bool):
            provenance.verify = verify if check else (lambda *a, **k: None)
            try:
                restore.run_config(store, run_id)
            finally:
                provenance.verify = verify

        read_plain, read_verified = _pairs(lambda: read(False), lambda: read(True), args.repeats)
        key, text = provenance.signing_key(), config_mod.to_yaml(cfg)
        tags = store.tags(run_id)
        started = time.perf_counter()
        for _ in range(1000):
            provenance.verify(run_id, text, tags)
        hmac_ms = (time.perf_counter() - started)  # per 1000 -> ms each
    result = {
        "repeats": args.repeats, "threads": os.environ.get("OMP_NUM_THREADS", "default"), "key": key.id,
        "record_ms": {"unsigned": round(1000 * statistics.median(plain), 2), "signed": round(1000 * statistics.median(with_signature), 2)},
        "record_ratio": _spread([s / p for s, p in zip(with_signature, plain)]),
        "replay_ms": {"unverified": round(1000 * statistics.median(read_plain), 2), "verified": round(1000 * statistics.median(read_verified), 2)},
        "replay_ratio": _spread([v / p for v, p in zip(read_verified, read_plain)]),
        "verify_alone_ms": round(hmac_ms, 4),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
