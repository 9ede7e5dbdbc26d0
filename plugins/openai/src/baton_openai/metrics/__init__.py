"""The ``prometheus`` stat logger, its settings, and the figures the dashboard reads."""
