"""Rollout engines: torch engine server, SGLang backend, sglang-router supervision, fleet health."""
