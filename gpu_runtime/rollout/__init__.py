"""Producing samples from engines: a step's rollout cut into chunks and dispatched to the
node's engines (``dispatch``), one chunk as single-turn samples (``single_turn``) or as
multi-turn tool-calling episodes (``agent/``), and the held-out eval (``evaluate``)."""
