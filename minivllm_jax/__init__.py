"""minivllm-jax."""
