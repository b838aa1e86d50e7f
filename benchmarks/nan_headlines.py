"""Every planted failure in examples/ and the test zoo, trained and diagnosed: `replay nan`'s headline for each.

    python benchmarks/nan_headlines.py [OUT.jsonl]

Trains each plant (through the same `train()` that `replay train` calls) into a temporary store, runs `find_nan` on it
and prints one line per plant: category, module, op, source and the suggested next command. Used for the table of
headlines before and after a change to the verdict (run it at both commits)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, config folder, config name, overrides)
PLANTS = [
    ("nan_data", "examples/nan_data", "config", []),
    ("nan_forward", "examples/nan_forward", "config", []),
    ("nan_loss", "examples/nan_loss", "config", []),
    ("nan_backward", "examples/nan_backward", "config", []),
    ("nan_optimizer", "examples/nan_optimizer", "config", []),
    ("nan_corrupt", "examples/nan_corrupt", "config", []),
    ("ablate_lr_explosion", "examples/ablate_lr_explosion", "config", []),
    ("ablate_fp16_overflow", "examples/ablate_fp16_overflow", "config", []),
    ("ablate_deep_gradients", "examples/ablate_deep_gradients", "config", []),
    ("ablate_bad_row", "examples/ablate_bad_row", "config", []),
    ("diagnose nan_lr", "examples/diagnose_pathologies", "nan_lr", []),
    ("diagnose nan_init", "examples/diagnose_pathologies", "nan_init", []),
    ("zoo handwritten_softmax", "tests/zoo", "gpt", ["model.plant=handwritten_softmax", "optim.lr=0.1"]),
    ("zoo fp16_attention", "tests/zoo", "gpt", ["model.plant=fp16_attention", "train.precision=fp16", "optim.lr=0.1"]),
    ("zoo layernorm_overflow", "tests/zoo", "gpt", ["model.plant=layernorm_overflow"]),
    ("zoo nan_row", "tests/zoo", "cnn", ["data.nan_row=700"]),
    ("builtin mlp lr=3 (sgd)", None, "config", ["optim=sgd", "optim.lr=3", "train.steps=200"]),
]


def main(out: str | None) -> None:
    from replaybisect.core import config as config_mod
    from replaybisect.core.trust import Trust
    from replaybisect.store import open_store
    from replaybisect.verbs.nan.engine import find_nan
    from replaybisect.verbs.train.engine import train

    work = Path(tempfile.mkdtemp(prefix="nan-headlines-"))
    store = open_store(f"sqlite:///{work / 'mlflow.db'}")
    lines = []
    for name, folder, config_name, overrides in PLANTS:
        project = None
        if folder is not None:
            project = work / name.replace(" ", "_")
            shutil.copytree(ROOT / folder, project, ignore=shutil.ignore_patterns("__pycache__"))
        os.chdir(project or work)  # as a user runs it: from the example's folder (relative data paths)
        if name == "nan_data":  # its README's first step: write the rows, one of them NaN
            subprocess.run([sys.executable, "planted_data.py", "rows.csv"], check=True, capture_output=True)
        for module_name, module in list(sys.modules.items()):  # two plants may name their modules alike
            if str(getattr(module, "__file__", "") or "").startswith(str(work)):
                del sys.modules[module_name]
        started = time.perf_counter()
        cfg = config_mod.compose(project, config_name, overrides)
        result = train(cfg, store, code_folder=project)
        if result.status != "nonfinite":
            row = {"plant": name, "status": result.status}
        else:
            report = find_nan(store, result.run_id, trust=Trust.from_user([project] if project else []))
            row = {"plant": name, "step": report.failing_step, "category": report.category, "module": report.module,
                   "op": report.op, "source": report.source, "next": report.ablate_command or report.suggestion[:100],
                   "headline": getattr(report, "headline", None)}
        row["seconds"] = round(time.perf_counter() - started, 1)
        lines.append(row)
        print(json.dumps(row), flush=True)
    if out:
        Path(out).write_text("".join(json.dumps(row) + "\n" for row in lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
