"""Published weight-sync figures and the setups they describe, for validation only (no cost is set from them).

Each figure states what its source states; what the source leaves out (NIC counts, node types, layouts) is
written in ``assumptions`` so the reader can judge the comparison. ``docs/simulator.md`` lists the sources.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvmove.bench.sim.setup import Spec

VLLM = "https://github.com/vllm-project/vllm-project.github.io/blob/main/_posts/2026-08-22-rdt-weight-transfer.md"
CKPT = "https://github.com/MoonshotAI/checkpoint-engine/blob/main/README.md#benchmark"
PPLX = "https://research.perplexity.ai/articles/weight-transfer-for-rl-post-training-in-under-2-seconds"
LMSYS = "https://lmsys.org/blog/2026-04-29-p2p-update/"
VERL = "https://github.com/volcengine/verl/blob/main/verl/checkpoint_engine/README.md"
SLIME = "https://hebiao064.github.io/rl-weight-sync"

H100 = "gpu=h100,nic=cx7-400,nics_per_node=8"
H800 = "gpu=h800,nic=cx7-400,nics_per_node=8"
H20 = "gpu=h20,nic=cx7-400,nics_per_node=8"
H200 = "gpu=h200,nic=cx7-400,nics_per_node=8"
GIB = 1 << 30

SKYRL_BUCKET = (
    "https://github.com/NovaSky-AI/SkyRL/blob/main/skyrl/train/config/config.py "
    "(weight_transfer_threshold_cuda_ipc_GB = 1.0, the Megatron worker's bucket); vLLM's packed NCCL transfer "
    "broadcasts one 1 GB buffer at a time (DEFAULT_PACKED_BUFFER_SIZE_BYTES, "
    "https://github.com/vllm-project/vllm/blob/main/vllm/distributed/weight_transfer/packed_tensor.py)"
)
_MILES = (
    "; miles buckets its broadcasts (1 GB buckets in the profiled runs: "
    "https://github.com/radixark/miles/blob/main/docs/advanced/p2p-weight-transfer.md), each pipeline stage's "
    "root broadcasting to every engine GPU; SGLang runs one weight-update request at a time ('The communicator "
    "now only run up to 1 in-flight request at any time', "
    "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/managers/tokenizer_communicator_mixin.py), "
    "so the stages reach an engine one after another"
)
PPLX_ENGINES = (
    "; the post does not give the inference layout: 4 replicas of 32 GPUs (TP16 attention in 2 DP groups, EP32), the "
    "replica width of the vLLM post's Kimi K2 run from the same 256 training GPUs onto 128 (its 48-node figure; its "
    "TP32 would cut FP8 blocks: shared experts 2048/32 = 64 rows, which vLLM refuses). 8 replicas of TP16/EP16 "
    "(assumed before) cannot reach 1.3 s: each engine node then keeps 8 x 65.5 GB that only its 8 x 400 Gb/s NICs "
    "can bring in, 1.31 s at line rate with nothing else"
)
_VERL_BUCKET = (
    "; buckets of update_weights_bucket_megabytes = 2048 "
    "(https://github.com/volcengine/verl/blob/main/verl/workers/config/rollout.py), one broadcast per bucket "
    "(https://github.com/volcengine/verl/blob/main/verl/checkpoint_engine/nccl_checkpoint_engine.py)"
)
_MILES_P2P = (
    "; staged through a host-memory engine replica (modelled as a D2H copy) and written by RDMA; TP/EP shards are "
    "all-gathered as on the broadcast path ('Both modes perform this identically via common.py', "
    "https://github.com/radixark/miles/blob/main/docs/advanced/p2p-weight-transfer.md)"
)
CKPT_BUCKET = (
    "; every rank buckets the bytes it holds (the README's IPC bucket size per row) and the buckets are broadcast "
    "one at a time over all GPUs, a rank's worker reloading bucket g-1 while g is broadcast "
    "(https://github.com/MoonshotAI/checkpoint-engine/blob/main/checkpoint_engine/ps.py, _update_per_bucket)"
)


@dataclass(frozen=True)
class Figure:
    """One published figure (``metric`` "seconds" or "bytes") and the setup it describes."""

    key: str
    source: str
    url: str
    what: str
    value: float
    strategy: str
    spec: Spec
    metric: str = "seconds"
    assumptions: str = ""


def _fig(key: str, source: str, url: str, what: str, value: float, strategy: str, spec: Spec, note: str) -> Figure:
    return Figure(key, source, url, what, value, strategy, spec, assumptions=note)


_Q235 = Spec("qwen3-235b-a22b", "tp=4,pp=2,ep=8", "dp=16,ep=16", 1, 2, 2, H100, constraints="published")
_Q235_NOTE = "8 NICs x 400 Gb/s per node (the post does not say); warm syncs, engine layer-wise reload"
_KIMI = Spec("kimi-k2", "tp=8,pp=8,ep=32", "tp=32,ep=32", 4, 32, 16, H100, constraints="published")
_KIMI_NOTE = "4 replicas of TP32/EP32 (the post's 400x4 GB/s per replica), 8 NICs x 400 Gb/s per node"


def _vllm() -> list[Figure]:
    src = "vLLM blog (RDT)"
    out = [
        _fig(f"vllm-qwen3-{v}", src, VLLM, f"Qwen3-235B-A22B {v.upper()}", t, v, _Q235, _Q235_NOTE)
        for v, t in (("v1", 25.02), ("v2", 5.61), ("v3", 3.49))
    ]
    nccl = replace(_Q235, transport="nccl", bucket_bytes=GIB, bucket_call="vllm-packed", constraints="vllm-nccl")
    out.append(_fig("skyrl-qwen3-broadcast", "SkyRL NCCL broadcast (vLLM blog)", VLLM,
                    "Qwen3-235B-A22B NCCL broadcast", 64.72, "broadcast", nccl,
                    f"{_Q235_NOTE}; 1 GiB buckets: {SKYRL_BUCKET}"))  # fmt: skip
    out.append(_fig("vllm-kimi-v3", src, VLLM, "Kimi K2 BF16 V3, 48 nodes", 7.53, "v3", _KIMI, _KIMI_NOTE))
    moved = Figure("vllm-kimi-bytes", src, VLLM, "Kimi K2 bytes moved per sync ('7.9 TB')", 7.9e12, "v3", _KIMI,
                   metric="bytes", assumptions=_KIMI_NOTE)  # fmt: skip
    return [*out, moved]


_CKPT_ROWS = (
    ("glm-air-8xh800", "GLM-4.5-Air BF16, 8xH800 TP8", "glm-4.5-air", "tp=8", 1, 8, H800, "bf16", 3.47, 4.12, 3.02),
    ("qwen3-235b-8xh800", "Qwen3-235B BF16, 8xH800 TP8", "qwen3-235b-a22b", "tp=8", 1, 8, H800, "bf16", 6.22, 7.10,
     2.67),
    ("dsv31-16xh20", "DeepSeek-V3.1 FP8, 16xH20 TP16", "deepseek-v3.1", "tp=16", 1, 16, H20, "fp8", 10.19, 11.80,
     5.39),
    ("kimi-16xh20", "Kimi-K2 FP8, 16xH20 TP16", "kimi-k2", "tp=16", 1, 16, H20, "fp8", 14.36, 17.49, 5.89),
    ("dsv31-256xh20", "DeepSeek-V3.1 FP8, 256xH20 (16 x TP16)", "deepseek-v3.1", "tp=16", 16, 256, H20, "fp8",
     11.33, 11.81, 8.00),
    ("kimi-256xh20", "Kimi-K2 FP8, 256xH20 (16 x TP16)", "kimi-k2", "tp=16", 16, 256, H20, "fp8", 16.04, 16.75,
     8.00),
)  # fmt: skip
"""key, what, model, engine, replicas, GPUs, cluster, dtype, broadcast s, P2P s, the published IPC bucket (GiB)."""


def _checkpoint_engine() -> list[Figure]:
    src, note = "MoonshotAI checkpoint-engine README", "weights in host memory of the serving nodes, vLLM v0.10.2rc1"
    out = []
    for key, what, model, engine, replicas, gpus, cluster, dtype, bcast, p2p, bucket in _CKPT_ROWS:
        nodes = max(1, gpus // 8)
        spec = Spec(model, f"host:world={gpus}", engine, replicas, nodes, nodes, cluster, placement="colocated",
                    transport="nccl", dtype=dtype, quantize_on="none" if dtype == "fp8" else "engine",
                    constraints="vllm-ipc", bucket_bytes=int(bucket * GIB))  # fmt: skip
        out.append(_fig(f"ckpt-{key}-broadcast", src, CKPT, f"{what}, broadcast", bcast, "broadcast-pipelined",
                        spec, note + CKPT_BUCKET))  # fmt: skip
        small = min(gpus, 16)
        p2p_spec = replace(spec, replicas=1, engine_nodes=max(1, small // 8), remote_host=True,
                           placement="colocated" if gpus == small else "disaggregated")  # fmt: skip
        out.append(_fig(f"ckpt-{key}-p2p", src, CKPT, f"{what}, P2P (timed on <= 16 GPUs)", p2p,
                        "broadcast-pipelined", p2p_spec, note + CKPT_P2P))  # fmt: skip
    return out


CKPT_P2P = (
    "; P2P: the same buckets over the updated GPUs only, each read first over RDMA (mooncake) from the host "
    "memory of the rank that holds it, then broadcast ('ParameterServer.update(ranks=...)', _update_per_bucket "
    "with ranks: https://github.com/MoonshotAI/checkpoint-engine/blob/main/checkpoint_engine/ps.py)"
)

_SLIME_FLOW = (
    "; a bucketing push, one bucket at a time: the trainer all-gathers each bucket's TP and EP shards into full "
    "tensors, flattens them into one 512 MB bucket and sends its CUDA IPC handle with one update_weights_from_tensor "
    "call, which SGLang lands through its own load_weights, tensor by tensor, before the next bucket (the post's "
    "five-step workflow, its 512 MB buckets, and 'Overlap Communication' listed as future work; "
    "https://github.com/THUDM/slime/blob/main/slime/backends/megatron_utils/update_weight_utils.py)"
)

_LMSYS_ROWS = (
    ("qwen3-30b", "Qwen3-30B-A3B", "qwen3-30b-a3b", "tp=4,pp=1,ep=8,dp=4", 2, "tp=8,ep=8", 2, 2, 2.6700, 2.1602),
    ("glm-air", "GLM-4.5-Air", "glm-4.5-air", "tp=1,pp=4,ep=8,dp=8", 4, "tp=8,ep=8", 4, 4, 5.0011, 2.6372),
    ("qwen3-235b", "Qwen3-235B-A22B", "qwen3-235b-a22b", "tp=4,pp=4,ep=16,dp=4", 8, "tp=32,ep=32", 2, 8, 10.7536,
     3.1620),
    ("kimi-fp8", "Kimi-K2 FP8 (64x64 blocks)", "kimi-k2", "tp=8,pp=8,ep=32,dp=4", 32, "tp=32,ep=32", 8, 32, 53.2791,
     7.2273),
)  # fmt: skip


def _lmsys() -> list[Figure]:
    src = "LMSYS blog (SGLang P2P weight transfer)"
    note = "miles (Megatron) -> SGLang on 8xH100 IB nodes; context parallel ranks counted as data parallel"
    out = []
    for key, what, model, trainer, tnodes, engine, replicas, enodes, nccl, rdma in _LMSYS_ROWS:
        spec = Spec(model, trainer, engine, replicas, tnodes, enodes, H100, transport="nccl",
                    dtype="fp8" if key == "kimi-fp8" else "bf16", quantize_on="trainer", block=64,
                    constraints="sglang", bucket_bytes=GIB, bucket_call="async")  # fmt: skip
        out.append(_fig(f"lmsys-{key}-nccl", src, LMSYS, f"{what}, NCCL broadcast", nccl, "broadcast", spec,
                        note + _MILES))  # fmt: skip
        p2p = replace(spec, transport="push", via_host=True, constraints="kvmove", bucket_bytes=0, bucket_call="op",
                      ep_gather=True)  # fmt: skip
        out.append(_fig(f"lmsys-{key}-rdma", src, LMSYS, f"{what}, RDMA P2P", rdma, "v2", p2p,
                        note + _MILES_P2P))  # fmt: skip
    return out


def _others() -> list[Figure]:
    pplx = Spec("kimi-k2", "fsdp:world=256,shard=8", "tp=16,dp=2,ep=32", 4, 32, 16, H200, transport="push", dtype="fp8",
                quantize_on="trainer")  # fmt: skip
    verl = Spec("qwen3-30b-a3b", "fsdp:world=2,shard=2", "tp=1", 30, 1, 4, H100, transport="nccl",
                bucket_bytes=2048 << 20)  # fmt: skip
    verl_note = "30 rollout ranks receiving only (no engine load), 4x8 H100 with CX-7 400 Gb/s"
    slime = Spec("qwen3-30b-a3b", "tp=4,ep=8", "tp=8", 1, 1, 1, H100, placement="colocated", transport="cuda-ipc",
                 constraints="sglang", bucket_bytes=512 << 20, bucket_call="async")  # fmt: skip
    return [
        _fig("pplx-kimi", "Perplexity research blog", PPLX, "Kimi-K2 BF16 (256 GPUs) -> FP8 (128 GPUs)", 1.3, "v3",
             pplx, "H200 nodes with 8x400 Gb/s; FSDP shards of 8 GPUs, 32 mesh groups" + PPLX_ENGINES),
        _fig("verl-qwen3-30b-nccl", "verl checkpoint-engine README", VERL,
             "Qwen3-30B-A3B, NCCL all-gather + broadcast", 7.0, "broadcast", verl, verl_note + _VERL_BUCKET),
        _fig("verl-qwen3-30b-nixl", "verl checkpoint-engine README", VERL, "Qwen3-30B-A3B, NIXL all-gather + ring",
             7.0, "v3", replace(verl, transport="pull", fanout="chain", bucket_bytes=0), verl_note),
        _fig("slime-qwen3-30b-colocated", "slime weight-sync blog", SLIME, "Qwen3-30B-A3B colocated (CUDA IPC)",
             7.0, "broadcast", slime, "8xH100, Megatron TP4/EP8 as slime's example, one SGLang TP8 engine on the same "
             "GPUs" + _SLIME_FLOW),
    ]  # fmt: skip


FIGURES: tuple[Figure, ...] = (*_vllm(), *_checkpoint_engine(), *_lmsys(), *_others())

NOT_SIMULATED = (
    ("Awex (inclusionAI)", "https://github.com/inclusionAI/asystem-awex",
     "trillion-parameter sync in 5-10 s on thousands of GPUs: no model layout, node or engine setup is published"),
    ("checkpoint-engine headline", CKPT, "'about 20 s for Kimi-K2 across thousands of GPUs': no setup stated"),
)  # fmt: skip

ORDERS: tuple[tuple[str, str], ...] = (
    ("vllm-qwen3-v1", "vllm-qwen3-v2"),
    ("vllm-qwen3-v2", "vllm-qwen3-v3"),
    ("skyrl-qwen3-broadcast", "vllm-qwen3-v1"),
    *((f"lmsys-{k[0]}-nccl", f"lmsys-{k[0]}-rdma") for k in _LMSYS_ROWS),
    *((f"ckpt-{k[0]}-p2p", f"ckpt-{k[0]}-broadcast") for k in _CKPT_ROWS),
)
"""(slower, faster) as each source publishes them: vLLM's V1 > V2 > V3 and SkyRL's broadcast > V1; LMSYS's NCCL
broadcast > RDMA P2P per model; checkpoint-engine's P2P > broadcast per setup (its table has P2P slower)."""
