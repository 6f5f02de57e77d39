"""Decoding features over the engine: speculative, structured output, beam search."""
