"""Validated configuration, one module per kind: request.py what one request asks (sampling, speculation,
structured output), settings.py how a worker hosts its model (model, KV cache, batching, n-gram sizes), strict.py
their one base (`StrictModel`) and `validate`. The Serve app's own settings are in cluster/app_config.py."""
