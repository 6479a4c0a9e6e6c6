"""The `specserve` command line."""
