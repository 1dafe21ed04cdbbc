"""``tools/tokenizer_bench.py`` measures a new tokenizer's training through ``prepare``: a
1 MB sample yields one row whose numbers come from the run (the console's lines and the
sampled memory), filed with its environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "tokenizer_bench.py"


def test_one_small_sample_is_measured_and_filed(tmp_path):
    record = tmp_path / "tokenizer.json"
    subprocess.run(
        [sys.executable, str(TOOL), "--record", str(record), "--scratch", str(tmp_path / "s"),
         "--sample-mb", "1", "--kinds", "sentencepiece", "--vocab-size", "1000"],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    data = json.loads(record.read_text())
    (row,) = data["rows"]
    assert (row["tokenizer"], row["sample_mb"], row["sampled_mb"]) == ("SentencePiece BPE", 1, 1.0)
    assert row["train_s"] > 0 and row["wall_s"] >= row["train_s"]
    assert 0 < row["training_peak_rss_gib"] <= row["command_peak_rss_gib"]
    assert data["vocab_size"] == 1000 and "tokenizer_bench.py" in data["environment"]["command"]
    assert not any((tmp_path / "s").iterdir())  # each prepared directory is removed
