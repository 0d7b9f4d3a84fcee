"""Payloads between workflows and activities: URIs, keys, versions, counts, scalars.

No tensor, token list or sample list ever travels here (DESIGN §2). One module per
purpose: ``events``, ``placement``, ``cells``, ``sampling``, ``training`` and ``step``
(a step child's input and summary); ``TrainingRun``'s own input, state and reports are
``workflows.run_state``. Import each model from its module; this package hands no
names on.
"""
