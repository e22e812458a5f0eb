"""atoll bench."""
