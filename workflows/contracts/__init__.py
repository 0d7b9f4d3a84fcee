"""Payloads between workflows and activities: URIs, keys, versions, counts, scalars.

No tensor, token list or sample list ever travels here (DESIGN §2). One module per
purpose: ``placement``, ``cells``, ``sampling``, ``training`` and ``step`` (a step
child's input and summary); ``TrainingRun``'s own input, state and reports are
``workflows.run_state``. The run-config sections, the status models (events, engine
slots, trainer cells) and the trainer's wire messages they carry are ``spec``'s. Import
each model from its module; this package hands no names on.
"""
