"""The Batch API's machinery: stored files and batches, the runner of batch lines, and ``baton run-batch`` (offline)."""
