"""RL math as plain functions: advantages, losses, KL, entropy."""
