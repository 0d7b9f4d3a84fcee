"""``trainer.backend: fsdp2``: a cell of FSDP2 ranks placed by Ray, driven by the trainer
process (``host`` -> ``cell`` -> one ``rank`` per Ray actor)."""
