"""Weight-sync rows as runs: one row per (commit, setup), strategies side by side, from fault-free syncs only.

A *setup* is what a run measured: kind (measured/simulated), hardware, model, trainer and engine layouts, engine
kind, the engine's weight format (BF16 or FP8: one layout into either is two setups), simulator constraints, the
pulls' transport and whether v2/v3 pulled directly or packed. A *run* is a setup at one commit; ``-dirty`` commits
stay apart from clean ones. A sync with a dead replica, fewer live engine ranks than the layout has, or a failed
verification is a *fault*: it is listed apart and never enters a median.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from kvmove.models.layout import split_label

STRATEGY_ORDER = ("v1", "v2", "v3", "broadcast")
RUN_KEYS = ["kind", "commit", "hardware", "model", "trainer", "engine", "engine_kind", "engine_dtype", "constraints"]
SETUP_KEYS = [k for k in RUN_KEYS if k != "commit"] + ["transport", "pulls"]
EXCLUDED_SUITES = ("plan", "migration")


def short_commit(commit: Any) -> str:
    """First 8 hex digits, keeping a ``-dirty`` suffix (a dirty tree is not the commit it sits on)."""
    text = "" if commit is None or (isinstance(commit, float) and math.isnan(commit)) else str(commit)
    dirty = text.endswith("-dirty")
    base = text.removesuffix("-dirty")
    return (base[:8] if base != "unknown" else base) + ("-dirty" if dirty else "")


def engine_ranks(label: str) -> int:
    """Engine ranks of a layout label such as ``tp=2,dp=1,ep=2,pp=1 x2`` (tp·dp·pp per replica, times replicas)."""
    body, replicas = split_label(label)
    dims = dict(part.split("=", 1) for part in body.split(",") if "=" in part)
    try:
        per = int(dims.get("tp", 1)) * int(dims.get("dp", 1)) * int(dims.get("pp", 1))
        return per * replicas
    except ValueError:
        return 0


def sync_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The weight-sync rows (measured and simulated), decorated with the setup columns and ``fault`` ("" if none)."""
    df = rows[(rows["strategy"].fillna("") != "") & ~rows["suite"].isin(EXCLUDED_SUITES)].copy()
    if df.empty:
        return df
    extra = df["extra_d"]
    df["commit"] = df["git_commit"].map(short_commit)
    df["constraints"] = extra.map(_variant)
    # NOTE: rows written before engine kinds existed synced into kvmove's reference engine
    default_kind = df["kind"].map(lambda k: "reference" if k == "measured" else "")
    df["engine_kind"] = [str(e.get("engine_kind") or d) for e, d in zip(extra, default_kind, strict=True)]
    df["engine_dtype"] = [_engine_dtype(k, e) for k, e in zip(df["kind"], extra, strict=True)]
    df["hardware"] = [_hardware(k, h, e) for k, h, e in zip(df["kind"], df["hardware"], extra, strict=True)]
    df["pulls"] = [_pulls(k, s, e) for k, s, e in zip(df["kind"], df["strategy"], extra, strict=True)]
    df["sync"] = extra.map(lambda e: e.get("sync"))
    df["published"] = extra.map(_published_seconds)
    df["fault"] = [_fault(e, label) for e, label in zip(extra, df["engine"], strict=True)]
    for k in [*SETUP_KEYS, "commit", "strategy"]:
        df[k] = df[k].fillna("").astype(str)
    df["link"] = [_link(limit, e) for limit, e in zip(df["link_limit_gbps"], extra, strict=True)]
    return df


def _hardware(kind: str, hardware: Any, extra: dict[str, Any]) -> str:
    """Measured: the machine. Simulated: the simulated cluster and its node counts, never the machine that ran
    the simulator (rows of an older simulator named that one)."""
    if kind != "simulated":
        return str(hardware or "")
    if str(hardware).startswith("simulated"):
        nodes = f"{extra.get('trainer_nodes', '?')}+{extra.get('engine_nodes', '?')} nodes"
        return f"{str(hardware).removeprefix('simulated: ')}; {nodes}"
    cluster = dict(p.split("=", 1) for p in str(extra.get("cluster", "")).split(",") if "=" in p)
    nodes = f"{extra.get('trainer_nodes', '?')}+{extra.get('engine_nodes', '?')}"
    return f"sim {nodes} nodes x{cluster.get('gpus_per_node', '?')} GPU"


def _engine_dtype(kind: str, extra: dict[str, Any]) -> str:
    """Measured: the engine's weight format (rows written before FP8 engines existed synced BF16). Simulated: ""
    (a simulated setup names its format, and where it quantizes, in its constraints)."""
    if kind == "simulated":
        return ""
    return str(extra.get("engine_dtype") or "bf16")


def _variant(extra: dict[str, Any]) -> str:
    """What else sets a simulated setup apart: simulator constraints, FP8, colocation, relays, host staging,
    broadcast buckets, a delta sync's changed fractions."""
    parts = [str(extra.get("constraints", ""))]
    if extra.get("delta"):
        parts.append(f"delta {extra['delta']}")
    if extra.get("bucket_bytes"):
        parts.append(f"{int(extra['bucket_bytes']) / 2**30:g} GiB buckets")
    if extra.get("dtype", "bf16") != "bf16":
        parts.append(f"{extra['dtype']} on {extra.get('quantize_on', '?')}")
    if extra.get("placement", "disaggregated") != "disaggregated":
        parts.append(str(extra["placement"]))
    if extra.get("fanout", "none") != "none":
        parts.append(f"{extra['fanout']} fanout")
    if "via host" in str(extra.get("setup_detail", "")):
        parts.append("via host")
    return " ".join(p for p in parts if p)


def _pulls(kind: str, strategy: str, extra: dict[str, Any]) -> str:
    """v2/v3: "direct" (from trainer arenas where possible) or "packed" (every region packed; measured rows written
    before direct pulls existed carry no flag and were packed; simulated rows say it in their setup). Other
    strategies, and simulated rows of an older simulator: ""."""
    if strategy not in ("v2", "v3"):
        return ""
    if kind == "simulated":
        detail = str(extra.get("setup_detail", ""))
        return ("direct" if detail.rsplit(",", 1)[-1].strip().endswith("direct") else "packed") if detail else ""
    return "direct" if extra.get("direct") else "packed"


def _published_seconds(extra: dict[str, Any]) -> float:
    """The published time a simulated row is checked against (its figure's value), else NaN."""
    pub = extra.get("published") or {}
    if not isinstance(pub, dict):
        return math.nan
    if "value" in pub:  # {"figure", "value", "metric", ...}
        return float(pub["value"]) if pub.get("metric", "seconds") == "seconds" else math.nan
    return float(pub["seconds"]) if isinstance(pub.get("seconds"), int | float) else math.nan  # older rows


def _fault(extra: dict[str, Any], engine_label: str) -> str:
    dead = extra.get("dead_replicas") or []
    if dead:
        return f"replica {', '.join(map(str, dead))} dead"
    world, live = engine_ranks(engine_label), extra.get("live_engines")
    if isinstance(live, int) and world and live < world:
        return f"{live}/{world} engine ranks live"
    if extra.get("verified") is False:
        return "did not verify"
    return ""


def _link(limit: Any, extra: dict[str, Any]) -> float:
    """The link's limit: the row's own, else the raw bandwidth measured in the same run (CPU sync suite)."""
    value = float(limit) if limit is not None and not pd.isna(limit) else 0.0
    if value > 0:
        return value
    raw = extra.get("raw_gbps")
    return float(raw) if isinstance(raw, int | float) and raw > 0 else math.nan


def series(clean: pd.DataFrame) -> pd.DataFrame:
    """Per (run, strategy, transport, pulls): syncs, median/min/max seconds and GB/s, bytes, link, phases."""
    if clean.empty:
        return pd.DataFrame()
    keys = [*RUN_KEYS, "strategy", "transport", "pulls"]
    recs = []
    for key, g in clean.groupby(keys, sort=False):
        phases = pd.DataFrame(list(g["phases_d"])).median(numeric_only=True).to_dict() if len(g) else {}
        recs.append(
            {
                **dict(zip(keys, key, strict=True)),
                "syncs": len(g),
                "seconds": g["seconds"].median(),
                "seconds_min": g["seconds"].min(),
                "seconds_max": g["seconds"].max(),
                "gbps": g["gbps"].median(),
                "gbps_min": g["gbps"].min(),
                "gbps_max": g["gbps"].max(),
                "bytes": g["bytes"].median(),
                "link_gbps": g["link"].median(),
                "published": g["published"].median(),
                "phases": {k: float(v) for k, v in phases.items()},
                "timestamp": str(g["timestamp"].fillna("").max()),
            }
        )
    return pd.DataFrame(recs)


def sync_table(ser: pd.DataFrame) -> pd.DataFrame:
    """One row per (commit, setup): each strategy's median, min and max seconds, GB/s and phases side by side.

    v1 joins the rows of its transport; the broadcast baseline (its own transport; the pipelined broadcast where a
    run has no plain one, named in ``broadcast_strategy``) joins every row of its run.
    """
    if ser.empty:
        return pd.DataFrame()
    recs = []
    for key, run in ser.groupby(RUN_KEYS, sort=False):
        base = dict(zip(RUN_KEYS, key, strict=True))
        baselines = run[run["strategy"].str.startswith("broadcast")]
        bcast = baselines.sort_values("strategy", key=lambda c: c != "broadcast", kind="stable")
        pulls = run[~run["strategy"].str.startswith("broadcast")]
        for transport, pull_mode in _rows_of(pulls, bcast):
            members = pulls[(pulls["transport"] == transport) & pulls["pulls"].isin(["", pull_mode])]
            recs.append(_row(base, transport, pull_mode, pd.concat([members, bcast.head(1)])))
    out = pd.DataFrame(recs)
    return out.sort_values([*SETUP_KEYS, "timestamp"], ascending=[True] * len(SETUP_KEYS) + [False], kind="stable")


def _rows_of(pulls: pd.DataFrame, bcast: pd.DataFrame) -> list[tuple[str, str]]:
    """(transport, pulls) of each table row of one run."""
    if pulls.empty:
        return [(str(bcast["transport"].iloc[0]), "")]
    out: dict[tuple[str, str], None] = {}
    for transport, g in pulls.groupby("transport", sort=False):
        modes = [m for m in dict.fromkeys(g["pulls"]) if m] or [""]
        for m in modes:
            out[(str(transport), m)] = None
    return list(out)


def _row(base: dict[str, Any], transport: str, pull_mode: str, members: pd.DataFrame) -> dict[str, Any]:
    rec: dict[str, Any] = {**base, "transport": transport, "pulls": pull_mode}
    by = {_slot(str(r["strategy"])): r for _, r in members.iterrows()}
    strategies = [s for s in STRATEGY_ORDER if s in by] + sorted(set(by) - set(STRATEGY_ORDER))
    pull_bytes = [float(by[s]["bytes"]) for s in strategies if s != "broadcast"]
    rec["strategies"] = ",".join(strategies)
    rec["syncs"] = int(min(int(by[s]["syncs"]) for s in strategies))
    rec["bytes"] = pull_bytes[0] if pull_bytes else float(by[strategies[0]]["bytes"])
    rec["link_gbps"] = pd.Series([by[s]["link_gbps"] for s in strategies], dtype=float).median()
    rec["timestamp"] = max(str(by[s]["timestamp"]) for s in strategies)
    for s in STRATEGY_ORDER:
        r = by.get(s)
        for col in ("seconds", "seconds_min", "seconds_max", "gbps", "gbps_min", "gbps_max", "published"):
            rec[f"{s}_{col}"] = float(r[col]) if r is not None else math.nan
        rec[f"{s}_phases"] = r["phases"] if r is not None else {}
    rec["broadcast_transport"] = str(by["broadcast"]["transport"]) if "broadcast" in by else ""
    rec["broadcast_strategy"] = str(by["broadcast"]["strategy"]) if "broadcast" in by else ""
    for s in ("v1", "broadcast"):
        rec[f"v3_speedup_vs_{s}"] = rec[f"{s}_seconds"] / rec["v3_seconds"] if rec["v3_seconds"] > 0 else math.nan
    rec["v3_pct_of_link"] = 100 * rec["v3_gbps"] / rec["link_gbps"] if rec["link_gbps"] > 0 else math.nan
    return rec


def _slot(strategy: str) -> str:
    """The column a strategy's numbers go to: the pipelined broadcast stands in for the broadcast baseline."""
    return "broadcast" if strategy.startswith("broadcast") else strategy


def latest_complete(table: pd.DataFrame) -> pd.DataFrame:
    """Per setup, its latest run that has every strategy any run of that setup had (else its latest run)."""
    if table.empty:
        return table
    picks = []
    for _, g in table.groupby(SETUP_KEYS, sort=False):
        union = set().union(*(set(s.split(",")) for s in g["strategies"]))
        complete = g[g["strategies"].map(lambda s, u=union: set(s.split(",")) >= u)]
        pool = complete if not complete.empty else g
        picks.append(pool.sort_values("timestamp").iloc[-1])
    return pd.DataFrame(picks).reset_index(drop=True)


def faults_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Every faulty sync, one row each (kept out of the medians)."""
    df = rows[rows["fault"] != ""] if not rows.empty else rows
    if df.empty:
        return pd.DataFrame()
    out = df[[*RUN_KEYS, "transport", "strategy", "sync", "seconds", "bytes", "fault", "timestamp"]].copy()
    out["live_engines"] = df["extra_d"].map(lambda e: e.get("live_engines"))
    out["engine_ranks"] = df["engine"].map(engine_ranks)
    out["verified"] = df["extra_d"].map(lambda e: e.get("verified"))
    return out.reset_index(drop=True)
