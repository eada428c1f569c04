"""LoRA adapters: the manager of loaded adapters and their slots, and the safetensors checkpoint reader."""
