"""Wire constants that clients and servers share. Standard library only: `specserve.client` imports this module, and
the client must load without torch, pydantic or Ray."""

from __future__ import annotations

# The Serve application specserve deploys; gRPC calls name it in their `application` metadata.
APP_NAME = "specserve"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Channel options of specserve's clients: the servers they call set the real limits.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
