"""Models and tokenizers: loaded (whole, for a layout, as a meta skeleton) and saved, checkpoints of the
student, LoRA adapters, a student tokenizer of its own with embeddings transplanted."""
