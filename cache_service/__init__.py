"""cache_service."""
