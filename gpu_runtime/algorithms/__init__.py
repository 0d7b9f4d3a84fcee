"""RL math as plain functions: advantage estimators (``advantages``), policy losses,
KL, entropy, truncated IS and loss aggregation (``losses``), and the policy's
per-token log-probabilities (``logprobs``). ``docs/algorithms.md`` has the formulas."""
