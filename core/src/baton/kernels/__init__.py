"""baton's C++ kernels for the CPU, compiled on first use (see ``loader``)."""
