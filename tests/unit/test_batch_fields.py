"""replay nan names a batch tensor as the user's code saw it (verbs/nan/probes.batch_fields): a stored step's
bookkeeping (its record, a loop recorded as written's training calls) never shows in the name."""

from __future__ import annotations

import torch

from replaybisect.core import rng, user_step
from replaybisect.core.inline_step import micro_batch, OUTSIDE, CARRIED
from replaybisect.verbs.nan.probes import batch_fields, probe_batch


def names(batch) -> list[str]:
    return [name for name, _ in batch_fields(batch)]


def test_an_inputs_and_targets_batch_keeps_its_roles_and_a_dict_its_keys():
    assert names((torch.zeros(2), torch.zeros(2))) == ["batch[0] (inputs)", "batch[1] (targets)"]
    assert names({"input_ids": torch.zeros(2), "labels": torch.zeros(2)}) == ["batch['input_ids']", "batch['labels']"]


def test_a_loop_recorded_as_written_names_the_models_arguments_and_the_losss_targets():
    one = [{**micro_batch((torch.zeros(2), (torch.zeros(2), torch.zeros(2))), {"mask": torch.zeros(2)}),
            OUTSIDE: [torch.zeros(2)], CARRIED: []}]
    assert names(one) == ["model(arg 0)", "model(arg 1)[0]", "model(arg 1)[1]", "model(mask=)", "loss target 0"]
    two = one + [{**micro_batch((torch.zeros(2),), {}), OUTSIDE: [], CARRIED: []}]
    assert names(two)[0] == "micro-batch 0: model(arg 0)" and names(two)[-1] == "micro-batch 1: model(arg 0)"


def test_a_stored_records_non_finite_row_is_named_without_its_bookkeeping():
    inputs = torch.zeros(4, 3)
    inputs[2, 1] = float("nan")
    record = user_step.pack([{**micro_batch((inputs,), {}), OUTSIDE: [torch.zeros(4)], CARRIED: []}], torch.device("cpu"),
                            rng.capture_raw())
    [finding] = probe_batch(record)
    assert (finding.field, finding.rows, finding.nan) == ("model(arg 0)", [2], 1)


def test_a_step_of_many_non_finite_fields_names_a_few_in_order_and_counts_the_rest():
    """A policy-gradient step (one training call per environment step, each return a loss target) whose reward was
    NaN: every target holds it. The headline names the first three in the batch's order and the evidence ten; all
    of them stay in the report's batch list (report.json)."""
    from types import SimpleNamespace

    from replaybisect.verbs.nan.result import NanReport, headline
    from replaybisect.verbs.nan.verdict import _is_data

    calls = [{**micro_batch((torch.zeros(1, 4),), {}), OUTSIDE: [], CARRIED: []} for _ in range(11)]
    calls[-1][OUTSIDE] = [torch.tensor(float("nan")) for _ in range(12)]
    findings = probe_batch(calls)
    assert [finding.field for finding in findings] == [f"micro-batch 10: loss target {index}" for index in range(12)]
    report = NanReport(run_id="r", failing_step=5, recorded_failing_step=5, snapshot_step=0, reproduced="exact",
                       category="", phase="", module=None, op=None, source=None, evidence=[], suggestion="", arms=[],
                       ablate_command=None)
    assert _is_data(report, SimpleNamespace(batch=findings, probe=SimpleNamespace(first_nonfinite_output=None)), None)
    report.batch = findings
    assert headline(report) == ("data at step 5: the batch holds non-finite values (micro-batch 10: loss target 0, "
                                "micro-batch 10: loss target 1, micro-batch 10: loss target 2 and 9 more)")
    fields = [line for line in report.evidence if line.startswith("batch field")]
    assert len(fields) == 10 and fields[-1].startswith("batch field micro-batch 10: loss target 9 ")
    assert "... and 2 more batch fields hold non-finite values (report.json: batch)" in report.evidence
