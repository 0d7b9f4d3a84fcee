"""A claimed trainer node brought to the run's committed version (``TrainingRun`` after a claim):
its trainer built (SFT warm-up) or restored (checkpoint + replay), then the run's engines
serving that version: the trainer node's own (``engines.nodes`` 0), or every rollout node's,
each pulling it from the new trainer node (``workflows.rollout_nodes``)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from spec.engine import EngineSpec
    from spec.run import RunConfig
    from spec.trainer_rpc import ForkPoint, RunSetup
    from workflows import cell_heal
    from workflows.contracts.placement import InitPolicyInput
    from workflows.contracts.training import UpdateWeightsInput
    from workflows.disk_wait import waiting_for_disk
    from workflows.rollout_nodes import RolloutNodes
    from workflows.run_state import RunState
    from workflows.stubs import INIT_POLICY, UPDATE_WEIGHTS


async def init_trainer_node(
    run_id: str, chash: str, init: bool, cfg: RunConfig, st: RunState, lineage: list[ForkPoint],
    engines: EngineSpec, rollout: RolloutNodes,
) -> None:
    """``st.node``'s trainer to ``st.policy_version`` (``init``: the SFT warm-up to v0), then the engines up."""
    assert st.dataset is not None and st.train is not None and st.node is not None
    node, dataset, train = st.node, st.dataset, st.train
    setup = RunSetup(
        run_id=run_id, store_uri=cfg.store, epoch=node.epoch, seed=cfg.seed, model=cfg.model, sft=cfg.sft,
        hparams=train, dataset_key=dataset.key, keep_last=cfg.checkpoint.keep_last,
        keep_versions=cfg.checkpoint.keep_versions, config_hash=chash, distill=cfg.distill, lineage=lineage,
        trainer=cfg.trainer,
    )
    policy = await waiting_for_disk(lambda: INIT_POLICY.run(
        InitPolicyInput(setup=setup, policy_version=st.policy_version),
        queue=node.task_queue,
        summary="SFT warm-up -> v0" if init else f"restore policy v{st.policy_version}",
    ), "init policy")
    st.add_events(policy.node_events)
    st.checksum = policy.checksum
    st.cells = [policy.cell] if policy.cell is not None else []
    if policy.dp is not None:  # trainer.cells > 1: cells this trainer lost are scheduled for a restart
        st.dp = policy.dp
        st.cell_heal = cell_heal.after_step(st.cell_heal, policy.dp, {}, workflow.now(), cfg.trainer)
    if rollout.target(cfg, st) or st.rollout_nodes:  # the rollout nodes keep their engines: pushed again
        await rollout.ensure(run_id, cfg, st, engines, lost=[], trainer_placed=True, push_all=True)
        return
    synced = await UPDATE_WEIGHTS.run(
        UpdateWeightsInput(
            run_id=run_id, store_uri=cfg.store, policy_version=policy.policy_version,
            checksum=policy.checksum, engines=engines,
        ),
        queue=node.task_queue,
        summary=f"start engines @ v{policy.policy_version}",
    )
    st.add_events(synced.node_events)
    st.engines = synced.engines
