"""Running a model: loading, the KV caches, the forward pass, per-request state on a worker."""
