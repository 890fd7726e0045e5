"""Runtime KV-cache migration between rollout workers (the SGLang fork's protocol, kvmove's data plane).

Pipeline: ``messages`` (the protocol's wire types) -> ``session`` (handshake checks) -> ``endpoint`` (host pool +
transport) -> ``target`` (match, reserve, pull, commit) / ``source`` (collect, stage, hand to the target) ->
``watchdog``; the client side: ``client`` (HTTP, every route of a server, ``kvmove.server.messages`` too) ->
``policy`` (who moves where) -> ``controller`` (protocol, verification).
"""
