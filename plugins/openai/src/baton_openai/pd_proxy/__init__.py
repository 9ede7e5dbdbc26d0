"""``baton pd-proxy``: prefill on a producer engine, decode on a consumer (disaggregated serving)."""
