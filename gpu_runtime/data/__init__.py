"""Datasets (generation, JSONL loading, prompt formatting) and reward functions."""
