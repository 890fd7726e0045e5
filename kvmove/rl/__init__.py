"""An RL loop on kvmove's weight sync: an FSDP2 policy trained on rollouts of live inference engines.

``rollouts`` (completions scored by a reward, group-relative advantages, each trainer rank's share) ->
``learner`` (the trainer ranks: an FSDP2 transformers model, a REINFORCE step on the rollouts, a checkpoint per
step) -> ``loop`` (train, sync with verification, roll out, repeat). The engines are reached through one small
seam (``loop.EngineSeam``) so the way weights reach them can change without touching the loop.
"""
