"""fedtune: resource-adaptive collaborative fine-tuning of foundation models."""

__version__ = "0.1.0"
