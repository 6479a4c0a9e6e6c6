"""Wire constants that clients and servers share. Standard library only: `specserve.client` imports this module, and
the client must load without torch, pydantic or Ray."""

from __future__ import annotations

# The Serve application specserve deploys; gRPC calls name it in their `application` metadata.
APP_NAME = "specserve"
SERVICE_NAME = "specserve.v1.SpecServe"  # the public gRPC service (protos/specserve.proto)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Channel options of specserve's clients: the servers they call set the real limits.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Largest block of EAGLE-3 features (float16 data) one verify reply or propose call carries: with a round's other
# fields it fits a worker server's default 4 MiB limit. Beyond it the oldest positions are left out and the head
# starts its cache later (SmolLM2-135M: 3,456 bytes per position, so the newest 910 positions of a long prompt).
MAX_FEATURE_BYTES = 3 * 1024 * 1024
# The gRPC metadata key that carries the cluster's shared secret to the worker servers.
SECRET_METADATA = "x-specserve-secret"
