"""Attention backends: torch (CPU reference, default here) and Triton (GPU)."""
