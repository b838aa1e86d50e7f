"""The own-loop MLP of diverging_loop.py run as a Hydra app (a learning rate too high for it).
Run: python hydra_diverging.py +lr=0.04 +steps=40"""
import hydra
from omegaconf import DictConfig

from diverging_loop import main


@hydra.main(version_base=None, config_path=None)
def app(cfg: DictConfig) -> None:
    main(float(cfg.lr), int(cfg.steps))


if __name__ == "__main__":
    app()
