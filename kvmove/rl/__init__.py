"""An RL loop on kvmove's weight sync: an FSDP2 policy trained on rollouts of live inference engines.

``rollouts`` (completions scored by a reward, group-relative advantages, each trainer rank's share) ->
``learner`` (the trainer ranks: an FSDP2 transformers model, a REINFORCE step on the rollouts, a checkpoint per
step) -> ``trainer_rank`` (a trainer process: the policy and kvmove's trainer engine of vLLM's weight-transfer API)
-> ``engines`` (the live vLLM ``LLM`` engines in the driver, serving the trainer's weight-sync calls) -> ``loop``
(train, sync with verification, roll out, repeat). The loop reaches trainers and engines through one small seam
(``loop.EngineSeam``).
"""
