"""kimi's GPU kernels: triton/ (Triton kernels and their launchers), cuda/ (CUDA C++ kernels shipped as package data
and built at first use), tuning/ (the measured launch tables the launchers read)."""
