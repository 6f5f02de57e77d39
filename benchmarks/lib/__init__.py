"""What every benchmark shares: workloads, the engine harness, the peers (HF transformers,
llama.cpp) and the report helpers (results JSON, tables, plots, README blocks)."""
