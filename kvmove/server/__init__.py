"""kvmove's HTTP server: one rollout worker behind SGLang-compatible routes, with runtime KV migration.

``messages`` (its own routes' wire types) and ``config`` (frozen settings) -> ``runtime`` (worker loop, futures,
hand-over, migration core) -> ``app`` (routes) -> ``launch`` (foreground, thread or subprocess).
"""
