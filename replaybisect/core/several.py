"""Several models and optimizers trained in one step (a GAN's generator and discriminator, a teacher and a student,
an actor and a critic), handed to the Recorder by name:

    rec = replaybisect.Recorder({"G": netG, "D": netD}, {"G": optimizerG, "D": optimizerD})

They stand as one model and one optimizer everywhere else: `Models` is an nn.ModuleDict of the models (its state
dict, and the module names the probes report, start with each model's name: `D.main.2`), `Optimizers` is a
torch.optim.Optimizer whose parameter groups are the optimizers' own (in the order given; an lr set on a group
is set on that optimizer's) and whose state dict is theirs joined in the layout of one optimizer's, so a snapshot
holds every optimizer's moments and a replay from any snapshot restores them all. The optimizers step themselves,
each where the loop steps it: a step of the loop ends when each of them has stepped (a critic stepped five times
per generator step is one step). Several schedulers (`{"G": schedG, "D": schedD}`) are one `Schedulers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch

from replaybisect.errors import ConfigError


OPTIMIZERS_TAG = "optimizers"  # the run's tag naming its optimizers, where several (an arm on one: lr[D]=x0.1)


class Models(torch.nn.ModuleDict):
    """The models of one step, by name; nothing calls this container itself: each model is called by the loop."""

    def members(self) -> list[torch.nn.Module]:
        return list(self.values())


class _JoinedState(Mapping):
    """The optimizers' per-parameter state as one optimizer's `state` reads (a live view: load_state_dict replaces
    each optimizer's own)."""

    def __init__(self, optimizers: "Optimizers"):
        self._optimizers = optimizers

    def _states(self):
        return [optimizer.state for optimizer in self._optimizers.members()]

    def __getitem__(self, param):
        for state in self._states():
            if param in state:
                return state[param]
        raise KeyError(param)

    def get(self, param, default=None):
        return self[param] if param in self else default

    def __contains__(self, param) -> bool:
        return any(param in state for state in self._states())

    def __iter__(self) -> Iterator:
        return (param for state in self._states() for param in state)

    def __len__(self) -> int:
        return sum(len(state) for state in self._states())


class Optimizers(torch.optim.Optimizer):
    """The optimizers of one step, by name, standing as one optimizer (see the module's text). `step()` steps each;
    a hook registered on it is registered on each (called with that optimizer)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        params = [param for optimizer in optimizers.values() for group in optimizer.param_groups for param in group["params"]]
        super().__init__(params, {})  # (checks that no parameter is in two of them)
        self.named = dict(optimizers)
        self.param_groups = [group for optimizer in optimizers.values() for group in optimizer.param_groups]
        self.state = _JoinedState(self)

    def members(self) -> list[torch.optim.Optimizer]:
        return list(self.named.values())

    def name_of(self, optimizer: torch.optim.Optimizer) -> str:
        return next(name for name, member in self.named.items() if member is optimizer)

    def __getstate__(self) -> dict[str, Any]:  # (Optimizer's keeps only defaults, state and param_groups)
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"Optimizers({', '.join(f'{name}={type(o).__name__}' for name, o in self.named.items())})"

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("several optimizers step one by one, each in the loop: there is no closure to re-evaluate")
        for optimizer in self.members():
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.members():
            optimizer.zero_grad(set_to_none=set_to_none)

    def register_step_pre_hook(self, hook):
        return _Handles([optimizer.register_step_pre_hook(hook) for optimizer in self.members()])

    def register_step_post_hook(self, hook):
        return _Handles([optimizer.register_step_post_hook(hook) for optimizer in self.members()])

    def state_dict(self) -> dict[str, Any]:
        """One optimizer's layout: the groups in order, the parameters numbered across all of them (an entry a member
        keeps under a key of its own: "<member's position>.<key>")."""
        state, groups, offset = {}, [], 0
        for position, optimizer in enumerate(self.members()):
            own = optimizer.state_dict()
            state.update({_joined_key(key, offset, position): value for key, value in own["state"].items()})
            groups += [{**group, "params": [index + offset for index in group["params"]]} for group in own["param_groups"]]
            offset += sum(len(group["params"]) for group in optimizer.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = list(state_dict["param_groups"])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(groups)} parameter groups, these optimizers {len(self.param_groups)}")
        offset = 0
        for position, optimizer in enumerate(self.members()):
            own_groups, groups = groups[:len(optimizer.param_groups)], groups[len(optimizer.param_groups):]
            count = sum(len(group["params"]) for group in optimizer.param_groups)
            own_state = {int(index) - offset: value for index, value in state_dict["state"].items()
                         if _numbered(index) and offset <= int(index) < offset + count}
            own_state.update({key.partition(".")[2]: value for key, value in state_dict["state"].items()
                              if not _numbered(key) and str(key).partition(".")[0] == str(position)})
            optimizer.load_state_dict({"state": own_state, "param_groups": [
                {**group, "params": [index - offset for index in group["params"]]} for group in own_groups]})
            offset += count
        self.param_groups = [group for optimizer in self.members() for group in optimizer.param_groups]


def _numbered(key) -> bool:
    return isinstance(key, int) and not isinstance(key, bool) or isinstance(key, str) and key.isdigit()


def _joined_key(key, offset: int, position: int):
    """A member's state key in the joined state_dict: a parameter's index shifted past the members before it; an
    entry of its own named by a string, prefixed with its position."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key + offset
    return f"{position}.{key}" if isinstance(key, str) else key  # (another key: left out of a snapshot, with a warning)


class _Handles:
    def __init__(self, handles: list):
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class Schedulers:
    """The schedulers of several optimizers, by name, stepped and stored as one."""

    def __init__(self, schedulers: dict[str, Any]):
        self.named = dict(schedulers)

    def step(self) -> None:
        for scheduler in self.named.values():
            scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {name: scheduler.state_dict() for name, scheduler in self.named.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, scheduler in self.named.items():
            scheduler.load_state_dict(state_dict[name])

    def get_last_lr(self) -> list[float]:
        return [lr for scheduler in self.named.values() for lr in scheduler.get_last_lr()]


def members(optimizer) -> list:
    """The optimizers that step: those of `Optimizers`, or the one optimizer."""
    return optimizer.members() if isinstance(optimizer, Optimizers) else [optimizer]


def models(model) -> list[torch.nn.Module]:
    """The models the loop calls: those of `Models`, or the one model."""
    return model.members() if isinstance(model, Models) else [model]


def named_models(model) -> list[tuple[Optional[str], torch.nn.Module]]:
    """The models the loop calls, each with its name (the one model: None)."""
    return list(model.items()) if isinstance(model, Models) else [(None, model)]


def joined(parts: dict[str, Any]) -> dict[str, Any]:
    """The Recorder's model, optimizer and scheduler where each may be several, by name (a dict): one of each.
    Names must be the same for the models and the optimizers' where both are several (the optimizers are matched
    to nothing, but a name says which is which in every report)."""
    parts = dict(parts)
    for key, joining in (("model", _joined_models), ("optimizer", _joined_optimizers), ("scheduler", _joined_schedulers)):
        if isinstance(parts.get(key), Mapping) and not isinstance(parts[key], torch.nn.Module):
            parts[key] = joining(_named(parts[key], key))
    return parts


def _named(values: Mapping, what: str) -> dict[str, Any]:
    if not values:
        raise ConfigError(f"the {what}s dict is empty; pass {what}={{'name': ...}} with one entry per {what}")
    for name in values:
        if not (isinstance(name, str) and name.isidentifier()):
            raise ConfigError(f"{what} name {name!r} is not a Python identifier; name each {what} like a variable ('G', 'D')")
    return dict(values)


def _joined_models(named: dict[str, Any]) -> Models:
    for name, model in named.items():
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model {name!r} is a {type(model).__name__}; pass a torch.nn.Module for each name")
    return Models(named)


def _joined_optimizers(named: dict[str, Any]) -> Optimizers:
    for name, optimizer in named.items():
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer {name!r} is a {type(optimizer).__name__}; pass a torch.optim.Optimizer for each name")
    try:
        return Optimizers(named)
    except ValueError as error:
        raise ConfigError(f"the optimizers share parameters ({error}); give each parameter to one optimizer") from None


def _joined_schedulers(named: dict[str, Any]) -> Schedulers:
    return Schedulers(named)
