"""Speculative decoding: the kernel's draft bookkeeping (``drafts``) and the built-in
prompt-lookup speculator (``ngram``). Verification runs in the model runner."""
