"""A Hydra app recorded as it is written: the settings a structured config, the step a closure inside `main`, no
build. Hydra writes its output folder in the working folder before `main` runs; a replay points it elsewhere.
At lr=0.3 this linear regression diverges (inf, then NaN) in about 20 steps.
Run: python hydra_script.py lr=0.3"""
from dataclasses import dataclass

import hydra
import torch
from hydra.core.config_store import ConfigStore

import replaybisect


@dataclass
class Settings:
    lr: float = 0.01
    steps: int = 40


ConfigStore.instance().store(name="settings", node=Settings)


@hydra.main(config_path=None, config_name="settings", version_base="1.3")
def main(cfg):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    features = torch.randn(64, 8) * 4
    targets = features.sum(1, keepdim=True)

    def step(batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    with replaybisect.Recorder(model, optimizer, step_fn=step, config=cfg, snapshot_every=4) as rec:
        for _ in range(cfg.steps):
            rows = torch.randint(0, 64, (16,))
            print("loss", rec.step((features[rows], targets[rows])))


if __name__ == "__main__":
    main()
