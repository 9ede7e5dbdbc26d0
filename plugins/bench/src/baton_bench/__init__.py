"""baton-bench: baton's benchmarks (``baton bench ...``), the scheduler simulator, the
llama.cpp peer driver and the shared chat-workload format (``baton_bench.common``)."""
