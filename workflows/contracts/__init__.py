"""Payloads between workflows and activities: URIs, keys, versions, counts, scalars.

No tensor, token list or sample list ever travels here (DESIGN §2). One module per
purpose: ``events``, ``placement``, ``cells``, ``sampling``, ``training``, ``step``
(a step child's input and summary) and ``run_state`` (``TrainingRun``'s). Import
each model from its module; this package hands no names on.
"""
