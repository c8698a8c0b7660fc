"""Multi-LoRA serving: many fine-tunes of one base model in one engine, in one step.

Lifecycle of an adapter (every part on the engine thread unless said otherwise):

1. **Registered** (``manager.LoRAManager.load``): a PEFT directory is read and validated
   against the base model (``peft``: format, rank, target modules, shapes, dtypes; a
   ``BadRequest`` naming the field or module otherwise) and its weights kept in host memory
   (an LRU of ``max_cpu_loras`` adapters; an evicted one is read again when a request needs
   it). Sources: ``--lora-modules`` at start, ``LLM.generate(lora_request=...)``, the server's
   runtime load API, and (in the server) the registry of runtime loads kept in Redis. A
   runtime load's files are opened from a root's descriptor (``paths``, ``files``: no symlink,
   regular files, size-capped, a deadline) and read on the loader thread (``commands``);
   the engine thread only registers the result between two steps.
2. **Admitted**: the scheduler lets at most ``max_loras`` distinct adapters run at a time
   (``admission``); a request whose adapter does not fit waits, and is not starved.
3. **In a slot** (``slots.DeviceSlots``): when its first request joins the input batch the
   adapter gets one of ``max_loras`` fixed device slots (LRU among the free ones); the copy
   of its weights into the slot is queued and done by the step thread before the step that
   first reads it (so the step still running never sees a slot change under it).
   Tensor-parallel ranks receive rank 0's tensors with the copy (``transfer``): a worker
   never opens an adapter's files.
4. **Applied** (``layers``): each LoRA-capable projection (q/k/v/o, gate/up/down of dense
   layers) adds ``x A^T B^T`` (B pre-scaled) of its token's slot to the base output. The
   step's token -> slot grouping (``step.LoRAStep``) is built once per step and read by
   every layer through one shared field; a step without adapter tokens does no LoRA work.

The block-hash chain carries the adapter's name and the digest of its files
(``AdapterKey``), so prefix-cache blocks are never shared across adapters or across weights
loaded under one name.
"""

from __future__ import annotations

from services.engine.lora.request import LoRAModule, LoRARequest

__all__ = ["LoRAModule", "LoRARequest"]
