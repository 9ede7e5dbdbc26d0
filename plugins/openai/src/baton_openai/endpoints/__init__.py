"""The routes, one module per API: chat, completions, responses, messages, embeddings, tokenize, files, batches, LoRA adapters, the dev endpoints, the web pages (playground, dashboard)."""
