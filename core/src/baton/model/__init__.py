"""Loading a model: finding it (a built-in alias, a GGUF file, a Hugging Face folder or Hub id),
converting a GGUF once, reading a sharded state, the compute dtype, and quantization at load
(``loader``, ``hub``, ``gguf_tensors``, ``sharded_state``, ``compute_dtype``, ``quantization``;
``no_lm_head``: base models without an LM head). Step execution is ``baton.worker``'s."""
