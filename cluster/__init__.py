"""atoll cluster."""
