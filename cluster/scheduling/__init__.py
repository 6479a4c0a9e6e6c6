"""The scheduler: a CPU-only state machine (plan a round, apply its result), the pipeline that executes it
over gRPC, and the speculation and autoscaling policies."""
