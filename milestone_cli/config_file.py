"""Load a YAML run config; errors name the key and its file:line."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from spec.rollout import rl_sampling_conflicts
from spec.run import RunConfig
from spec.strict import format_validation_error


class ConfigError(ValueError):
    pass


def _line_of(node: yaml.Node | None, loc: tuple) -> int | None:
    """Follow a pydantic error location through the YAML node tree to a line number."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    line, node = k.start_mark.line + 1, v
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def load_run_config(path: str | Path, overrides: dict | None = None) -> RunConfig:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such file")
    text = path.read_text()
    try:
        raw = yaml.safe_load(text) or {}
        root = yaml.compose(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}:1: the config must be a mapping of keys")
    raw.update(overrides or {})
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as err:
        def where(loc: tuple) -> str:
            return f"{path}:{_line_of(root, loc) or 1}"

        raise ConfigError(format_validation_error(err, where)) from None
    if cfg.mode == "rl" and (bad := rl_sampling_conflicts(cfg.rollout)):
        raise ConfigError("\n".join(f"{path}:{_line_of(root, tuple(key.split('.'))) or 1}: {key}: {why}"
                                     for key, why in bad))
    return absolutize_model_path(absolutize_teacher_path(absolutize_data_path(absolutize_store(cfg))))


def absolutize_store(cfg: RunConfig) -> RunConfig:
    """``file://relative/dir`` is relative to where the run is started, not to the workers."""
    if cfg.store.startswith("file://"):
        rest = cfg.store.removeprefix("file://")
        if not rest.startswith("/"):
            cfg = cfg.model_copy(update={"store": f"file://{Path(rest).resolve()}"})
    return cfg


def from_start(value: str) -> str:
    """A path as seen from where the run is started: an absolute one as it is, a relative one (or one
    under ``~``) resolved here, since the workers that read it run with other working directories."""
    return value if Path(value).is_absolute() else str(Path(value).expanduser().resolve())


def absolutize_data_path(cfg: RunConfig) -> RunConfig:
    """A relative ``data.path`` / ``data.eval_path`` is relative to where the run is started
    (the control worker that reads it again in ``prepare_data`` may run elsewhere)."""
    for field in ("path", "eval_path"):
        value = getattr(cfg.data, field)
        if value:
            cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={field: from_start(value)})})
    return cfg


def absolutize_model_path(cfg: RunConfig) -> RunConfig:
    """A relative ``model.path`` is relative to where the run is started (the node agents that load
    it run with their own working directories)."""
    if cfg.model.path:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": from_start(cfg.model.path)})})
    return cfg


def absolutize_teacher_path(cfg: RunConfig) -> RunConfig:
    """A relative ``distill.teacher_path`` is relative to where the run is started (the
    trainer that loads it runs elsewhere)."""
    d = cfg.distill
    if d is not None:
        cfg = cfg.model_copy(update={"distill": d.model_copy(update={"teacher_path": from_start(d.teacher_path)})})
    return cfg
