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
