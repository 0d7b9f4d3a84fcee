"""``trainer.backend: megatron`` groundwork: HF <-> Megatron-core weights and config for
the Qwen2 / Llama family. ``convert`` and ``config`` need no megatron-core (pure tensor
layout and dicts); ``model`` imports it lazily (the ``[gpu]`` extra)."""
