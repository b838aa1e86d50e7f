"""A Lightning script as its README example is written: the LightningModule and `trainer.fit` at the top level
(it trains when run, so a replay cannot import it), the default logger and checkpointing writing into the working
folder. Recording adds the callback (the lines marked `# replaybisect`); a replay runs the script again and takes
the module over when training starts. At lr=0.3 the regression diverges to inf in about 20 steps.
Run: python lightning_script.py 0.3"""
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from replaybisect.lightning import ReplayCallback  # replaybisect


class LitRegression(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


L.seed_everything(0)
features = torch.randn(256, 8) * 4
data = DataLoader(TensorDataset(features, features.sum(1, keepdim=True)), batch_size=16, shuffle=True)
trainer = L.Trainer(max_steps=40, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[ReplayCallback(snapshot_every=4)])  # replaybisect
trainer.fit(LitRegression(float(sys.argv[1])), data)
