"""What every trainer backend shares: batches and the LR schedule, AdamW steps, LoRA,
optimizer offload, the trainer-state files, and the trainer process's device."""
