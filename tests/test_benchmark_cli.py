"""`mlx-dspark benchmark`: prompt sets, medians, the device-stamped JSON, the table, the chart."""

from __future__ import annotations

import json

import pytest

from mlx_dspark.cli.main import main


def _bench(model, capsys, *extra):
    rc = main(
        [
            "benchmark",
            "--model",
            str(model),
            "--mode",
            "lookup",
            "--prompts",
            "chat,copy",
            "--trials",
            "2",
            "--max-new-tokens",
            "12",
            "--no-progress",
            *extra,
        ]
    )
    return rc, capsys.readouterr()


def test_json_is_device_stamped_with_ratios_per_class(model_dir, capsys):
    rc, out = _bench(model_dir("qwen3", scale=1.0, seed=3), capsys, "--json", "--versus-mlx-lm")
    assert rc == 0
    d = json.loads(out.out)
    for k in ("device", "chip", "mlx", "mlx_dspark", "blas", "precision", "model"):
        assert k in d, k
    assert d["device"] == "cpu" and d["blas"] in ("openblas", "reference", "accelerate", "mkl", "blis", "other")
    assert d["trials"] == 2 and d["mode"] == "lookup" and set(d["classes"]) == {"chat", "copy"}
    for c in d["classes"].values():
        assert c["baseline_tps"] > 0 and c["mode_tps"] > 0 and c["same_tokens"] is True
        assert (
            c["ratio"] == pytest.approx(c["prompts"][0]["tps"]["mode"] / c["prompts"][0]["tps"]["baseline"], rel=0.02)
            if len(c["prompts"]) == 1
            else c["ratio"] > 0
        )
        assert c["ratio_vs_mlx_lm"] > 0 and c["mlx_lm_tps"] > 0
    assert len(d["classes"]["chat"]["prompts"]) == 3  # the chat set has three prompts


def test_table_on_stdout_and_a_png_chart(model_dir, capsys, tmp_path):
    png = tmp_path / "ratios.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        rc, out = _bench(model_dir("qwen3", scale=1.0, seed=3), capsys, "--chart", str(png))
        assert rc == 2 and "pip install 'mlx-dspark[chart]'" in out.err and not png.exists()
        return
    rc, out = _bench(model_dir("qwen3", scale=1.0, seed=3), capsys, "--chart", str(png))
    assert rc == 0
    lines = out.out.splitlines()
    assert "median of 2" in lines[0] and "x baseline" in lines[1]
    assert [l.split()[0] for l in lines[2:4]] == ["chat", "copy"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_prompt_set_is_a_one_line_error(model_dir, capsys):
    rc = main(["benchmark", "--model", str(model_dir("qwen3", scale=1.0, seed=3)), "--prompts", "poetry"])
    err = capsys.readouterr().err
    assert rc == 2 and "--prompts 'poetry'" in err and "chat, code, math, copy" in err
