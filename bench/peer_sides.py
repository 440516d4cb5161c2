"""The per-side processes of bench/bench_peer.py (see its header): `--role prep|ref|ours|peer
--job FILE` runs one side and writes its JSON. Run by bench_peer.py with each side's own
sys.path; the module itself imports neither mlx_dspark at load.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "python"
PEER_VERSION = "0.20.3"


def timed_passes(job: dict, modes: dict, say_prefix: str, decode) -> dict:
    """Run every mode on every prompt: one warm pass, then timed passes until the trials or the
    deadline. modes: name -> fn(ids) returning (tokens, text, mean_accept). A call that returns
    more than the tokens asked for (the peer's last round overshoots) is counted and compared on
    the first job["tokens"]: tok/s = min(returned, asked) / seconds; text_n = decode(those ids)."""
    prompts, trials, deadline, n = job["prompts"], job["trials"], job["deadline"], job["tokens"]
    names = list(modes)
    runs = {m: [[] for _ in prompts] for m in names}  # per mode, per prompt: [{tps, tokens...}]
    passes_done = 0
    for p in range(trials + 1):
        t_pass = time.perf_counter()
        order = names if p % 2 == 0 else names[::-1]
        for i, pr in enumerate(prompts):
            for m in order:
                t0 = time.perf_counter()
                toks, text, accept = modes[m](pr["ids"])
                dt = time.perf_counter() - t0
                kept = toks[:n]
                runs[m][i].append(
                    {
                        "warm": p == 0, "tps": len(kept) / dt, "s": dt, "tokens": kept, "text": text,
                        "text_n": text if len(toks) <= n else decode(kept), "extra": len(toks) - len(kept),
                        "accept": accept,
                    }
                )  # fmt: skip
        took = time.perf_counter() - t_pass
        passes_done = p
        print(
            f"{say_prefix}: pass {p} ({'warm-up' if p == 0 else 'timed'}) in {took:.1f}s", file=sys.stderr, flush=True
        )
        if p >= 1 and p < trials and time.time() + took > deadline:
            print(f"{say_prefix}: budget reached after {p} timed pass(es)", file=sys.stderr, flush=True)
            break
    out = {}
    for m in names:
        rows = []
        for i, pr in enumerate(prompts):
            rs = runs[m][i]
            timed = [r for r in rs if not r["warm"]] or rs
            best = max(timed, key=lambda r: r["tps"])
            rows.append(
                {
                    "domain": pr["domain"],
                    "tps": round(best["tps"], 3),
                    "tps_runs": [round(r["tps"], 3) for r in timed],
                    "tokens": best["tokens"],
                    "text": best["text"],
                    "text_n": best["text_n"],
                    "extra": max(r["extra"] for r in rs),
                    "accept": best["accept"],
                    "all_runs_same": all(r["tokens"] == rs[0]["tokens"] and r["text_n"] == rs[0]["text_n"] for r in rs),
                }
            )
        out[m] = rows
    return {"modes": out, "timed_passes": passes_done}


def _stamp(mx) -> dict:
    dev = mx.default_device()
    name = str(dev)
    if dev != mx.cpu:
        try:
            name = mx.device_info().get("device_name", name)
        except Exception:
            pass
    return {"device": name, "mlx": mx.__version__, "python": sys.version.split()[0]}


def role_prep(job: dict) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import _package  # noqa: F401  (the installed mlx_dspark, else python/)
    import mlx.core as mx

    from mlx_dspark.models.demo import model_or_demo

    cpu = mx.default_device() == mx.cpu
    dtype = job["dtype"] or ("float32" if cpu else "bfloat16")
    work = Path(job["work"])
    model = model_or_demo(job["model"])
    if Path(model).is_dir():
        target_dir = Path(model)
    else:
        target_dir = work / f"target-{dtype}"
        if not (target_dir / "config.json").is_file():
            subprocess.run(
                [sys.executable, "-m", "mlx_dspark", "convert", model, "--out", str(target_dir), "--dtype", dtype],
                check=True,
            )
    drafter_dir = work / f"drafter-{dtype}"
    if not (drafter_dir / "model.safetensors").is_file():
        dequantize_drafter(Path(job["drafter"]), drafter_dir, getattr(mx, dtype))
    return {
        **_stamp(mx),
        "dtype": dtype,
        "model": model,
        "target_dir": str(target_dir),
        "drafter_dir": str(drafter_dir),
    }


def dequantize_drafter(src: Path, dst: Path, dtype) -> None:
    """An unquantized copy of a drafter stored MLX-affine quantized (weight/scales/biases triples)."""
    import mlx.core as mx

    cfg = json.loads((src / "config.json").read_text())
    q = cfg.pop("quantization", None) or {}
    cfg.pop("quantization_config", None)
    w = mx.load(str(src / "model.safetensors"))
    out = {}
    for k, v in w.items():
        if k.endswith((".scales", ".biases")):
            continue
        base = k[: -len(".weight")] if k.endswith(".weight") else None
        if base and f"{base}.scales" in w:
            v = mx.dequantize(
                v, w[f"{base}.scales"], w.get(f"{base}.biases"), group_size=q.get("group_size", 64), bits=q["bits"]
            )
        out[k] = v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
    cfg["dtype"] = str(dtype).replace("mlx.core.", "")
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    print(f"drafter {src.name}: {len(out)} tensors, {len(w) - len(out)} quantization tables folded, as {cfg['dtype']}")


def role_ref(job: dict) -> dict:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm import load, stream_generate

    assert "mlx_dspark" not in sys.modules
    model, tok = load(job["target_dir"])
    for pr in job["prompts"]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": pr["text"]}], add_generation_prompt=True, tokenize=False
        )
        pr["ids"] = list(tok.encode(text, add_special_tokens=False))
    n = job["tokens"]

    def plain(ids):
        toks = []
        for r in stream_generate(model, tok, ids, max_tokens=n):
            if r.finish_reason is None or r.finish_reason == "length":
                toks.append(int(r.token))
        return toks, tok.decode(toks), 1.0

    res = timed_passes(job, {"mlx_lm": plain}, "ref", tok.decode)
    return {**res, **_stamp(mx), "mlx_lm": mlx_lm.__version__, "prompt_ids": [p["ids"] for p in job["prompts"]]}


def role_ours(job: dict) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import _package  # noqa: F401
    import mlx.core as mx

    import mlx_dspark
    from mlx_dspark._version import __version__
    from mlx_dspark.api import drafter_for, encode_prompt, generate
    from mlx_dspark.models.loading import load_target

    here = Path(mlx_dspark.__file__).resolve()
    assert "peer_site" not in str(here), here
    target, tok = load_target(job["target_dir"])
    same_ids = [encode_prompt(tok, p["text"]) == p["ids"] for p in job["prompts"]]
    n = job["tokens"]
    modes = {
        "baseline": lambda ids: _ours_run(
            generate(target, tok, None, prompt_ids=ids, mode="baseline", max_new_tokens=n)
        )
    }
    drafters = {}
    from mlx_dspark.decode.drafting import DrafterProposer

    def dspark(ids, d, device_drafts=True, ahead=True):
        DrafterProposer.device_drafts, DrafterProposer.draft_ahead = device_drafts, ahead
        try:
            return _ours_run(
                generate(
                    target, tok, None, prompt_ids=ids, mode="dspark", drafter=d, max_new_tokens=n, max_draft="auto"
                )
            )
        finally:
            DrafterProposer.device_drafts = DrafterProposer.draft_ahead = True

    # "default" | 4 | 8 | 16 | "hostdraft" (default bits, drafts read back first) | "noahead" (default
    # bits, the next block drafted after the accept point is read back)
    for bits in job["ours_bits"]:
        b = None if bits in ("default", "hostdraft", "noahead") else int(bits)
        d = drafter_for(target, "dspark", job["drafter"], bits=b)
        name = "dspark" if bits == "default" else f"dspark-{bits}" if b is None else f"dspark-{b}bit"
        drafters[name] = d.describe()
        modes[name] = lambda ids, d=d, dev=bits != "hostdraft", ahead=bits != "noahead": dspark(ids, d, dev, ahead)
    res = timed_passes(job, modes, "ours", tok.decode)
    return {
        **res,
        **_stamp(mx),
        "version": __version__,
        "file": str(here),
        "drafters": drafters,
        "same_prompt_ids": same_ids,
    }


def _ours_run(r):
    return list(r.tokens), r.text, r.mean_accept_len


def _peer_path(job: dict) -> None:
    """Make `import mlx_dspark` find the peer: its site first, ours gone (path entries and the
    editable-install finder), the carried fallbacks last."""
    src = str(SRC)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != src]
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (getattr(f, "__module__", "") or "").lower()]
    sys.path_importer_cache.clear()
    for m in [m for m in sys.modules if m == "mlx_dspark" or m.startswith("mlx_dspark.")]:
        del sys.modules[m]
    sys.path.insert(0, job["peer_site"])
    sys.path.append(job["peer_deps"])


def _import_peer(job: dict):
    _peer_path(job)
    import mlx_dspark as peer

    here = Path(peer.__file__).resolve()
    assert str(here).startswith(os.path.realpath(job["peer_site"])), f"imported {here}, not the peer"
    assert peer.__version__ == PEER_VERSION, peer.__version__
    return peer, here


def role_check(job: dict) -> dict:
    """Before any timing: the peer imports here, and with which packages around it."""
    from importlib.metadata import version

    peer, here = _import_peer(job)
    found = {}
    for name in ("mlx", "mlx-lm", "mlx-vlm", "transformers", "huggingface-hub", "numpy", "requests", "pillow"):
        try:
            found[name] = version(name)
        except Exception:
            found[name] = None
    return {"file": str(here), "version": peer.__version__, "python": sys.version.split()[0], "packages": found}


def role_peer(job: dict) -> dict:
    peer, here = _import_peer(job)
    import mlx.core as mx

    cal = importlib.import_module("mlx_dspark.calibrate")  # the package's `calibrate` is a function
    from mlx_dspark.generate import encode_prompt, greedy_generate, speculative_generate
    from mlx_dspark.load import load_drafter, load_target, lookup_drafts_default, resolve_drafter_window

    tdir, ddir = job["target_dir"], job["drafter_dir"]
    target, tok = load_target(tdir, require_tap=True)
    drafter, _ = load_drafter(ddir, quantize=False)
    drafter.ctx_window = resolve_drafter_window(None, tdir)
    gates = {}
    for name, call in (  # what its `generate` applies before decoding, in its order
        ("small_m", lambda: cal.apply_small_m(target, drafter, target_repo=tdir, drafter_repo=ddir)),
        ("sdpa_split", lambda: cal.apply_sdpa_split(target, target_repo=tdir)),
        ("multirow_attn", lambda: cal.apply_multirow_attn(target, drafter)),
        ("wide_gemm", lambda: cal.apply_wide_gemm(target, drafter, target_repo=tdir)),
        ("cpu_split", lambda: cal.apply_cpu_split(target, drafter, target_repo=tdir)),
    ):
        try:
            gates[name] = repr(call())[:200]
        except Exception as e:  # a gate its CLI would have hit too: recorded, decoding goes on
            gates[name] = f"raised {type(e).__name__}: {str(e)[:200]}"
    lookup = lookup_drafts_default(tdir)
    same_ids = [encode_prompt(tok, p["text"]) == p["ids"] for p in job["prompts"]]
    n = job["tokens"]

    def run(r):
        return list(r.token_ids), r.text, r.mean_accept_len

    modes = {"baseline": lambda ids: run(greedy_generate(target, tok, prompt_ids=ids, max_new_tokens=n))}
    for cap in job["caps"]:
        modes[f"dspark-cap{cap}"] = lambda ids, cap=cap: run(
            speculative_generate(
                target, tok, drafter, prompt_ids=ids, max_new_tokens=n, max_draft_tokens=cap,
                lookup_drafts=lookup, lookup_long_draft=32,
            )
        )  # fmt: skip
    res = timed_passes(job, modes, "peer", tok.decode)
    return {
        **res, **_stamp(mx), "version": peer.__version__, "file": str(here), "gates": gates,
        "lookup_drafts": lookup, "drafter_window": drafter.ctx_window, "same_prompt_ids": same_ids,
    }  # fmt: skip


ROLES = {"check": role_check, "prep": role_prep, "ref": role_ref, "ours": role_ours, "peer": role_peer}


def child_main(role: str, job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    out = ROLES[role](job)
    Path(job["result"]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=sorted(ROLES), required=True)
    ap.add_argument("--job", required=True)
    a = ap.parse_args()
    raise SystemExit(child_main(a.role, a.job))
