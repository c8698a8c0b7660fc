"""What runs the engine as a service: the HTTP server, its config and metrics, the Redis
publisher, and the engine core it drives (in a thread of the server, or in a process of its
own, ``core_process``), with the core's step loop and the messages between them."""
