"""Pure-JAX contracts, references and the one dispatcher per op (attention, matmul, KV cache, batch, sampler)."""
