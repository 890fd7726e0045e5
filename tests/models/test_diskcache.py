"""What transformers says about a config, kept on disk between runs: read back equal to a fresh build, rebuilt
when stale or unreadable, off when asked, never for a checkpoint directory, and a warm dry run never imports
transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmove.errors import ModelError
from kvmove.models import diskcache, resolve_model
from kvmove.models.config import hf_dict
from kvmove.models.presets import preset_raw
from kvmove.models.table import _built_table, _config_table, _freeze, table_of


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(diskcache.CACHE_DIR_ENV, str(root))
    monkeypatch.delenv(diskcache.NO_CACHE_ENV, raising=False)
    return root


def _frozen(model: str) -> tuple:
    return _freeze(hf_dict(resolve_model(model)))


def _refuse_building(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(frozen: tuple) -> None:
        raise AssertionError("built although the cache holds the table")

    monkeypatch.setattr("kvmove.models.table._built_table", refuse)


@pytest.mark.parametrize("model", ["kimi-k2-tiny", "mixtral-tiny", "gpt-oss-tiny"])
def test_a_cached_table_is_read_back_equal_to_a_fresh_build(
    cache: Path, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    frozen = _frozen(model)
    fresh = _built_table(frozen)
    assert _config_table.__wrapped__(frozen) == fresh  # cold: built and written
    assert len(list(cache.glob("table-*.json"))) == 1
    _refuse_building(monkeypatch)
    assert _config_table.__wrapped__(frozen) == fresh  # warm: read back


def test_a_stale_or_unreadable_entry_is_rebuilt_and_rewritten(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    frozen = _frozen("kimi-k2-tiny")
    fresh = _config_table.__wrapped__(frozen)
    (path,) = cache.glob("table-*.json")
    written = json.loads(path.read_text())
    for bad in ["{not json", json.dumps({**written, "key": written["key"] + " "}), json.dumps({**written, "value": 3})]:
        path.write_text(bad)
        assert _config_table.__wrapped__(frozen) == fresh
        assert json.loads(path.read_text()) == written
    # another transformers or another kvmove model code: another entry, the old one never read
    monkeypatch.setattr(diskcache, "code_version", lambda: "another version")
    assert diskcache.entry_path("table", frozen) != path
    assert _config_table.__wrapped__(frozen) == fresh
    assert len(list(cache.glob("table-*.json"))) == 2


def test_no_cache_neither_reads_nor_writes(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(diskcache.NO_CACHE_ENV, "1")
    frozen = _frozen("kimi-k2-tiny")
    assert _config_table.__wrapped__(frozen) == _built_table(frozen)
    assert not cache.exists()


def test_an_unwritable_cache_leaves_the_answer_uncached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(diskcache.CACHE_DIR_ENV, str(blocker / "cache"))  # under a file: no directory can be made
    frozen = _frozen("kimi-k2-tiny")
    assert _config_table.__wrapped__(frozen) == _built_table(frozen)


def test_a_refusal_is_not_cached(cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**preset_raw("llama3-tiny"), "architectures": ["LlamaXForCausalLM"]}))
    for _ in range(2):
        with pytest.raises(ModelError, match="'LlamaXForCausalLM' is not a causal LM transformers knows"):
            resolve_model(str(path))
    assert not list(cache.glob("*.json"))


def test_a_checkpoint_directory_is_read_from_its_headers_not_the_cache(cache: Path, tmp_path: Path) -> None:
    from kvmove.sync.sources.tiny_trainer import hf_model

    out = tmp_path / "ckpt"
    hf_model(resolve_model("llama3-tiny"), seed=0).save_pretrained(str(out))
    table = table_of(resolve_model(str(out)))
    assert sorted(table.tensors()) == sorted(_built_table(_frozen("llama3-tiny")).tensors())
    assert not list(cache.glob("table-*.json"))


WARM_DRY_RUN = """
import sys
from kvmove.cli.main import main
sys.argv = ["kvmove", "sync-weights", "--dry-run", "--model", "kimi-k2-tiny", "--trainer", "tp=2,ep=2",
            "--engine", "tp=2,ep=2", "--replicas", "2", "--verify", "--json"]
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
print("transformers imported:", "transformers" in sys.modules)
"""


def test_a_dry_run_on_a_warm_cache_never_imports_transformers(cache: Path) -> None:
    resolve_model("kimi-k2-tiny")  # the architecture's defaults, written
    _config_table.__wrapped__(_frozen("kimi-k2-tiny"))  # the table, written
    done = subprocess.run([sys.executable, "-c", WARM_DRY_RUN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    *reports, imported = done.stdout.splitlines()
    assert imported == "transformers imported: False"
    assert [json.loads(line)["verified"] for line in reports] == [True] * 4  # the plans read from the cached table


FULL_SIZE = ("qwen3-235b-a22b", "kimi-k2")


def _asked_now(monkeypatch: pytest.MonkeyPatch, root: Path) -> list[dict]:
    """What transformers answers now for the full-size presets (their tables and config defaults), as the shipped
    file holds them: built into an empty cache with the shipped answers hidden."""
    monkeypatch.setenv(diskcache.CACHE_DIR_ENV, str(root))
    monkeypatch.setattr(diskcache, "shipped_answers", dict)
    for name in FULL_SIZE:  # past every in-process memo: the defaults, then the table
        _config_table.__wrapped__(_frozen(name))
    out = []
    for path in sorted(root.glob("*.json")):
        stored = json.loads(path.read_text())
        asked = json.loads(stored["key"])
        out.append({"key": diskcache.shipped_key(asked["kind"], asked["key"]), "value": stored["value"]})
    return sorted(out, key=lambda a: a["key"])


def test_the_shipped_answers_are_what_transformers_answers_now(tmp_path: Path, monkeypatch) -> None:
    """The full-size presets' answers shipped in kvmove/models/configs/answers.json equal what the installed
    transformers builds (KVMOVE_WRITE_ANSWERS=1 rewrites the file from it instead)."""
    import os
    from importlib import resources

    asked = _asked_now(monkeypatch, tmp_path / "asked")
    assert {json.loads(a["key"])["kind"] for a in asked} == {"table", "defaults"}
    path = Path(str(resources.files("kvmove.models").joinpath("configs", diskcache.SHIPPED)))
    if os.environ.get("KVMOVE_WRITE_ANSWERS") == "1":
        path.write_text(json.dumps({"answers": asked}, separators=(",", ":")) + "\n")
    shipped = json.loads(path.read_text())["answers"]
    assert shipped == asked, "rerun with KVMOVE_WRITE_ANSWERS=1 to ship what transformers answers now"


def test_a_first_full_size_plan_reads_the_shipped_answers_and_imports_no_transformers(tmp_path: Path) -> None:
    """A fresh process with an empty disk cache plans Kimi K2's full-size layout (its table and defaults shipped)
    without importing transformers."""
    code = (
        "import sys; from kvmove.models import resolve_model; from kvmove.models.table import table_of; "
        "t = table_of(resolve_model('kimi-k2')); "
        "print(len(t.kinds), 'transformers' in sys.modules)"
    )
    env = {**__import__("os").environ, diskcache.CACHE_DIR_ENV: str(tmp_path / "empty")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["61", "False"]
