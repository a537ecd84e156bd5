"""streamrl: fully asynchronous, off-policy, streaming RL for LLMs."""

import os

__version__ = "0.1.0"

# DeepSpeed probes for an accelerator on import (transformers imports it too) and warns when it
# falls back to the CPU; on a machine without an NVIDIA device, say "cpu" up front.
if "DS_ACCELERATOR" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["DS_ACCELERATOR"] = "cpu"
