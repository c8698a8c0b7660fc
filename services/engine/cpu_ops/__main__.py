"""``python -m services.engine.cpu_ops``: builds the CPU kernels (``make install`` runs it)."""

from services.engine.cpu_ops import main

main()
