"""The KV pages: their allocation and prefix cache (`pages`), the device copies between them
(`page_mover`), swap, the disk tier and the tiers over them, compression."""
