"""A LightningModule with a learning rate too high for it: an MLP regression under SGD with momentum, no exp or log
anywhere, so nothing but the runaway updates can overflow. Run: python lit_diverging.py LR STEPS"""
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from replaybisect.lightning import ReplayCallback


class LitMLP(L.LightningModule):
    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()  # a replay rebuilds the module from its hparams
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.body(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main(lr: float, steps: int):
    torch.manual_seed(0)
    x = torch.randn(512, 8) * 3
    y = x.sum(-1)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ReplayCallback(snapshot_every=5, layer_stats_every=1)])
    trainer.fit(LitMLP(lr), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]))
