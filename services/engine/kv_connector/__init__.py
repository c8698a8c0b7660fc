"""The seam through which KV moves between the engine's pool and anything outside it.

``base.KVConnector`` is the contract (after vLLM's ``KVConnectorBase_V1``), ``config`` reads
``--kv-transfer-config``, ``registry`` builds connectors by name and ``multi`` composes them.
A connector lives in a package of its own (the KV tiers: ``kv_offload``); the core names none
of them, only this package.
"""
