"""atoll atoll."""
