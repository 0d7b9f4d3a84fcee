"""The shared vocabulary (``spec``): stored records of older versions still read, each
knob can change mid-run, a reward's terms carry their kind's defaults, events carry one
time form, and the package loads without the project's other packages or torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from spec.reward import RewardSpec, RewardTerm
from spec.events import CellStarted
from spec.train import HParamUpdate, TrainSpec
from spec.trainer_rpc import SFTRows, StepBatch, TrainResult

ROOT = Path(__file__).resolve().parents[2]

def test_a_step_batch_round_trips() -> None:
    """As ``service`` stores it before a step trains and reads it back for replay."""
    batch = StepBatch(step=3, policy_version=2, chunk_keys=["runs/r/steps/000003/chunks/0000.json"],
                      rewards_key="runs/r/steps/000003/rewards.json", group_size=4, hparams=TrainSpec(lr=2e-5))
    assert batch.sft is None and StepBatch.model_validate_json(batch.model_dump_json()) == batch
    sft = batch.model_copy(update={"sft": SFTRows(data_cursor=64, n_rows=32)})
    assert StepBatch.model_validate_json(sft.model_dump_json()).sft == SFTRows(data_cursor=64, n_rows=32)


def test_a_step_batch_refuses_an_unknown_knob() -> None:
    raw = json.loads(StepBatch(step=1, policy_version=0, chunk_keys=[], rewards_key="", group_size=1,
                               hparams=TrainSpec()).model_dump_json())
    raw["hparams"]["lr_typo"] = 1.0
    with pytest.raises(ValidationError, match="lr_typo"):
        StepBatch.model_validate(raw)


def test_every_train_knob_can_be_set_mid_run() -> None:
    assert set(HParamUpdate.model_fields) - {"unset"} == set(TrainSpec.model_fields)


def test_reward_terms_carry_their_kind_defaults() -> None:
    spec = RewardSpec(kind="weighted", terms=[
        RewardTerm(kind="gsm8k", weight=0.8, mode="flexible"),
        RewardTerm(kind="format", pattern="a.*", weight=0.2, name="fmt"),
        RewardTerm(kind="judge", url="http://127.0.0.1:1/j", concurrency=2, timeout_s=3.0),
        RewardTerm(kind="custom", function="m:f", error_policy="zero"),
    ])
    terms = spec.term_list()
    assert [(t.label, t.weight) for t in terms] == [("gsm8k", 0.8), ("fmt", 0.2), ("judge", 1.0), ("custom", 1.0)]
    gsm8k, fmt, judge, custom = terms
    assert (gsm8k.mode, gsm8k.format_score, gsm8k.url) == ("flexible", 0.0, None)
    assert (fmt.pattern, fmt.format_score) == ("a.*", 1.0)
    assert (judge.url, judge.concurrency, judge.max_retries, judge.timeout_s, judge.batch_size) == (
        "http://127.0.0.1:1/j", 2, 5, 3.0, None)
    assert (custom.function, custom.error_policy) == ("m:f", "zero")
    (plain,) = RewardSpec(kind="http", url="https://rm/score").term_list()
    assert (plain.name, plain.weight, plain.batch_size, plain.max_retries) == ("http", 1.0, 32, 5)
    assert spec.terms is not None and spec.terms[0].format_score is None  # the config itself keeps what it was given


def test_a_train_result_reads_its_events_by_kind() -> None:
    """``train_result.json`` (read back on a retry and on replay): each event decodes as its
    kind's model; a cell without its node (the node agent names it) reads too."""
    old = {"policy_version": 3, "checksum": "c", "metrics": {"dp_cells": 1.0}, "rebuild": None,
           "seconds": 1.5, "events": [{"at": "1970-01-02T00:00:00.500000+00:00", "kind": "cell_started",
                                       "generation": 1, "ranks": 1, "placement": "spread", "pids": [7],
                                       "ray_address": "local"}],
           "cell": {"generation": 1, "placement": "strict_pack", "ray_address": "local", "ranks": [
               {"rank": 0, "pid": 7, "node_ip": "127.0.0.1", "node_id": "n0", "state": "alive"}]},
           "dp": {"lighthouse_pid": 9, "lighthouse_restarts": 0, "cells": [{"index": 0, "pid": 8, "state": "alive"}]}}
    res = TrainResult.model_validate_json(json.dumps(old))
    assert res.events == [CellStarted(at="1970-01-02T00:00:00.500000+00:00", generation=1, ranks=1,
                                      placement="spread", pids=[7], ray_address="local")]
    assert res.cell is not None and res.cell.node == "" and res.dp is not None and res.dp.cells[0].pid == 8


def test_spec_loads_without_torch_or_the_other_packages() -> None:
    """Workflow code imports ``spec`` in the sandbox: no torch, no other package of the project,
    no side effect at import."""
    subprocess.run([sys.executable, "-m", "tests.scripts.spec_alone"], cwd=ROOT, check=True)
