"""vidtune: fine-tune open video diffusion models on your own clips."""

__version__ = "0.1.0"
