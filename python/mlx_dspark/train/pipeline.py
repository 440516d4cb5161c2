"""`mlx-dspark distill` end to end: target -> answers -> training -> checkpoint -> evaluation.

    from mlx_dspark.train.pipeline import DistillOptions, run_distill
    run_distill(DistillOptions(model="path/or/repo", out="drafter_dir", prompts=["train.jsonl"]))

Output folder:
  config.json, model.safetensors   the drafter (DeepSpec layout): `--drafter DIR` loads it
  draft_vocab.json                 the target's answer tokens ranked by frequency (--draft-vocab)
  samples.jsonl                    the target's answers (reused by --resume and re-runs)
  train_state/                     resumable state (weights, optimizer, data position)
  train_log.jsonl, eval.json       metrics during training; held-out acceptance per domain
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import UserError
from . import checkpoint as ck
from . import data as D
from .trainer import DistillConfig, resolve_arch, train

# When the target ships no generation_config.json: DeepSpec's regeneration defaults for Qwen3
# non-thinking answers (DSpark paper, §4.1).
DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


@dataclass
class DistillOptions:
    model: str | None
    out: str
    prompts: list[str] = field(default_factory=list)
    builtin_prompts: bool = True
    eval_prompts: list[str] = field(default_factory=list)
    eval_samples: int = 8  # prompts per domain
    holdout: int = 4  # per domain, held out of training when no eval_prompts are given
    eval_max_tokens: int = 128
    evaluate: bool = True
    max_train_prompts: int | None = None
    dtype: str | None = None
    export: str | None = None
    export_bits: int = 16  # 8 or 4: the export's matrices stored quantized
    resume: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    raw_code: bool = False  # every prompt as raw code (data.raw_code), no chat template: a base model
    train: DistillConfig = field(default_factory=DistillConfig)


def _fit_window(samples: list, target, say) -> list:
    """On a GPU, answers that run past a sliding-window target's window are cut to it: there, a
    training forward longer than the window (mlx-lm's windowed mask array) crashed MLX 0.32.4's
    CUDA backend with SIGFPE within 30 steps, three times, and the same answers less those longer
    than the window trained through 5,676 steps (bench/results/gemma-dspark.md). The CPU trains on
    them whole."""
    import mlx.core as mx

    window = D.sliding_window(target.model)
    if window is None or mx.default_device() != mx.gpu or not any(len(s.ids) > window for s in samples):
        return samples
    kept, n_cut = D.cut_to_window(samples, window)
    say(
        f"distill: {n_cut} answers run past the target's sliding window of {window} tokens; on a GPU they are "
        f"cut to it ({len(samples) - len(kept)} left with under 2 answer tokens are dropped)"
    )
    return kept


def _generation_defaults(model: str, target) -> dict:
    """The target's recommended sampling (generation_config.json) where it has one."""
    path = Path(model).expanduser() if model else None
    gc = {}
    if path is not None and path.is_dir() and (path / "generation_config.json").is_file():
        try:
            gc = json.loads((path / "generation_config.json").read_text())
        except (OSError, json.JSONDecodeError):
            gc = {}
    if gc.get("do_sample") is False or "temperature" not in gc:
        return dict(DEFAULT_SAMPLING)
    return {
        "temperature": float(gc.get("temperature", 0.7)),
        "top_p": float(gc.get("top_p", 1.0)),
        "top_k": int(gc.get("top_k", 0) or 0),
    }


def _check_out(out: Path, resume: bool) -> None:
    if resume:
        if not ck.has_state(out):
            raise UserError(f"--resume: {out} holds no interrupted training run ({ck.STATE_DIR}/ is missing)")
        return
    if ck.has_state(out):
        raise UserError(f"{out} already holds a training run: pass --resume to continue it, or choose another --out")
    if out.exists() and (not out.is_dir() or any(p.name != "samples.jsonl" for p in out.iterdir())):
        raise UserError(f"--out {out} exists and is not empty; choose a new folder")


def run_distill(
    opts: DistillOptions, *, log: Callable[[str], None] | None = None, on_step: Callable[[int], None] | None = None
) -> dict:
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    from ..models.loading import load_target

    out = Path(opts.out).expanduser()
    cfg = opts.train
    if cfg.kind not in (None, "dspark", "dflash"):
        raise UserError(f"--kind must be dspark or dflash, got {cfg.kind!r}")
    _check_out(out, opts.resume)
    # Cheap checks first: bad prompt files fail before the target is loaded.
    prompts = D.load_prompts(opts.prompts, builtin=opts.builtin_prompts)
    eval_prompts = [p for f in opts.eval_prompts for p in D.read_prompt_file(f)]
    if opts.raw_code:
        prompts, eval_prompts = D.as_raw_code(prompts), D.as_raw_code(eval_prompts)
        cfg.gen.chat_template = False
    from ..models.demo import model_or_demo

    model = model_or_demo(opts.model)
    t0 = time.perf_counter()
    target, tokenizer = load_target(model, dtype=opts.dtype)
    if cfg.gen.chat_template:
        D.require_chat_template(tokenizer, f"target {model}")
    resolve_arch(cfg, target)  # --init-from is checked before any answer is generated
    if cfg.taps:
        ck.check_taps(cfg.taps, target.num_layers)
    if eval_prompts:
        train_prompts = prompts
        held = D.subsample(eval_prompts, opts.eval_samples, cfg.seed)
    else:
        train_prompts, held = D.split_holdout(prompts, opts.holdout, cfg.seed)
        held = D.subsample(held, opts.eval_samples, cfg.seed)
    if opts.max_train_prompts:
        train_prompts = D.subsample(train_prompts, opts.max_train_prompts, cfg.seed)
    say(
        f"distill: target {model} ({target.model_type}, {target.num_layers} layers, hidden {target.hidden_size}, "
        f"vocab {target.vocab_size}); {len(train_prompts)} training prompts, {len(held)} held out"
    )

    samp = _generation_defaults(model, target)
    for k in ("temperature", "top_p", "top_k"):
        if getattr(opts, k) is not None:
            samp[k] = getattr(opts, k)
    g = cfg.gen
    g.temperature, g.top_p, g.top_k, g.seed = (
        float(samp["temperature"]),
        float(samp["top_p"]),
        int(samp["top_k"]),
        cfg.seed,
    )
    key = D.data_key(str(model), train_prompts, g)
    out.mkdir(parents=True, exist_ok=True)
    samples = D.load_samples(out / "samples.jsonl", key)
    t_gen = 0.0
    if samples is None:
        say(
            f"distill: the target answers {len(train_prompts)} prompts (T={g.temperature}, top_p={g.top_p}, "
            f"top_k={g.top_k}, up to {g.max_new_tokens} tokens, batches of {g.batch_size})"
        )
        t = time.perf_counter()
        samples = D.generate_samples(target, tokenizer, train_prompts, g, progress=say)
        t_gen = time.perf_counter() - t
        D.save_samples(out / "samples.jsonl", samples, key)
    else:
        say(f"distill: reusing the target's answers in {out / 'samples.jsonl'}")
    samples = _fit_window(samples, target, say)
    say("distill: " + D.describe(samples))

    meta = {
        "target": str(model),
        "kind": cfg.kind,
        **({"layout": cfg.layout} if cfg.kind == "dflash" else {}),
        "prompts": [str(p) for p in opts.prompts] + (["<built-in>"] if opts.builtin_prompts else []),
        "samples": len(samples),
        "answer_tokens": sum(s.n_answer for s in samples),
        "sampling": samp,
        "batch_size": cfg.batch_size,
        "anchors": cfg.anchors,
        "lr": cfg.lr,
        "warmup_ratio": cfg.warmup_ratio,
        "train_vocab": cfg.train_vocab,
    }
    if not g.chat_template:
        meta["chat_template"] = False  # raw prompts: run it with `generate --no-chat-template`
    if opts.raw_code:
        meta["prompts_as"] = "raw code"
    if g.cut_loops:
        meta["cut_loops"] = g.cut_loops  # answers ended where an n-gram of this length starts a third time
    if cfg.init_from:
        meta["init_from"] = str(cfg.init_from)
        if cfg.init_layers is not None and cfg.init_layers < cfg.layers:
            meta["grown_from_layers"] = cfg.init_layers
    from ..models.draft_vocab import write_ranking

    # The tokens the target answers with (written first: a run stopped mid-training ships it too).
    write_ranking(out, (s.ids[s.n_prompt :] for s in samples))
    summary = train(target, tokenizer, samples, cfg, out, resume=opts.resume, meta=meta, on_step=on_step, log=say)
    summary["generate_s"] = round(t_gen, 1)
    ship = out
    if opts.export:
        from .export import export_compact

        ship = export_compact(out, Path(opts.export).expanduser(), bits=opts.export_bits)
        say(f"distill: compact export in {ship} ({ck.size_mb(ship):.1f} MB)")
    if opts.evaluate and held:
        from ..models.drafters import load_drafter
        from .evaluate import acceptance, format_table

        drafter = load_drafter(str(ship), target, bits=16)
        res = acceptance(
            target,
            tokenizer,
            drafter,
            held,
            max_new_tokens=opts.eval_max_tokens,
            chat_template=g.chat_template,
            log=say,
        )
        summary["eval"] = res
        (out / "eval.json").write_text(
            json.dumps({"drafter": str(ship), "max_new_tokens": opts.eval_max_tokens, "result": res}, indent=1)
        )
        say("distill: held-out mean acceptance length (greedy, accepted + 1 per round):\n" + format_table(res))
    summary["total_s"] = round(time.perf_counter() - t0, 1)
    return summary


__all__ = ["DistillOptions", "run_distill"]
