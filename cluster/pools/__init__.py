"""Without Serve: worker bodies (run by the Serve pool replicas), local worker processes for the bench, and
`specserve generate --local`."""
