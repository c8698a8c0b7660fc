"""Attention backends: ``cpu`` (the C++ kernels, the CPU default), ``torch`` (the reference,
and the path of sliding windows and soft-caps on the CPU) and ``triton`` (GPU). Their contract
(``base``) is checked once per step and once per KV cache (``contract``), never per layer; each
step's plan is built once by the runner and read by every layer."""
