"""The Done-when table of adaptive speculation from synthetic bench results."""

from __future__ import annotations

import pytest

from vllm_dflash.bench import adaptive_report as rep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cell(mode, k, cat, conc, tok_s, dtype="float32", adaptive=None):
    c = {"mode": mode, "num_spec_tokens": k, "category": cat, "concurrency": conc, "output_tokens_per_s": tok_s,
         "dtype": dtype}
    if adaptive is not None:
        c["adaptive"] = adaptive
    return c


def doc(cells):
    return {"config": {"dtype": "float32"}, "results": cells}


def calib(pred, real, n=500):
    return {"calibration": [{"position": 1, "verified": n, "predicted": pred, "realised": real},
                            {"position": 2, "verified": 10, "predicted": 0.9, "realised": 0.1}]}


def round_docs(adaptive_at_4: float):
    """One round: none 100 tok/s everywhere; static k=3 110 / k=15 120 at c=1; adaptive as given."""
    cells = []
    for conc in (1, 4):
        cells += [cell("none", None, "all", conc, 100.0), cell("dflash", 3, "all", conc, 110.0),
                  cell("dflash", 15, "all", conc, 120.0 if conc == 1 else 60.0),
                  cell("dflash-adaptive", 15, "all", conc, 125.0 if conc == 1 else adaptive_at_4)]
    cells += [cell("none", None, "math", 1, 100.0),
              cell("dflash-adaptive", 15, "math", 1, 99.0, adaptive=calib(0.80, 0.78))]
    return doc(cells)


def test_passes_when_every_bar_is_met_and_names_each_check():
    result = rep.evaluate(rep.collect([(1, round_docs(108.0)), (2, round_docs(107.0)), (3, round_docs(50.0))]))
    by = {(c["check"], c["concurrency"], c["category"]): c for c in result["checks"]}
    assert by[("vs no speculation", 4, "all")]["ratio"] == pytest.approx(1.07)  # median of 1.08, 1.07, 0.50
    assert by[("vs best static k", 4, "all")]["ratio"] == pytest.approx(107 / 110)
    assert by[("vs largest static k at c=1", 1, "all")]["against"] == "dflash k=15"
    assert by[("category vs no speculation at c=1", 1, "math")]["pass"]
    calibration = {r["position"]: r for r in result["calibration"]}
    assert calibration[1]["pass"] and calibration[2]["pass"] is None  # 10 verifications: shown, not judged
    assert result["all_pass"]


def test_fails_below_a_bar():
    result = rep.evaluate(rep.collect([(r, round_docs(96.0)) for r in (1, 2, 3)]))
    failed = {(c["check"], c["concurrency"]) for c in result["checks"] if not c["pass"]}
    assert failed == {("vs no speculation", 4), ("vs best static k", 4)}
    assert not result["all_pass"]


def test_calibration_error_above_the_bar_fails():
    d = round_docs(108.0)
    d["results"][-1]["adaptive"] = calib(0.80, 0.70)
    result = rep.evaluate(rep.collect([(1, d)]))
    assert result["calibration"][0]["error"] == pytest.approx(0.10) and not result["calibration"][0]["pass"]
    assert not result["all_pass"]


def test_markdown_and_plot(tmp_path):
    collected = rep.collect([(1, round_docs(108.0))])
    result = rep.evaluate(collected)
    text = rep.markdown(result, "Some CPU", "load 1.0")
    assert "| vs no speculation | float32 | 4 | all | none | 1.08x | 1.08 | >= 0.97 | PASS |" in text
    assert "Overall: PASS" in text and "Machine: Some CPU" in text
    path = rep.plot(collected, result, str(tmp_path / "s.png"))
    assert open(path, "rb").read(8) == PNG_MAGIC


def test_control_engine_is_shown_beside_the_checks_not_judged_nor_a_static_k(tmp_path):
    """A second engine without speculation (none-control) at 0.90x of none: its row shows the
    comparison's noise, it is not taken for the best static k, and it does not fail the run."""
    docs = []
    for r, control in ((1, 90.0), (2, 93.0), (3, 104.0)):
        d = round_docs(108.0)
        d["results"] += [cell("none-control", None, "all", conc, control) for conc in (1, 4)]
        docs.append((r, d))
    collected = rep.collect(docs)
    result = rep.evaluate(collected)
    rows = [c for c in result["checks"] if c["check"].startswith("control")]
    assert [(c["concurrency"], c["pass"]) for c in rows] == [(1, None), (4, None)]
    assert rows[0]["ratio"] == pytest.approx(0.93) and rows[0]["rounds"] == pytest.approx([0.90, 0.93, 1.04])
    best = {c["concurrency"]: c for c in result["checks"] if c["check"] == "vs best static k"}
    assert best[4]["against"] == "best of dflash k=15, dflash k=3"
    assert best[4]["ratio"] == pytest.approx(108 / 110)
    assert result["all_pass"]
    text = rep.markdown(result)
    assert "| control: second engine without speculation | float32 | 4 | all | none | 0.93x | 0.90, 0.93, 1.04 | - | shown |" in text
    assert "Overall: PASS" in text
    assert open(rep.plot(collected, result, str(tmp_path / "c.png")), "rb").read(8) == PNG_MAGIC
