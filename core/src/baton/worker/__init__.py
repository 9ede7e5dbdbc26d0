"""Step execution: baton's worker and model runner (persistent batch, step inputs, forward,
sampling, the paged KV cache on the device). Loading the model is ``baton.model``'s."""
