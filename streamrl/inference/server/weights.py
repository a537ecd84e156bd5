"""The server's end of the learner's weight push (SGLang's endpoints): join the update group, take a version's
tensors bucket by bucket, or load a checkpoint from disk; all take the server's token.

A push's last bucket may bring the learner's ``probe``: the version is served only if the applied weights
reproduce it. One that fails is rolled back and withdraws the server from generation (503s, which sglang-router
sends elsewhere) until a later version passes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from streamrl.adapters import AdapterSpec
from streamrl.inference.engines.base import Engine, WeightReceiver
from streamrl.inference.server.generation import Standing
from streamrl.weightsync import Probe, ProbeMismatch

log = logging.getLogger(__name__)


class WeightsFromDiskIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_path: str
    weight_version: int | None = None


class InitWeightsGroupIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)  # rank 0 is the learner
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = Field("gloo", pattern="^(gloo|nccl)$")
    timeout_s: float = Field(60.0, gt=0)


class AdapterIn(BaseModel):
    """The adapter a push carries (a LoRA learner's): the bucket's tensors are its, not the model's."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.]+$")
    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    tensors: int = Field(ge=2, description="the whole adapter's tensor count")

    def spec(self) -> AdapterSpec:
        return AdapterSpec(self.rank, self.alpha, self.tensors, self.name)


class ProbeIn(BaseModel):
    """The learner's logprobs of ``input_ids[1:]`` under the version it pushed, and how close the server must be."""

    model_config = ConfigDict(extra="forbid")
    input_ids: list[int] = Field(min_length=2, max_length=8192)
    logprobs: list[float]
    tolerance: float = Field(gt=0, le=1)

    def probe(self) -> Probe:
        if len(self.logprobs) != len(self.input_ids) - 1:
            raise ValueError(f"probe: {len(self.input_ids)} input_ids need {len(self.input_ids) - 1} logprobs, "
                             f"got {len(self.logprobs)}")
        if min(self.input_ids) < 0:
            raise ValueError("probe: input_ids must be token ids (>= 0)")
        return Probe(self.input_ids, self.logprobs, self.tolerance)


class WeightsFromDistributedIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: int | None = None
    lora: AdapterIn | None = None
    digest: str | None = Field(None, description="the bucket's xxh3-128 (streamrl's learner sends it): a bucket "
                               "whose bytes hash otherwise is refused and its push dropped")
    probe: ProbeIn | None = Field(None, description="with a push's last bucket: the version is served only if the "
                                  "applied weights reproduce the learner's logprobs (409 and rolled back otherwise)")


def routes(engine: Engine, receiver: WeightReceiver, standing: Standing, control: Sequence[Any]) -> APIRouter:
    router = APIRouter()

    @router.post("/update_weights_from_disk", dependencies=control)
    async def update_weights_from_disk(req: WeightsFromDiskIn) -> dict:
        version = req.weight_version if req.weight_version is not None else engine.version + 1
        try:
            count = await receiver.load_from_disk(req.model_path, version)
        except (KeyError, RuntimeError, ValueError) as e:
            raise HTTPException(400, f"weights do not fit this model: {e}") from None
        return {"success": True, "message": f"loaded {count} tensors", "weight_version": version}

    @router.post("/init_weights_update_group", dependencies=control)
    async def init_weights_update_group(req: InitWeightsGroupIn) -> dict:
        try:
            await receiver.init(req.master_address, req.master_port, req.rank_offset, req.world_size, req.backend,
                                req.group_name, req.timeout_s)
        except Exception as e:  # the learner never came, or the backend refused
            raise HTTPException(500, f"could not join weight update group: {e}") from None
        return {"success": True, "message": f"joined {req.group_name} as rank {req.rank_offset}"}

    @router.post("/update_weights_from_distributed", dependencies=control)
    async def update_weights_from_distributed(req: WeightsFromDistributedIn) -> dict:
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise HTTPException(400, "names, dtypes and shapes must have the same length")
        version = req.weight_version if req.weight_version is not None else engine.version + 1
        try:
            probe = req.probe.probe() if req.probe else None
            count = await receiver.receive(req.names, req.dtypes, req.shapes, version,
                                           req.lora.spec() if req.lora else None, req.digest, probe)
        except ProbeMismatch as e:
            standing.withdrawn, standing.failures = str(e), standing.failures + 1
            log.error("%s: rolled back; version %d serves, and this server takes no generation until a version "
                      "passes", e, engine.version)
            raise HTTPException(409, f"{e}; rolled back: version {engine.version} serves") from None
        except (KeyError, RuntimeError, ValueError) as e:
            raise HTTPException(400, f"weight update failed: {e}") from None
        reply = {"success": True, "message": f"updated {count} tensors", "weight_version": version}
        if probe is not None:
            standing.withdrawn = None
            reply["probe_gap"] = receiver.probe_gap
        return reply

    @router.post("/destroy_weights_update_group", dependencies=control)
    async def destroy_weights_update_group() -> dict:
        receiver.destroy()
        return {"success": True}

    return router
