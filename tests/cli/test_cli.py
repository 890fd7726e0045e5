"""The command-line contract: names, flags, JSON keys and exit codes (see CLI.md)."""

from __future__ import annotations

import json
import sys

import pytest

from kvmove.cli.main import main


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["kvmove", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_models_show_json(monkeypatch, capsys) -> None:
    code, out, _ = run(monkeypatch, capsys, "models", "show", "qwen3-235b-a22b", "--json")
    assert code == 0
    row = json.loads(out)
    want = {"name", "architecture", "num_tensors", "total_params", "total_bytes", "expert_params", "non_expert_params"}
    assert want <= set(row)
    assert row["total_params"] == 235_093_634_560 and row["total_bytes"] == 2 * row["total_params"]


def test_models_list(monkeypatch, capsys) -> None:
    code, out, _ = run(monkeypatch, capsys, "models", "list", "--json")
    names = [json.loads(line)["name"] for line in out.splitlines()]
    assert code == 0 and {"qwen3-235b-a22b", "kimi-k2", "qwen3-moe-tiny", "kimi-k2-tiny"} <= set(names)


def test_dry_run_verify_json(monkeypatch, capsys) -> None:
    code, out, _ = run(monkeypatch, capsys, "sync-weights", "--dry-run", "--verify", "--json", "--strategy", "v1,v3")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["strategy"] for r in rows] == ["v1", "v3"]
    keys = {"strategy", "plan_seconds", "bytes_total", "bytes_per_engine_rank_max", "bytes_per_trainer_rank_max"}
    for r in rows:
        assert keys | {"verified"} <= set(r) and r["verified"] is True


def test_dry_run_engine_dtype_fp8_counts_fp8_bytes(monkeypatch, capsys) -> None:
    args = ["sync-weights", "--dry-run", "--json", "--strategy", "v3", "--model", "qwen3-moe-fp8-tiny"]
    args += ["--trainer", "tp=2,etp=2", "--engine", "tp=2"]
    rows = {}
    for dtype in ("bf16", "fp8"):
        code, out, _ = run(monkeypatch, capsys, *args, "--engine-dtype", dtype)
        assert code == 0
        rows[dtype] = json.loads(out)
    assert rows["fp8"]["engine_dtype"] == "fp8" and set(rows["fp8"]["bytes_by_transform"]) == {"plain", "trainer"}
    assert rows["fp8"]["bytes_total"] < 0.6 * rows["bf16"]["bytes_total"]


def test_full_size_dry_run_table(monkeypatch, capsys) -> None:
    args = ["sync-weights", "--dry-run", "--model", "qwen3-235b-a22b", "--trainer", "tp=4,pp=2,ep=8,dp=2"]
    code, out, _ = run(monkeypatch, capsys, *args, "--engine", "dp=16,ep=16", "--strategy", "v2")
    assert code == 0 and "v2" in out and "GB" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["models", "show", "llama-9000"], "unknown model 'llama-9000'"),
        (["models", "show", "qwen3-tiny", "--override", "num_hidden_layers"], "key=value"),
        (["sync-weights", "--dry-run", "--trainer", "tp=3"], "num_attention_heads (4) % tp"),
        (["sync-weights", "--dry-run", "--engine", "tp=2,dp=2,ep=2"], "ep in (1, tp·dp = 4)"),
        (["sync-weights", "--dry-run", "--strategy", "v9"], "unknown strategy 'v9'"),
        (["sync-weights", "--dry-run", "--verify", "--model", "kimi-k2"], "would materialize"),
        (["sync-weights", "--dry-run", "--engine-dtype", "fp4"], "engine dtype 'fp4' is not one of bf16, fp8"),
        (["sync-weights", "--dry-run", "--engine-dtype", "fp8", "--engine", "tp=2"], "not a multiple of the 128x128"),
    ],
)
def test_bad_input_is_one_line_exit_2(monkeypatch, capsys, args: list[str], message: str) -> None:
    code, _, err = run(monkeypatch, capsys, *args)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_models_show_and_dry_run_a_checkpoint_directory(monkeypatch, capsys, tmp_path) -> None:
    from kvmove.models import resolve_model
    from kvmove.sync.sources.tiny_trainer import hf_model

    hf_model(resolve_model("mixtral-tiny"), seed=0).save_pretrained(str(tmp_path / "mixtral"))
    capsys.readouterr()
    code, out, _ = run(monkeypatch, capsys, "models", "show", str(tmp_path / "mixtral"), "--json")
    row = json.loads(out)
    assert code == 0 and row["architecture"] == "MixtralForCausalLM" and row["table_source"] == "checkpoint"
    assert row["megatron_families"] == ["gqa-moe"] and row["num_tensors"] == 78
    args = ["sync-weights", "--dry-run", "--verify", "--json", "--model", str(tmp_path / "mixtral")]
    code, out, _ = run(monkeypatch, capsys, *args, "--trainer", "tp=2,ep=2", "--engine", "tp=2", "--strategy", "v3")
    assert code == 0 and json.loads(out)["verified"] is True


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"architectures": ["NoSuchLMForCausalLM"]}, "'NoSuchLMForCausalLM' is not a causal LM transformers knows"),
        (
            {
                "architectures": ["Qwen2MoeForCausalLM"],
                "hidden_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 6,
                "num_key_value_heads": 2,
                "intermediate_size": 64,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "vocab_size": 300,
            },
            "no Megatron sharding rule for tensor model.embed_tokens.weight: Qwen2MoeForCausalLM is in no family",
        ),
    ],
)
def test_unknown_architectures_and_unclassified_tensors_exit_2(monkeypatch, capsys, tmp_path, raw, message) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    args = ["sync-weights", "--dry-run", "--model", str(path), "--trainer", "tp=2", "--engine", "tp=2"]
    code, _, err = run(monkeypatch, capsys, *args, "--strategy", "v1")
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_checkpoint_that_does_not_tile_exits_2(monkeypatch, capsys, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from kvmove.models import resolve_model
    from kvmove.sync.sources.tiny_trainer import hf_model

    out = tmp_path / "llama"
    hf_model(resolve_model("llama3-tiny"), seed=0).save_pretrained(str(out))
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:100].clone()
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    capsys.readouterr()
    code, _, err = run(monkeypatch, capsys, "models", "show", str(out))
    assert code == 2 and "tensor model.layers.1.mlp.up_proj.weight is (100, 96)" in err
    assert len(err.strip().splitlines()) == 1


def test_malformed_config_file(monkeypatch, capsys, tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{oops")
    code, _, err = run(monkeypatch, capsys, "models", "show", str(path))
    assert code == 2 and "cannot read" in err


def test_unrecordable_loader_is_exit_2(monkeypatch, capsys) -> None:
    from kvmove.engines import ENGINES, EngineAdapter

    ref = ENGINES["reference"]

    def peeking(model, weights):
        return ref.load_weights(model, ((n, w.float()) for n, w in weights))

    monkeypatch.setitem(ENGINES, "reference", EngineAdapter("reference", ref.build, peeking))
    code, _, err = run(monkeypatch, capsys, "sync-weights", "--dry-run")
    assert code == 2 and "op 'float'" in err and len(err.strip().splitlines()) == 1


def test_help_has_example(monkeypatch, capsys) -> None:
    code, out, _ = run(monkeypatch, capsys, "sync-weights", "--help")
    assert code == 0 and "Example:" in out


def test_every_bench_suite_has_a_runner() -> None:
    from kvmove.cli.bench import SUITES, Suite

    assert set(SUITES) == set(Suite)


def test_models_show_names_the_fused_expert_family_and_refuses_its_halves_over_etp(monkeypatch, capsys) -> None:
    code, out, _ = run(monkeypatch, capsys, "models", "show", "llama4-tiny", "--json")
    row = json.loads(out)
    assert code == 0 and row["megatron_families"] == ["gqa-fused-moe"] and row["expert_params"] == 2 * 6 * 3 * 96 * 80
    args = ["sync-weights", "--dry-run", "--model", "llama4-tiny", "--trainer", "tp=2,ep=2,etp=2", "--engine", "tp=2"]
    code, _, err = run(monkeypatch, capsys, *args)
    assert code == 2 and "keeps gate and up in two halves" in err and len(err.strip().splitlines()) == 1
