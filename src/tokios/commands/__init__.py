"""commands package."""
