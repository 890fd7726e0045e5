"""`kvmove models`: the presets and the totals of a checkpoint."""

from __future__ import annotations

import typer

from kvmove.cli import render, streams
from kvmove.cli.options import JsonOpt, ModelArg, OverrideOpt

app = typer.Typer(no_args_is_help=True, help="Model presets and checkpoint totals.")

_SHOW_KEYS = (
    "name",
    "architecture",
    "num_tensors",
    "total_params",
    "total_bytes",
    "expert_params",
    "non_expert_params",
)


@app.command("list")
@streams.owns_stdout
def list_models(as_json: JsonOpt = False) -> None:
    """List the presets.

    Example: kvmove models list --json
    """
    from kvmove.models import model_totals, preset_names, resolve_model

    rows = [model_totals(resolve_model(n)) for n in preset_names()]
    if as_json:
        render.json_lines({k: getattr(t, k) for k in _SHOW_KEYS} for t in rows)
    else:
        render.model_list(rows)


@app.command("show")
@streams.owns_stdout
def show(model: ModelArg, override: OverrideOpt = None, as_json: JsonOpt = False) -> None:
    """Totals of a model's HF checkpoint as a BF16 trainer holds it, and which Megatron rule families apply.

    MODEL: a preset, a config.json of any causal LM transformers knows, or a checkpoint directory (config.json +
    safetensors: the table is read from the safetensors headers).

    Example: kvmove models show qwen3-235b-a22b --json
    """
    from kvmove.models import model_totals, parse_overrides, resolve_model

    totals = model_totals(resolve_model(model, parse_overrides(override or [])))
    if as_json:
        extra = {"num_layers": totals.num_layers, "megatron_families": list(totals.megatron_families)}
        extra["table_source"] = totals.table_source
        render.json_lines([{**{k: getattr(totals, k) for k in _SHOW_KEYS}, **extra}])
    else:
        render.model_show(totals)
