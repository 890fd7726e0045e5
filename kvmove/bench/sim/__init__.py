"""Full-scale weight-sync simulator: costs from our own measured rows, validated on published figures.

Pipeline: ``groups`` and ``shards`` -> ``traffic`` (bytes and operations per rank and group, from the model's
tensor table and the layouts) -> ``pricing`` (seconds on a ``hardware.Cluster`` with a ``costs.CostBook``);
``measure`` builds the book from ``results/`` rows, ``validation`` compares with ``figures``, ``rows`` writes
``results/simulated.parquet``. Entry point: :func:`kvmove.bench.sim.predict.simulate`.
"""
