"""Where the learner's per-step numbers go: JSONL always; TensorBoard and W&B when configured."""

from __future__ import annotations

import json
import numbers
import time
from pathlib import Path
from typing import Any


class MetricsSink:
    def __init__(self, run_dir: Path, *, tensorboard: bool = False, wandb_project: str | None = None,
                 run_name: str = "streamrl", config: dict | None = None):
        self.jsonl = run_dir / "metrics" / "learner.jsonl"
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        self.tb = self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("learner.tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ValueError("learner.wandb_project needs the wandb package: pip install wandb") from None
            self.wandb = wandb.init(project=wandb_project, name=run_name, config=config or {}, dir=str(run_dir))

    def write(self, record: dict[str, Any]) -> None:
        with self.jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: float(v) for k, v in record.items()
                   if isinstance(v, numbers.Real) and not isinstance(v, bool) and k not in ("step", "time")}
        step = int(record.get("step", 0))
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(f"learner/{key}", value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({f"learner/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def line(version: int, plan: Any, stats: dict, cursor: str, train_s: float | None = None) -> dict[str, Any]:
    """A step's metrics line: the plan's figures, the updates' statistics, the cursor; with ``train_s`` (a step
    whose update landed) its time and tokens per second."""
    out = {"step": version, "time": time.time(), **plan.info, **stats, "cursor": cursor}
    if train_s is not None:
        out |= {"train_s": train_s, "tokens_per_s": out["tokens_global"] / max(train_s, 1e-9)}
    return out
