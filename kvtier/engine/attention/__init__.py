"""Paged attention: the backend contract, the reference implementation and backend selection."""

from kvtier.engine.attention.base import AttentionBackend, AttentionMetadata, ReferenceBackend
from kvtier.engine.attention.registry import get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "ReferenceBackend", "get_backend"]
