"""The pieces of a run on rollout nodes (``engines.nodes``) that need no server: how a step
deals its chunks over the nodes, the config's and ``set_engines``' rules, and what
``milestone status`` prints of the nodes. The runs themselves: tests/e2e/test_rollout_nodes.py
and tests/e2e/test_multi_host.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from milestone_cli.progress_view import format_nodes
from spec.engine import EngineSpec, EngineUpdate
from spec.run import RunConfig
from spec.status import EngineSlotInfo, SlotState
from workflows.contracts.placement import NodeClaim
from workflows.run_state import RunProgress
from workflows.step_nodes import chunk_count, shares


def test_chunks_are_dealt_round_robin_over_the_live_nodes_in_their_order() -> None:
    assert shares(list(range(7)), ["a", "b", "c"]) == {"a": [0, 3, 6], "b": [1, 4], "c": [2, 5]}
    # a lost node's share dealt again over the survivors: every chunk once, none to a node without work
    assert shares([1, 4], ["a", "c"]) == {"a": [1], "c": [4]}
    assert shares([2], ["a", "c"]) == {"a": [2]}


def test_the_chunk_count_is_the_rollout_s_samples_cut_by_chunk_size() -> None:
    cfg = RunConfig.model_validate({"name": "t", "store": "file:///tmp/s", "model": {"init": {}},
                                    "rollout": {"prompts_per_step": 5, "group_size": 4, "chunk_size": 8}})
    assert chunk_count(cfg, None) == 3  # 20 samples: 8 + 8 + 4
    assert chunk_count(cfg, 2) == 1  # a dynamic-sampling round of 2 prompts


def test_engines_nodes_refuses_what_only_works_on_one_node() -> None:
    assert EngineSpec(nodes=2).nodes == 2
    with pytest.raises(ValidationError, match="release_memory"):
        EngineSpec(nodes=1, release_memory="on")
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        EngineSpec(nodes=-1)


def test_set_engines_takes_the_engine_count_or_the_rollout_nodes() -> None:
    assert EngineUpdate(nodes=3).model_dump(exclude_none=True) == {"nodes": 3}
    assert EngineUpdate(num_engines=2, nodes=0).model_dump(exclude_none=True) == {"num_engines": 2, "nodes": 0}
    with pytest.raises(ValidationError, match="engines.num_engines or engines.nodes"):
        EngineUpdate()


def test_status_shows_which_node_holds_what() -> None:
    def claim(node: str) -> NodeClaim:
        return NodeClaim(node_id=node, boot_id="b", task_queue=f"node-{node}-b", weights_url=f"http://{node}:1")

    def engine(slot: int, node: str) -> EngineSlotInfo:
        return EngineSlotInfo(slot=slot, state=SlotState.HEALTHY, weight_version=3, node=node)

    p = RunProgress(run_id="r", state="running", step=3, total_steps=4, policy_version=3, data_cursor=12,
                    node_queue="node-t-b", trainer_node=claim("t"), rollout_nodes=[claim("r1"), claim("r2")],
                    engines=[engine(0, "r1"), engine(1, "r1"), engine(0, "r2")])
    assert format_nodes(p) == [
        "  trainer node node-t-b",
        "  rollout node r1 (node-r1-b): 2 engines serving v3",
        "  rollout node r2 (node-r2-b): 1 engines serving v3",
    ]
    assert format_nodes(p.model_copy(update={"rollout_nodes": []})) == []  # colocated: the engines line as before
