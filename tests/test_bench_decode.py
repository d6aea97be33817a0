"""``eval/bench_decode.py`` end to end on the embedded model with tiny settings: the table has every
setting, the budget keeps fewer bytes than the full cache, and ``--profile`` writes an op table per
setting (what the next GPU session reads to find where the plain rows' time goes)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))


@pytest.mark.slow  # about 30 s: nine prefills and profiled decodes of the embedded model
@pytest.mark.smollm2
def test_bench_decode_table_and_profile(tmp_path, capsys):
    import bench_decode

    out = tmp_path / "profile.txt"
    assert bench_decode.main(["--contexts", "64", "--budget", "8", "--new", "3", "--chunk", "32", "--profile", str(out)]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 ") or line.startswith("| 8 ")]
    names = [r[1] for r in rows]
    assert names == ["full@B", "budget", "full", "plain", "bare"]
    mib = {r[1]: float(r[3]) for r in rows}
    assert mib["budget"] < mib["full"] == mib["plain"] == mib["bare"]
    text = out.read_text()
    sections = text.split("## N = ")[1:]
    assert [s.split("\n")[0] for s in sections] == ["8, full@B", "64, budget", "64, full", "64, plain", "64, bare"]
    for s in sections:
        assert "host time per step" in s and "aten::" in s and "Self CPU time total" in s
