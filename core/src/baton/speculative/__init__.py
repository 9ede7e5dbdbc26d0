"""Speculative decoding: the kernel's draft bookkeeping (``drafting``) and the built-in
prompt-lookup speculator (``ngram``). Verification runs in the model runner."""
