"""A fuzzer for the trust boundary: nested `_target_` trees drawn from every public callable that torch,
replaybisect and a user's folder expose, under every key a stored config has.

Two properties, for every tree:
- `admit` calls none of the tree's targets (it decides from names, finders and class checks alone);
- a tree `admit` accepts holds, at every node, only what the key may build (the issue's rule, written here
  independently of replaybisect.core.trust): a library class of the key's kind, an entry of the registry in its
  place, or something the user's own module defines. Anything else would be called by the replay that follows.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import replaybisect  # noqa: F401  (its modules join the pool of candidates)
import replaybisect.lightning  # noqa: F401
import replaybisect.verbs.ablate.engine  # noqa: F401
import replaybisect.verbs.check.engine  # noqa: F401
import replaybisect.verbs.nan.engine  # noqa: F401
from replaybisect.core.trust import BUILTIN_PREFIXES, Trust, admit
from replaybisect.errors import ReplayError

# The rule, as the issue states it: what a library object may be, per key (nested objects: modules).
MODULE, OPTIMIZER, DATASET = torch.nn.Module, torch.optim.Optimizer, torch.utils.data.Dataset
SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
TOP_KINDS = {"model": (MODULE,), "loss": (MODULE,), "optim": (OPTIMIZER,), "scheduler": SCHEDULERS, "data": (DATASET,),
             "val_data": (DATASET,), "train.step_fn": (), "train.build": (),
             "user.net": (MODULE, OPTIMIZER, DATASET, *SCHEDULERS)}
BUILT_IN_STEPS = {"replaybisect.core.loop.supervised_step", "replaybisect.core.loop.sequence_step",
                  "replaybisect.lightning.lightning_step"}
BUILT_IN_BUILDS = {"replaybisect.lightning.build"}
LOOP_STEPS = {"replaybisect.core.loop.supervised_step", "replaybisect.core.loop.sequence_step"}  # also in `user`: a
# `replay train` DDP run's user config is the composed config that trained it, its step included
BUILT_IN_BLOCKS = {"replaybisect.models.MLP", "replaybisect.models.SmallCNN", "replaybisect.models.CharTransformer",
                   "replaybisect.data.Digits", "replaybisect.data.Blobs", "replaybisect.data.CharText"}

USER_MODULE = textwrap.dedent(
    """
    import subprocess
    import torch as T
    from torch import nn, save
    from torch.utils.collect_env import run
    from replaybisect import train
    from replaybisect.models import MLP


    class OwnNet(nn.Module):
        def __init__(self, width=4):
            super().__init__()
            self.layer = nn.Linear(width, width)


    def own_step(model, batch, loss_fn):
        return loss_fn(model(batch[0]), batch[1])


    def configure_optimizers(model, lr=0.1):
        return T.optim.SGD(model.parameters(), lr=lr)
    """
)


def _public_callables(module) -> list[str]:
    names = []
    for name in dir(module):
        if name.startswith("_"):
            continue
        try:
            value = getattr(module, name)
        except Exception:
            continue
        if callable(value):
            names.append(f"{module.__name__}.{name}")
    return names


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fuzz_user")
    (folder / "fuzz_own.py").write_text(USER_MODULE)
    return folder


@pytest.fixture(scope="module")
def candidates(user_folder) -> list[str]:
    modules = [module for name, module in list(sys.modules.items())
               if module is not None and name.split(".")[0] in ("torch", "replaybisect") and "._" not in name]
    pool = {path for module in modules for path in _public_callables(module)}
    own = ["fuzz_own." + name for name in ("OwnNet", "own_step", "configure_optimizers", "subprocess", "T", "nn", "save", "run",
                                           "train", "MLP")]
    own += ["fuzz_own.T.save", "fuzz_own.subprocess.run", "fuzz_own.T.nn.Linear", "fuzz_own.T.manual_seed"]
    assert len(pool) > 5000  # torch's public surface, not a sample of it
    return sorted(pool) + own


def _resolve(path: str):
    from hydra.utils import get_object

    return get_object(path)


def _defined_in(obj, folder: Path) -> bool:
    module = inspect.getmodule(obj)
    source = getattr(module, "__file__", None)
    return bool(source) and Path(source).resolve().is_relative_to(folder.resolve())


def _allowed(path: str, key: str, nested: bool, folder: Path) -> bool:
    """The rule, independently of trust.py: may a replay build `path` at `key`?"""
    obj = _resolve(path)
    if _defined_in(obj, folder):
        return True
    if key == "train.step_fn" and not nested:
        return path in BUILT_IN_STEPS
    if key == "train.build" and not nested:
        return path in BUILT_IN_BUILDS
    if path.startswith("replaybisect."):
        return (path in BUILT_IN_BLOCKS and key in ("model", "data", "val_data", "user.net")) or (path in LOOP_STEPS and key == "user.net")
    kinds = TOP_KINDS[key] if not nested else (TOP_KINDS[key] if key == "user.net" else (MODULE,))
    return inspect.isclass(obj) and bool(kinds) and issubclass(obj, kinds)


@st.composite
def trees(draw, pool: list[str], depth: int = 0):
    node = {"_target_": draw(st.sampled_from(pool))}
    if draw(st.booleans()):
        node["_partial_"] = True
    if depth < 2:
        children = draw(st.lists(trees(pool, depth + 1), max_size=2))
        if children:
            node["_args_" if draw(st.booleans()) else "inner"] = children if len(children) > 1 else children[0]
    return node


def _targets(node, nested=False):
    if isinstance(node, dict):
        if "_target_" in node:
            yield node["_target_"], nested
        for name, value in node.items():
            if name != "_target_":
                yield from _targets(value, True)
    elif isinstance(node, list):
        for value in node:
            yield from _targets(value, True)


def _calls_during(function, *args):
    """Code objects and C functions called while `function` runs."""
    called_code, called_c = set(), set()

    def profile(frame, event, arg):
        if event == "call":
            called_code.add(frame.f_code)
        elif event == "c_call":
            called_c.add(id(arg))

    sys.setprofile(profile)
    try:
        return function(*args), called_code, called_c
    except ReplayError as refused:
        return refused, called_code, called_c
    finally:
        sys.setprofile(None)


# admit's own functions run while admit runs: a tree naming them is judged by the admission property alone
ADMITS_MACHINERY = {"replaybisect.core.trust", "replaybisect.core.config"}


def _code_of(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    return getattr(target, "__code__", None)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_nothing_outside_the_kinds_is_ever_admitted_or_called(candidates, user_folder, data):
    key = data.draw(st.sampled_from(sorted(TOP_KINDS)))
    tree = data.draw(trees(candidates))
    config = {"seed": 0}
    parent, _, leaf = key.rpartition(".")
    (config.setdefault(parent, {}) if parent else config)[leaf] = tree
    trust = Trust(roots=(str(user_folder.resolve()),), prefixes=BUILTIN_PREFIXES)
    outcome, called_code, called_c = _calls_during(admit, OmegaConf.create(config), trust, None, "the fuzzer")
    for path, nested in _targets(tree):
        try:
            obj = _resolve(path)
        except Exception:
            continue  # not importable: nothing could call it
        code = _code_of(obj)
        if getattr(obj, "__module__", None) not in ADMITS_MACHINERY:
            assert (code is None or code not in called_code) and id(obj) not in called_c, f"admit called {path}"
        if not isinstance(outcome, ReplayError):
            assert _allowed(path, key, nested, user_folder), f"admitted {path} at {key} (nested={nested}): {tree}"


def test_the_fuzzer_sees_admitted_trees(candidates, user_folder):
    """The properties would hold vacuously if everything were refused: the kinds, the registry and the user's
    own code are admitted."""
    trust = Trust(roots=(str(user_folder.resolve()),), prefixes=BUILTIN_PREFIXES)
    for key, tree in (
        ("model", {"_target_": "torch.nn.Sequential", "_args_": [{"_target_": "torch.nn.Linear", "_args_": [2, 2]}]}),
        ("model", {"_target_": "fuzz_own.OwnNet"}),
        ("model", {"_target_": "replaybisect.models.MLP"}),
        ("optim", {"_target_": "torch.optim.AdamW", "_partial_": True}),
        ("optim", {"_target_": "fuzz_own.configure_optimizers", "_partial_": True}),
        ("scheduler", {"_target_": "torch.optim.lr_scheduler.StepLR", "_partial_": True, "step_size": 1}),
        ("data", {"_target_": "torch.utils.data.TensorDataset"}),
        ("train", {"step_fn": {"_target_": "fuzz_own.own_step", "_partial_": True}}),
        ("train", {"step_fn": {"_target_": "replaybisect.core.loop.supervised_step", "_partial_": True}}),
    ):
        admit(OmegaConf.create({key: tree}), trust, None, "the fuzzer")
    for path in ("fuzz_own.save", "fuzz_own.run", "fuzz_own.train", "fuzz_own.T.manual_seed", "torch.manual_seed"):
        with pytest.raises(ReplayError):
            admit(OmegaConf.create({"model": {"_target_": path}}), trust, None, "the fuzzer")
