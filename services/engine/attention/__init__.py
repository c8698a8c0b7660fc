"""Attention backends: torch (CPU reference, default here) and Triton (GPU). Their contract
(``base``) is checked once per step and once per KV cache (``contract``), never per layer."""
