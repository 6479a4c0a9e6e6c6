"""Worker services: gRPC servicers for draft and target workers, batching, tensor-parallel groups, worker processes."""
