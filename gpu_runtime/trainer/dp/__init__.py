"""Independent data-parallel trainer cells joined by torchft (``trainer.cells: K``).

``lighthouse`` supervises torchft's quorum server, ``cell_trainer`` is the policy trainer
of one cell (its share of the step's micro-batches, the cross-cell gradient allreduce, the
commit vote, the heal from a peer), ``cell_server`` is a cell's process and ``group`` is the
trainer process's handle on all of them. See docs/dp-cells.md.
"""
