"""Shared infrastructure of the services (not contracts): the Redis index client and its
scripts, tracing set-up, process metrics, HTTP error responses, CLI flags from config
dataclasses, and where the default model lives."""
