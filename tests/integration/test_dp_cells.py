"""trainer.cells: 2 independent DP cells (real cell processes, a real torchft lighthouse,
gloo across cells) against the plain single trainer, and the faults they are for.

The reference is ``PolicyTrainer`` in this process (one process, the same recipe, the same
samples). Two cells each accumulate their share of the micro-batches and add the two
partial gradients, so against the reference only the order of float sums differs
(weights compared with ``WEIGHT_ATOL``, the bound test_trainer_cell.py justifies for the
same recipe); the cells against each other are compared bitwise every step (the group
raises ``CellsDiverged`` otherwise). A step that one cell trains alone sums its
micro-batches in the reference's order: bitwise equal to the reference.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torchft  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)

from gpu_runtime.models.causal_lm import export_state_dict
from gpu_runtime.models.model_folder import load_model_folder, weights_checksum
from gpu_runtime.proc.processes import pid_alive
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.dp.group import DPGroup
from gpu_runtime.trainer.dp.lighthouse import Lighthouse
from spec.events import CellHealed
from tests.stack import wait_for
from tests.unit.test_policy_trainer import ROWS, base, hparams, rollout

SEED = 7
HP = hparams(micro_batch_size=2, ppo_epochs=1, kl_coef=0.1, warmup_steps=0, lr=1e-3, entropy_coef=0.01)
WEIGHT_ATOL = 1e-5  # see test_trainer_cell.py: ~lr * 1e-7 relative per step, weights move ~1e-3 per step
GATE = "fault_gate"  # under tmp_path: a fault delay (MILESTONE_FAULT_CELL_GATE) ends once it exists
TIMEOUT_S = 5.0  # the cells' collective timeout: what a SIGSTOPped cell costs its peer


@pytest.fixture(scope="module")
def folder() -> Path:
    torch.set_num_threads(1)
    tr = PolicyTrainer.create(base(SEED), HP, SEED)
    tr.sft_warmup(ROWS, steps=3, batch_size=8, lr=1e-3, seed=SEED, betas=(0.9, 0.95))
    out = Path(tempfile.mkdtemp(prefix="dp-base-")) / "policy"
    tr.export_model_folder(out)
    return out


@pytest.fixture(scope="module")
def reference(folder: Path) -> list[dict[str, torch.Tensor]]:
    """The single trainer's weights after steps 1..4."""
    torch.set_num_threads(1)
    tr = PolicyTrainer.create(folder, HP, SEED)
    out = []
    for s in range(1, 5):
        tr.train_step(*rollout(s), 4, HP)
        out.append({k: v.clone() for k, v in tr.published_state().items()})
    return out


@pytest.fixture
def group(folder: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[DPGroup]:
    delay = getattr(request, "param", "")
    old = os.environ.get("MILESTONE_FAULT_CELL_DELAY")
    os.environ["MILESTONE_FAULT_CELL_DELAY"] = delay
    os.environ["MILESTONE_FAULT_CELL_GATE"] = str(tmp_path / GATE)  # the delay ends once a test creates it
    lighthouse = Lighthouse(tmp_path / "lighthouse.log")
    g = None
    try:
        g = DPGroup(2, folder, HP, SEED, tmp_path / "dp", lighthouse, timeout_s=TIMEOUT_S)
        yield g
    finally:
        os.environ.pop("MILESTONE_FAULT_CELL_GATE", None)
        if old is None:
            os.environ.pop("MILESTONE_FAULT_CELL_DELAY", None)
        else:
            os.environ["MILESTONE_FAULT_CELL_DELAY"] = old
        if g is not None:
            g.close()
            assert not any(c.pid and pid_alive(c.pid) for c in g.members), "a cell outlived close()"
        lighthouse.stop()


def _weights(g: DPGroup, tmp: Path, tag: str) -> dict[str, torch.Tensor]:
    g.export_model_folder(tmp / tag)
    return export_state_dict(load_model_folder(tmp / tag)[0])


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def _step(g: DPGroup, s: int, **kw: object) -> dict[str, float]:
    return g.train_step(*rollout(s), 4, HP, **kw)


def _background_step(g: DPGroup, s: int) -> tuple[threading.Thread, dict[str, object]]:
    """Step ``s`` on a thread (a test injects a fault meanwhile); its metrics land in box["m"]."""
    box: dict[str, object] = {}
    t = threading.Thread(target=lambda: box.update(m=_step(g, s)), daemon=True)
    t.start()
    return t, box


def _restart(g: DPGroup, index: int) -> None:
    """The run's heal: the restart returns at once, the new process is up a few seconds later."""
    assert g.restart(index) == "restarting"
    wait_for(lambda: g.members[index].state != "starting", 120, what=f"cell {index} restarted")
    assert g.members[index].state == "alive", g.members[index].why


def _log_has(g: DPGroup, index: int, text: str) -> bool:
    p = g.work_dir / f"cell{index}.log"
    return p.exists() and text in p.read_text(errors="replace")


def test_two_cells_train_like_the_single_trainer(group: DPGroup, reference, tmp_path: Path) -> None:
    for s in (1, 2):
        m = _step(group, s)
        assert m["dp_cells"] == 2 and m["dp_attempts"] == 1 and m["policy_version"] == s
        # the gap's max over both cells' tokens (one slot per cell in the SUM allreduce), not their sum
        assert 0 < m["rollout_logprob_abs_diff"] <= m["rollout_logprob_abs_diff_max"] < 2 * m["rollout_logprob_abs_diff"]
    got = _weights(group, tmp_path, "v2")
    assert 0 < _close(got, reference[1]) <= WEIGHT_ATOL  # a reordered sum, not the same sum
    assert _close(got, reference[0]) > 100 * WEIGHT_ATOL  # a step moves the weights far more than that
    state = group.state()
    assert [c.state for c in state.cells] == ["alive", "alive"]
    assert len({c.state_checksum for c in state.cells}) == 1  # weights + AdamW bitwise equal


def test_a_step_one_cell_trains_is_bitwise_the_single_trainer(group: DPGroup, reference, tmp_path: Path) -> None:
    m = _step(group, 1, forced_participants=1)  # how a replay trains a step that committed with one cell
    assert m["dp_cells"] == 1
    got = _weights(group, tmp_path, "v1")
    assert weights_checksum(got) == weights_checksum(reference[0])


@pytest.mark.parametrize("group", ["1:3"], indirect=True)
def test_a_cell_killed_mid_step_leaves_the_step_to_its_peer_and_heals_from_it(group: DPGroup, reference, tmp_path: Path) -> None:
    _step(group, 1)
    victim = group.members[1]
    t, box = _background_step(group, 2)
    wait_for(lambda: _log_has(group, 1, "fault delay before the allreduce of v2"), 60, what="cell 1 inside step 2")
    os.kill(victim.pid, signal.SIGKILL)
    t.join(120)
    m = box["m"]
    assert isinstance(m, dict) and m["dp_cells"] == 1 and m["policy_version"] == 2
    assert victim.state == "lost" and "died" in victim.why
    kinds = [e.kind for e in group.take_events()]
    assert "cell_lost" in kinds
    # the survivor trained step 2 alone: bitwise the single trainer's step 2 from the same v1?
    # (v1 came from two cells, so compare with a tolerance against the reference)
    assert _close(_weights(group, tmp_path, "v2"), reference[1]) <= WEIGHT_ATOL
    _step(group, 3)  # one cell: no quorum waits on the lost one
    os.environ["MILESTONE_FAULT_CELL_DELAY"] = ""
    assert group.restart(1) == "restarting"
    assert group.restart(1) == "starting"  # asked again while it starts: nothing more
    wait_for(lambda: group.members[1].state == "alive", 120, what="cell 1 restarted")
    m = _step(group, 4)
    assert m["dp_cells"] == 2
    events = group.take_events()
    assert [e.kind for e in events].count("cell_restarted") == 1 and "cell_restart_failed" not in [e.kind for e in events]
    healed = [e for e in events if isinstance(e, CellHealed)]
    assert [(e.cell, e.trained_version) for e in healed] == [(1, 4)]
    state = group.state()
    assert [c.state for c in state.cells] == ["alive", "alive"]
    assert state.cells[0].state_checksum == state.cells[1].state_checksum  # the healed cell is bitwise its peer
    assert state.cells[1].healed_from_step == 0 and state.cells[1].policy_version == 4
    assert _close(_weights(group, tmp_path, "v4"), reference[3]) <= WEIGHT_ATOL


@pytest.mark.parametrize("group", ["1:3"], indirect=True)
def test_a_stopped_cell_is_timed_out_killed_and_replaced(group: DPGroup, tmp_path: Path) -> None:
    _step(group, 1)
    victim = group.members[1]
    pid = victim.pid
    t, box = _background_step(group, 2)
    wait_for(lambda: _log_has(group, 1, "fault delay before the allreduce of v2"), 60, what="cell 1 inside step 2")
    os.kill(pid, signal.SIGSTOP)
    t.join(120)
    m = box["m"]
    assert isinstance(m, dict) and m["dp_cells"] == 1
    assert victim.state == "lost" and "hung or stopped" in victim.why
    assert not pid_alive(pid)
    os.environ["MILESTONE_FAULT_CELL_DELAY"] = ""
    group.restart(1)
    wait_for(lambda: group.members[1].state == "alive", 120, what="cell 1 restarted")
    assert _step(group, 3)["dp_cells"] == 2
    state = group.state()
    assert state.cells[0].state_checksum == state.cells[1].state_checksum


def test_a_dead_lighthouse_is_restarted_between_steps(group: DPGroup) -> None:
    """The group's watchdog restarts a dead lighthouse on its port whenever it dies, not
    only when the next step starts."""
    _step(group, 1)
    old = group.lighthouse.pid
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: group.lighthouse.restarts == 1 and group.lighthouse.alive(), 30, what="the lighthouse restarted")
    assert group.lighthouse.pid != old
    assert "lighthouse_restarted" in [e.kind for e in group.take_events()]
    m = _step(group, 2)
    assert m["dp_cells"] == 2 and m["dp_attempts"] == 1


@pytest.mark.parametrize("group", ["1:3:2:quorum"], indirect=True)
def test_a_lighthouse_killed_inside_a_step_is_back_before_the_step_gives_up(group: DPGroup) -> None:
    """Killed after the step's start and before its quorum (cell 0 already asked, cell 1
    waits 3 s before it asks): the cells' quorum requests fail while it is gone. Restarted
    only at the next step's start, it left this step retrying its quorum 20 times, 15 s
    each, for 300 s (the soak saw that as a run stuck after a lighthouse kill)."""
    _step(group, 1)
    old = group.lighthouse.pid
    t, box = _background_step(group, 2)
    wait_for(lambda: _log_has(group, 1, "fault delay before the quorum of v2"), 60, what="cell 1 inside step 2")
    os.kill(old, signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "step 2 still waits for its quorum after 120 s"
    m = box["m"]
    assert isinstance(m, dict) and m["dp_cells"] == 2 and m["policy_version"] == 2, m
    assert m["dp_attempts"] <= 2, m  # one quorum request may fail against the dead lighthouse
    assert group.lighthouse.pid != old and group.lighthouse.restarts == 1
    assert "lighthouse_restarted" in [e.kind for e in group.take_events()]
    state = group.state()
    assert [c.state for c in state.cells] == ["alive", "alive"]
    assert state.cells[0].state_checksum == state.cells[1].state_checksum


@pytest.mark.parametrize("group", ["1:120:2:quorum"], indirect=True)
@pytest.mark.parametrize("stopped", [0, 1], ids=["delayed-cell-asks", "retrying-cell-asks"])
def test_a_restarted_lighthouse_that_hears_one_cell_does_not_give_it_a_quorum_alone(group: DPGroup, stopped: int,
                                                                                    tmp_path: Path) -> None:
    """The race a loaded machine lost twice in CI: the lighthouse restarted mid-step and one
    cell asked it for the step's quorum while only that cell's heartbeat had reached it, and
    got a quorum of itself (dp_cells 1); its peer's request then waited for a quorum the idle
    cell never joined, and the peer was lost. Here one cell is SIGSTOPped while the lighthouse
    restarts, so the new one hears only the other when it asks: cell 1 leaving its fault delay
    (cell 0 stopped), or cell 0 retrying its failed request (cell 1 stopped; torchft's own
    retries once asked at once). The asking cell waits for its peer's heartbeat, and the step
    is trained by both once the stopped cell runs again."""
    asker = 1 - stopped
    _step(group, 1)
    old = group.lighthouse.pid
    t, box = _background_step(group, 2)
    wait_for(lambda: _log_has(group, 1, "fault delay before the quorum of v2"), 60, what="cell 1 inside step 2")
    wait_for(lambda: group.lighthouse.pending_requests() == 1, 60, what="cell 0 waiting for the quorum of v2")
    pid = group.members[stopped].pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: group.lighthouse.pid != old and group.lighthouse.heartbeating() == 1, 60,
                 what=f"the restarted lighthouse hearing cell {asker} only")
        (tmp_path / GATE).touch()  # cell 1's fault delay ends (once it runs)
        wait_for(lambda: _log_has(group, asker, "waiting for their heartbeats before asking it"), 60,
                 what=f"cell {asker} waiting for cell {stopped}'s heartbeat")
        assert group.lighthouse.pending_requests() == 0, f"cell {asker} asked a lighthouse that hears it alone"
    finally:
        with contextlib.suppress(ProcessLookupError):  # lost and stopped by the group meanwhile
            os.kill(pid, signal.SIGCONT)
    t.join(120)
    assert not t.is_alive(), "step 2 still waits for its quorum after 120 s"
    m = box["m"]
    assert isinstance(m, dict) and m["dp_cells"] == 2 and m["policy_version"] == 2, m
    state = group.state()
    assert [c.state for c in state.cells] == ["alive", "alive"]
    assert state.cells[0].state_checksum == state.cells[1].state_checksum


def test_a_lighthouse_ends_with_the_trainer_that_started_it(tmp_path: Path) -> None:
    """A SIGKILLed trainer process leaves no lighthouse behind (its watcher ends it)."""
    import subprocess
    import sys

    owner = subprocess.Popen([sys.executable, "-m", "tests.scripts.lighthouse_owner", str(tmp_path / "lh.log")],
                             stdout=subprocess.PIPE, cwd=str(Path(__file__).parents[2]))
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        assert pid_alive(pid)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        wait_for(lambda: not pid_alive(pid), 30, what="the lighthouse gone with its owner")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_lighthouse_restart_waits_for_the_port_to_be_free(tmp_path: Path) -> None:
    """A SIGKILLed lighthouse (many threads) can count as dead, its main thread a zombie,
    while its other threads still hold the listening socket. The restart took that socket's
    answer for the new lighthouse, which then failed to bind and was restarted again (an
    extra ``lighthouse_restarted``, the soak's seed 11). Here a plain socket holds the port
    after the kill: the restart waits for it to close."""
    import socket

    from gpu_runtime.proc.processes import reachable

    lh = Lighthouse(tmp_path / "lh.log")
    holder = socket.socket()
    try:
        lh.start()
        old = lh.pid
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: not pid_alive(old), 10, what="the old lighthouse gone")
        wait_for(lambda: not lh.alive(), 10, what="its watcher gone")
        wait_for(lambda: not reachable(f"127.0.0.1:{lh.port}", 0.2), 10, what="its port closed")
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", lh.port))
        holder.listen()
        threading.Timer(1.5, holder.close).start()
        assert lh.ensure_running()
        assert lh.pid is not None and lh.pid != old and lh.alive()
        assert lh.heartbeating() == 0  # the new lighthouse's own /status page answers
        assert not lh.ensure_running() and lh.restarts == 1  # it is up: nothing to restart
    finally:
        holder.close()
        lh.stop()


def test_a_cell_restarted_while_the_lighthouse_is_dead_restarts_it_first(group: DPGroup) -> None:
    """The restart of a lost cell (the run's heal schedule) can come before the next step,
    which is where a dead lighthouse was once restarted: now the group's watchdog brings it
    back meanwhile, before the new cell joins torchft at its first step."""
    _step(group, 1)
    victim = group.members[1]
    os.kill(victim.pid, signal.SIGKILL)
    assert _step(group, 2)["dp_cells"] == 1 and victim.state == "lost"
    old = group.lighthouse.pid
    os.kill(old, signal.SIGKILL)
    _restart(group, 1)  # restarts the lighthouse first unless the watchdog already has
    assert group.lighthouse.pid != old and group.lighthouse.restarts == 1
    assert "lighthouse_restarted" in [e.kind for e in group.take_events()]
    assert _step(group, 3)["dp_cells"] == 2
    state = group.state()
    assert state.cells[0].state_checksum == state.cells[1].state_checksum


def test_a_cell_stopped_between_steps_is_skipped_by_an_export(group: DPGroup, tmp_path: Path) -> None:
    """An export (every step publishes the weights) or a checkpoint asks one cell; when that
    one is stopped (SIGSTOP) right after a step, it is lost after its health check has gone
    unanswered for the collective timeout + grace, and the peer answers (not after the
    call's 600 s timeout)."""
    _step(group, 1)
    first = group.members[0]
    pid = first.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        checksum = group.export_model_folder(tmp_path / "v1")
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert checksum and export_state_dict(load_model_folder(tmp_path / "v1")[0])  # the peer exported v1
    assert first.state == "lost" and "hung or stopped" in first.why
    assert not pid_alive(pid)
    _restart(group, 0)
    assert _step(group, 2)["dp_cells"] == 2
    state = group.state()
    assert state.cells[0].state_checksum == state.cells[1].state_checksum


def test_a_lighthouse_killed_while_a_cell_restarts_is_back_before_the_cell_connects(group: DPGroup) -> None:
    """A lighthouse killed while a lost cell restarts is back (the group's watchdog) before
    the restarted cell joins torchft at its first step (its manager's connect would give up
    after 30 s)."""
    _step(group, 1)
    victim = group.members[1]
    old_cell = victim.pid
    os.kill(old_cell, signal.SIGKILL)
    assert _step(group, 2)["dp_cells"] == 1 and victim.state == "lost"
    assert group.restart(1) == "restarting"  # in the background
    wait_for(lambda: victim.pid != old_cell, 30, what="the new cell process")  # importing torch: not connected yet
    old = group.lighthouse.pid
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: victim.state != "starting", 120, what="cell 1 restarted")
    assert victim.state == "alive", victim.why
    wait_for(lambda: group.lighthouse.restarts == 1 and group.lighthouse.alive(), 30, what="the lighthouse restarted")
    assert group.lighthouse.pid != old
    assert "lighthouse_restarted" in [e.kind for e in group.take_events()]
    assert _step(group, 3)["dp_cells"] == 2
    state = group.state()
    assert state.cells[0].state_checksum == state.cells[1].state_checksum


def test_a_heal_after_a_lighthouse_restart_takes_one_quorum(group: DPGroup) -> None:
    """A restarted lighthouse numbers its quorums from 1 again, and torchft names a quorum's
    gloo rendezvous (on the first cell's store) by that number: the first quorum with a
    number the old lighthouse had used read the old rendezvous' addresses, the healing cell
    failed to connect and its peer waited out the collective timeout before a new quorum."""
    _step(group, 1)  # quorum 1: both cells
    victim = group.members[1]
    os.kill(victim.pid, signal.SIGKILL)
    assert _step(group, 2)["dp_cells"] == 1  # quorum 2: cell 0 alone
    os.kill(group.lighthouse.pid, signal.SIGKILL)
    wait_for(lambda: group.lighthouse.restarts == 1 and group.lighthouse.alive(), 30, what="the lighthouse restarted")
    assert _step(group, 3)["dp_cells"] == 1  # the new lighthouse's quorum 1: cell 0 alone
    _restart(group, 1)
    m = _step(group, 4)  # the new lighthouse's quorum 2: both cells, cell 1 heals
    assert m["dp_cells"] == 2 and m["dp_attempts"] == 1, m
    state = group.state()
    assert state.cells[0].state_checksum == state.cells[1].state_checksum


def test_a_restarted_lighthouses_quorum_with_an_old_number_and_other_cells_reconfigures(group: DPGroup) -> None:
    """The lighthouse and a cell die together after step 1 (quorum 1: both cells). The new
    lighthouse's first quorum is number 1 again, now of cell 0 alone. torchft rebuilds its
    process group only when the number changes: cell 0 kept the two-cell group and its
    allreduce waited out the collective timeout for the dead cell (a second quorum)."""
    m = _step(group, 1)
    assert m["dp_cells"] == 2
    victim = group.members[1]
    os.kill(group.lighthouse.pid, signal.SIGKILL)
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: group.lighthouse.restarts == 1 and group.lighthouse.alive(), 30, what="the lighthouse restarted")
    m = _step(group, 2)
    assert m["dp_cells"] == 1 and m["dp_attempts"] == 1, m
    assert _log_has(group, 0, "(a restarted lighthouse): reconfiguring")
    assert victim.state == "lost"
    _restart(group, 1)
    m = _step(group, 3)
    assert m["dp_cells"] == 2, m
    state = group.state()
    assert state.cells[0].state_checksum == state.cells[1].state_checksum


@pytest.mark.parametrize("group", ["0:300:3:quorum"], indirect=True)
def test_a_cell_restarting_during_a_step_on_a_restarted_lighthouse_does_not_block_its_quorum(group: DPGroup) -> None:
    """A lighthouse with no quorum yet (just restarted) will not form one of half or fewer
    of the cells it hears heartbeat. A restarted cell's torchft manager used to connect as
    soon as the cell was built: when that happened while a step ran without it on a
    restarted lighthouse, cell 0's quorum (1 of 2 heartbeating) never formed and the step
    hung (the soak, seed 11). Now a restarted cell joins torchft at its first step."""
    _step(group, 1)
    victim = group.members[1]
    os.kill(victim.pid, signal.SIGKILL)
    assert _step(group, 2)["dp_cells"] == 1 and victim.state == "lost"
    os.kill(group.lighthouse.pid, signal.SIGKILL)
    wait_for(lambda: group.lighthouse.restarts == 1 and group.lighthouse.alive(), 30, what="the lighthouse restarted")
    assert group.restart(1) == "restarting"
    t, box = _background_step(group, 3)  # cell 0 only: cell 1 is starting
    wait_for(lambda: _log_has(group, 0, "fault delay before the quorum of v3"), 60, what="cell 0 inside step 3")
    wait_for(lambda: victim.state == "alive", 120, what="cell 1 built")
    assert t.is_alive(), "step 3 ended before cell 1 was built: this test did not interleave them"
    assert group.lighthouse.heartbeating() == 1  # cell 1 is not heard yet
    (group.work_dir.parent / GATE).touch()  # cell 0 may ask for step 3's quorum now
    t.join(120)
    assert not t.is_alive(), "step 3's quorum did not form"
    m = box["m"]
    assert isinstance(m, dict) and m["dp_cells"] == 1 and m["dp_attempts"] == 1, m
    m = _step(group, 4)  # cell 1 joins, heals from cell 0 and trains
    assert m["dp_cells"] == 2, m
    state = group.state()
    assert state.cells[0].state_checksum == state.cells[1].state_checksum


def test_quorums_with_the_same_number_get_their_own_rendezvous() -> None:
    """What the test above needs, without its race: the communicator id of quorum 2 before a
    lighthouse restart and of the new lighthouse's quorum 2 differ (the first cell's store is
    the same one, so its keys' prefix is what keeps the two apart); all cells of one quorum
    agree on it (the same handles)."""
    import json
    from datetime import timedelta

    from gpu_runtime.trainer.dp.cell_trainer import _gloo, communicator_id

    pg0, pg1 = _gloo(timedelta(seconds=5)), _gloo(timedelta(seconds=5))
    old, new = pg0.get_reconfigure_handle(), pg0.get_reconfigure_handle()
    assert json.loads(old)["store"] == json.loads(new)["store"] and json.loads(old)["id"] == json.loads(new)["id"]
    peer = pg1.get_reconfigure_handle()
    assert communicator_id(2, [old]) != communicator_id(2, [new, peer])
    assert communicator_id(2, [new, peer]) == communicator_id(2, [new, peer])
