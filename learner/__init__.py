"""atoll learner."""
