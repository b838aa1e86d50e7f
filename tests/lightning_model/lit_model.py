"""A LightningModule for the callback's tests: a small regressor whose prediction goes through exp (ExpHead), with
dropout, a per-step StepLR, and a shuffling DataLoader. Too high a learning rate makes SGD diverge until the exp
overflows: the planted NaN. Run: python lit_model.py PRECISION LR STEPS [CLIP [ACCUMULATE [skip]]] (skip: training_step
returns None for some batches, as Lightning allows); several fits, a run each, one after another: ARGS + ARGS ..."""
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from replaybisect.lightning import ReplayCallback  # replaybisect


class ExpHead(nn.Module):
    def forward(self, h):
        return torch.exp(h)


class LitRegressor(L.LightningModule):
    def __init__(self, lr: float = 0.05, hidden: int = 16, skip: bool = False):
        super().__init__()
        self.save_hyperparameters()  # replaybisect: a replay rebuilds the module from its hparams
        self.body = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Dropout(0.1), nn.Linear(hidden, 1))
        self.head = ExpHead()

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.hparams.skip and batch_idx % 8 in (3, 6, 7):  # with 2 accumulated batches: one step half, one wholly skipped
            return None
        loss = F.mse_loss(self.head(self.body(x)).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Jittered(TensorDataset):
    """Per-sample noise drawn from torch's global RNG as items are loaded: draws between (and, with accumulation,
    within) optimizer steps that a replay must not depend on."""

    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return x + 0.01 * torch.randn(8), y


def data(samples: int = 256) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=generator)
    y = torch.exp(0.5 * x[:, 0] - 0.3 * x[:, 1])
    return DataLoader(Jittered(x, y), batch_size=16, shuffle=True)


def main(precision: str, lr: float, steps: int, clip: float | None = None, accumulate: int = 1, skip: bool = False):
    L.seed_everything(7, verbose=False)
    model = LitRegressor(lr=lr, skip=skip)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, precision=precision, gradient_clip_val=clip,
                        accumulate_grad_batches=accumulate,
                        callbacks=[ReplayCallback(snapshot_every=10, layer_stats_every=5)],  # replaybisect
                        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, data())


if __name__ == "__main__":
    for fit in " ".join(sys.argv[1:]).split(" + "):
        args = fit.split()
        precision, lr, steps, clip, accumulate, skip = args + ["none", "1", ""][len(args) - 3:]
        main(precision, float(lr), int(steps), None if clip == "none" else float(clip), int(accumulate), skip == "skip")
