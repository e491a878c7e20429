"""prefixrouter: a prefix-aware router for LLM inference clusters.

Routes each request to the replica where its first token comes soonest,
counting the prefill that a replica has already done for the request's prefix.
"""

__version__ = "0.1.0"
