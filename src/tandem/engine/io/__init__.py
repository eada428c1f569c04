"""What enters and leaves the engine: tokenizer, request validation (input processing), output
processing, generation defaults, and the engine's statistics."""
