"""DSA sparse-attention indexers on the packed path: each request's top-k keys from its own keys only."""

from nnrun.attention.indexer.adapter import adapt_indexers, unserved_indexers
from nnrun.attention.indexer.keys import IndexerInfo, IndexerKeyPool
from nnrun.attention.indexer.step import NO_KEY, IndexerStep, serve_indexers

__all__ = [
    "NO_KEY",
    "IndexerInfo",
    "IndexerKeyPool",
    "IndexerStep",
    "adapt_indexers",
    "serve_indexers",
    "unserved_indexers",
]
