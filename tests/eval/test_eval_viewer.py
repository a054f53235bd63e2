"""The rollout viewer: structure and escaping of the page, and the page in headless Chromium.

Two dumps: a hand-made one whose model output and tool results try to inject markup and
script, and a real `appo` rollout of the tiny model (branches included) written by
`write_jsonl`, as the trainer writes its dumps.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from appo.cli import main
from appo.errors import AppoError
from appo.eval.viewer import load_trajectories, render_html
from appo.models.tiny import build_tiny_tokenizer
from appo.rollout.records import Segment, ToolCallRecord, Trajectory, write_jsonl

CHROMIUM = Path("/usr/bin/chromium")
EVIL = "<img src=x onerror=\"console.error('xss')\"></script><script>console.error('xss')</script>"
TOK = build_tiny_tokenizer()


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def evil_dump() -> list[Trajectory]:
    """A root with a tool call and a branch of it (appo-style: split inside a segment)."""
    think, code = enc("<think>" + EVIL + "</think>"), enc("<python>print(1)</python>")
    result = enc(" <result>\n" + EVIL + "\n</result>")
    answer = enc("<answer>\\boxed{1}</answer>")
    ids = think + code + result + answer
    a, b = len(think + code), len(think + code + result)
    root = Trajectory(
        uid="p" + EVIL, traj_id="root" + EVIL, prompt_ids=enc("question " + EVIL),
        response_ids=ids, loss_mask=[1] * a + [0] * (b - a) + [1] * (len(ids) - b),
        logp_rollout=[-0.5] * len(ids),
        entropy=[float(i % 7) / 3 for i in range(a)] + [0.0] * (b - a) + [1.0] * (len(ids) - b),
        segments=[Segment(0, a, True, 1.0), Segment(a, b, False), Segment(b, len(ids), True, 0.5)],
        tool_calls=[ToolCallRecord("python", "print(1)" + EVIL, EVIL, True, result_start=a,
                                   result_end=b)],
        finish_reason="eos", reward=1.0, extra={"advantage": 0.5, "ground_truth": EVIL},
    )
    split = 5
    tail = enc("other " + EVIL)
    branch_ids = ids[: split + 1] + tail
    branch = Trajectory(
        uid=root.uid, traj_id="branch" + EVIL, prompt_ids=root.prompt_ids,
        response_ids=branch_ids, loss_mask=[0] * len(branch_ids),
        logp_rollout=[-0.1] * len(branch_ids), entropy=[2.0] * len(branch_ids),
        segments=[Segment(0, len(branch_ids), True, 2.0)], parent_id=root.traj_id,
        branch_token_index=split, is_branch=True, finish_reason="length", truncated=True,
        reward=0.0,
    )
    return [root, branch]


def tiny_appo_dump() -> list[Trajectory]:
    """A real appo rollout (2 prompts x (2 initial + 2 branches)) of the random tiny model."""
    import random

    from appo.models import load_model
    from appo.rollout import RolloutPrompt, RolloutSettings, rollout
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.scoring import hf_score_fn

    lm = load_model("tiny-test")
    engine = HFEngine(lm.model, lm.tokenizer, seed=0)
    settings = RolloutSettings(n=4, initial_rollouts=2, max_response_length=24)
    prompts = [RolloutPrompt(f"q{i}", enc(f"question {i}: ")) for i in range(2)]
    batch = rollout(prompts, engine, None, settings, strategy="appo",
                    rng=random.Random(0), score_fn=hf_score_fn(lm.model))
    for i, traj in enumerate(batch.trajectories):
        traj.reward = float(i % 2)
        if not traj.is_branch:
            traj.extra["advantage"] = 0.25 * i  # as the trainer writes it
    return batch.trajectories


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: dict[str, int] = {}
        self.traj_ids: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        attrs = dict(attrs)
        if "traj" in (attrs.get("class") or "").split():
            self.traj_ids.append(attrs["data-traj-id"])


def parse(page: str) -> _Collect:
    p = _Collect()
    p.feed(page)
    return p


def test_page_structure_and_escaping():
    trajs = evil_dump()
    page = render_html(trajs, TOK, title="t" + EVIL)
    p = parse(page)
    assert p.traj_ids == [t.traj_id for t in trajs]
    assert p.tags.get("img", 0) == 0 and p.tags["script"] == 1  # only the page's own script
    assert page.count("<script>") == 1 and html.escape(EVIL) in page
    # Reward, advantage (and "-" where the trainer wrote none), finish, the branch point.
    assert '<b class="reward">1.000</b>' in page and '<b class="adv">0.500</b>' in page
    assert '<b class="adv">-</b>' in page
    assert 'class="branch-point"' in page and 'class="child-mark" href="#t1"' in page
    assert 'branched from <a href="#t0">' in page
    assert "prefix shared with the parent (6 tokens)" in page
    assert page.count('<details class="tool ok">') == 1
    # Token spans carry entropy shading; forced result tokens are not marked untrained.
    assert 'title="#0 H=0.000' in page and "rgba(235,110,20," in page


def test_token_text_from_the_dump_needs_no_tokenizer():
    trajs = evil_dump()
    with pytest.raises(AppoError, match="--model"):
        render_html(trajs, None)
    for t in trajs:
        t.extra["token_text"] = [TOK.decode([i]) for i in t.response_ids]
        t.extra["prompt_text"] = "the prompt"
    page = render_html(trajs, None)
    assert parse(page).traj_ids == [t.traj_id for t in trajs]


def test_loading_dumps(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    write_jsonl(evil_dump(), path)
    with path.open("a") as f:  # a newer writer's extra field is kept, not rejected
        data = evil_dump()[0].to_dict() | {"traj_id": "x", "new_field": 3}
        f.write(json.dumps(data) + "\n")
    trajs = load_trajectories([tmp_path])
    assert [t.traj_id for t in trajs][-1] == "x" and trajs[-1].extra["new_field"] == 3
    (tmp_path / "bad.jsonl").write_text('{"samples": 1}\n')
    with pytest.raises(AppoError, match="bad.jsonl:1: not a trajectory"):
        load_trajectories([tmp_path / "bad.jsonl"])
    with pytest.raises(AppoError, match="not found"):
        load_trajectories([tmp_path / "missing.jsonl"])


# ---------------------------------------------------------------- headless Chromium
def _chromium_installed(wait_s: float = 900.0) -> bool:
    """Whether Debian's chromium is there; while `.ci/run` still installs it beside the
    suite (its marker file, $APPO_CHROMIUM_INSTALLING, exists) wait for the install to end."""
    marker = os.environ.get("APPO_CHROMIUM_INSTALLING")
    deadline = time.monotonic() + wait_s
    while marker and Path(marker).exists() and time.monotonic() < deadline:
        time.sleep(1.0)
    return CHROMIUM.exists()


@pytest.fixture
def _chromium_ready():
    if not _chromium_installed():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")


needs_chromium = pytest.mark.usefixtures("_chromium_ready")


def chromium(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
           "--enable-logging=stderr", "--v=0", *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def console_messages(stderr: str) -> list[str]:
    """Console output and uncaught errors, as Chromium logs them with --enable-logging."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


@needs_chromium
def test_console_capture_sees_errors(tmp_path):
    """The check below is not vacuous: a page with errors is caught."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><p>x</p><script>console.error('boom'); nope();</script>")
    run = chromium(page, tmp_path, "--dump-dom")
    messages = console_messages(run.stderr)
    assert any("boom" in m for m in messages) and any("Uncaught" in m for m in messages)


@needs_chromium
def test_report_in_headless_chromium(tmp_path):
    evil, real = tmp_path / "evil.jsonl", tmp_path / "appo_rollout.jsonl"
    write_jsonl(evil_dump(), evil)
    real_trajs = tiny_appo_dump()
    assert sum(t.is_branch for t in real_trajs) == 4  # the tree has branches to draw
    write_jsonl(real_trajs, real)
    report = tmp_path / "report.html"
    assert main(["view", str(evil), str(real), "-o", str(report), "--model", "tiny-test"]) == 0

    run = chromium(report, tmp_path, "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    assert console_messages(run.stderr) == []
    dom = parse(run.stdout)
    expected = [t.traj_id for t in load_trajectories([evil, real])]
    assert sorted(dom.traj_ids) == sorted(expected) and len(dom.traj_ids) == 10
    assert dom.tags.get("img", 0) == 0 and dom.tags["script"] == 1

    shot = tmp_path / "report.png"
    run = chromium(report, tmp_path, f"--screenshot={shot}", "--window-size=1280,2000")
    assert run.returncode == 0 and console_messages(run.stderr) == []
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_parallel_native_calls_show_in_one_tool_turn():
    # tools.format=hermes: two calls answered by one forced tool turn share its span.
    call = enc('<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>')
    turn = call + call + [TOK.eos_token_id]
    forced = enc("\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n"
                 "2\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    answer = enc("<answer>\\boxed{1}</answer>") + [TOK.eos_token_id]
    ids = turn + forced + answer
    a, b = len(turn), len(turn + forced)
    traj = Trajectory(
        uid="p", traj_id="t", prompt_ids=enc("q"), response_ids=ids,
        loss_mask=[1] * a + [0] * (b - a) + [1] * (len(ids) - b),
        logp_rollout=[0.0] * len(ids), entropy=[0.0] * len(ids),
        segments=[Segment(0, a, True, 1.0), Segment(a, b, False), Segment(b, len(ids), True)],
        tool_calls=[ToolCallRecord("python", "print(1)", "1", True, result_start=a,
                                   result_end=b),
                    ToolCallRecord("python", "print(2)", "2", False, "limit", result_start=a,
                                   result_end=b)],
        finish_reason="eos")
    page = render_html([traj], TOK)
    assert page.count('<details class="tool') == 1  # one tool turn
    assert "python call 1 [ok" in page and "python call 2 [limit" in page
    assert '<details class="tool err">' in page  # not every call of the turn succeeded
