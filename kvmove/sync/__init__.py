"""Weight sync, trainer ranks -> engine ranks. The folders read as the pipeline:

- ``config``, ``strategies``: the one frozen ``SyncConfig`` (placement and faults included) and the strategy
  registry, whose entries carry their behaviour (gather scope, grouping, delivery, overlap).
- ``planning/``: pure planning, no byte moves: recording-tensor dry runs (``recording``, ``plan``), trainer
  ownership, routing, grouping and pulls (``schedule``), direct pulls, packing, and the ``blueprint`` that
  derives everything a run needs from the engine plans.
- ``verify``: seeded weights and bit-exact checks (plans, and engine parameters after a sync).
- ``ranks/``: what runs in each rank's process: ``source`` (the ``WeightSource`` seam), the trainer's serving
  side and the engine's pull loop, the typed control plane (``control``: every command and reply; ``wire``: the
  same by address), the engine ``puller`` built from init info, and the *hosts* that answer commands.
- ``launchers/``: ``ray`` (Ray actors) and ``processes`` (plain local processes), two ways to start the same
  hosts and carry commands to them.
- ``driver/``: up-front ``checks``, the ``cluster`` (five-step init, replicas that drop out and rejoin), one
  sync as ``step`` (plan -> transfer -> commit), fault hooks, results, ``run`` (``run_syncs``), and ``dryrun``.

Entry points: ``kvmove.sync.driver.run.run_syncs(config)`` and ``kvmove.sync.driver.dryrun.dry_run_sync(config)``.
"""
