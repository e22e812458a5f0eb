"""atoll synchronizer."""
