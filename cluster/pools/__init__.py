"""Without Serve: `specserve generate --local` (the in-process engine) and the bench's local worker processes."""
