"""The trainer: its process (``server``, ``service``, ``layouts``), its client (``process``),
its wire messages (``api``), the ``Trainer`` protocol every backend answers (``protocol``),
and a folder per backend: ``policy`` (the Hugging Face trainer), ``fsdp2`` (a Ray cell of
FSDP2 ranks), ``dp`` (data-parallel cells joined by torchft), ``megatron``; ``common`` holds
what they share. See docs/trainer-backends.md."""
