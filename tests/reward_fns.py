"""Reward functions the tests load by dotted path (``tests.reward_fns:NAME``). The reward
process imports this module, so it stays light: no torch, nothing from the test suite."""

from __future__ import annotations

import os
import zlib
from pathlib import Path


def length_reward(prompt: str, response: str, row: dict) -> float:
    return float(len(response)) + (0.5 if prompt.endswith("=") else 0.0)


def odd_answers_vary_reward(prompt: str, response: str, row: dict) -> float:
    """Which groups vary is a property of the data, not of the model's numerics: 0 for every
    sample of a prompt whose answer is even (the group is filtered), a hash of the response
    otherwise (four sampled responses differ, so the group varies). Dynamic sampling's rounds
    are then the same on every CPU, for a given seed's prompt order."""
    if int(str(row["answer"]).rpartition("#### ")[2]) % 2 == 0:
        return 0.0
    return 1.0 + zlib.crc32(response.encode()) % 1000


def constant_reward(prompt: str, response: str, row: dict) -> float:
    return 0.5


def failing_reward(prompt: str, response: str, row: dict) -> float:
    raise KeyError("boom")


def raising_reward(prompt: str, response: str, row: dict) -> float:
    raise ZeroDivisionError("reward bug")


def string_reward(prompt: str, response: str, row: dict) -> float:
    return "1"


def nan_reward(prompt: str, response: str, row: dict) -> float:
    return float("nan")


def chatty_reward(prompt: str, response: str, row: dict) -> float:
    print("a print must not reach the reply pipe")
    return 2.0


def row_echo_reward(prompt: str, response: str, row: dict) -> float:
    """Sees the normalized row: messages, answer and metadata."""
    assert row["messages"] == [{"role": "user", "content": "23+45?"}] and row["prompt"] is None
    return float(row["metadata"]["weight"]) * (response == row["answer"])


def hanging_reward(prompt: str, response: str, row: dict) -> float:
    """Hangs on the response "67" (after writing its pid to $MILESTONE_TEST_PID_FILE): only a kill ends it."""
    if response == "67":
        Path(os.environ["MILESTONE_TEST_PID_FILE"]).write_text(str(os.getpid()))
        while True:
            pass
    return 1.0


NOT_CALLABLE = 3
