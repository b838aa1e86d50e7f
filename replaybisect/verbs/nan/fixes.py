"""The fix patterns for the ops that fault most, and the command that proves a fix: `replay ablate --patch`.

A numerical fault names an op and its line; for the known patterns the report proposes the change and how to prove
it on the failure itself (the same state, the same batches) before training again."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

# op name fragments (forward ops and autograd nodes) -> the change that fixes the pattern
PATTERNS = (
    (("exp",), "subtract the max before exp (x - x.amax(dim, keepdim=True)), or use torch.softmax / torch.logsumexp"),
    (("log_softmax", "logsumexp"), "keep the computation in log space end to end (F.log_softmax on the logits, F.cross_entropy)"),
    (("log",), "work in log space (F.log_softmax, F.logsigmoid, BCEWithLogitsLoss on logits), or clamp: torch.log(x.clamp_min(eps))"),
    (("sqrt", "rsqrt"), "add an eps inside the root (torch.sqrt(x + eps)): its gradient is infinite at 0 and it is NaN below 0"),
    (("div", "reciprocal"), "add an eps to the divisor (x / (y + eps)), or guard the zero it divides by"),
    (("pow",), "bound the base or the exponent (clamp), or rewrite it in log space"),
    (("matmul", "linear", "bmm", "baddbmm", "addmm", "mm"),
     "scale before the product (e.g. q * d**-0.5 before q @ k^T), or run this op in fp32 (torch.autocast(enabled=False))"),
)


# ops whose non-finite values are an overflow of large inputs (the largest rows overflow first: not a fault of the data)
OVERFLOWS = ("exp", "expm1", "pow", "sinh", "cosh", "matmul", "linear", "bmm", "baddbmm", "addmm", "mm")


def _matches(op: Optional[str], fragments) -> bool:
    if not op:
        return False
    name = op.lower().rsplit(".", 1)[-1].removeprefix("_").removesuffix("backward").removesuffix("backward0")
    name = name.strip("_")
    return any(fragment == name or name.startswith(fragment) or name.endswith(fragment) for fragment in fragments)


def fix_for(op: Optional[str]) -> Optional[str]:
    """The known fix for the op's pattern, or None."""
    return next((fix for fragments, fix in PATTERNS if _matches(op, fragments)), None)


def overflows(op: Optional[str]) -> bool:
    """Whether the op is one that overflows on large inputs (exp, a product)."""
    return _matches(op, OVERFLOWS)


def source_file(source: Optional[str]) -> Optional[Path]:
    """The file of a report's source line (`path:line in function: code`)."""
    if not source or ":" not in source:
        return None
    return Path(source.split(":", 1)[0])


def patch_command(run_id: str, source: Optional[str], script: Optional[str] = None) -> Optional[str]:
    """The command that proves a fix of the op's file: the user's fixed copy replaces the recorded module. None for a
    run recorded by a script (`script`): its arms run the script's own code, so `replay ablate` takes no --patch."""
    path = source_file(source)
    if path is None or path.suffix != ".py" or script is not None:
        return None
    return f"replay ablate --patch fixed/{path.name} --run-id {run_id}"
