"""kvmove's HTTP server: one rollout worker behind SGLang-compatible routes, with runtime KV migration.

``config`` (frozen settings) -> ``runtime`` (worker loop, futures, hand-over, migration core) -> ``app`` (routes)
-> ``launch`` (foreground, thread or subprocess).
"""
