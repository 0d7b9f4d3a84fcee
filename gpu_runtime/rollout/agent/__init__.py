"""Multi-turn, tool-calling agent episodes (docs/agents.md)."""
