"""A tiny GPT-2 trained by transformers' Trainer (built from a small config: nothing downloaded), recorded by the
lines marked `# replaybisect`. Its plants: too high a learning rate (--lr), and a token whose embedding scale is
infinite (a count of 0; --plant ROW puts that token in one example: that row's forward makes the NaN)."""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from replaybisect.hf import ReplayCallback  # replaybisect

VOCAB, LENGTH = 64, 16
RARE = VOCAB - 1  # the token --plant puts in one example


class ScaledEmbeddingGPT2(GPT2LMHeadModel):
    """GPT-2 with per-token embedding scales, an inverse frequency from counts: the rare token's count is 0."""

    def __init__(self, config):
        super().__init__(config)
        counts = torch.full((config.vocab_size,), 100.0)
        counts[RARE] = 0.0
        self.register_buffer("token_counts", counts)

    def forward(self, input_ids=None, labels=None, **kwargs):
        scale = self.token_counts.mean() / self.token_counts[input_ids]
        embeds = self.transformer.wte(input_ids) * scale.unsqueeze(-1)
        return super().forward(inputs_embeds=embeds, labels=labels, **kwargs)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, plant_row: int | None):
        self.ids = torch.randint(0, RARE, (count, LENGTH), generator=torch.Generator().manual_seed(0))
        if plant_row is not None:
            self.ids[plant_row, 5] = RARE

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


class OwnStepTrainer(Trainer):
    """A training_step of its own: a replay, which repeats the Trainer's, cannot see it (refused at train())."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optim", default="adamw_torch")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plant", type=int, default=None)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--report-to", default="none")
    parser.add_argument("--out", default="trainer_out")
    parser.add_argument("--own-training-step", action="store_true", help="a Trainer subclass with its own training_step")
    args = parser.parse_args(argv)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0)
    set_seed(0)  # the Trainer seeds only after the model is built: its initial weights would differ from run to run
    model = ScaledEmbeddingGPT2(config) if args.plant is not None else GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=args.steps,
        learning_rate=args.lr, optim=args.optim, warmup_steps=2, lr_scheduler_type="linear", max_grad_norm=args.clip,
        bf16=args.precision == "bf16", use_cpu=True, seed=0, logging_steps=1, save_strategy="no",
        report_to=[args.report_to] if args.report_to != "none" else [], disable_tqdm=True,
    )
    trainer_class = OwnStepTrainer if args.own_training_step else Trainer
    trainer = trainer_class(model=model, args=training, train_dataset=Tokens(256, args.plant),
                      callbacks=[ReplayCallback(snapshot_every=5)])  # replaybisect
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1:])
