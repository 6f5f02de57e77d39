"""The KV pages: allocation and prefix cache, swap, the disk tier, compression."""
