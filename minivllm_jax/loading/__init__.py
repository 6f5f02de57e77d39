"""Checkpoints: reading HF/GGUF sources, quantizing, writing and loading converted (orbax) params."""
