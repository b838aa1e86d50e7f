"""`replay ablate --patch`: the failure replayed with the user's changed module(s) in place of the recorded ones, from
the same snapshot over the same batches. The plant: examples/nan_forward's hand-written softmax gate, whose
`torch.exp` overflows once its annealed temperature is small (recorded once for the module: non-finite at step 3)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import EXAMPLES, Workspace, assert_one_line_error

PLANT = EXAMPLES / "nan_forward" / "planted_forward.py"
OVERFLOWING = "weights = torch.exp(x / self.temperature)  # the bug: no x.max() subtracted first"
MAX_SUBTRACTED = "scaled = x / self.temperature\n        weights = torch.exp(scaled - scaled.max(-1, keepdim=True).values)"

# A fix in a file of its own, defining a class named as the config's `_target_` (planted_forward.GatedMLP)
SOFTMAX_FIX = EXAMPLES / "ablate_patch" / "softmax_fix.py"

# A change elsewhere in the same model: the gate still overflows. Bound to the run's class name by assignment, which
# a patch is read for (ast) before it is imported.
UNRELATED = '''
import torch

import planted_forward


class ClampedInput(planted_forward.GatedMLP):
    def forward(self, x):
        return super().forward(x.clamp(-10.0, 10.0))  # clamps the input, not the exp's argument


GatedMLP = ClampedInput
'''


@pytest.fixture(scope="module")
def failed(tmp_path_factory):
    ws = Workspace(tmp_path_factory.mktemp("patch"))
    run = helpers.train_example(ws.store(), "nan_forward", "model.decay=0.3", "snapshot.every=2", "snapshot.layer_stats_every=0")
    assert run.status == "nonfinite" and run.first_nonfinite_step == 3, run
    return ws, run


def write(ws: Workspace, name: str, text: str) -> Path:
    path = ws.path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def ablate_json(ws: Workspace, run_id: str, patch: Path) -> dict:
    """`replay ablate --patch PATCH --run-id RUN_ID --horizon 5 --workers 1 --json` computed in this process (the
    command's request, engine and report; its one-line refusals below run the installed command)."""
    return ws.answer_here("ablate", run_id, publish=True, patch=patch, horizon=5, workers=1)


def test_a_patch_that_subtracts_the_max_fixes_the_overflow(failed):
    ws, run = failed
    patch = SOFTMAX_FIX
    data = ablate_json(ws, run.run_id, patch)
    assert data["baseline"]["verdict"] == "fails-again" and data["baseline"]["reproduced"] == "exact"
    [arm] = data["arms"]
    assert arm["name"] == "patch" and arm["verdict"] == "fixes", arm
    assert data["patch"] == "your patch softmax_fix.py: planted_forward.GatedMLP -> softmax_fix.GatedMLP"
    assert data["conclusion"].startswith("fixed by your patch (finite through step")
    store = ws.store()
    assert store.get_run(data["report_run_id"]).info.run_name == "✓ your patch fixes · ablate @ step 3 (patch)"
    [child] = [c for c in store.child_runs(data["report_run_id"], "ablation-arm") if c.data.params["arm"] == "patch"]
    assert child.info.run_name == "✓ patch: fixes · ablate @ step 3" and child.data.params["change.patch"] == str(patch)


def test_an_unrelated_change_does_not_fix_it(failed):
    ws, run = failed
    data = ablate_json(ws, run.run_id, write(ws, "unrelated/clamp_input.py", UNRELATED))
    [arm] = data["arms"]
    assert arm["verdict"] == "no-effect" and arm["first_nonfinite_step"] == 3, arm
    assert data["conclusion"].startswith("your patch does not fix it: no-effect (non-finite")


def test_a_folder_replaces_the_recorded_module_in_place_and_only_for_its_arm(failed):
    """A changed copy of the recorded module (same name) in a folder, run with another arm in this process (the Python
    API): the patched arm imports the copy; the baseline and the other arm, and this process afterwards, the recorded one."""
    import replaybisect as rb

    ws, run = failed
    assert OVERFLOWING in PLANT.read_text()
    folder = ws.path / "changed"
    write(ws, "changed/planted_forward.py", PLANT.read_text().replace(OVERFLOWING, MAX_SUBTRACTED))
    import planted_forward  # the recorded module, as this process imported it

    module_before = sys.modules["planted_forward"]
    result = rb.ablate(run.run_id, "skip-batch", patch=folder, horizon=5, workers=1, tracking_uri=ws.tracking_uri,
                       code_dirs=[EXAMPLES], publish=False)
    assert result.patch == "your patch changed: module planted_forward"
    assert result.verdicts() == {"skip-batch": "delays", "patch": "fixes"}, [arm.reason for arm in result.arms]
    assert result.baseline.verdict == "fails-again"
    assert str(folder) not in sys.path and sys.modules["planted_forward"] is module_before is planted_forward
    assert OVERFLOWING in Path(planted_forward.__file__).read_text()


# ---- bad input: one line, exit 2 ---------------------------------------------------------------------------------
def test_a_patch_that_does_not_import_is_one_line(failed):
    ws, run = failed
    broken = write(ws, "broken/fix_broken.py", "import torch\n\ndef forward(:\n")
    assert_one_line_error(ws.replay("ablate", "--patch", str(broken), "--run-id", run.run_id),
                          "--patch fix_broken.py: fix_broken does not import: SyntaxError", "line 3")
    raising = write(ws, "raising/fix_raising.py", "import planted_forward\nraise RuntimeError('not yet')\n\n\n"
                    "class GatedMLP(planted_forward.GatedMLP):\n    pass\n")  # defines the run's class, so it is imported
    assert_one_line_error(ws.replay("ablate", "--patch", str(raising), "--run-id", run.run_id),
                          "does not import: RuntimeError: not yet (fix_raising.py, line 2)")


def test_a_patch_that_defines_none_of_the_runs_modules_is_one_line(failed):
    ws, run = failed
    unrelated = write(ws, "other/helpers.py", "open(__file__ + '.ran', 'w').close()\n\n\nclass Unrelated:\n    pass\n")
    assert_one_line_error(ws.replay("ablate", "--patch", str(unrelated), "--run-id", run.run_id),
                          "--patch helpers.py defines none of the run's modules or classes", "planted_forward.GatedMLP")
    assert not unrelated.with_name("helpers.py.ran").exists()  # read, never run: a script would train on import
    folder = unrelated.parent
    assert_one_line_error(ws.replay("ablate", "--patch", str(folder), "--run-id", run.run_id),
                          "--patch other defines none of the run's modules")
    # a class it only imports is the recorded one: replaying it would prove nothing
    reexport = write(ws, "reexport/fix_reexport.py", "from planted_forward import GatedMLP\n")
    assert_one_line_error(ws.replay("ablate", "--patch", str(reexport), "--run-id", run.run_id),
                          "--patch fix_reexport.py defines none of the run's modules or classes")


def test_a_patch_that_is_not_a_module_is_refused_before_any_run_is_read(workspace):
    assert_one_line_error(workspace.replay("ablate", "--patch", "missing.py", "--run-id", "0123"), "--patch 'missing.py' does not exist")
    (workspace.path / "notes.txt").write_text("x")
    assert_one_line_error(workspace.replay("ablate", "--patch", "notes.txt", "--run-id", "0123"), "is not a .py file")
    assert_one_line_error(workspace.replay("ablate", "--patch", "notes.txt", "--sweep", "lr", "--run-id", "0123"),
                          "--sweep lr runs its own arms; leave out the arms and --patch")
