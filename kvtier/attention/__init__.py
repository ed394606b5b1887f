"""Paged attention: the backend contract, the reference implementation and backend selection."""

from kvtier.attention.base import AttentionBackend, AttentionMetadata, ReferenceBackend
from kvtier.attention.registry import get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "ReferenceBackend", "get_backend"]
