"""A pull through both halves of a delta sync: the trainer's detection and encoding against its kept image, the
engine's patch through the pull's landing program (strided BF16 regions, FP8 weights and scales, padding)."""

from __future__ import annotations

import pytest
import torch

from kvmove.quant import FP8_DTYPE
from kvmove.sync.delta import detect
from kvmove.sync.delta import diff as diff_module
from kvmove.sync.delta.apply import Patch
from kvmove.sync.delta.detect import COST_WAIT, Costs, Images, region_class, summary
from kvmove.sync.delta.encoding import Encoding
from kvmove.sync.planning.entries import ENGINE, PLAIN, TRAINER
from kvmove.sync.planning.packing import PartSpec, ServeSpec, pack_layout
from kvmove.sync.planning.plan import Box
from kvmove.sync.programs import Program, ProgramBuilder
from kvmove.sync.verify import bits_equal


@pytest.fixture(autouse=True, params=["cpu", "cuda"])
def finder_of(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs under each device's finder on CPU tensors: CPU's packs first and compares the slot,
    CUDA's compares each copy's source."""
    monkeypatch.setitem(diff_module.FINDERS, "cpu", diff_module.FINDERS[request.param])
    return str(request.param)


KEY = ("v1", 0, 7)
NAMES = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight", "model.norm.weight")


class Pull:
    """Trainer tensors served by one pull, the engine's parameters they land in, and the programs between them."""

    def __init__(self, parts: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.src = [
            torch.randn(8, 4, generator=g).to(torch.bfloat16),  # lands in columns 1:5 of an (8, 6) parameter
            torch.randn(4, 16, generator=g).to(FP8_DTYPE),  # an FP8 weight and its scale
            torch.rand(1, 1, generator=g) + 0.5,
            torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: padding follows
        ]
        self.params = [torch.zeros(8, 6, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=FP8_DTYPE)]
        self.params += [torch.zeros(1, 1), torch.zeros(3, dtype=torch.bfloat16)]
        self.src, self.params = self.src[:parts], self.params[:parts]
        self.sizes = [t.numel() * t.element_size() for t in self.src]
        self.layout = pack_layout(self.sizes)
        self.slot = torch.zeros(self.layout.nbytes + 64, dtype=torch.uint8)
        self.recv = torch.full_like(self.slot, 0xAB)
        transforms = (PLAIN, TRAINER, TRAINER, PLAIN)[:parts]
        tensors = (NAMES[0], NAMES[1], NAMES[1], NAMES[2])[:parts]
        self.specs = [
            ServeSpec(
                tr, name, tuple(t.shape), Box.full(tuple(t.shape)), True, (PartSpec("data", None, (), t.dtype, n),)
            )
            for tr, name, t, n in zip(transforms, tensors, self.src, self.sizes, strict=True)
        ]
        self.pack = self._program(self.slot, lambda dst, t: (dst, t))
        self.program = self._program(self.recv, lambda view, _: (_, view))  # landing: slot views into regions

    def _program(self, buf: torch.Tensor, pair) -> Program:
        b = ProgramBuilder()
        for region, t, off in zip(self.regions(), self.src, self.layout.offsets, strict=True):
            view = buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            dst, src = pair(view, t) if buf is self.slot else (region, view)
            b.copy(dst, src)
        return b.build(persistent=True)

    def regions(self) -> list[torch.Tensor]:
        return [self.params[0][:, 1:5], *self.params[1:]]

    def sync(
        self, images: Images, sync_id: int, base: int | None, read_s: tuple[float, float] | None = None
    ) -> Encoding:
        """Serve (dense or delta), 'read' the slot's bytes into the receive slot (taking ``read_s``: seconds of a
        dense read and of a delta's, as the engine's finish note says), land."""
        coded = images.serve(KEY, self.pack, self.slot, self.specs, sync_id, base)
        self.recv[: coded.nbytes].copy_(self.slot[: coded.nbytes])
        if read_s is not None:
            images.note_read(KEY, read_s[coded.encoding is not Encoding.DENSE])
        patch = Patch.of(coded.encoding, coded.changed, self.sizes)
        if patch is None:
            self.program.run()
        else:
            patch.apply(patch.target(self.regions()), self.recv)
        return coded.encoding

    def landed(self) -> bool:
        return all(bits_equal(r.contiguous(), t) for r, t in zip(self.regions(), self.src, strict=True))


def _set_bits(t: torch.Tensor, index: int, bits: int) -> None:
    t.view(-1).view(torch.int16)[index] = bits


def test_a_sequence_of_delta_syncs_lands_every_change_bit_exact() -> None:
    pull, images = Pull(), Images()
    assert pull.sync(images, 1, None) is Encoding.DENSE and pull.landed()  # first sync: no image yet
    assert pull.sync(images, 2, 1) is Encoding.INDEX and pull.landed()  # nothing changed: an empty delta
    assert images.take_counts()["sent_bytes"] == 0 + pull.layout.nbytes
    pull.src[0][3, 2] += 1.0  # one element
    assert pull.sync(images, 3, 2) is Encoding.INDEX and pull.landed()
    counts = images.take_counts()
    assert counts["changed.attention"] == 1 and counts["changed.experts"] == 0 and counts["sent_bytes"] == 18
    _set_bits(pull.src[0], 0, 0x7FC0)  # a NaN
    _set_bits(pull.src[3], 1, 0x0000)  # +0.0
    assert pull.sync(images, 4, 3) is not Encoding.DENSE and pull.landed()
    images.take_counts()
    _set_bits(pull.src[0], 0, 0x7FC1)  # another NaN payload: a change, though NaN != NaN either way
    _set_bits(pull.src[3], 1, -0x8000)  # -0.0: a change, though -0.0 == +0.0 as values
    assert pull.sync(images, 5, 4) is Encoding.INDEX and pull.landed()
    counts = images.take_counts()
    assert counts["pulls.index"] == 1 and counts["changed.attention"] == 1 and counts["changed.other"] == 1
    pull.src[2] *= 2.0  # an FP8 block's new scale, and every weight quantized with it
    pull.src[1].copy_((pull.src[1].float() * 0.5).to(FP8_DTYPE))  # in place, as an optimizer steps
    assert pull.sync(images, 6, 5) is not Encoding.DENSE and pull.landed()


def test_everything_changed_costs_no_more_than_dense_and_a_missed_sync_goes_dense() -> None:
    pull, images = Pull(), Images()
    pull.sync(images, 1, None)
    images.take_counts()
    for t in pull.src:
        t.view(-1).view(torch.uint8).add_(1)
    assert pull.sync(images, 2, 1) is not Encoding.INDEX and pull.landed()
    assert images.take_counts()["sent_bytes"] <= pull.layout.nbytes  # a bitmap beats dense only by the padding
    pull.src[0][0, 0] += 1.0
    assert pull.sync(images, 3, None) is Encoding.DENSE and pull.landed()  # an engine that rejoined
    pull.src[0][0, 1] += 1.0
    assert pull.sync(images, 4, 2) is Encoding.DENSE and pull.landed()  # it holds sync 2, the image is of 3
    pull.src[0][0, 2] += 1.0
    assert pull.sync(images, 5, 4) is Encoding.INDEX and pull.landed()


def test_a_pull_with_more_changed_than_an_encoding_carries_goes_dense_and_waits_to_be_compared_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-pull fallback: dense where no encoding is smaller, found as soon as the comparison passes the
    limit; then dense up front, without comparing, for 1, then 2, ... syncs; the image refreshed only for the
    sync that compares next."""
    pull, images = Pull(parts=1), Images()  # no padding: with every word changed, every encoding is larger
    compared: list[int] = []
    real = detect.diff

    def counted(*args: object) -> object:
        compared.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(detect, "diff", counted)
    pull.sync(images, 1, None)

    def everything() -> None:
        for t in pull.src:
            t.view(-1).view(torch.uint8).add_(1)

    kinds = []
    for sync in range(2, 7):
        everything()
        kinds.append((pull.sync(images, sync, sync - 1), len(compared), pull.landed()))
        if sync == 2:
            assert images.take_counts()["pulls.dense_by_size"] == 1
    assert kinds == [
        (Encoding.DENSE, 1, True),  # compared: dense by size, compare again after 1 sync
        (Encoding.DENSE, 1, True),  # dense up front, image refreshed
        (Encoding.DENSE, 2, True),  # compared: dense by size again, wait 2
        (Encoding.DENSE, 2, True),  # dense up front, image not refreshed
        (Encoding.DENSE, 2, True),  # dense up front, image refreshed
    ]
    pull.src[0][1, 1] += 1.0
    assert pull.sync(images, 7, 6) is Encoding.INDEX and pull.landed() and len(compared) == 3


def test_pulls_the_engine_quantizes_always_go_dense() -> None:
    pull, images = Pull(), Images()
    pull.specs[0] = pull.specs[0]._replace(transform=ENGINE)
    pull.sync(images, 1, None)
    pull.src[0][0, 0] += 1.0
    assert pull.sync(images, 2, 1) is Encoding.DENSE and pull.landed()
    assert images.nbytes == 0  # nothing kept for it


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("model.embed_tokens.weight", "embeddings"),
        ("lm_head.weight", "embeddings"),
        ("model.layers.1.self_attn.k_proj.weight", "attention"),
        ("model.layers.1.mlp.experts.12.down_proj.weight", "experts"),
        ("model.layers.1.mlp.gate_proj.weight", "dense_mlp"),
        ("model.layers.1.mlp.gate.weight", "other"),
        ("model.layers.1.input_layernorm.weight", "other"),
    ],
)
def test_region_classes(name: str, cls: str) -> None:
    assert region_class(name) == cls


def test_summary_adds_up_every_trainer_rank() -> None:
    a = {"dense_bytes": 100, "sent_bytes": 10, "pulls.index": 1, "changed.experts": 3, "words.experts": 50}
    b = {"dense_bytes": 100, "sent_bytes": 30, "pulls.dense": 1, "changed.experts": 2, "words.experts": 50}
    s = summary([a, b])
    assert s["ratio"] == 0.2 and s["pulls"] == {"dense": 1, "index": 1, "gaps": 0, "bitmap": 0}
    assert s["changed_fraction"] == {"experts": 0.05} and summary([{}]) == {}


def test_costs_weigh_the_trainer_and_the_link_and_judge_each_delta_once_both_kinds_are_measured() -> None:
    costs = Costs()
    costs.served("dense", 0.010)
    costs.read(0.050)
    assert costs.verdict() is None  # no delta measured yet
    costs.served("delta", 0.030)
    assert costs.verdict() is None  # its read not noted yet
    costs.read(0.002)
    assert costs.verdict() is False  # 0.032 s against 0.060 s
    assert costs.verdict() is None  # judged once
    costs.served("delta", 0.070)
    costs.read(0.002)
    assert costs.verdict() is True  # 0.072 s against 0.060 s
    costs.served("dense", None)  # dense by size: a read of dense bytes, not a dense pack's seconds
    costs.read(0.100)
    costs.served("delta", 0.070)
    costs.read(0.002)
    assert costs.pack_s == 0.010 and costs.dense_read_s == 0.100 and costs.verdict() is False


def _changed(pull: Pull, i: int) -> None:
    pull.src[0][i % 8, i % 4] += 1.0


def test_a_pull_whose_delta_costs_more_than_dense_goes_dense_by_cost_then_is_measured_again() -> None:
    """The per-pull fallback by cost: a delta whose read (or trainer work) costs more than the pull's dense
    pack and read sends the pull dense up front for 1, then 2, ... syncs, every landing bit-exact; where the
    delta is cheaper it stays a delta."""
    pull, images = Pull(), Images()
    reads = (0.0, 10.0)  # a dense read in no time, a delta's in 10 s
    assert pull.sync(images, 1, None, reads) is Encoding.DENSE
    kinds = []
    for sync in range(2, 9):
        _changed(pull, sync)
        kinds.append(pull.sync(images, sync, sync - 1, reads))
        assert pull.landed()
        if sync == 3:
            assert images.take_counts()["pulls.dense_by_cost"] == 1
    d, x = Encoding.DENSE, Encoding.INDEX
    assert kinds == [x, d, x, d, d, x, d]  # delta, dense 1, delta, dense 2, delta, dense 4 ...
    assert COST_WAIT > 8


def test_a_pull_whose_delta_is_cheaper_stays_a_delta() -> None:
    pull, images = Pull(), Images()
    reads = (10.0, 0.0)  # a dense read in 10 s, a delta's in no time
    pull.sync(images, 1, None, reads)
    for sync in range(2, 6):
        _changed(pull, sync)
        assert pull.sync(images, sync, sync - 1, reads) is Encoding.INDEX and pull.landed()
    assert images.take_counts().get("pulls.dense_by_cost", 0) == 0


def test_a_full_sync_leaves_the_verdict_on_a_costly_delta_to_the_next_sync_that_could_take_one() -> None:
    pull, images = Pull(), Images()
    reads = (0.0, 10.0)
    pull.sync(images, 1, None, reads)
    _changed(pull, 2)
    assert pull.sync(images, 2, 1, reads) is Encoding.INDEX  # a delta that lost
    _changed(pull, 3)
    assert pull.sync(images, 3, None, reads) is Encoding.DENSE and pull.landed()  # full: dense anyway
    assert images.take_counts().get("pulls.dense_by_cost", 0) == 0
    _changed(pull, 4)
    assert pull.sync(images, 4, 3, reads) is Encoding.DENSE and pull.landed()  # the verdict, here
    assert images.take_counts()["pulls.dense_by_cost"] == 1
    _changed(pull, 5)
    assert pull.sync(images, 5, 4, reads) is Encoding.INDEX and pull.landed()  # measured again
