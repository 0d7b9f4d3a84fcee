"""A node agent's runtime: child processes, the trainer RPC, Prometheus metrics."""
