"""Built-in connector ``pd``: prefill on one engine, decode on another, on one machine.

A producer engine (``[kv_transfer] role = "producer"``) computes a prompt for a request whose
``kv_transfer_params`` say ``do_remote_decode`` and saves its full blocks as checked files
in a folder both engines share (``[kv_transfer.pd] path``, /dev/shm by default); its response's
``kv_transfer_params`` say how many tokens it saved. A consumer engine (``role = "consumer"``) given those
params loads the blocks instead of computing them and decodes. ``baton pd-proxy`` runs the
flow for OpenAI clients (docs/kv-connectors.md).
"""
