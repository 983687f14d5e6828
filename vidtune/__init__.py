"""vidtune: fine-tune open video diffusion models on your own clips."""

import logging

__version__ = "0.1.0"


class _NoAcceleratorGuess(logging.Filter):
    """DeepSpeed, imported by accelerate whenever a model is saved, warns "Setting accelerator to CPU" on a machine
    without a GPU: the first line a creator would see, about an engine they did not ask for. vidtune says itself
    which device a run uses."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


logging.getLogger("DeepSpeed").addFilter(_NoAcceleratorGuess())
