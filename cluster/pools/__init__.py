"""Worker pools: the Ray actors that host workers and schedulers, their builders, and local worker processes."""
