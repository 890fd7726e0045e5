"""A sync run from inside a framework's own processes: trainer ranks it hosts, engine ranks that register.

kvmove's driver starts every rank itself (``kvmove.sync.driver``). An RL framework already has its trainer
processes and starts its inference engines its own way (vLLM's workers live wherever its engine mode puts
them), so here nothing is launched: each trainer process hosts its rank (:mod:`.trainer`), and each engine rank
*registers* with trainer rank 0 by address, plan in hand (:mod:`.registry`, :mod:`.member`). Trainer rank 0 then
derives the blueprint from the registered plans, exactly as init steps 3-5 do, and every engine rank fetches its
``PullerInit`` and pulls. A framework's weights reach kvmove through its own source (:mod:`.source` adapts a
re-iterable ``(name, tensor)`` source such as vLLM's ``ModuleSource``) or through a kvmove ``WeightSource``.

Nothing here imports an inference engine: ``kvmove.vllm`` puts vLLM's weight-transfer API on top.
"""
