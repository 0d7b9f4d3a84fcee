"""The policy model, its tokenizer, and Hugging Face model folders."""
