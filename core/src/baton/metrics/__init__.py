"""baton.metrics: per-step and per-request statistics and the stat-logger plugins."""
