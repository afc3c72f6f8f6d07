"""Distributed set-up and batch math for training (see `toolkit.training.distributed`)."""
