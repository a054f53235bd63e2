"""The hf engine on tiny-test: KV-cache reuse/forks are exact, counters, stops, sampling.

The reference for every cache test is one full forward pass over the row's final token ids
with no cache at all: the log-prob the engine recorded for each sampled token must equal
the full-forward log-prob of that token (float32, max abs diff < 1e-4).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from rollout_fakes import Recorder, full_logits

from appo.models import load_model
from appo.rollout import hf_batch, hf_engine
from appo.rollout.hf_engine import HFEngine
from appo.rollout.sampling import SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-test", device="cpu")


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "model-forward"])
def test_cache_reuse_forks_and_tool_rounds_match_full_forward(lm, lean):
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=3, lean_forward=lean)
    assert (eng._lean is not None) == lean
    rec = Recorder(eng)
    params = SamplingParams()
    # Prompts of very different lengths: heavy left padding in the shared batch.
    roots = [eng.add_row(tok.encode(t)) for t in ("A much longer prompt, with punctuation!",
                                                  "Hi", "Medium prompt")]
    rows = rec.fork(roots[0], 3) + rec.fork(roots[1], 2) + rec.fork(roots[2], 1)
    # Different budgets: rows stop at different steps, so compaction runs mid-loop.
    rec.decode(rows, [3, 17, 9, 25, 1, 12], params)
    # Tool round: forced results of different lengths on some rows, then branches.
    eng.append(rows[0], tok.encode(" <result>\n42\n</result>"))
    eng.append(rows[3], tok.encode(" <result>\na much longer tool result text\n</result>"))
    kids = rec.fork(rows[0], 2) + rec.fork(rows[3], 1)
    rec.decode(rows + kids, [10, 4, 7, 12, 6, 9, 11, 8, 5], params)
    # An appo-style fork from the middle of a finished row.
    mid = len(eng.row_ids(rows[1])) - 6
    [late] = rec.fork(rows[1], 1, at=mid)
    rec.decode([late, rows[2]], [15, 6], params)
    for r in rows + kids + [late]:
        assert rec.max_error(lm.model, r) < TOL, r


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=0.9, top_p=0.8, top_k=50, repetition_penalty=1.3),
    ],
)
def test_recorded_logp_is_under_the_sampling_distribution(lm, params):
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=5)
    rec = Recorder(eng)
    root = eng.add_row(tok.encode("Sampling with processors"))
    rows = rec.fork(root, 3)
    rec.decode(rows, [20, 14, 8], params)
    eng.append(rows[0], tok.encode(" <result>\n7\n</result>"))
    rec.decode(rows, [6, 6, 6], params)
    for r in rows:
        assert rec.max_error(lm.model, r, params) < TOL


def test_sampled_tokens_lie_in_the_top_k_set(lm):
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=0)
    params = SamplingParams(temperature=1.0, top_k=3)
    rows = eng.fork(eng.add_row(tok.encode("top k")), 4)
    eng.decode(rows, [12] * 4, params)
    for r in rows:
        ids = eng.row_ids(r)
        logits = full_logits(lm.model, ids)
        for pos in range(len(ids) - 12, len(ids)):
            assert ids[pos] in torch.topk(logits[pos - 1], 3).indices.tolist()


def test_shared_prefill_and_counters(lm):
    tok = lm.tokenizer
    prompt = tok.encode("one shared prompt prefilled once")
    eng = HFEngine(lm.model, tok, seed=0)
    rows = eng.fork(eng.add_row(prompt), 5)
    eng.decode(rows, [4] * 5, SamplingParams())
    # The prompt is computed once for the group; the other 4 rows reuse it.
    assert eng.counters.prefilled == len(prompt)
    assert eng.counters.reused == 4 * len(prompt)
    # Each row: 4 sampled tokens, the first from the prefill's logits, 3 decode steps.
    assert eng.counters.decoded == 5 * 3
    # A tool result shared by a row and its branch is prefilled once for both.
    result = tok.encode(" <result>\nok\n</result>")
    eng.append(rows[0], result)
    kids = eng.fork(rows[0], 2)
    before = eng.counters.prefilled
    eng.decode([rows[0], *kids], [2] * 3, SamplingParams())
    # pending = last sampled token + result; one computation for the three rows
    assert eng.counters.prefilled - before == 1 + len(result)
    # Branches from the middle of a row (appo), made in one fork: they share the truncated
    # cache, so their one pending token is computed once for all three.
    at = len(prompt) + 2
    late = eng.fork(rows[1], 3, at=at)
    before = eng.counters.prefilled, eng.counters.reused
    eng.decode(late, [1] * 3, SamplingParams())
    assert eng.counters.prefilled - before[0] == 1
    assert eng.counters.reused - before[1] == 3 * (at - 1) + 2


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "model-forward"])
def test_different_prompts_share_their_common_prefix(lm, lean):
    tok = lm.tokenizer
    system = tok.encode("A system prompt that every question of the batch starts with. ")
    questions = [tok.encode(q) for q in ("What is 2+2?", "Name a colour, please.", "Hi")]
    eng = HFEngine(lm.model, tok, seed=1, lean_forward=lean)
    rec = Recorder(eng)
    roots = [eng.add_row(system + q) for q in questions]
    eng.prefill(roots)
    # The system prompt is computed once; each prompt adds only its question but the last
    # token (prefill leaves one pending token per row).
    assert eng.counters.prefilled == len(system) + sum(len(q) - 1 for q in questions)
    assert eng.counters.prefilled + eng.counters.reused == sum(
        len(system) + len(q) - 1 for q in questions)
    rows = [r for root in roots for r in rec.fork(root, 2)]
    rec.decode(rows, [6, 9, 3, 12, 7, 5], SamplingParams())
    for r in rows:
        assert rec.max_error(lm.model, r) < TOL, r
    # Rows without a prefill (decode directly) share the prefix the same way.
    eng2 = HFEngine(lm.model, tok, seed=1, lean_forward=lean)
    rec2 = Recorder(eng2)
    direct = [eng2.add_row(system + q) for q in questions]
    rec2.decode(direct, [5, 5, 5], SamplingParams())
    assert eng2.counters.prefilled == len(system) + sum(len(q) for q in questions)
    for r in direct:
        assert rec2.max_error(lm.model, r) < TOL, r


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "model-forward"])
def test_rows_store_a_shared_prefix_once(lm, lean):
    """Rows that leave a decode call, and prompts a prefill caches, keep their own tokens'
    keys/values on top of one block of the prefix they all share (a system prompt): one
    copy of it, not one per row; their caches still equal a full forward's, through a
    tool round and another decode (which writes parent and own columns into the batch)."""
    tok = lm.tokenizer
    system = tok.encode("You are a careful assistant who answers every question. " * 4)
    assert len(system) >= hf_engine.MIN_CASCADE_PREFIX
    questions = [tok.encode(q) for q in ("What is 2+2?", "Name a colour, please.", "Hi")]

    def own_bytes(kv):
        return kv.data.untyped_storage().nbytes()

    eng = HFEngine(lm.model, tok, seed=2, lean_forward=lean)
    per_token = eng.num_layers * 2 * eng.kv_heads * eng.head_dim * 4  # float32 K and V
    rec = Recorder(eng)
    rows = [eng.add_row(system + q) for q in questions]
    rec.decode(rows, [4, 9, 6], SamplingParams())
    blocks = [eng.rows[r].kv for r in rows]
    shared = blocks[0].parent
    assert shared is not None and shared.parent is None
    assert all(kv.parent is shared for kv in blocks)  # one copy of the prefix
    assert shared.length >= len(system)
    assert own_bytes(shared) == shared.length * per_token
    for r, kv in zip(rows, blocks, strict=True):
        assert kv.length == len(eng.row_ids(r)) - 1
        assert own_bytes(kv) == (kv.length - shared.length) * per_token
        assert rec.max_error(lm.model, r) < TOL, r
    eng.append(rows[1], tok.encode(" <result>\n4\n</result>"))
    kids = rec.fork(rows[1], 2)
    rec.decode([rows[1], *kids, rows[2]], [5, 7, 3, 6], SamplingParams())
    for r in [*rows, *kids]:
        assert rec.max_error(lm.model, r) < TOL, r
    # A prefill of prompts under one system prompt: each keeps its question on top of the
    # common prefix's block.
    eng2 = HFEngine(lm.model, tok, seed=2, lean_forward=lean)
    roots = [eng2.add_row(system + q) for q in questions]
    eng2.prefill(roots)
    root_blocks = [eng2.rows[r].kv for r in roots]
    assert root_blocks[0].parent is not None
    assert all(kv.parent is root_blocks[0].parent for kv in root_blocks)
    assert sum(map(own_bytes, root_blocks)) == sum(
        (kv.length - kv.parent.length) * per_token for kv in root_blocks)
    rec2 = Recorder(eng2)
    forks = [r for root in roots for r in rec2.fork(root, 2)]
    rec2.decode(forks, [3, 5, 4, 6, 2, 5], SamplingParams())
    for r in forks:
        assert rec2.max_error(lm.model, r) < TOL, r


def test_no_reuse_mode_recomputes_every_context(lm):
    tok = lm.tokenizer
    prompt = tok.encode("baseline")
    eng = HFEngine(lm.model, tok, seed=0, reuse_cache=False)
    rec = Recorder(eng)
    rows = rec.fork(eng.add_row(prompt), 3)
    rec.decode(rows, [5] * 3, SamplingParams())
    assert eng.counters.prefilled == 3 * len(prompt)
    eng.append(rows[0], tok.encode(" <result>\nx\n</result>"))
    total = sum(len(eng.row_ids(r)) for r in rows)
    before = eng.counters.prefilled
    rec.decode(rows, [5] * 3, SamplingParams())
    assert eng.counters.prefilled - before == total
    for r in rows:
        assert rec.max_error(lm.model, r) < TOL


def test_eos_and_budget_finish(lm):
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=0)
    rows = eng.fork(eng.add_row(tok.encode("x")), 2)
    outs = eng.decode(rows, [0, 7], SamplingParams())
    assert outs[0].token_ids == [] and outs[0].finish == "length"
    assert len(outs[1].token_ids) <= 7
    if outs[1].finish == "length":
        assert len(outs[1].token_ids) == 7
    # EOS: bias the model so EOS is certain after the first token.
    eos = tok.eos_token_id

    class EosHead(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.weight = inner.weight

        def forward(self, h):
            out = self.inner(h).clone()
            out[..., eos] += 100.0
            return out

    head = lm.model.lm_head
    lm.model.lm_head = EosHead(head)
    try:
        eng2 = HFEngine(lm.model, tok, seed=0)
        [r] = eng2.fork(eng2.add_row(tok.encode("y")), 1)
        [out] = eng2.decode([r], [10], SamplingParams())
    finally:
        lm.model.lm_head = head
    assert out.token_ids == [eos] and out.finish == "eos"


def _two_token_stop(tok, ids: list[int]) -> tuple[int, str] | None:
    """An index i and the text of ids[i-1:i+1] usable as a 2-token stop string."""
    for i in range(3, len(ids)):
        text = tok.decode(ids[i - 1 : i + 1])
        if (len(text) == 2 and text.isascii() and text.isprintable() and not text.isspace()
                and text not in tok.decode(ids[:i])):
            return i, text
    return None


def test_engine_stops_on_a_multi_token_stop_string(lm):
    tok = lm.tokenizer
    prompt = tok.encode("Stop strings span several tokens.")
    params = SamplingParams(temperature=1.0)
    eng = HFEngine(lm.model, tok, seed=11)
    [r] = eng.fork(eng.add_row(prompt), 1)
    [out] = eng.decode([r], [200], params)
    found = _two_token_stop(tok, out.token_ids)
    assert found is not None, "sampled output of tiny-test has no printable 2-char pair"
    i, stop = found
    # Same seed, same single row: the same tokens, now cut at the stop string.
    eng2 = HFEngine(lm.model, tok, stop_strings=[stop], seed=11)
    [r2] = eng2.fork(eng2.add_row(prompt), 1)
    [o] = eng2.decode([r2], [200], params)
    assert o.finish == "stop" and o.stop_string == stop
    assert o.token_ids == out.token_ids[: i + 1]  # the completing token is kept


def test_stop_is_detected_only_in_the_current_segment(lm):
    """A closing tag inside the prompt or a tool result must not stop the next segment."""
    from appo.rollout.stops import StopChecker

    tok = lm.tokenizer
    checker = StopChecker(tok, ["</calc>"], frozenset({tok.eos_token_id}))
    ids = tok.encode("x = 1 </calc> tail")
    assert len(tok.encode("</calc>")) == 7  # byte-level: a 7-token stop string
    hits = [checker.check(ids[: k + 1]) for k in range(len(ids))]
    end = len(tok.encode("x = 1 </calc>")) - 1
    assert hits[end] == "</calc>"
    assert all(h is None for k, h in enumerate(hits) if k != end)
    assert checker.check(tok.encode(" after")) is None


def test_unwritten_cache_columns_are_never_read(lm, monkeypatch):
    """Fill every new cache buffer with NaN: a padding or unwritten column that reached the
    attention (even masked: 0 * NaN = NaN) would make the recorded log-probs NaN."""
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=9, capacity_chunk=8)  # small chunks: buffers grow
    original = eng._alloc

    def nan_alloc(rows, capacity):
        return original(rows, capacity).fill_(float("nan"))

    monkeypatch.setattr(eng, "_alloc", nan_alloc)
    rec = Recorder(eng)
    roots = [eng.add_row(tok.encode(t)) for t in ("a longer first prompt", "b")]
    eng.prefill(roots)
    rows = rec.fork(roots[0], 2) + rec.fork(roots[1], 2)
    rec.decode(rows, [3, 20, 11, 6], SamplingParams())
    eng.append(rows[1], tok.encode(" <result>\nnan check\n</result>"))
    kids = rec.fork(rows[1], 2)
    rec.decode(rows + kids, [9, 4, 13, 2, 7, 16], SamplingParams())
    for r in rows + kids:
        err = rec.max_error(lm.model, r)
        assert err == err and err < TOL  # not NaN, and exact


def test_engine_leaves_the_trainer_model_untouched_and_follows_weight_updates(lm):
    tok = lm.tokenizer
    model = lm.model
    eng = HFEngine(model, tok, seed=2, transpose_weights=True)
    rec = Recorder(eng)
    rows = rec.fork(eng.add_row(tok.encode("weights")), 2)
    rec.decode(rows, [5, 5], SamplingParams())
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears and all("forward" not in m.__dict__ for m in linears)
    # Gradients still reach the weights through the untouched modules.
    out = model(torch.tensor([eng.row_ids(rows[0])])).logits.sum()
    out.backward()
    assert linears[0].weight.grad is not None
    model.zero_grad()
    # An in-place update (as an optimizer step does) is seen by the next decode.
    _next_decode_sees_an_update(eng, rec, model, model.model.layers[0].mlp.down_proj, 3.0)


def _next_decode_sees_an_update(eng, rec, model, target, factor: float) -> None:
    """Scale `target`'s weight in place (as an optimizer step writes it): the next decode
    matches the updated model, and not the old one; the weight is restored after."""
    tok = eng.tokenizer
    with torch.no_grad():
        saved = target.weight.clone()
        target.weight.mul_(factor)
    try:
        fresh = rec.fork(eng.add_row(tok.encode("after the update")), 1)
        rec.decode(fresh, [8], SamplingParams())
        assert rec.max_error(model, fresh[0]) < TOL  # matches the updated model
        with torch.no_grad():
            target.weight.copy_(saved)
        assert rec.max_error(model, fresh[0]) > 1e-3  # ...and not the old one
    finally:
        with torch.no_grad():
            target.weight.copy_(saved)


def test_lean_decode_checks_the_weights_once_per_call_and_follows_updates(lm, monkeypatch):
    # The lean decoder's weight check walks every parameter; a decode call does it once
    # (its steps change no weight), and the next call still sees an in-place update.
    from appo.rollout.cpu.lean import LeanDecoder

    tok, model = lm.tokenizer, lm.model
    eng = HFEngine(model, tok, seed=3)
    assert eng._lean is not None
    walks = []
    real = LeanDecoder._version_key
    monkeypatch.setattr(LeanDecoder, "_version_key",
                        lambda self: walks.append(1) or real(self))
    rec = Recorder(eng)
    rows = rec.fork(eng.add_row(tok.encode("pinned weights")), 2)
    outs = rec.decode(rows, [12, 12], SamplingParams())
    assert max(len(o.token_ids) for o in outs) >= 6  # enough steps to tell the two apart
    assert 1 <= len(walks) <= 3  # prefill and the decode loop's one check, not per step
    _next_decode_sees_an_update(eng, rec, model, model.model.layers[1].self_attn.o_proj, 2.0)
    assert not eng._lean._pinned  # the block ended


def test_the_engine_decodes_with_the_weights_a_fused_adamw_step_wrote():
    # torch's fused CPU AdamW (the trainer's default there) writes the parameters without
    # bumping their versions; appo's optimizer bumps them, so the engine repacks its copies.
    from appo.trainer.optim import adamw

    lm = load_model("tiny-test", device="cpu")  # its own copy: this test trains it
    model, tok = lm.model, lm.tokenizer
    eng = HFEngine(model, tok, seed=4)
    rec = Recorder(eng)
    rec.decode(rec.fork(eng.add_row(tok.encode("before the step")), 2), [6, 6],
               SamplingParams())
    opt = adamw(model.parameters(), lr=0.05, fused=True)
    model(torch.tensor([tok.encode("a loss to step on")])).logits.pow(2).mean().backward()
    opt.step()
    fresh = rec.fork(eng.add_row(tok.encode("after the step")), 1)
    rec.decode(fresh, [8], SamplingParams())
    assert rec.max_error(model, fresh[0]) < TOL  # the updated weights, not stale copies


def test_cascade_attention_over_a_shared_prefix_matches_full_forward(lm):
    # Rows share a prefix longer than MIN_CASCADE_PREFIX (a group's prompt, and under it a
    # second prompt with the same start), so decode attention reads the prefix once.
    from appo.rollout.hf_engine import MIN_CASCADE_PREFIX

    tok = lm.tokenizer
    system = tok.encode("You are a careful assistant. " * 12)
    assert len(system) > MIN_CASCADE_PREFIX
    prompts = [system + tok.encode(" Question one?"), system + tok.encode(" Two: what now")]
    runs = {}
    for cascade in (True, False):
        eng = HFEngine(lm.model, tok, seed=5, cascade_attention=cascade)
        used = []
        original = eng._forward

        def spy(*args, _orig=original, _used=used):
            _used.append(len(args) > 4 and args[4] is not None)
            return _orig(*args)

        eng._forward = spy
        rec = Recorder(eng)
        rows = rec.fork(eng.add_row(prompts[0]), 3) + rec.fork(eng.add_row(prompts[1]), 2)
        # Different budgets: rows leave the batch mid-loop (compaction keeps the prefix).
        rec.decode(rows, [6, 20, 11, 3, 16], SamplingParams())
        eng.append(rows[1], tok.encode(" <result>\n7\n</result>"))
        rec.decode(rows[1:3], [9, 5], SamplingParams())
        assert any(used) == cascade
        for r in rows:
            assert rec.max_error(lm.model, r) < TOL, r
        runs[cascade] = [eng.row_ids(r) for r in rows]
    assert runs[True] == runs[False]  # same seed, same tokens: only the arithmetic differs


@pytest.mark.parametrize("name", ["torch", "torch_weight_first", "numba", "numba_wide"])
def test_decode_steps_match_full_forward_with_every_matmul_implementation(lm, name,
                                                                         monkeypatch):
    from appo.rollout.cpu import kernels, matmuls

    impl = matmuls.IMPLEMENTATIONS[name]
    if impl.kernel and not kernels.available():
        pytest.skip("numba CPU kernels are not available")
    calls = []

    def spy(x, weight, bias=None):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return impl.linear(x, weight, bias)

    monkeypatch.setitem(matmuls.IMPLEMENTATIONS, name,
                        matmuls.Implementation(name, spy, impl.head, impl.kernel))
    monkeypatch.setenv(matmuls.FORCE_ENV, name)
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=4)
    rec = Recorder(eng)
    # 14 rows from two prompts, shrinking to one as their budgets run out.
    rows = rec.fork(eng.add_row(tok.encode("kernel check")), 9) + rec.fork(
        eng.add_row(tok.encode("and another prompt")), 5)
    rec.decode(rows, [2, 4, 6, 8, 10, 12, 14, 3, 5, 7, 9, 11, 13, 15], SamplingParams())
    for r in rows:
        assert rec.max_error(lm.model, r) < TOL, r
    # Decode steps (and only they: prefill is torch's) ran the forced implementation.
    assert calls and max(calls) == 14 and min(calls) <= 2


def test_each_decode_step_runs_the_implementation_its_rule_names(lm, monkeypatch, tmp_path):
    from appo.rollout.cpu import matmuls

    monkeypatch.setenv(matmuls.FORCE_ENV, "1:torch_weight_first,5:torch")
    monkeypatch.setenv("APPO_CACHE", str(tmp_path))
    used: list[tuple[str, int]] = []
    for name in ("torch", "torch_weight_first"):
        impl = matmuls.IMPLEMENTATIONS[name]

        def spy(x, weight, bias=None, impl=impl):
            used.append((impl.name, x.reshape(-1, x.shape[-1]).shape[0]))
            return impl.linear(x, weight, bias)

        monkeypatch.setitem(matmuls.IMPLEMENTATIONS, name,
                            matmuls.Implementation(name, spy, impl.head))
    tok = lm.tokenizer
    # compact_fraction=0: a row that stops leaves the batch at once, so the 8 rows shrink
    # by one per decode step.
    eng = HFEngine(lm.model, tok, seed=1, cpu_kernel=False, compact_fraction=0.0)
    rows = eng.fork(eng.add_row(tok.encode("which matmuls")), 8)
    eng.decode(rows, [2, 3, 4, 5, 6, 7, 8, 9], SamplingParams())
    # Steps of <= 4 rows ran W @ x^T, larger ones F.linear.
    assert set(used) == {("torch", r) for r in range(5, 9)} | {
        ("torch_weight_first", r) for r in range(1, 5)}
    assert not any(tmp_path.iterdir())  # nothing measured, nothing kept on disk


def test_cpu_kernel_can_be_switched_off_by_environment(lm, monkeypatch):
    from appo.errors import AppoError
    from appo.rollout.cpu import kernels

    monkeypatch.setenv("APPO_CPU_KERNELS", "0")
    assert not kernels.available()
    lean = HFEngine(lm.model, lm.tokenizer)._lean
    assert not lean.cpu_kernel and not lean.rule.kernels
    with pytest.raises(AppoError, match="cpu_kernel=True needs numba"):
        HFEngine(lm.model, lm.tokenizer, cpu_kernel=True)


WITHOUT_NUMBA = """
import sys
sys.modules["numba"] = None  # `import numba` now raises ImportError, as on an install without it
sys.path.insert(0, sys.argv[1])
from rollout_fakes import Recorder
from appo.errors import AppoError
from appo.models import load_model
from appo.rollout.cpu import kernels
from appo.rollout.hf_engine import HFEngine
from appo.rollout.sampling import SamplingParams

assert kernels.numba is None and not kernels.available()
lm = load_model("tiny-test", device="cpu")
tok = lm.tokenizer
eng = HFEngine(lm.model, tok, seed=4)
assert eng._lean is not None and not eng._lean.rule.kernels, eng._lean.rule
rec = Recorder(eng)
rows = rec.fork(eng.add_row(tok.encode("no numba here")), 6)
outs = rec.decode(rows, [3, 5, 7, 9, 11, 13], SamplingParams())
assert [len(o.token_ids) for o in outs] == [3, 5, 7, 9, 11, 13]
print(max(rec.max_error(lm.model, r) for r in rows))
try:
    HFEngine(lm.model, tok, cpu_kernel=True)
except AppoError as e:
    print("refused:", e)
"""


def test_without_numba_the_engine_decodes_exactly_with_torch(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    script = tmp_path / "without_numba.py"
    script.write_text(WITHOUT_NUMBA)
    done = subprocess.run([sys.executable, str(script), str(here)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    error, refused = done.stdout.strip().splitlines()
    assert float(error) < TOL
    assert refused.startswith("refused: cpu_kernel=True needs numba")


def test_decode_frees_every_batch_buffer_and_rows_keep_only_their_tokens(lm, monkeypatch):
    """Memory: the buffers a decode call allocates (the prefill's, each compaction's and
    growth's) are gone when it returns, and at most two are alive at once (the old and new
    one of a compaction or growth); every row keeps a copy of exactly its own tokens' keys
    and values. Rows keeping views of a batch buffer instead kept each whole buffer alive:
    with a compaction every 25 % of stopped rows, buffers of 1, 3/4, 9/16... of the batch
    stacked up (about 4x the first) and stayed until the rows were released."""
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=4, capacity_chunk=8)  # small chunks: buffers grow
    alive: list[weakref.ref] = []
    most = [0]

    def tracked(tensor):
        alive.append(weakref.ref(tensor))
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return tensor

    alloc, gather = eng._alloc, hf_batch.gather_rows
    monkeypatch.setattr(eng, "_alloc", lambda *a: tracked(alloc(*a)))
    for module in (hf_batch, hf_engine):
        monkeypatch.setattr(module, "gather_rows", lambda *a: tracked(gather(*a)))
    rec = Recorder(eng)
    roots = [eng.add_row(tok.encode(t)) for t in ("first prompt of three", "second", "3rd")]
    eng.prefill(roots)
    rows = [r for root in roots for r in rec.fork(root, 4)]
    # Budgets 1..23: rows stop one after another, so several compactions run.
    rec.decode(rows, [1 + 2 * i for i in range(12)], SamplingParams())
    eng.append(rows[-1], tok.encode(" <result>\n7\n</result>"))
    kids = rec.fork(rows[-1], 2)
    rec.decode([rows[-1], *kids, rows[0]], [9, 14, 5, 11], SamplingParams())
    gc.collect()
    assert len(alive) >= 6  # prefills, compactions and growths all ran
    assert most[0] <= 2
    assert all(r() is None for r in alive)
    per_token = eng.num_layers * 2 * eng.kv_heads * eng.head_dim * 4  # float32 K and V
    for r in rows + kids:
        kv = eng.rows[r].kv
        assert kv.length == len(eng.row_ids(r)) - 1  # all but the pending last token
        assert kv.data.untyped_storage().nbytes() == kv.length * per_token
        assert rec.max_error(lm.model, r) < TOL, r


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "model-forward"])
def test_prefill_computes_logits_for_the_last_position_only(lm, lean):
    """Memory: logits over the whole prompt (`[rows, prompt_len, vocab]` float32) would be
    SmolLM2's largest tensor by far (32 rows x 300 tokens x 49152 x 4 bytes = 1.9 GB). Every
    tensor any operation makes during a prefill and a decode, of vocabulary width, must
    hold at most one vector per row (views of the weights aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = lm.model.get_output_embeddings().weight.shape[0]
    seen: list[tuple[int, int]] = []  # (vectors, storage) of every vocabulary-wide tensor

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == vocab:
                    seen.append((t.numel() // vocab, t.untyped_storage().data_ptr()))
            return out

    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=2, lean_forward=lean)
    prompts = [tok.encode(f"A prompt of some forty tokens or so, number {i}.") for i in range(3)]
    assert min(len(p) for p in prompts) > 30
    roots = [eng.add_row(p) for p in prompts]
    with Watch():
        eng.prefill(roots)
        eng.decode([eng.fork(r, 1)[0] for r in roots], [3, 4, 5], SamplingParams())
    # The weights and the engine's transposed copy of them (model forward on CPU) aside.
    weights = {p.untyped_storage().data_ptr() for p in lm.model.parameters()}
    if eng._linears is not None:
        weights |= {c[2].untyped_storage().data_ptr() for c in eng._linears._copies.values()}
    widest = max(n for n, ptr in seen if ptr not in weights)
    assert 0 < widest <= len(roots)
