"""Per-layer statistics, written once for the recorder (logged every `snapshot.layer_stats_every` steps) and
`replay check` (its gradient probe): which modules own which parameters, which activations zero or saturate, and
the norms of a layer's gradients and weights."""

from __future__ import annotations

import torch

from replaybisect.core.thresholds import SATURATION_PREACT  # DeepDiagnosis: |pre-activation| > 5

ZEROING = (torch.nn.ReLU, torch.nn.ReLU6)
SATURATING = (torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Hardtanh)  # ReLU6 subclasses Hardtanh: test ZEROING first


def parameter_owners(model: torch.nn.Module) -> list[tuple[str, list[torch.Tensor]]]:
    """(module, its own parameters) for every module that owns some, each parameter once: a tied weight
    (GPT's lm_head.weight is wte.weight) belongs to the first module that holds it, so it is counted once and no
    layer is compared with itself."""
    seen: set[int] = set()
    owners = []
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            owners.append((name or "model", params))
    return owners


def norm_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of several tensors together, in fp32 (stays on their device)."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.detach().float()) for t in tensors]))


class LayerStats:
    """Observer for one statistics step: activation zero/saturation fractions, per-layer grad and weight
    norms, total parameter norm and the update/weight ratio ‖Δθ‖/‖θ‖. It only reads."""

    def __init__(self, model: torch.nn.Module):
        self._pending: dict[str, torch.Tensor] = {}
        self._handles = []
        self._before: list[torch.Tensor] = []
        self._owners = parameter_owners(model)
        for name, module in model.named_modules():
            if isinstance(module, ZEROING):
                self._handles.append(module.register_forward_hook(self._zero_hook(name)))
            elif isinstance(module, SATURATING):
                self._handles.append(module.register_forward_hook(self._saturation_hook(name)))

    def _zero_hook(self, name):
        def hook(module, inputs, output):
            if torch.is_grad_enabled():  # a training forward, not an evaluation the loop runs between its steps
                self._pending[f"act_zero_frac/{name}"] = (output.detach() == 0).float().mean()

        return hook

    def _saturation_hook(self, name):
        def hook(module, inputs, output):
            if torch.is_grad_enabled():
                self._pending[f"act_sat_frac/{name}"] = (inputs[0].detach().abs() > SATURATION_PREACT).float().mean()

        return hook

    def after_backward(self, state) -> None:
        for name, params in self._owners:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                self._pending[f"grad_norm/{name}"] = norm_of(grads)
            self._pending[f"weight_norm/{name}"] = norm_of(params)
        self._before = [p.detach().clone() for p in state.params]

    def after_update(self, state) -> None:
        params = [p.detach() for p in state.params]
        param_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(self._before))) if params else torch.zeros(())
        deltas = torch._foreach_sub(params, self._before)
        update_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(deltas))) if deltas else torch.zeros(())
        self._pending["param_norm"] = param_norm
        self._pending["update_ratio"] = update_norm / param_norm.clamp_min(1e-12)
        self._before = []

    def finish(self) -> dict[str, torch.Tensor]:
        """The step's statistics, still on the device (the recorder reads them with its other metrics, in one
        transfer at the flush); the module hooks removed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return dict(self._pending)
