"""streamrl: fully asynchronous, off-policy, streaming RL for LLMs."""

__version__ = "0.1.0"
