"""The trust boundary: a run's config read back from a tracking store is untrusted input.

An attacker with write access to the store rewrites a real run's `config.yaml` artifact and its
`replaybisect.code_dir` tag through the MLflow client, and (here) signs it: a replay refuses an unsigned or
tampered run before reading its config (test_provenance.py), and these checks are the wall behind that one. Replaying it from another folder must refuse (exit 2,
one line naming the target and the key, no child run) and never import the attacker's module: importing it
writes a marker file, which must never appear. The same module in a folder the user trusts (--code-dir,
--trust) builds and runs: the marker does appear then, so its absence means something.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests import helpers
from tests.helpers import Workspace, assert_one_line_error
from replaybisect.replay import restore as restore_mod
from replaybisect.errors import ReplayError
from replaybisect.core.trust import BUILTIN_PREFIXES, CODE_DIR_ENV, TRUST_ENV, Trust, UntrustedConfig

# A module that announces every import of it: a harmless stand-in for an attacker's payload. Its model is the
# built-in MLP under another name, so a run's snapshots load into it when the user does trust it.
PLANTED = textwrap.dedent(
    """
    from pathlib import Path

    import torch as T
    from replaybisect.models import MLP as _MLP

    Path(__file__).with_name("MARKER").write_text("imported")


    class MLP(_MLP):
        pass
    """
)


class Scene:
    """One recorded run, the attacker's folder, the user's own project folder and an unrelated working folder."""

    def __init__(self, root: Path):
        self.attacker = root / "attacker"
        self.project = root / "project"
        for folder, module in ((self.attacker, "evil"), (self.project, "own_model")):
            folder.mkdir()
            (folder / f"{module}.py").write_text(PLANTED)
        self.workspace = Workspace(root / "elsewhere")  # where the user runs `replay`: holds the store, no code
        self.workspace.path.mkdir()
        self.store = self.workspace.store()
        self.run_id = helpers.train_example(
            self.store, "nan_optimizer", "train.steps=12", "snapshot.every=4", "model.hidden=16", "train.val_every=0"
        ).run_id
        self.original = self.store.read_artifact_text(self.run_id, "config.yaml")

    def markers(self) -> list[Path]:
        return [folder / "MARKER" for folder in (self.attacker, self.project) if (folder / "MARKER").exists()]

    def tamper(self, patch: dict, code_dir: str | Path | None = None) -> None:
        """What an attacker with write access does: rewrite the stored config and the code_dir tag."""
        config = yaml.safe_load(self.original)
        for dotted, value in patch.items():
            *parents, last = dotted.split(".")
            node = config
            for name in parents:
                if not isinstance(node.get(name), dict):
                    node[name] = {}
                node = node[name]
            node[last] = value
        self.store.log_text(self.run_id, yaml.safe_dump(config), "config.yaml")
        self.store.set_tags(self.run_id, {"code_dir": str(code_dir or self.attacker)})
        self.sign()

    def sign(self) -> None:
        """Sign the stored config as it is now: these tests are of the wall behind the signature, which holds for a
        run the user vouched for (--allow-unsigned) or whose signer was fooled (test_provenance.py: the signature)."""
        helpers.sign_as_recorder(self.store, self.run_id)

    def children(self) -> int:
        return len(self.store.child_runs(self.run_id))

    def env(self, **extra: str) -> dict[str, str]:
        env = self.workspace.env(**extra)
        for name in (CODE_DIR_ENV, TRUST_ENV):  # only what each case passes: not the suite's own trusted folders
            if name not in extra:
                env.pop(name, None)
        return env

    def replay(self, *args: str, **extra: str):
        return self.workspace.replay(*args, env=self.env(**extra))


@pytest.fixture(scope="module")
def scene(tmp_path_factory) -> Scene:
    return Scene(tmp_path_factory.mktemp("trust"))


@pytest.fixture(autouse=True)
def fresh(scene):
    for marker in scene.markers():
        marker.unlink()
    yield


def untrusted(scene) -> Trust:
    """What `replay` decides in the working folder with no --code-dir and no --trust."""
    return Trust(roots=(str(scene.workspace.path.resolve()),), prefixes=BUILTIN_PREFIXES)


# ---- end to end: every verb that rebuilds a stored config refuses the attacker's module ------------------------
VERBS = helpers.STORED_RUN_VERBS


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_a_tampered_run_never_imports_the_attackers_module(scene, verb):
    scene.tamper({"model._target_": "evil.MLP"})  # the tag points at the attacker's folder
    before = scene.children()
    result = scene.replay(*VERBS[verb], scene.run_id)
    assert_one_line_error(result, "untrusted", "evil.MLP", "model._target_", "--code-dir", "--trust evil")
    assert "code_dir tag" in result.stderr  # says the tag was not used
    assert scene.markers() == []
    assert scene.children() == before


def test_code_dir_trusts_the_users_own_module_and_ablation_workers_inherit_it(scene):
    scene.tamper({"model._target_": "own_model.MLP"}, code_dir=scene.project)
    refused = scene.replay(*VERBS["ablate"], scene.run_id)  # the tag alone: refused, never imported
    assert_one_line_error(refused, "own_model.MLP", "--code-dir")
    assert scene.markers() == []

    before = scene.children()
    trusted = scene.replay(*VERBS["ablate"], scene.run_id, "--code-dir", str(scene.project), "--json")
    assert trusted.returncode == 0, trusted.stderr
    assert scene.markers() == [scene.project / "MARKER"]
    arms = trusted.json()["arms"]
    assert [arm["name"] for arm in arms] == ["lr"] and arms[0]["verdict"] != "error", arms
    assert scene.children() == before + 1  # the ablation's run, holding baseline and lr, each built in a worker process
    assert len(scene.store.child_runs(trusted.json()["report_run_id"], "ablation-arm")) == 2


def test_trust_prefix_trusts_an_importable_package_that_importability_alone_does_not(scene):
    scene.tamper({"model._target_": "own_model.MLP"})
    installed = {"PYTHONPATH": str(scene.project)}  # importable, as an installed package is
    assert_one_line_error(scene.replay("nan", "--run-id", scene.run_id, **installed), "untrusted", "own_model.MLP")
    assert scene.markers() == []
    by_option = scene.replay("nan", "--run-id", scene.run_id, "--no-child-run", "--trust", "own_model", **installed)
    assert by_option.returncode == 0, by_option.stderr
    assert scene.markers() == [scene.project / "MARKER"]


def test_the_environment_says_the_same_as_the_options(scene, monkeypatch):
    monkeypatch.setenv(TRUST_ENV, "own_model, other.pkg.")
    monkeypatch.setenv(CODE_DIR_ENV, os.pathsep.join([str(scene.project), str(scene.attacker)]))
    monkeypatch.chdir(scene.workspace.path)
    trust = Trust.from_user(code_dirs=[scene.project], prefixes=["mine"])
    assert trust.prefixes == (*BUILTIN_PREFIXES, "mine", "own_model", "other.pkg")
    assert trust.roots == tuple(str(p.resolve()) for p in (scene.workspace.path, scene.project, scene.attacker))
    assert Trust.from_json(trust.to_json()) == trust  # what ablation workers receive


def test_a_code_loader_is_refused_end_to_end_whatever_the_user_trusts(scene):
    scene.tamper({"model": {"_target_": "torch.load", "f": "/tmp/model.pt", "weights_only": False}})
    result = scene.replay("nan", "--run-id", scene.run_id, "--trust", "torch", "--code-dir", str(scene.attacker))
    assert_one_line_error(result, "refused", "torch.load", "model._target_")


# ---- in process: the whole config is walked, and loaders are refused under any prefix ------------------------
REFUSED = {
    # (patch to the stored config, what the one line names)
    "torch.load weights_only false": ({"model": {"_target_": "torch.load", "f": "x.pt", "weights_only": False}}, "torch.load"),
    "a trusted target with weights_only false": ({"model.weights_only": False}, "weights_only: False"),
    "numpy.load allow_pickle": ({"data": {"_target_": "numpy.load", "file": "x.npy", "allow_pickle": True}}, "numpy.load"),
    "allow_pickle on a trusted target": ({"data.allow_pickle": True}, "allow_pickle: True"),
    "mlflow.pyfunc.load_model": ({"model": {"_target_": "mlflow.pyfunc.load_model", "model_uri": "runs:/x/m"}}, "mlflow.pyfunc.load_model"),
    "mlflow.pytorch.load_model": ({"model": {"_target_": "mlflow.pytorch.load_model", "model_uri": "runs:/x/m"}}, "mlflow.pytorch.load_model"),
    "pickle_module kwarg": ({"model.pickle_module": "dill"}, "pickle_module"),
    "trust_remote_code": ({"data.trust_remote_code": True}, "trust_remote_code"),
    "torch.jit.load": ({"model": {"_target_": "torch.jit.load", "f": "m.pt"}}, "torch.jit.load"),
    "torch.hub.load": ({"model": {"_target_": "torch.hub.load", "repo_or_dir": "evil/repo", "model": "m"}}, "torch.hub.load"),
    "torch.package": ({"model": {"_target_": "torch.package.PackageImporter", "file_or_buffer": "m.pt"}}, "torch.package.PackageImporter"),
    "torch.ops.load_library": ({"model": {"_target_": "torch.ops.load_library", "path": "evil.so"}}, "torch.ops.load_library"),
    "cpp_extension.load_inline": ({"model": {"_target_": "torch.utils.cpp_extension.load_inline", "name": "x"}}, "load_inline"),
    "torch.serialization": ({"model": {"_target_": "torch.serialization.load", "f": "x"}}, "torch.serialization.load"),
    "pickle.loads": ({"data": {"_target_": "pickle.loads", "data": "x"}}, "pickle.loads"),
    "joblib.load": ({"data": {"_target_": "joblib.load", "filename": "x"}}, "joblib.load"),
    "pandas.read_pickle": ({"data": {"_target_": "pandas.read_pickle", "filepath_or_buffer": "x"}}, "pandas.read_pickle"),
    "builtins.eval": ({"loss": {"_target_": "builtins.eval", "_args_": ["1"]}}, "builtins.eval"),
    "os.system": ({"loss": {"_target_": "os.system", "_args_": ["touch x"]}}, "os.system"),
    "subprocess.run": ({"loss": {"_target_": "subprocess.run", "_args_": [["touch", "x"]]}}, "subprocess.run"),
    "importlib.import_module": ({"loss": {"_target_": "importlib.import_module", "_args_": ["evil"]}}, "importlib.import_module"),
    "runpy.run_path": ({"loss": {"_target_": "runpy.run_path", "_args_": ["x.py"]}}, "runpy.run_path"),
    "torch.load re-exported by replaybisect": ({"model": {"_target_": "replaybisect.core.loop.torch.load", "f": "x"}}, "replaybisect.core.loop.torch.load"),
    "os re-exported by replaybisect": ({"loss": {"_target_": "replaybisect.verbs.ablate.engine.os.system", "_args_": ["x"]}}, "engine.os.system"),
    "a dunder walk": ({"loss": {"_target_": "replaybisect.core.loop.__builtins__"}}, "__builtins__"),
    "a private torch name": ({"loss": {"_target_": "torch._C._get_tracing_state"}}, "private"),
    "the attacker in _args_": ({"loss": {"_target_": "torch.nn.Sequential", "_args_": [{"_target_": "evil.MLP"}]}}, "loss._args_[0]._target_"),
    "the attacker in a _partial_ step_fn": ({"train.step_fn": {"_target_": "evil.step", "_partial_": True}}, "train.step_fn._target_"),
    "the attacker in a scheduler": ({"scheduler": {"_target_": "evil.Schedule", "_partial_": True}}, "scheduler._target_"),
    "the attacker in val_data": ({"val_data": {"_target_": "evil.Data"}}, "val_data._target_"),
    "the attacker nested in data": ({"data.transform": {"_target_": "evil.Transform"}}, "data.transform._target_"),
    "an installed but untrusted package": ({"model": {"_target_": "hydra.utils.get_method", "path": "os.system"}}, "hydra.utils.get_method"),
    "a target that is not a name": ({"model._target_": ["evil", "MLP"]}, "not a dotted name"),
    "an env interpolation": ({"model.hidden": "${oc.env:HOME}"}, "oc.env"),
    "a resolver interpolation": ({"model.hidden": "${python:__import__('os').system('x')}"}, "interpolation"),
    # kinds: under a trusted prefix, only what the key needs
    "a torch function that writes a file": ({"model": {"_target_": "torch.UntypedStorage.from_file", "filename": "x", "shared": True,
                                                       "nbytes": 1}}, "torch.nn.Module subclass"),
    "collect_env.run nested in modules": ({"model": {"_target_": "torch.nn.Sequential", "_args_": [
        {"_target_": "torch.nn.Identity", "_args_": [{"_target_": "torch.utils.collect_env.run", "_args_": ["touch x"]}]},
        {"_target_": "torch.nn.Linear", "_args_": [64, 10]}]}}, "model._args_[0]._args_[0]._target_"),
    "a torch function nested in a module": ({"model": {"_target_": "torch.nn.Identity", "_args_": [
        {"_target_": "torch.manual_seed", "_args_": [1]}]}}, "model._args_[0]._target_"),
    "a module where the optimizer goes": ({"optim": {"_target_": "torch.nn.Linear", "_partial_": True}}, "torch.optim.Optimizer subclass"),
    "an optimizer where the data goes": ({"data": {"_target_": "torch.optim.SGD", "params": []}}, "Dataset subclass"),
    "a torch function as the step": ({"train.step_fn": {"_target_": "torch.save", "_partial_": True}}, "train.step_fn._target_"),
    # replaybisect contributes only its registry
    "replaybisect.train": ({"model": {"_target_": "replaybisect.train", "config_dir": "/tmp/conf"}}, "replaybisect.train"),
    "replaybisect.check": ({"model": {"_target_": "replaybisect.check"}}, "replaybisect.check"),
    "replaybisect compose": ({"model": {"_target_": "replaybisect.core.config.compose", "config_dir": "/tmp"}}, "compose"),
    "a registered step function as the model": ({"model": {"_target_": "replaybisect.core.loop.supervised_step"}}, "registered"),
    "hydra's instantiate": ({"model": {"_target_": "hydra.utils.instantiate", "config": {}}}, "hydra.utils.instantiate"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_before_anything_is_imported(scene, case):
    patch, named = REFUSED[case]
    scene.tamper(patch)
    path_before = list(sys.path)
    with pytest.raises(UntrustedConfig) as refused:
        restore_mod.run_config(scene.store, scene.run_id, untrusted(scene))
    message = str(refused.value)
    assert named.lower() in message.lower() and "\n" not in message
    assert scene.markers() == []
    assert sys.path == path_before  # nothing was added, the tag's folder least of all


def test_loaders_stay_refused_when_their_package_and_folder_are_trusted(scene):
    everything = Trust(roots=(str(scene.workspace.path.resolve()), str(scene.project)), prefixes=(*BUILTIN_PREFIXES, "numpy", "mlflow", "os"))
    for patch in ({"model": {"_target_": "numpy.load", "file": "x"}}, {"model": {"_target_": "mlflow.pyfunc.load_model", "model_uri": "x"}},
                  {"loss": {"_target_": "os.system", "_args_": ["x"]}}):
        scene.tamper(patch)
        with pytest.raises(UntrustedConfig, match="refused"):
            restore_mod.run_config(scene.store, scene.run_id, everything)
    # an alias only visible once the (trusted) module is imported: own_model does `import torch as T`
    scene.tamper({"model": {"_target_": "own_model.T.load", "f": "x"}}, code_dir=scene.project)
    with pytest.raises(UntrustedConfig, match=r"own_model.T.load \(= torch.serialization.load\)"):
        restore_mod.run_config(scene.store, scene.run_id, everything)


def test_the_tag_counts_only_inside_a_trusted_folder_without_symlink_escapes(scene, tmp_path):
    scene.tamper({"model._target_": "own_model.MLP"}, code_dir=scene.project)
    with pytest.raises(UntrustedConfig, match="code_dir tag"):
        restore_mod.run_config(scene.store, scene.run_id, untrusted(scene))
    # a symlink inside the working folder that leads out of it is outside it
    link = scene.workspace.path / "looks_local"
    link.symlink_to(scene.project, target_is_directory=True)
    try:
        scene.tamper({"model._target_": "own_model.MLP"}, code_dir=link)
        with pytest.raises(UntrustedConfig, match="own_model.MLP"):
            restore_mod.run_config(scene.store, scene.run_id, untrusted(scene))
    finally:
        link.unlink()
    # files uploaded to the store (this run's artifacts) are never a code folder, though inside the working folder
    uploads = scene.store.local_artifact_dir(scene.run_id) / "code"
    uploads.mkdir()
    (uploads / "evil.py").write_text(PLANTED)
    scene.tamper({"model._target_": "evil.MLP"}, code_dir=uploads)
    with pytest.raises(UntrustedConfig, match="evil.MLP"):
        restore_mod.run_config(scene.store, scene.run_id, untrusted(scene))
    assert not (uploads / "MARKER").exists() and scene.markers() == []
    # inside the working folder (replay train --config-dir examples/x, then replay nan from the clone's root), it counts
    project_here = scene.workspace.path / "examples" / "mine"
    project_here.mkdir(parents=True)
    (project_here / "here_model.py").write_text(PLANTED)
    scene.tamper({"model._target_": "here_model.MLP"}, code_dir=project_here)
    assert restore_mod.run_config(scene.store, scene.run_id, untrusted(scene)).model._target_ == "here_model.MLP"
    assert (project_here / "MARKER").exists()


def test_bad_trust_options_are_one_line_errors(scene, tmp_path):
    assert_one_line_error(scene.replay("nan", "--run-id", scene.run_id, "--code-dir", str(tmp_path / "nowhere")), "--code-dir", "not a folder")
    assert_one_line_error(scene.replay("nan", "--run-id", scene.run_id, "--trust", "my pkg"), "--trust", "not a module prefix")
    assert_one_line_error(scene.replay("check", "--trust", "mypkg"), "--run-id")


def test_the_unchanged_run_replays_from_anywhere(scene):
    """Built-in targets only (torch, replaybisect): no --code-dir needed, wherever the tag points."""
    scene.store.log_text(scene.run_id, scene.original, "config.yaml")
    scene.store.set_tags(scene.run_id, {"code_dir": str(scene.attacker)})
    scene.sign()
    cfg = restore_mod.run_config(scene.store, scene.run_id, untrusted(scene))
    assert cfg.model._target_ == "replaybisect.models.MLP" and scene.markers() == []
    assert str(scene.attacker) not in sys.path


# ---- the attacks, end to end: a marker the payload would write must never appear ---------------------------
def _shell_payload(marker: Path) -> dict:
    """torch.utils.collect_env.run runs its argument with shell=True: under the old prefix allow-list, trusted."""
    return {"model": {"_target_": "torch.nn.Sequential", "_args_": [
        {"_target_": "torch.nn.Identity", "_args_": [{"_target_": "torch.utils.collect_env.run", "_args_": [f"touch {marker}"]}]},
        {"_target_": "torch.nn.Linear", "_args_": [64, 10]}]}}


def _write_payload(marker: Path) -> dict:
    """UntypedStorage.from_file(shared=True) creates a file: a torch function no deny-list names, refused by kind."""
    return {"model": {"_target_": "torch.nn.Identity", "_args_": [
        {"_target_": "torch.UntypedStorage.from_file", "_args_": [str(marker), True, 8]}]}}


# Each verb's Python API (rb.find_nan, rb.ablate, rb.check): the same request, trust and restore as its command.
API_VERBS = {
    "nan": lambda rb, run_id, **trust: rb.find_nan(run_id, **trust),
    "ablate": lambda rb, run_id, **trust: rb.ablate(run_id, ["lr"], horizon=2, workers=1, **trust),
    "check": lambda rb, run_id, **trust: rb.check(run_id=run_id, overfit_steps=5, lr_steps=4, **trust),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_a_torch_function_never_runs_from_a_stored_config(scene, verb, tmp_path, monkeypatch):
    """`--trust torch` admits torch's classes, never a torch function that runs a shell or writes a file: the first
    payload through the command, the second through the verb's Python API (the same refusal, raised)."""
    import replaybisect as rb

    marker = tmp_path / "RAN"
    scene.tamper(_shell_payload(marker), code_dir=scene.workspace.path)
    before = scene.children()
    result = scene.replay(*VERBS[verb], scene.run_id, "--trust", "torch")
    assert_one_line_error(result, "refused", "collect_env.run", "model._args_[0]")
    assert not marker.exists() and scene.children() == before

    scene.tamper(_write_payload(marker), code_dir=scene.workspace.path)
    for name in (CODE_DIR_ENV, TRUST_ENV):  # only what the call passes: not the suite's own trusted folders
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(scene.workspace.path)
    with pytest.raises(UntrustedConfig) as refused:
        API_VERBS[verb](rb, scene.run_id, tracking_uri=scene.workspace.tracking_uri, trust=["torch"])
    assert all(fragment in str(refused.value) for fragment in ("refused", "from_file", "model._args_[0]")), refused.value
    assert "\n" not in str(refused.value)
    assert not marker.exists() and scene.children() == before


def _run_id_starting_with_a_letter(store, experiment: str) -> str:
    while True:  # MLflow run ids are hex: a module path needs one that starts with a-f
        run_id = store.create_run("upload", experiment=experiment)
        if run_id[0].isalpha():
            return run_id


def test_a_module_uploaded_to_the_stores_artifact_folder_is_never_imported(scene):
    """`replay` run in the folder that holds mlflow.db and mlruns/ (the README's layout): an uploaded module is
    reachable as a namespace package `mlruns.<experiment>.<run>.artifacts.<module>` from the working folder."""
    store = scene.store
    upload_run = _run_id_starting_with_a_letter(store, "replaybisect")
    payload = scene.workspace.path / "upload" / "evilmod.py"
    payload.parent.mkdir(exist_ok=True)
    payload.write_text(PLANTED)
    store.log_artifact(upload_run, payload)
    artifacts = store.local_artifact_dir(upload_run)
    assert (artifacts / "evilmod.py").is_file() and artifacts.is_relative_to(scene.workspace.path)
    dotted = ".".join(artifacts.relative_to(scene.workspace.path).parts + ("evilmod", "MLP"))
    scene.tamper({"model._target_": dotted}, code_dir=scene.workspace.path)
    result = scene.replay("nan", "--run-id", scene.run_id)
    assert_one_line_error(result, "untrusted", dotted, "model._target_")
    assert not (artifacts / "MARKER").exists()
    # the same, with the artifact folder itself as a --code-dir and the run's tag pointing at it: never a code folder
    scene.tamper({"model._target_": "evilmod.MLP"}, code_dir=artifacts)
    with pytest.raises(UntrustedConfig, match="evilmod.MLP"):
        restore_mod.run_config(store, scene.run_id, Trust(roots=(str(scene.workspace.path.resolve()),), prefixes=BUILTIN_PREFIXES))
    assert not (artifacts / "MARKER").exists()
    payload.unlink()


def test_the_users_own_code_builds_anything_it_defines(scene):
    """Kinds bind libraries, not the user: a function of their own (a nanoGPT-style configure_optimizers, a step)
    builds from their folder, and a library class of the right kind nested in their module is fine."""
    (scene.project / "own_parts.py").write_text(textwrap.dedent(
        """
        import torch
        from torch import nn


        def make_model(hidden=8):
            return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


        def configure_optimizers(model, lr=0.1):
            return torch.optim.SGD(model.parameters(), lr=lr)
        """
    ))
    scene.tamper({"model": {"_target_": "own_parts.make_model", "hidden": 16},
                  "optim": {"_target_": "own_parts.configure_optimizers", "_partial_": True, "lr": 0.1},
                  "loss": {"_target_": "own_parts.nn.CrossEntropyLoss"}}, code_dir=scene.project)
    trust = Trust(roots=(str(scene.workspace.path.resolve()), str(scene.project)), prefixes=BUILTIN_PREFIXES)
    cfg = restore_mod.run_config(scene.store, scene.run_id, trust)
    assert cfg.optim._target_ == "own_parts.configure_optimizers"
    # a library function re-exported by the user's module is still a library function
    scene.tamper({"model": {"_target_": "own_parts.torch.manual_seed", "_args_": [0]}}, code_dir=scene.project)
    with pytest.raises(UntrustedConfig, match="own_parts.torch.manual_seed"):
        restore_mod.run_config(scene.store, scene.run_id, trust)


STORED_TEXTS = {
    # (the stored config.yaml's text, what the one line says)
    "bad YAML": ("model: {_target_: [unclosed\n", "not valid YAML"),
    "a list": ("- model\n- data\n", "not a mapping"),
    "an unknown key": ("bogus_key: 1\n", "does not fit the run schema"),
    "a wrong type": ("train:\n  steps: many\n", "does not fit the run schema"),
    "a python tag": ("model: !!python/object/apply:os.system ['touch x']\n", "YAML tag"),
    "a python name tag": ("model: !!python/name:os.system\n", "YAML tag"),
    "an alias bomb": ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(9)), "anchor or alias"),
    "too deep": ("model: " + "[" * 200 + "]" * 200 + "\n", "deeper"),
    "too big": ("model: {hidden: 1}\n" + "# " + "x" * 1_100_000 + "\n", "over 1 MB"),
}


@pytest.mark.parametrize("case", sorted(STORED_TEXTS))
def test_a_stored_config_that_replaybisect_never_wrote_is_one_line(scene, case):
    text, named = STORED_TEXTS[case]
    scene.store.log_text(scene.run_id, text, "config.yaml")
    scene.sign()
    with pytest.raises(ReplayError) as refused:
        restore_mod.run_config(scene.store, scene.run_id, untrusted(scene))
    message = str(refused.value)
    assert named.lower() in message.lower() and "\n" not in message and len(message) < 600, message
    assert scene.markers() == []


def test_a_stored_alias_bomb_is_one_line_at_the_command_line(scene):
    scene.store.log_text(scene.run_id, STORED_TEXTS["an alias bomb"][0], "config.yaml")
    scene.sign()
    result = scene.replay("nan", "--run-id", scene.run_id)
    assert_one_line_error(result, "alias")
