"""draft_service."""
