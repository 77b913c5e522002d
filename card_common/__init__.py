"""card_common."""
