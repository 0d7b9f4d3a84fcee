"""The shared vocabulary of workflows and the GPU runtime, torch-free (pydantic and the
standard library only): the run-config sections (one module per section; ``run.RunConfig``
holds them all), the trainer's wire messages built on those sections (``trainer_rpc``) and
one status model per thing a process reports (``status``). Each knob and each message is
declared here once, with its default and validation. ``spec`` imports nothing of the
project's other packages. Import each name from its module; this package hands none on.
"""
