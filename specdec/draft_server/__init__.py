"""Draft service: a small model that proposes K tokens per round with their q vectors."""
