"""replaybisect: replay, ablate and bisect failing PyTorch training runs recorded to MLflow."""

__version__ = "0.1.0"
