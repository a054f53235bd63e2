"""The small working directory the bad-input and ownership tests train in: four toy
questions (`toy.jsonl`) and a reward file (`reward.py`) whose score is the share of
lower-case ASCII letters in the response, so even the random tiny-test model gets a varied,
non-zero reward."""

from __future__ import annotations

import json
from pathlib import Path

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str or ""
    return sum(c.islower() and c.isascii() for c in text) / max(len(text), 1)
'''


def make_toy_files(tmp_path: Path, monkeypatch, reward: bool = True) -> Path:
    """chdir into `tmp_path` (appo's cache inside it) and write `toy.jsonl` (and
    `reward.py`)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "cache"))
    with open("toy.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"question": f"q{i}?", "answer": "7"}) + "\n")
    if reward:
        Path("reward.py").write_text(REWARD)
    return tmp_path
