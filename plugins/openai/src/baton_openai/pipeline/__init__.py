"""What runs between a route and AsyncLLM: the handlers' context, sampling parameters, tools, the answer's reading, logprobs, beam search, merging generations."""
