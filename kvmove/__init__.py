"""kvmove: move model state in large-scale RL post-training, and prove how fast."""

__version__ = "0.1.0"
