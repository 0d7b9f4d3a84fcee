"""The Hugging Face policy trainer (``trainer.backend: single``) and the parts of its step:
the RL step (``step``), SFT (``sft``), PPO's critic (``critic``, ``ppo``), on-policy
distillation (``distill``). The fsdp2 ranks and the DP cells build on it."""
