"""specserve: disaggregated speculative decoding for LLM serving on Ray Serve.

The design card's top-level folders are mapped into this namespace by pyproject.toml:
``cluster/`` -> ``specserve.cluster``, ``workers/`` -> ``specserve.workers``, ``protos/`` -> ``specserve.protos``.
"""

__version__ = "0.1.0"
