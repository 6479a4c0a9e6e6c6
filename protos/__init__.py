"""The protocol: `specserve.proto`, its generated stubs, and the wire constants shared by clients and servers."""
