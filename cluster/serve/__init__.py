"""Ray Serve: deployments, the gRPC and OpenAI HTTP edges, metrics, limits, binds, the worker registry and the
`specserve serve` main job."""
