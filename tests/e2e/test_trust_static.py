"""A stored config's `_target_`s are resolved in the user's files before anything of theirs is imported.

Every module file here announces its import by writing `MARKER-<stem>` beside itself: a refused config must leave
none. A name must be bound at its module's top level (read with ast), and a re-export (`import torch as T`,
`from x import Y`, `load = T.load`) is checked where it was defined. A model in a folder without `__init__.py`
(a namespace package) is the user's code when every folder of it is theirs: `replay train` records it, and
`replay nan` / `replay check --run-id` replay it; in an artifact folder it stays refused.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests import helpers
from tests.helpers import EXAMPLES, Workspace, assert_one_line_error
from replaybisect.replay import restore as restore_mod
from replaybisect.core import bindings
from replaybisect.core.trust import BUILTIN_PREFIXES, CODE_DIR_ENV, TRUST_ENV, Trust, admit
from replaybisect.errors import ConfigError, UntrustedConfig

ANNOUNCE = 'from pathlib import Path as _Path\n_Path(__file__).with_name("MARKER-" + _Path(__file__).stem).write_text("imported")\n'


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(ANNOUNCE + textwrap.dedent(text))


def markers(*roots: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for root in roots for path in root.rglob("MARKER-*"))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The user's folder (the working folder): sys.path and the modules imported from it are put back afterwards."""
    root = tmp_path / "project"
    root.mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    importlib.invalidate_caches()
    yield root
    imported_here = []
    for name in set(sys.modules) - before:  # decided before any is removed: a namespace path reads its parent's
        module = sys.modules[name]
        where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", []) or []), "")
        if str(where).startswith(str(tmp_path)):
            imported_here.append(name)
    for name in imported_here:
        del sys.modules[name]


def admit_target(root: Path, target: str, key: str = "model", trust: tuple[str, ...] = (), roots: tuple[Path, ...] = ()):
    node: dict = {"_target_": target}
    *parents, last = key.split(".")
    tree: dict = {last: node}
    for parent in reversed(parents):
        tree = {parent: tree}
    from omegaconf import OmegaConf

    folders = (root, *roots)
    return admit(OmegaConf.create(tree), Trust(roots=tuple(str(f.resolve()) for f in folders), prefixes=(*BUILTIN_PREFIXES, *trust)),
                 None, "run X")


# ---- re-exports and unbound names: refused, the user's module never imported ------------------------------------
REFUSED = {
    # case: (files, target, what the one line says)
    "import torch as T": ({"mymod.py": "import torch as T\n"}, "mymod.T.load", ["mymod.T.load (= torch.serialization.load)"]),
    "from torch import load": ({"mymod.py": "from torch import load\n"}, "mymod.load", ["mymod.load", "torch.serialization.load"]),
    "import torch.serialization as S": ({"mymod.py": "import torch.serialization as S\n"}, "mymod.S.load", ["mymod.S.load"]),
    "an assignment of an imported loader": ({"mymod.py": "import torch as T\nld = T.load\n"}, "mymod.ld", ["mymod.ld", "torch.serialization.load"]),
    "an assignment of a star-imported loader": ({"mymod.py": "from torch import *\nld = load\n"}, "mymod.ld", ["mymod.ld", "torch.serialization.load"]),
    "an assignment of a builtin": ({"mymod.py": "ev = eval\n"}, "mymod.ev", ["mymod.ev (= builtins.eval)"]),
    "subprocess under another name": ({"mymod.py": "import subprocess as sp\n"}, "mymod.sp.run", ["mymod.sp.run (= subprocess.run)"]),
    "one branch of a try": ({"mymod.py": """
        try:
            from torch import load as Net
        except ImportError:
            class Net:
                pass
        """}, "mymod.Net", ["mymod.Net", "torch.serialization.load"]),
    "under an if": ({"mymod.py": "if True:\n    import torch as T\n"}, "mymod.T.load", ["mymod.T.load"]),
    "through another module of the user's": ({"helpers.py": "import torch as T\n", "mymod.py": "from helpers import T\n"},
                                             "mymod.T.load", ["mymod.T.load", "torch.serialization.load"]),
    "a package's re-export": ({"pkg/__init__.py": "from .io import load\n", "pkg/io.py": "from torch.serialization import load\n"},
                              "pkg.load", ["pkg.load"]),
    "a package's star import": ({"pkg/__init__.py": "from .io import *\n", "pkg/io.py": "from torch import load\n"},
                                "pkg.load", ["pkg.load", "torch.serialization.load"]),
    "a namespace package's module": ({"nsm/model.py": "import torch as T\n"}, "nsm.model.T.load", ["nsm.model.T.load"]),
    "a library function by kind": ({"mymod.py": "from torch import manual_seed as seed\n"}, "mymod.seed",
                                   ["mymod.seed (= torch.manual_seed)", "torch.nn.Module subclass"]),
    "a library function nested in the user's class path": ({"mymod.py": "import torch\n"}, "mymod.torch.manual_seed",
                                                           ["mymod.torch.manual_seed"]),
    "a private library name": ({"mymod.py": "import torch\n"}, "mymod.torch._C._get_tracing_state", ["private"]),
    "an installed package nobody trusted": ({"mymod.py": "from yaml import YAMLObject as Net\n"}, "mymod.Net",
                                            ["untrusted", "mymod.Net (= yaml.YAMLObject)", "--trust yaml"]),
    "a name bound nowhere": ({"mymod.py": "class Other:\n    pass\n"}, "mymod.Net", ["Net is not bound at the top level"]),
    "a name set at run time": ({"mymod.py": 'globals()["Net"] = object\n'}, "mymod.Net", ["not bound"]),
    "a name only annotated": ({"mymod.py": "Net: type\n"}, "mymod.Net", ["not bound"]),
    "a re-export cycle": ({"a_mod.py": "from b_mod import X\n", "b_mod.py": "from a_mod import X\n"}, "a_mod.X", ["more than 16"]),
    "a relative import beyond the top": ({"mymod.py": "from .other import Net\n"}, "mymod.Net", ["relative import"]),
    "a namespace folder in mlruns": ({"mlruns/nsm/model.py": "class Net:\n    pass\n"}, "mlruns.nsm.model.Net", ["untrusted"]),
    "a namespace folder in a run's artifacts": ({f"{'a' * 32}/artifacts/nsm/model.py": "class Net:\n    pass\n"},
                                                f"{'a' * 32}.artifacts.nsm.model.Net", ["untrusted"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_target_imports_nothing_of_the_users(project, case):
    files, target, fragments = REFUSED[case]
    write(project, files)
    path_before = list(sys.path)
    with pytest.raises(UntrustedConfig) as refused:
        admit_target(project, target)
    message = str(refused.value)
    assert all(fragment.lower() in message.lower() for fragment in fragments) and "\n" not in message, message
    assert markers(project) == []
    assert sys.path == path_before


def test_an_attribute_set_on_a_library_is_the_librarys_which_has_none(project):
    """`torch.Net = torch.load` in the user's module binds no name of theirs: mymod.torch.Net is torch.Net, which
    importing torch alone does not have (one line; the user's module is not run to find out)."""
    write(project, {"mymod.py": "import torch\ntorch.Net = torch.load\n"})
    with pytest.raises(ConfigError, match=r"cannot build `model`: mymod.torch.Net \(= torch.Net\)"):
        admit_target(project, "mymod.torch.Net")
    assert markers(project) == []


def test_a_namespace_folder_reached_through_a_symlink_or_with_a_portion_elsewhere_is_refused(project, tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    write(outside, {"nsm/model.py": "class Net:\n    pass\n", "nsx/model.py": "class Net:\n    pass\n"})
    (project / "nslink").symlink_to(outside / "nsm", target_is_directory=True)
    with pytest.raises(UntrustedConfig, match="nslink"):
        admit_target(project, "nslink.model.Net")
    # one folder of the namespace package is the user's, another one on sys.path is not: its modules could come from it
    write(project, {"nsx/other.py": "class Other:\n    pass\n"})
    monkeypatch.syspath_prepend(str(outside))
    with pytest.raises(UntrustedConfig, match="nsx"):
        admit_target(project, "nsx.model.Net")
    assert markers(project, outside) == []


# ---- what the user's files define builds, and is imported only then -----------------------------------------------
ACCEPTED = {
    # case: (files, target, the markers its import leaves)
    "a class": ({"mymod.py": "import torch\nclass Net(torch.nn.Module):\n    pass\n"}, "mymod.Net", ["MARKER-mymod"]),
    "an alias of the user's class": ({"mymod.py": "import torch\nclass Net(torch.nn.Module):\n    pass\nModel = Net\n"},
                                     "mymod.Model", ["MARKER-mymod"]),
    "a factory function": ({"mymod.py": "import torch\ndef make():\n    return torch.nn.Linear(1, 1)\n"}, "mymod.make", ["MARKER-mymod"]),
    "a torch class through the user's module": ({"mymod.py": "from torch import nn\n"}, "mymod.nn.Linear", ["MARKER-mymod"]),
    "a torch class under another name": ({"mymod.py": "from torch.nn import Linear as Lin\n"}, "mymod.Lin", ["MARKER-mymod"]),
    "a class of another module of the user's": ({"helpers.py": "import torch\nclass Block(torch.nn.Module):\n    pass\n",
                                                 "mymod.py": "from helpers import Block\n"}, "mymod.Block", ["MARKER-helpers", "MARKER-mymod"]),
    "a package's re-export": ({"pkg/__init__.py": "from .model import GPT\n", "pkg/model.py": "import torch\nclass GPT(torch.nn.Module):\n    pass\n"},
                              "pkg.GPT", ["pkg/MARKER-__init__", "pkg/MARKER-model"]),
    "a package's module": ({"pkg/__init__.py": "from . import model\n", "pkg/model.py": "import torch\nclass GPT(torch.nn.Module):\n    pass\n"},
                           "pkg.model.GPT", ["pkg/MARKER-__init__", "pkg/MARKER-model"]),
    "a package's star import": ({"pkg/__init__.py": "from .layers import *\n", "pkg/layers.py": "import torch\nclass Block(torch.nn.Module):\n    pass\n"},
                                "pkg.Block", ["pkg/MARKER-__init__", "pkg/MARKER-layers"]),
    "the fallback of an optional dependency": ({"mymod.py": """
        import torch
        try:
            from not_installed_anywhere import Net
        except ImportError:
            class Net(torch.nn.Module):
                pass
        """}, "mymod.Net", ["MARKER-mymod"]),
    "a folder without __init__.py": ({"nsm/model.py": "import torch\nclass Net(torch.nn.Module):\n    pass\n"}, "nsm.model.Net", ["nsm/MARKER-model"]),
    "nested folders without __init__.py": ({"research/nsm/model.py": "import torch\nclass Net(torch.nn.Module):\n    pass\n"},
                                          "research.nsm.model.Net", ["research/nsm/MARKER-model"]),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_what_the_users_files_define_builds(project, case):
    files, target, imported = ACCEPTED[case]
    write(project, files)
    admit_target(project, target)
    assert markers(project) == imported


def test_a_trusted_package_is_read_before_it_is_imported_and_imports_from_a_code_dir(project, tmp_path):
    """--trust: a re-export of a loader is refused unrun; a package that lives in a --code-dir (not installed)
    imports, as --code-dir . --trust nanogpt_b should."""
    write(project, {"trustedpkg/__init__.py": "import torch as T\nclass Net(T.nn.Module):\n    pass\n"})
    with pytest.raises(UntrustedConfig, match=r"trustedpkg.T.load \(= torch.serialization.load\)"):
        admit_target(project, "trustedpkg.T.load", trust=("trustedpkg",))
    assert markers(project) == []
    code_dir = tmp_path / "code"
    write(code_dir, {"nsmodel/model.py": "import torch\nclass Net(torch.nn.Module):\n    pass\n"})
    admit_target(project, "nsmodel.model.Net", trust=("nsmodel",), roots=(code_dir,))
    assert markers(code_dir) == ["nsmodel/MARKER-model"]


def test_a_file_that_does_not_parse_is_one_line_and_runs_nothing(project):
    write(project, {"mymod.py": "class Net(:\n"})
    with pytest.raises(ConfigError, match="does not parse") as refused:
        admit_target(project, "mymod.Net")
    assert "\n" not in str(refused.value) and markers(project) == []


def test_the_ast_reader_says_how_each_name_is_bound():
    import ast

    tree = ast.parse(textwrap.dedent(
        """
        import torch as T, numpy
        import torch.nn
        from . import sibling
        from ..up import thing as other
        from .layers import *
        class Net: pass
        def make(): pass
        Alias = Net
        ld = T.load
        a, b = 1, 2
        obj.attr = 3
        only: int
        if True:
            with open("x") as handle:
                try:
                    inner = 1
                except ImportError:
                    fallback = 2
        """
    ))
    top = bindings.top_level(tree, "pkg.sub.mod")
    how = {name: [(b.how, b.origin) for b in found] for name, found in top.names.items()}
    assert how == {
        "T": [("import", "torch")], "numpy": [("import", "numpy")], "torch": [("import", "torch")],
        "sibling": [("import", "pkg.sub.sibling")], "other": [("import", "pkg.up.thing")],
        "Net": [("class", None)], "make": [("def", None)], "Alias": [("assign", "Net")], "ld": [("assign", "T.load")],
        "a": [("assign", None)], "b": [("assign", None)], "inner": [("assign", None)], "fallback": [("assign", None)],
    }
    assert top.stars == ("pkg.sub.layers",)
    assert bindings.defined_names(tree) == {"Net", "make", "Alias", "ld", "a", "b", "inner", "fallback"}
    assert bindings.top_level(ast.parse("from ... import x"), "pkg.mod").names["x"][0].origin is None  # beyond the top
    assert bindings.top_level(ast.parse("from . import x"), "pkg", is_package=True).names["x"][0].origin == "pkg.x"


# ---- end to end: the real commands -----------------------------------------------------------------------------
def _env(ws: Workspace) -> dict[str, str]:
    env = ws.env()
    for name in (CODE_DIR_ENV, TRUST_ENV):  # only what each case passes: not the suite's own trusted folders
        env.pop(name, None)
    return env


VERBS = {
    "nan": ("nan", "--run-id"),
    "ablate": ("ablate", "lr", "--workers", "2", "--horizon", "2", "--run-id"),
    "check": ("check", "--overfit-steps", "5", "--lr-steps", "4", "--run-id"),
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A recorded run and the user's project, whose module re-exports torch (`import torch as T`)."""
    root = tmp_path_factory.mktemp("static")
    project = root / "project"
    write(project, {"reexporting.py": "import torch as T\nfrom replaybisect.models import MLP as _MLP\nclass MLP(_MLP):\n    pass\n"})
    ws = Workspace(root / "work")
    ws.path.mkdir()
    store = ws.store()
    run_id = helpers.train_example(store, "nan_optimizer", "train.steps=12", "snapshot.every=4", "model.hidden=16").run_id
    return ws, store, run_id, project


def _tamper(store, run_id: str, model: dict, code_dir: Path) -> None:
    config = yaml.safe_load(store.read_artifact_text(run_id, "config.yaml"))
    config["model"] = model
    store.log_text(run_id, yaml.safe_dump(config), "config.yaml")
    store.set_tags(run_id, {"code_dir": str(code_dir)})
    sign = getattr(helpers, "sign_as_recorder", None)  # signed as it is now: these are the checks behind the signature
    if sign is not None:
        sign(store, run_id)


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_a_reexported_loader_is_refused_before_the_users_module_runs(recorded, verb):
    ws, store, run_id, project = recorded
    _tamper(store, run_id, {"_target_": "reexporting.T.load", "f": "x.pt"}, project)
    before = len(store.child_runs(run_id))
    result = ws.replay(*VERBS[verb], run_id, "--code-dir", str(project), env=_env(ws))
    assert_one_line_error(result, "refused", "reexporting.T.load (= torch.serialization.load)", "model._target_")
    assert markers(project) == []
    assert len(store.child_runs(run_id)) == before
    # the same module, naming a class it defines: imported (so the marker's absence above means something)
    _tamper(store, run_id, {"_target_": "reexporting.MLP", "hidden": 16}, project)
    if verb == "nan":
        trusted = ws.replay("nan", "--run-id", run_id, "--no-child-run", "--code-dir", str(project), env=_env(ws))
        assert trusted.returncode == 0, trusted.stderr
        assert markers(project) == ["MARKER-reexporting"]
        (project / "MARKER-reexporting").unlink()


def _namespace_project(ws: Workspace) -> Path:
    """exp/config.yaml building nsmodel.model.Net, in exp/nsmodel/ without __init__.py: examples/nan_forward's model."""
    exp = ws.path / "exp"
    (exp / "nsmodel").mkdir(parents=True)
    model = (EXAMPLES / "nan_forward" / "planted_forward.py").read_text().replace("class GatedMLP(", "class Net(")
    (exp / "nsmodel" / "model.py").write_text(model + "\n" + ANNOUNCE)  # after its `from __future__` import
    config = (EXAMPLES / "nan_forward" / "config.yaml").read_text().replace("planted_forward.GatedMLP", "nsmodel.model.Net")
    (exp / "config.yaml").write_text(config)
    return exp


def test_a_model_in_a_folder_without_init_trains_and_replays(tmp_path):
    ws = Workspace(tmp_path / "work")
    ws.path.mkdir()
    exp = _namespace_project(ws)
    env = _env(ws)
    trained = ws.replay("train", "--config-dir", "exp", "--json", "model.decay=0.3", "snapshot.every=2", env=env)
    assert trained.returncode == 3, trained.stderr  # non-finite at step 3, as recorded
    run_id = trained.json()["run_id"]
    marker = exp / "nsmodel" / "MARKER-model"
    assert marker.exists()
    marker.unlink()

    found = ws.replay("nan", "--run-id", run_id, "--no-child-run", "--json", env=env)
    assert found.returncode == 0, found.stderr
    assert found.json()["op"] == "torch.exp" and found.json()["module"] == "gate"
    assert marker.exists()
    checked = ws.replay("check", "--run-id", run_id, "--overfit-steps", "5", "--lr-steps", "4", "--json", env=env)
    assert checked.returncode in (0, 1), checked.stderr  # a verdict (the run's own exp overflow may fail a check)
    assert checked.json()["checked_run_id"] == run_id
    trusted = ws.replay("nan", "--run-id", run_id, "--no-child-run", "--code-dir", ".", "--trust", "nsmodel", env=env)
    assert trusted.returncode == 0, trusted.stderr

    # the same folder inside the run's artifact folder (an upload), named as a --code-dir: refused, never imported
    artifacts = ws.store().local_artifact_dir(run_id)
    shutil.move(str(exp / "nsmodel"), str(artifacts / "nsmodel"))
    (artifacts / "nsmodel" / "MARKER-model").unlink()
    shutil.copytree(artifacts / "nsmodel", ws.path / "mlruns" / "nsmodel")  # MLflow's default artifact root, by name
    for folder in (artifacts, ws.path / "mlruns"):
        refused = ws.replay("nan", "--run-id", run_id, "--no-child-run", "--code-dir", str(folder), env=env)
        assert_one_line_error(refused, "untrusted", "nsmodel.model.Net", "model._target_")
    assert markers(ws.path) == []
