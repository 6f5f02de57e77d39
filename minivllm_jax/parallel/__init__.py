"""Tensor parallelism (sharding over a mesh) and multi-process runs."""
