"""The KV-connector seam: KV blocks that live outside the engine's own pool (tiers, other engines).

``baton.kv_transfer.connector`` holds the protocols a ``kv_connector`` plugin implements (a
scheduler half in the engine process, a worker half in each worker), ``baton.kv_transfer.types``
the structs that cross between them.
"""
