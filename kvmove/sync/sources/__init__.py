"""Weight sources over real trainer state (``kvmove.sync.ranks.source.WeightSource`` implementations).

``fsdp``: a live FSDP2/DTensor model; ``tiny_trainer``: a small transformers model trained with FSDP2, the
source of tests and examples. kvmove's own seeded Megatron shards (both HF-named and megatron-core-named) are
``kvmove.sync.ranks.source.ShardedSource``.
"""
