"""What a triage concludes from its steps' JSON results: the one-line answer, the evidence, the proven fix and the
next command, which is never a verb the triage already ran (the proven fix as a `replay train` override, the
change to make in your own loop, or the op and line to change).

A step's result is kept as tags on the run (`replaybisect.triage.<step>` and `.<step>.*`), so a triage resumed by
another watcher concludes from the tags of the steps it did not run itself. Both the older and the newer shapes of
the verbs' JSON are read: missing fields are simply absent from the report."""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass
from typing import Any, Optional

from replaybisect.store import TAG

TRIAGE = "triage"  # the run's tag replaybisect.triage, and the prefix of every tag a triage writes
ABLATE_ARMS = ("lr", "clip", "precision")  # always tried after nan, besides the arms nan suggests
EVIDENCE_LINES = 4  # a triage report shows this many lines of a verb's evidence
LINE_CHARS = 300  # and cuts each at this length
_CHANGE = re.compile(r"^(?P<key>[\w.]+) \S+ -> (?P<value>\S+)$")  # an arm's change, e.g. "optim.lr 0.001 -> 0.0001"
_LOCATION = re.compile(r"^(?P<file>.+?:\d+)(?: in (?P<function>[^:]+))?")  # nan's source: "path:24 in forward: code"


@dataclass
class Conclusion:
    verdict: str  # the nan category or the diagnose verdict
    summary: str  # the one-line answer
    next_command: str  # the next useful step; never a verb the triage ran
    evidence: list[str]
    fix: str  # the proven fix in one line ("" when no arm fixed the failure)
    to_prove: str = ""  # no arm fixed it: the command that proves the op's fix nan proposes (`replay ablate --patch`)
    headline: str = ""  # the answer in a few words first: the triage run's name in the MLflow UI


def key(step: str, part: str = "") -> str:
    return f"{TRIAGE}.{step}" + (f".{part}" if part else "")


def tag_line(text: str, limit: int = 500) -> str:
    return " ".join(str(text).split())[:limit]  # one line; well under MLflow's tag value limit


# ---- a finished step's result as tags ----------------------------------------------------------------------
def step_lines(step: str, result: dict[str, Any]) -> dict[str, str]:
    """Enough of a step's result to conclude the triage after a restart without rerunning it, and to report it."""
    if step == "nan":
        return _nan_lines(result)
    if step == "ablate":
        return _ablate_lines(result)
    if step == "verify":
        first = (result.get("differences") or [None])[0]
        return {key("verify"): tag_line(result.get("verdict") or ""),
                key("verify", "step"): str(first["step"]) if first else "",
                key("verify", "evidence"): tag_line(result.get("sentence") or ""),
                key("verify", "steps"): str(result.get("steps_compared") or 0)}
    findings = result.get("findings") or []
    return {key("diagnose"): tag_line(result.get("verdict") or ""),
            key("diagnose", "next"): _command_part(findings[0].get("next") or "") if findings else "",
            key("diagnose", "evidence"): _joined(finding.get("summary") or "" for finding in findings),
            key("diagnose", "run"): result.get("report_run_id") or ""}


def _nan_lines(result: dict[str, Any]) -> dict[str, str]:
    where = f" in {result['module']}" if result.get("module") else ""
    op = f" ({result['op']})" if result.get("op") else ""
    arms, from_step = _ablate_spec(result.get("ablate_command") or "")
    found = result.get("headline") or f"{result.get('category')}{where}{op} at step {result.get('failing_step')}"  # nan's own words
    return {key("nan"): tag_line(found),
            key("nan", "category"): str(result.get("category")),
            key("nan", "next"): _command_part(result.get("suggestion") or ""),
            key("nan", "arms"): ",".join(arms),
            key("nan", "from_step"): from_step,
            key("nan", "where"): _where(result),
            key("nan", "op"): str(result.get("op") or ""),
            key("nan", "fix"): tag_line(_nan_fix(result).get("change") or ""),  # an op-level fault's known fix pattern
            key("nan", "prove"): tag_line(_nan_fix(result).get("prove") or ""),  # and the command that proves it
            key("nan", "evidence"): _joined(_evidence(result)),
            key("nan", "run"): result.get("replay_run_id") or ""}


def _ablate_lines(result: dict[str, Any]) -> dict[str, str]:
    lines = {key("ablate"): tag_line(result.get("conclusion") or result.get("status") or ""),
             key("ablate", "run"): result.get("report_run_id") or "", key("ablate", "fix"): ""}
    arm = proven_arm(result)
    if arm is not None:
        lines.update({key("ablate", "fix"): fix_override(arm), key("ablate", "fix.arm"): str(arm.get("label") or arm.get("name") or ""),
                      key("ablate", "fix.change"): tag_line(arm.get("change") or ""),
                      key("ablate", "fix.proof"): tag_line(_proof(result, arm)), key("ablate", "fix.run"): arm.get("run_id") or ""})
    return lines


def proven_arm(result: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The arm the ablation proved to fix the failure: a fixing arm it ran for a value it suggests (a clip threshold,
    an lr factor), else the first arm that fixes."""
    arms = [arm for arm in result.get("arms") or [] if isinstance(arm, dict) and arm.get("verdict") == "fixes"]
    return next((arm for arm in arms if arm.get("suggested")), arms[0] if arms else None)


def fix_override(arm: dict[str, Any]) -> str:
    """The arm's change as one Hydra override (`optim.lr=0.0001`); "" when it is not one config key."""
    match = _CHANGE.match(arm.get("change") or "")
    return f"{match['key']}={match['value']}" if match else ""


def _proof(result: dict[str, Any], arm: dict[str, Any]) -> str:
    start, end = result.get("start_step"), result.get("end_step")
    proof = f"finite over steps {start}..{end - 1}" if isinstance(start, int) and isinstance(end, int) else "finite over the replay"
    loss = arm.get("final_loss")
    if isinstance(loss, (int, float)) and math.isfinite(loss):
        proof += f", final loss {loss:.4g}"
    failed_at = (result.get("baseline") or {}).get("first_nonfinite_step")
    if failed_at is not None:
        proof += f"; without it the replay goes non-finite at step {failed_at}"
    return proof


def _ablate_spec(command: str) -> tuple[list[str], str]:
    """nan's suggested `replay ablate ARMS ... [--from-step N]`: the arms and the step to apply them from."""
    words = command.split()
    arms = words[2].split(",") if len(words) > 2 and words[:2] == ["replay", "ablate"] and not words[2].startswith("-") else []
    from_step = words[words.index("--from-step") + 1] if "--from-step" in words[:-1] else ""
    return [arm for arm in arms if arm], from_step if from_step.isdigit() else ""


def ablate_args(lines: dict[str, str]) -> list[str]:
    """The ablate step's arms: those nan suggested (with their values), then the standard ones it did not name."""
    arms = [arm for arm in lines.get(key("nan", "arms"), "").split(",") if arm]
    named = {arm.split("=", 1)[0] for arm in arms}
    arms += [arm for arm in ABLATE_ARMS if arm not in named]
    from_step = lines.get(key("nan", "from_step"), "")
    return [",".join(arms), *(["--from-step", from_step] if from_step else [])]


def _nan_fix(result: dict[str, Any]) -> dict[str, Any]:
    fix = result.get("fix")
    return fix if isinstance(fix, dict) else {}


def _where(result: dict[str, Any]) -> str:
    """The op nan named and its line (`torch.exp in gate at model.py:24 in forward`); "" when it named no op."""
    if not result.get("op"):
        return ""
    where = str(result["op"]) + (f" in {result['module']}" if result.get("module") else "")
    location = _LOCATION.match(str(result.get("source") or ""))
    if location:
        where += f" at {location['file']}" + (f" in {location['function']}" if location["function"] else "")
    return tag_line(where)


def _evidence(result: dict[str, Any]) -> list[str]:
    """nan's evidence, shortened: its first lines (how exact the replay was, what it saw first) and its last (where
    the values went non-finite); the indented detail stays in nan's own report."""
    lines = [line for line in result.get("evidence") or [] if isinstance(line, str) and line.strip() and not line[0].isspace()]
    chosen = lines[:EVIDENCE_LINES] + lines[EVIDENCE_LINES:][-1:]
    return [tag_line(line, LINE_CHARS) for line in chosen]


def _joined(lines) -> str:
    return "\n".join(tag_line(line, LINE_CHARS) for line in lines if line)[:2000]


def _command_part(suggestion: str) -> str:
    return tag_line(suggestion.split("#", 1)[0])


# ---- the conclusion ---------------------------------------------------------------------------------------
def conclude(failure: str, run_id: str, lines: dict[str, str], run_name: str, run_tags: dict[str, str],
             ran: list[str], run_params: Optional[dict[str, str]] = None) -> Conclusion:
    """The answer from the steps' tag lines. `run_tags` are the examined run's (all of them, prefixed): they say how
    it was trained, and so how the proven fix is applied; `run_params` its flattened config (a key it lacks is added
    with `++`). `ran` are the verbs this triage ran (resumed ones too)."""
    if failure == "nonfinite":
        fix = lines.get(key("ablate", "fix.change"), "")
        fix_line = f"{lines.get(key('ablate', 'fix.arm'), '')}: {fix} ({lines.get(key('ablate', 'fix.proof'), '')})" if fix else ""
        conclusion = lines.get(key("ablate"), "")
        summary = f"{lines.get(key('nan'), '')}; ablate: {conclusion.split('; ', 1)[0]}"  # the rest is evidence
        evidence = evidence_of(lines) + ([f"ablate: {conclusion}"] if "; " in conclusion else [])
        nan_next = lines.get(key("nan", "next"), "")
        candidates = [_apply_fix(lines, run_name, run_tags, run_params), _op_to_change(lines), nan_next]
        to_prove = "" if fix else lines.get(key("nan", "prove"), "")
        return Conclusion(lines.get(key("nan", "category"), ""), summary, _first_useful(candidates, ran, run_id), evidence, fix_line,
                          to_prove, _nonfinite_headline(lines))
    if failure == "audit":
        verdict, at = lines.get(key("verify"), ""), lines.get(key("verify", "step"), "")
        where = f" at step {at}" if at else f" over {lines.get(key('verify', 'steps'), '0')} sampled steps"
        next_command = "" if verdict == "exact" else f"replay verify --run-id {run_id} --cross-check"
        return Conclusion(verdict, f"audit: {verdict}{where}", next_command, [lines.get(key("verify", "evidence"), "")], "",
                          headline=f"audit: {verdict}{where}")
    verdict = lines.get(key("diagnose"), "")
    return Conclusion(verdict, f"{failure} run: {verdict}",
                      _first_useful([lines.get(key("diagnose", "next"), "")], ran, run_id), evidence_of(lines), "",
                      headline=f"{verdict} · triage")


def _nonfinite_headline(lines: dict[str, str]) -> str:
    """What to do first, in the few characters MLflow's runs view shows of a nested run's name (~13):
    `lr=x0.1 fixes · triage: divergence at step 20`, `fix torch.exp · triage: forward in gate ...`."""
    found = lines.get(key("nan"), "")
    if lines.get(key("ablate", "fix.change")):
        return f"{lines.get(key('ablate', 'fix.arm'), '')} fixes · triage: {found}"
    if lines.get(key("nan", "op")):
        return f"fix {lines[key('nan', 'op')]} · triage: {found}"
    return f"{lines.get(key('nan', 'category'), '')}: no single fix · triage: {found}"


def _first_useful(candidates: list[str], ran: list[str], run_id: str) -> str:
    """The first candidate that is not a verb this triage ran; else `replay check` on the run (a checklist of its
    state, which triage never runs)."""
    for candidate in candidates:
        words = candidate.split()
        if candidate and not (words[:1] == ["replay"] and len(words) > 1 and words[1] in ran):
            return candidate
    return f"replay check --run-id {run_id}"


def evidence_of(lines: dict[str, str]) -> list[str]:
    """The finished steps' evidence lines (nan's or diagnose's)."""
    return [line for step in ("nan", "diagnose") for line in lines.get(key(step, "evidence"), "").split("\n") if line.strip()]


def result_runs(lines: dict[str, str]) -> list[tuple[str, str]]:
    """(step, run id) of the verbs' result runs: nan's, the ablation's and the arm that fixed the failure, diagnose's."""
    found = [(step, lines.get(key(step, "run"), "")) for step in ("nan", "ablate", "diagnose")]
    found.insert(2, ("fix", lines.get(key("ablate", "fix.run"), "")))
    return [(step, run_id) for step, run_id in found if run_id]


def _apply_fix(lines: dict[str, str], run_name: str, run_tags: dict[str, str], run_params: Optional[dict[str, str]]) -> str:
    """The proven fix applied: `replay train` with the run's own config folder and overrides and the fix's override
    for a run `replay train` recorded; a sentence naming the change for a run of your own loop (or Lightning)."""
    change = lines.get(key("ablate", "fix.change"), "")
    if not change:
        return ""
    arm = lines.get(key("ablate", "fix.arm"), "")
    if arm.partition("=")[0] in ("skip-batch", "skip-rows"):  # dropping data is a workaround: the data is what to fix
        what = "that batch" if arm.startswith("skip-batch") else "those rows"
        return (f"fix the data: the {change.removesuffix(' dropped')} is what fails (the ablation's {arm} arm, which drops "
                f"it, trains past the failure); inspect {what} and your data pipeline")
    override = lines.get(key("ablate", "fix"), "")
    if run_tags.get(TAG + "loop") != "user" and override:
        if run_params is not None and _override_key(override) not in run_params:  # e.g. optim.eps, a class default
            override = "++" + override
        return train_command(run_tags, run_name, override)
    proof = f"(the ablation's {arm} arm trains past the failure)"
    if run_tags.get(TAG + "trainer") == "lightning":
        name, _, value = arm.partition("=")
        if name == "clip" and value:  # what Lightning's Trainer takes for it
            return f"pass gradient_clip_val={value} to your Trainer {proof}"
        return f"in your LightningModule: {change} {proof}"
    if run_tags.get(TAG + "trainer") == "transformers":
        name, _, value = arm.partition("=")
        if name == "clip" and value:  # what the Trainer's arguments take for it
            return f"set max_grad_norm={value} in your TrainingArguments {proof}"
        if name == "lr" and value.startswith("x"):
            return f"multiply learning_rate in your TrainingArguments by {value[1:]} {proof}"
        return f"in your Trainer's setup: {change} {proof}"
    return f"in your training code: {change} {proof}"


def _op_to_change(lines: dict[str, str]) -> str:
    where = lines.get(key("nan", "where"), "")
    return f"change {where}: {lines.get(key('nan', 'fix')) or 'it makes the first non-finite value'}" if where else ""


def train_command(run_tags: dict[str, str], run_name: str, override: str) -> str:
    """`replay train` as the run was trained (its config folder and name, its overrides) with `override` in place of
    any override of the same key. Runs recorded before `replay train` tagged its arguments: the config folder is the
    run's code folder when the run's name says so (`train nan_forward` <- .../nan_forward), the overrides unknown."""
    config_dir = run_tags.get(TAG + "config_dir", "")
    config_name = run_tags.get(TAG + "config_name", "")
    try:
        overrides = [str(item) for item in json.loads(run_tags.get(TAG + "overrides") or "[]")]
    except ValueError:
        overrides = []
    if not config_dir and TAG + "overrides" not in run_tags:
        config_dir, config_name = _config_from_name(run_name, run_tags.get(TAG + "code_dir", ""))
    fixed_key = _override_key(override)
    args = ["replay", "train"]
    args += ["--config-dir", config_dir] if config_dir else []
    args += ["--config-name", config_name] if config_name and config_name != "config" else []
    args += [item for item in overrides if _override_key(item) != fixed_key]
    return shlex.join([*args, override])


def _config_from_name(run_name: str, code_dir: str) -> tuple[str, str]:
    if not run_name.startswith("train ") or not code_dir:
        return "", ""
    folder, _, name = run_name[len("train "):].partition("/")
    return (code_dir, name) if code_dir.rstrip("/").rsplit("/", 1)[-1] == folder else ("", "")


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")
