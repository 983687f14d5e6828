"""What torchrun starts in the fault tests: `vidtune train CONFIG`, except that on the first attempt (torchrun's
TORCHELASTIC_RESTART_COUNT 0) rank RANK kills itself with SIGKILL when a micro-batch holds stream position
POSITION, as a crashed machine would.

    torchrun ... tests/parallel/fsdp_kill_worker.py CONFIG RANK POSITION
"""

from __future__ import annotations

import os
import signal
import sys

from vidtune.cli import main
from vidtune.training import loop

config, victim, position = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and int(os.environ["RANK"]) == victim:
    forward_backward = loop.forward_backward

    def killed_at_position(context, batch, *args, **kwargs):
        if position in [int(p) for p in batch.positions]:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_backward(context, batch, *args, **kwargs)

    loop.forward_backward = killed_at_position
raise SystemExit(main(["train", config]))
