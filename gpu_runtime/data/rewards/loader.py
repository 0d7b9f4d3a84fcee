"""Load a reward function by dotted path: ``pkg.module:fn`` or ``pkg.module.fn``."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from gpu_runtime.data.rewards.errors import RewardFunctionNotFound

RewardFn = Callable[[str, str, dict], float]


def _split_dotted(path: str) -> tuple[str, str]:
    """``pkg.module:fn`` or ``pkg.module.fn`` -> (module, attribute). The run config
    checks the shape; a malformed path simply fails to import here."""
    if ":" in path:
        mod, _, attr = path.partition(":")
    else:
        mod, _, attr = path.rpartition(".")
    return mod, attr


def load_reward_function(path: str) -> RewardFn:
    """Import ``pkg.module:fn`` / ``pkg.module.fn``; ``RewardFunctionNotFound`` when it cannot."""
    mod_name, attr = _split_dotted(path)
    try:
        mod = importlib.import_module(mod_name)
    except (ImportError, SyntaxError, ValueError) as e:  # ValueError: an empty module name
        raise RewardFunctionNotFound(
            f"reward function {path!r}: cannot import module {mod_name!r}: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(mod, attr, None)
    if fn is None:
        raise RewardFunctionNotFound(f"reward function {path!r}: module {mod_name!r} has no callable {attr!r}")
    if not callable(fn):
        raise RewardFunctionNotFound(
            f"reward function {path!r}: {mod_name}.{attr} is not callable ({type(fn).__name__})"
        )
    return fn
