"""core/config.py in-process: composing the built-in and a user config folder, validation, YAML round trip, flatten."""

from __future__ import annotations

import textwrap

import pytest
from omegaconf import OmegaConf

from replaybisect.core import config as config_mod
from replaybisect.errors import ConfigError


def test_the_built_in_config_composes_with_its_defaults_and_overrides():
    cfg = config_mod.compose(overrides=["train.steps=7", "model=cnn", "optim.lr=0.5"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 0.5
    assert cfg.model._target_ == "replaybisect.models.SmallCNN"
    assert cfg.data._target_ == "replaybisect.data.Digits" and cfg.val_data.split == "val"
    assert cfg.train.step_fn._target_ == "replaybisect.core.loop.supervised_step"  # the schema's default
    assert config_mod.BUILTIN_CONFIG_DIR.name == "conf" and (config_mod.BUILTIN_CONFIG_DIR / "config.yaml").is_file()


def test_a_user_folder_composes_and_can_use_the_built_in_groups(tmp_path):
    (tmp_path / "exp.yaml").write_text(
        textwrap.dedent(
            """
            defaults:
              - model: mlp
              - _self_
            data: {_target_: replaybisect.data.Digits}
            optim: {_target_: torch.optim.SGD, _partial_: true, lr: 0.1}
            seed: 3
            """
        )
    )
    cfg = config_mod.compose(tmp_path, "exp", ["model.hidden=8"])
    assert cfg.model._target_ == "replaybisect.models.MLP" and cfg.model.hidden == 8  # a built-in group
    assert cfg.optim._target_ == "torch.optim.SGD" and cfg.seed == 3
    assert cfg.train.batch_size == 64  # the schema fills what the user left out


@pytest.mark.parametrize(
    "config_dir, config_name, overrides, fragments",
    [
        ("missing", None, [], ["does not exist"]),
        (None, "nosuch", [], ["no nosuch.yaml"]),
        (None, None, ["train.stpes=5"], ["no key 'train.stpes'", "did you mean train.steps?", "+train.stpes=5"]),
        (None, None, ["optim.lr=0.1", "trian.seed=1"], ["no key 'trian.seed'"]),
        (None, None, ["model=mpl"], ["no model 'mpl'", "did you mean model=mlp?", "char_transformer, cnn, mlp"]),
        (None, None, ["train.precision=fp8"], ["fp8", "fp32, bf16, fp16"]),
        (None, None, ["train.steps=0", "train.batch_size=-1"], ["train.steps=0", "train.batch_size=-1"]),
        (None, None, ["seed=-9223372036854775809"], ["seed=", "outside torch's seed range"]),
        (None, None, ["snapshot.on_nonfinite=pause"], ["pause", "stop, continue"]),
        (None, None, ["train.steps=abc"], ["train.steps=abc is not an integer"]),
    ],
)
def test_bad_configs_are_one_line_errors_naming_the_problem(tmp_path, config_dir, config_name, overrides, fragments):
    folder = tmp_path / "missing" if config_dir == "missing" else None
    with pytest.raises(ConfigError) as caught:
        config_mod.compose(folder, config_name, overrides)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_validate_lists_every_problem_at_once():
    cfg = config_mod.compose(overrides=["train.steps=3"])
    OmegaConf.set_struct(cfg, False)
    cfg.train.steps = -1
    cfg.train.val_batches = 0
    cfg.model = None
    with pytest.raises(ConfigError) as caught:
        config_mod.validate(cfg)
    message = str(caught.value)
    assert message.startswith("bad config: ")
    assert "`model` is not set" in message and "train.steps=-1" in message and "train.val_batches=0" in message


def test_to_yaml_and_from_yaml_round_trip():
    cfg = config_mod.compose(overrides=["train.steps=11", "scheduler=cosine", "train.clip_grad_norm=1.5"])
    text = config_mod.to_yaml(cfg)
    back = config_mod.from_yaml(text)
    assert OmegaConf.to_container(back, resolve=True) == OmegaConf.to_container(cfg, resolve=True)
    assert config_mod.to_yaml(back) == text
    with pytest.raises(Exception):
        back.train.no_such_key = 1  # struct: the schema still guards the rebuilt config


def test_from_yaml_maps_targets_recorded_before_the_move_to_core():
    cfg = config_mod.compose(overrides=["train.steps=2"])
    old_text = config_mod.to_yaml(cfg).replace("_target_: replaybisect.core.loop.", "_target_: replaybisect.loop.")
    assert "_target_: replaybisect.loop.supervised_step" in old_text  # a run recorded before the move
    back = config_mod.from_yaml(old_text)
    assert back.train.step_fn._target_ == "replaybisect.core.loop.supervised_step"
    assert back.model._target_ == cfg.model._target_  # other targets untouched


def test_flatten_gives_dotted_keys_for_mlflow_params():
    cfg = OmegaConf.create({"a": {"b": 1, "c": {"d": None}}, "e": [1, 2], "f": {}, "g": "x"})
    assert config_mod.flatten(cfg) == {"a.b": 1, "a.c.d": "null", "e": "[1, 2]", "f": "{}", "g": "x"}


def test_flatten_of_a_composed_config_names_every_leaf():
    flat = config_mod.flatten(config_mod.compose(overrides=["train.steps=9"]))
    assert flat["train.steps"] == 9 and flat["model._target_"] == "replaybisect.models.MLP"
    assert flat["train.clip_grad_norm"] == "null"


def test_composing_the_built_in_config_puts_none_of_replaybisects_folders_on_sys_path():
    """replaybisect/ on sys.path would make `import lightning` find replaybisect/lightning.py (a notebook that
    calls rb.train() and then imports lightning)."""
    import sys

    package = str(config_mod.BUILTIN_CONFIG_DIR.parent.resolve())
    config_mod.compose()
    assert package not in sys.path and str(config_mod.BUILTIN_CONFIG_DIR) not in sys.path


def test_the_shipped_digits_are_scikit_learns_load_digits_bit_for_bit():
    """Runs recorded while the digits came from scikit-learn replay on the package's own copy: the same tensors
    (checksums taken from `load_digits()` as the built-in config read it, float32 pixels and int64 labels)."""
    import hashlib

    from replaybisect.data import Digits

    everything = Digits(split="all", normalize=False)
    assert everything.inputs.shape == (1797, 64) and everything.targets.shape == (1797,)
    assert hashlib.sha256(everything.inputs.numpy().tobytes()).hexdigest() == "a627aed550b0b29bf76a981bc1ecbab5ef775aac454c94154f20ec9f61a04c83"
    assert hashlib.sha256(everything.targets.numpy().tobytes()).hexdigest() == "a3c91c262eddcf7ba8f0e37507c30284493c9b20412ffe4af30d536401f7ba21"


def test_a_misspelled_key_is_one_line_even_when_the_config_cannot_be_resolved_yet(tmp_path, monkeypatch):
    """The hint lists the config's keys without validating it: an interpolation that only validation would resolve
    (an unset environment variable) leaves the hint out, and the error stays one line."""
    monkeypatch.delenv("RB_TEST_UNSET_STEPS", raising=False)
    (tmp_path / "config.yaml").write_text("defaults:\n  - model: mlp\n  - data: digits\n  - _self_\n"
                                          "train:\n  steps: ${oc.env:RB_TEST_UNSET_STEPS}\n")
    with pytest.raises(ConfigError) as caught:
        config_mod.compose(tmp_path, "config", ["train.stpes=5"])
    assert str(caught.value).startswith("no key 'train.stpes' in the config (a new key is added with +train.stpes=5)")
    assert "\n" not in str(caught.value)
