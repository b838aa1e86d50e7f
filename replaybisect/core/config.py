"""Structured configs: the schema every run is validated against, and composing a run's config.

A run is its resolved config. Everything is built with `hydra.utils.instantiate`, so any process can
rebuild a run from the YAML that MLflow stores with it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, get_args

from replaybisect.errors import ConfigError, UntrustedConfig

BUILTIN_CONFIG_DIR = Path(__file__).parent.parent / "conf"  # replaybisect/conf (this module is in replaybisect/core)
SCHEMA_NAME = "replaybisect_schema"
ENTRY_NAME = "replaybisect_entry"
# The closed choices, typed once (OmegaConf's structured configs take no Literal: the fields below are str, and
# `validate` checks them against these).
Precision = Literal["fp32", "bf16", "fp16"]
Loop = Literal["builtin", "user"]
OnNonfinite = Literal["stop", "continue"]
PRECISIONS, LOOPS, ON_NONFINITE = get_args(Precision), get_args(Loop), get_args(OnNonfinite)
MAX_THREADS = 1024  # torch.set_num_threads(100000) exhausts memory mapping threads
MAX_PROCESSES = 64  # train.nproc: processes on this machine


@dataclass
class TrainConfig:
    steps: int = 1000
    """Number of optimizer steps."""
    batch_size: int = 64
    """Samples per step (the last partial batch of an epoch is dropped)."""
    precision: str = "fp32"  # Precision
    """fp32 | bf16 | fp16 (autocast; fp16 uses a GradScaler)."""
    clip_grad_norm: Optional[float] = None
    """Max total gradient norm; null = no clipping. The pre-clip norm is always logged."""
    accumulate: int = 1
    """Micro-batches per optimizer step: the step's batch_size samples are split in `accumulate` equal parts."""
    num_workers: int = 0
    """DataLoader worker processes reading the dataset. Batch order stays a function of (seed, step) and each
    sample's randomness is seeded by (seed, step, index), so the batches are the same for any worker count."""
    val_every: int = 100
    """Steps between validation passes (needs val_data)."""
    val_batches: int = 4
    """Batches per validation pass."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    num_threads: Optional[int] = None
    """torch intra-op threads; null = torch's default. Recorded: replay uses the same count."""
    step_fn: Any = field(default_factory=lambda: {"_target_": "replaybisect.core.loop.supervised_step", "_partial_": True})
    """(model, batch, loss_fn) -> scalar loss. In a run recorded from your own loop (loop: user): your whole
    step (forward, backward, clip, update), called with the arguments it names (see replaybisect.Recorder)."""
    loop: str = "builtin"  # Loop
    """builtin: replaybisect's step. user: a run recorded from your own loop by replaybisect.Recorder."""
    build: Any = None
    """loop: user only: build(config) -> model, optimizer[, scheduler[, scaler]] (a dict or a tuple)."""
    nproc: int = 1
    """`replay train` only: processes to train on as one DistributedDataParallel job (started with torchrun's
    launcher; gloo on CPU, nccl on CUDA). train.batch_size is each process's; the step's batch is nproc of them."""
    world_size: int = 1
    """Processes of a distributed data-parallel job (torchrun + DDP), recorded per rank and replayed on one process."""
    backend: Optional[str] = None
    """The recorded job's process-group backend (gloo, nccl), for a distributed run."""
    sharding: Optional[str] = None
    """fsdp: the recorded job's model was sharded with FSDP2's fully_shard (snapshots hold the gathered tensors)."""
    script: Any = None
    """loop: user, recorded from a script whose step is a closure (no build): {path, module, args, cwd}, how a
    replay runs the script again to take its objects over (core/reentry.py)."""


@dataclass
class SnapshotConfig:
    every: int = 100
    """Steps between full snapshots (0 = none)."""
    keep_batches: bool = True
    """Store the batches of each snapshot interval so replay needs no data source."""
    on_nonfinite: str = "stop"  # OnNonfinite
    """stop | continue."""
    layer_stats_every: int = 50
    """Steps between per-layer statistics, param_norm and update_ratio (0 = never)."""
    metrics_flush_every: int = 50
    """Steps between batched metric uploads."""
    metrics_flush_seconds: float = 5.0
    """Seconds between batched metric uploads, however few steps ran (0 = by step count only): after a
    SIGKILL the curve is in the store up to the last few seconds."""
    enabled: bool = True
    """Turn the recorder off entirely (benchmarks): no metrics, snapshots or stats."""


@dataclass
class ReplayConfig:
    seed: int = 0
    model: Any = None
    data: Any = None
    val_data: Any = None
    loss: Any = field(default_factory=lambda: {"_target_": "torch.nn.CrossEntropyLoss"})
    optim: Any = None
    scheduler: Any = None
    train: TrainConfig = field(default_factory=TrainConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    user: Any = None
    """loop: user only: your own config, handed back to your build and step functions on replay."""


def add_code_paths(*folders: str | Path) -> None:
    """Make the user's own modules importable for `_target_`s, as `python -m` would from their folder."""
    import sys

    for folder in reversed([str(Path(f).resolve()) for f in folders if f and Path(f).is_dir()]):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=ReplayConfig)


def _entry_node(user_config_name: str) -> dict:
    # The schema first, then the user's primary config on top of it: a user config needs only
    # model/data/loss/optim, with or without a defaults list of its own.
    return {"defaults": [SCHEMA_NAME, user_config_name, "_self_"]}


def compose(config_dir: str | Path | None = None, config_name: str | None = None, overrides: list[str] | None = None,
            checked: bool = True):
    """Compose a run config and, `checked`, validate it and build its optimizer once over a probe parameter (what
    listing its keys for a hint does without). Hydra errors become one-line ConfigErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    config_dir = Path(config_dir).expanduser().resolve() if config_dir else BUILTIN_CONFIG_DIR
    config_name = (config_name or "config").removesuffix(".yaml")
    if not config_dir.is_dir():
        what = "is a file, not a folder" if config_dir.exists() else "does not exist"
        raise ConfigError(f"config dir {config_dir} {what}; pass --config-dir with your Hydra config folder (the one holding config.yaml)")
    if not (config_dir / f"{config_name}.yaml").is_file():
        raise ConfigError(f"no {config_name}.yaml in {config_dir}; pass --config-name with one of its configs")
    overrides = list(overrides or [])
    # the user's folders, never replaybisect's own (its package folder would shadow `lightning` with lightning.py)
    add_code_paths(Path.cwd(), *([] if config_dir == BUILTIN_CONFIG_DIR else [config_dir.parent, config_dir]))
    if config_dir != BUILTIN_CONFIG_DIR:
        # Built-in groups (model=mlp, data=digits, ...) are available to user configs too.
        overrides.append(f"hydra.searchpath=[file://{BUILTIN_CONFIG_DIR}]")

    _register_schema()
    ConfigStore.instance().store(name=ENTRY_NAME, node=_entry_node(config_name))
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = hydra_compose(config_name=ENTRY_NAME, overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        problem = _override_problem(_one_line(error), config_dir, config_name, overrides, error.__cause__)
        raise ConfigError(_clip_words(problem) + "; see `replay train --help` for overrides") from None
    except YAMLError as error:
        raise ConfigError(_yaml_problem(error)) from None
    except OSError as error:  # e.g. an over-long `+key=` override, which Hydra looks up as a file name
        raise ConfigError(_clip_words(f"cannot compose the config: {error.strerror}: {error.filename}") + "; check the overrides") from None
    finally:
        GlobalHydra.instance().clear()
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra", None)
    OmegaConf.set_struct(cfg, True)
    if checked:
        validate(cfg)
        check_optimizer(cfg)
    return cfg


def _override_problem(text: str, config_dir: Path, config_name: str, overrides: list[str],
                      cause: BaseException | None = None) -> str:
    """Hydra's message for a misspelled key or group option, said the way a user fixes it: the key or option
    that was probably meant (Hydra suggests `+key=` for a typo and lists its config search path)."""
    import difflib
    import re

    unknown_option = re.match(r"In '[^']*': Could not find '([^']+)/([^']+)' Available options in '[^']+': (.*?) Config search path", text)
    if unknown_option:
        group, option, choices = unknown_option[1], unknown_option[2], unknown_option[3].split()
        close = difflib.get_close_matches(option, choices, n=1)
        return (f"no {group} '{option}'" + (f"; did you mean {group}={close[0]}?" if close else "")
                + f" (options: {', '.join(choices)})")
    unknown_key = re.match(r"Could not override '([^']+)'\. To append to your config use \+(\S+)", text)
    if unknown_key:
        key = unknown_key[1]
        rest = [item for item in overrides if not item.lstrip("+~").startswith((key + "=", "hydra.searchpath="))]
        close = difflib.get_close_matches(key, _known_keys(config_dir, config_name, rest), n=1)
        return (f"no key '{key}' in the config" + (f"; did you mean {close[0]}?" if close else "")
                + f" (a new key is added with +{unknown_key[2]})")
    bad_value = re.match(r"Error merging override ([^=]+=.*)", text)
    if bad_value and cause is not None:  # the schema's type check: OmegaConf's words say which type it wants
        wanted = re.search(r"could not be converted to (\w+)", str(cause))
        if wanted:
            kind = {"integer": "an integer", "float": "a number", "bool": "true or false"}.get(wanted[1].lower(), wanted[1])
            return f"{bad_value[1]} is not {kind}"
        return f"{bad_value[1]} ({_one_line(cause)})"
    return text


def _known_keys(config_dir: Path, config_name: str, overrides: list[str]) -> list[str]:
    """Every dotted key of the config composed without the override that failed (none when that fails too)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return list(flatten(compose(config_dir, config_name, overrides, checked=False)))  # its keys: nothing built
    except (ConfigError, OmegaConfBaseException, ValueError):  # e.g. an interpolation only validation would resolve
        return []


def _yaml_problem(error) -> str:
    mark = getattr(error, "problem_mark", None)
    where = f"{mark.name} line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a config file"
    problem = " ".join(str(getattr(error, "problem", None) or error).split())
    return f"YAML syntax error in {where}: {problem}; fix that file"


def _clip_words(text: str, longest: int = 80) -> str:
    """An over-long override would make the error line as long: clip each long word."""
    return " ".join(word if len(word) <= longest else f"{word[:longest]}...({len(word)} chars)" for word in text.split())


def once_per_callable(read: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`read(target)` remembered per callable (a signature asked for at every step); an unhashable callable object is
    read each time, and an error is never remembered."""
    remembered = functools.lru_cache(maxsize=64)(read)

    def cached(target):
        try:
            return remembered(target)
        except TypeError:  # (unhashable)
            return read(target)

    return cached


def needs_closure(optimizer) -> bool:
    """torch.optim.LBFGS and the like: `step(closure)` re-evaluates the loss, which the built-in step does not do."""
    step = optimizer.step
    return _closure_required(getattr(step, "__func__", step))


@once_per_callable
def _closure_required(step) -> bool:
    import inspect

    closure = inspect.signature(step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def build_optimizer(node, params, model=None):
    """`optim` (a _partial_) called with the parameters, or with the model when its factory asks for one (a
    `configure_optimizers(model, ...)` that builds its own parameter groups); a bad value or a closure
    optimizer is a ConfigError."""
    try:
        factory = instantiate(node, "optim")
        optimizer = factory(model=model) if model is not None and takes_model(factory) else factory(params=params)
    except (TypeError, ValueError) as error:  # e.g. optim.lr=-1 ("Invalid learning rate") or an unknown kwarg
        problem = _not_numbers(node) or _one_line(error)
        raise ConfigError(f"cannot build `optim`: {_clip_words(problem)}; fix the optim.* values") from None
    return optimizer


def takes_model(factory) -> bool:
    """An optimizer factory with a `model` parameter is called with the model instead of `params=`."""
    import inspect

    try:
        return "model" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _not_numbers(node) -> str | None:
    """`optim.lr=abc`: name the strings given where the optimizer's signature has a number."""
    import inspect

    from hydra.utils import get_class

    try:
        defaults = inspect.signature(get_class(node["_target_"])).parameters
    except Exception:  # not a class, or no signature: the original error says enough
        return None
    wrong = [f"optim.{key}={value!r} is not a number" for key, value in node.items()
             if isinstance(value, str) and key in defaults
             and isinstance(defaults[key].default, (int, float)) and not isinstance(defaults[key].default, bool)]
    return "; ".join(wrong) or None


def check_optimizer(cfg) -> None:
    """Build the optimizer once over a probe parameter: a bad optim.* value is caught before any run or store exists."""
    import torch

    import math

    probe = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(cfg.optim, list(probe.parameters()), model=probe)
    for group in optimizer.param_groups:  # torch refuses a negative lr, not an infinite one (which trains to NaN at once)
        lr = group.get("lr")
        number = isinstance(lr, (int, float)) and not isinstance(lr, bool) or isinstance(lr, torch.Tensor) and lr.numel() == 1
        if number and not (math.isfinite(float(lr)) and float(lr) >= 0):
            raise ConfigError(f"cannot build `optim`: its learning rate {float(lr)} is not a finite number >= 0; fix optim.lr")
    check_closure_optimizer(cfg, optimizer)


def check_closure_optimizer(cfg, optimizer) -> None:
    """LBFGS and the like re-evaluate the loss inside step(): a GradScaler cannot scale it, and a clip before
    step() is undone by the optimizer's own evaluations."""
    if not needs_closure(optimizer):
        return
    name = type(optimizer).__name__
    if cfg.train.precision == "fp16":
        raise ConfigError(f"`optim` is {name}, whose step() re-evaluates the loss: fp16 needs a GradScaler, which cannot "
                          "scale it; use train.precision=bf16 or fp32")
    if cfg.train.clip_grad_norm is not None:
        raise ConfigError(f"`optim` is {name}, whose step() recomputes the gradients: train.clip_grad_norm would not apply; "
                          "set train.clip_grad_norm=null")


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    for noise in ("\nfull_key:", " full_key:", " object_type="):
        if noise in text:
            text = text.split(noise)[0]
    return text.rstrip(".")


def validate(cfg) -> None:
    """Checks that need no instantiation, all problems in one error."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:  # every interpolation (`${oc.env:...}`) resolves now, before any store or run exists, not mid-run
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        raise ConfigError(f"bad config: cannot resolve {key or 'a value'}: {_clip_words(_one_line(error))[:300]}") from None
    problems = []
    if cfg.train.loop not in LOOPS:
        problems.append(f"train.loop={cfg.train.loop!r} is not one of {', '.join(LOOPS)}")
    required = ("model", "data", "optim")
    if cfg.train.loop == "user":  # a script run's step is a closure in the script: nothing to name
        required = ("train.script",) if cfg.train.get("script") is not None else ("train.build", "train.step_fn")
    for key in required:
        if OmegaConf.select(cfg, key) is None:
            problems.append(f"`{key}` is not set (give it a _target_)")
    if not -(2**63) <= cfg.seed < 2**64:
        problems.append(f"seed={cfg.seed} is outside torch's seed range (-2**63 to 2**64-1)")
    if cfg.train.precision not in PRECISIONS:
        problems.append(f"train.precision={cfg.train.precision!r} is not one of {', '.join(PRECISIONS)}")
    if cfg.train.steps <= 0:
        problems.append(f"train.steps={cfg.train.steps} must be positive")
    if cfg.train.batch_size <= 0:
        problems.append(f"train.batch_size={cfg.train.batch_size} must be positive")
    if cfg.train.accumulate < 1:
        problems.append(f"train.accumulate={cfg.train.accumulate} must be 1 or more")
    elif cfg.train.batch_size > 0 and cfg.train.loop == "builtin" and cfg.train.batch_size % cfg.train.accumulate:
        problems.append(f"train.batch_size={cfg.train.batch_size} does not split into train.accumulate={cfg.train.accumulate} equal micro-batches; "
                        "make batch_size a multiple of accumulate")
    if not 1 <= cfg.train.get("nproc", 1) <= MAX_PROCESSES:
        problems.append(f"train.nproc={cfg.train.nproc} must be between 1 and {MAX_PROCESSES}")
    elif cfg.train.get("nproc", 1) > 1 and cfg.train.loop != "builtin":
        problems.append("train.nproc starts `replay train`'s own loop on several processes; a run recorded from your loop "
                        "is started by you (torchrun)")
    if not 0 <= cfg.train.num_workers <= 256:
        problems.append(f"train.num_workers={cfg.train.num_workers} must be between 0 and 256")
    if cfg.train.num_threads is not None and not 1 <= cfg.train.num_threads <= MAX_THREADS:
        problems.append(f"train.num_threads={cfg.train.num_threads} must be between 1 and {MAX_THREADS}, or null")
    if cfg.train.val_batches <= 0:
        problems.append(f"train.val_batches={cfg.train.val_batches} must be positive")
    if cfg.train.clip_grad_norm is not None and not 0 < cfg.train.clip_grad_norm < float("inf"):
        problems.append(f"train.clip_grad_norm={cfg.train.clip_grad_norm} must be positive or null")
    if cfg.train.val_every < 0 or cfg.snapshot.every < 0 or cfg.snapshot.layer_stats_every < 0:
        problems.append("train.val_every, snapshot.every and snapshot.layer_stats_every must be >= 0")
    if not 0 <= cfg.snapshot.metrics_flush_seconds < float("inf"):  # (NaN too)
        problems.append(f"snapshot.metrics_flush_seconds={cfg.snapshot.metrics_flush_seconds} must be a finite number of seconds >= 0 "
                        "(0: by step count only)")
    if cfg.snapshot.on_nonfinite not in ON_NONFINITE:
        problems.append(f"snapshot.on_nonfinite={cfg.snapshot.on_nonfinite!r} is not one of {', '.join(ON_NONFINITE)}")
    if cfg.train.loop == "builtin" and cfg.train.device != "auto":  # a device that is not here: before any store or run
        from replaybisect.core.device import resolve_device

        try:
            resolve_device(cfg.train.device)
        except ConfigError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError("bad config: " + "; ".join(problems))


# Built-in targets that moved: runs recorded before the move name them by their old paths.
MOVED_TARGETS = {"replaybisect.loop.": "replaybisect.core.loop."}


def _current_targets(text: str) -> str:
    for old, new in MOVED_TARGETS.items():
        text = text.replace(f"_target_: {old}", f"_target_: {new}")
    return text


MAX_STORED_CONFIG_BYTES = 1_000_000
MAX_STORED_CONFIG_DEPTH = 64
MAX_STORED_CONFIG_NODES = 100_000


def from_yaml(text: str, source: str = "the stored config"):
    """Rebuild a run's config from the config.yaml MLflow stored with it, re-validated by the schema.

    The text is untrusted: it is parsed as plain YAML only after a bounded scan (size, depth, node count; no
    anchors, aliases or tags, which `OmegaConf.to_yaml` never writes and an alias bomb needs), and anything the
    schema does not accept is a one-line ConfigError."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    _check_plain_yaml(text, source)
    try:
        stored = OmegaConf.create(_current_targets(text))
        if not isinstance(stored, DictConfig):
            raise ConfigError(f"{source} is a {type(stored).__name__.removesuffix('Config').lower()}, not a mapping of "
                              "config keys; it was not written by replaybisect (re-record the run)")
        cfg = OmegaConf.merge(OmegaConf.structured(ReplayConfig), stored)
    except YAMLError as error:
        raise ConfigError(f"{source} is not valid YAML ({_one_line(error)[:200]}); re-record the run") from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"{source} does not fit the run schema: {_clip_words(_one_line(error))[:300]}; re-record the run") from None
    OmegaConf.set_struct(cfg, True)
    return cfg


def _check_plain_yaml(text: str, source: str) -> None:
    """Refuse, before building anything from it, YAML that is too big or deep or uses anchors, aliases or tags."""
    import yaml

    if not isinstance(text, str) or len(text.encode("utf-8", "surrogatepass")) > MAX_STORED_CONFIG_BYTES:
        raise ConfigError(f"{source} is over {MAX_STORED_CONFIG_BYTES // 1_000_000} MB; it was not written by replaybisect (re-record the run)")
    depth = nodes = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise ConfigError(f"{source} uses a YAML anchor or alias, which replaybisect never writes (and an alias "
                                  "can expand without bound); re-record the run")
            if getattr(event, "tag", None):  # an explicit tag: `!!python/object/apply:...`, `!!binary`, ...
                raise ConfigError(f"{source} has the YAML tag {event.tag[:80]}, which replaybisect never writes; re-record the run")
            if isinstance(event, yaml.ScalarEvent) and "${" in event.value:
                raise UntrustedConfig(f"refused interpolation {event.value[:80]!r} in {source}: a recorded config is stored "
                                  "resolved, and an interpolation can read the environment or run a resolver; nothing was run")
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_STORED_CONFIG_DEPTH:
                    raise ConfigError(f"{source} nests deeper than {MAX_STORED_CONFIG_DEPTH} levels; re-record the run")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
            nodes += 1
            if nodes > MAX_STORED_CONFIG_NODES:
                raise ConfigError(f"{source} has over {MAX_STORED_CONFIG_NODES} YAML nodes; re-record the run")
    except yaml.YAMLError as error:
        raise ConfigError(f"{source} is not valid YAML ({_one_line(error)[:200]}); re-record the run") from None


def to_yaml(cfg) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg, resolve=True)


def flatten(cfg) -> dict[str, Any]:
    """`a.b.c: value` params for MLflow."""
    from omegaconf import OmegaConf

    flat: dict[str, Any] = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            if not node and prefix:
                flat[prefix] = "{}"
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(node, list):
            flat[prefix] = str(node)
        else:
            flat[prefix] = "null" if node is None else node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def instantiate(node, what: str, **kwargs):
    """hydra.utils.instantiate with a one-line error naming the config key."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(node, **kwargs)
    except InstantiationException as error:
        raise ConfigError(f"cannot build `{what}`: {_one_line(error)}") from None
    except (ImportError, TypeError, ValueError) as error:
        raise ConfigError(f"cannot build `{what}`: {_one_line(error)}") from None
