"""A Lightning DDP job on CPU (strategy="ddp", 2 processes, gloo) recorded by ReplayCallback: a small regressor, a
DataLoader that Lightning shards across the ranks with its DistributedSampler. Plants:
rank 1's data pipeline serving a NaN as row 5 of its step 6, and too high a learning rate (SGD diverges).

Run: python lightning_ddp.py LR STEPS [nan]"""
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from replaybisect.lightning import ReplayCallback

BATCH = 16
NAN_SERVED = BATCH * 6 + 5  # the item rank 1 serves as row 5 of its step 6 (no loader workers: served in order)


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.body(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class Items(Dataset):
    def __init__(self, plant_nan: bool):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(2048, 8, generator=generator)
        self.y = torch.exp(0.5 * self.x[:, 0] - 0.3 * self.x[:, 1])
        self.plant_nan, self.served = plant_nan, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index].clone()
        if self.plant_nan and torch.distributed.get_rank() == 1 and self.served == NAN_SERVED:
            x[3] = float("nan")
        self.served += 1
        return x, self.y[index]


def main(lr: float, steps: int, plant_nan: bool):
    L.seed_everything(7, verbose=False)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=2, strategy="ddp",
                        callbacks=[ReplayCallback(snapshot_every=5, layer_stats_every=0)],
                        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Regressor(lr=lr), DataLoader(Items(plant_nan), batch_size=BATCH, shuffle=False))


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] == ["nan"])
