"""The network and its training: models, losses, the one training loop, metrics, evaluation."""
