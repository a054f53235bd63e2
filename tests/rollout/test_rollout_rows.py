"""The row table every engine keeps its rows in: add, fork (with truncation and segment
starts), forced tokens, copies out, release; and the hf engine's rows, whose forks keep the
part of the parent's KV block their tokens cover."""

from __future__ import annotations

import pytest
import torch
from rollout_fakes import tiny_tokenizer

from appo.errors import AppoError
from appo.http import JsonClient
from appo.rollout.engine import Engine
from appo.rollout.hf_batch import HFRow, KVBlock
from appo.rollout.openai_engine import OpenAICompletionsEngine
from appo.rollout.rows import Row, RowTable, TableRows, fork_point
from appo.rollout.vllm_engine import VLLMEngine


def test_a_root_row_copies_the_prompt_and_starts_its_segment_after_it():
    table = RowTable()
    prompt = [5, 6, 7]
    rid = table.add(prompt)
    prompt.append(8)  # the caller's list is not the row
    assert table[rid] == Row([5, 6, 7], 3)
    out = table.ids(rid)
    out.append(9)  # nor is the copy handed out
    assert table.ids(rid) == [5, 6, 7]
    with pytest.raises(AppoError, match="empty prompt"):
        table.add([])


def test_forks_are_independent_copies_with_new_ids():
    table = RowTable()
    root = table.add([1, 2, 3])
    table.append(root, [4, 5])
    kids = table.fork(root, 3)
    assert len(set(kids) | {root}) == 4
    assert all(table[k] == Row([1, 2, 3, 4, 5], 5) for k in kids)
    table.append(kids[0], [6])
    table[kids[1]].ids.append(7)  # decode extends a row in place
    assert table.ids(root) == [1, 2, 3, 4, 5]
    assert [table.ids(k) for k in kids] == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7],
                                            [1, 2, 3, 4, 5]]


def test_a_fork_can_truncate_and_move_the_segment_start():
    table = RowTable()
    root = table.add([1, 2, 3])  # segment starts at 3
    table[root].ids.extend([10, 11, 12, 13])  # sampled: the segment is 10..13
    [mid] = table.fork(root, at=5)  # inside the segment: it still starts at 3
    [early] = table.fork(root, at=2)  # inside the prompt: the segment moves back to 2
    [split] = table.fork(root, at=6, segment_start=5)  # appo: resumes mid-segment
    [whole] = table.fork(root, at=7)
    assert table[mid] == Row([1, 2, 3, 10, 11], 3)
    assert table[early] == Row([1, 2], 2)
    assert table[split] == Row([1, 2, 3, 10, 11, 12], 5)
    assert table[whole] == Row([1, 2, 3, 10, 11, 12, 13], 3)
    for at in (0, 8):
        with pytest.raises(AppoError, match=f"fork position {at} outside row of 7 tokens"):
            table.fork(root, at=at)
    assert fork_point([1, 2, 3], 3, None, None) == ([1, 2, 3], 3)


def test_forced_tokens_start_a_new_segment():
    table = RowTable()
    rid = table.add([1, 2])
    table[rid].ids.extend([3, 4])
    table.append(rid, torch.tensor([9, 8]))  # ids as a tensor: stored as Python ints
    assert table[rid] == Row([1, 2, 3, 4, 9, 8], 6)
    assert all(type(t) is int for t in table[rid].ids)


def test_released_rows_are_gone_and_their_ids_never_come_back():
    table = RowTable()
    a, b = table.add([1]), table.add([2])
    table.release([a, 12345])  # an unknown id is ignored
    table.release([a])  # and so is a second release
    assert len(table) == 1 and a not in table and b in table and list(table) == [b]
    for op in (lambda: table[a], lambda: table.ids(a), lambda: table.fork(a),
               lambda: table.append(a, [1]), lambda: table.many([b, a])):
        with pytest.raises(AppoError, match=f"engine row {a} does not exist"):
            op()
    c = table.add([3])
    assert c not in (a, b)
    assert [r.ids for r in table.many([c, b])] == [[3], [2]]


def test_hf_rows_fork_with_the_part_of_the_kv_block_their_tokens_cover():
    block = KVBlock(torch.arange(2 * 2 * 1 * 6 * 1.0).reshape(2, 2, 1, 6, 1))
    table: RowTable[HFRow] = RowTable(HFRow)
    root = table.add([1, 2, 3, 4, 5, 6, 7])  # 6 cached, the last pending
    table[root].kv = block
    assert table[root].kv_len == 6
    [same] = table.fork(root)
    cut, cut2 = table.fork(root, 2, at=4)
    [edge] = table.fork(root, at=7)
    assert table[same].kv is block and table[edge].kv is block  # shared, not copied
    assert table[cut].kv_len == 3  # 4 tokens kept, the last one pending again
    assert torch.equal(table[cut].kv.data, block.data[:, :, :, :3])
    assert isinstance(table[cut], HFRow)
    # The forks of one call share one block: the engine prefills their pending token once.
    assert table[cut2].kv is table[cut].kv and table[cut2].ids is not table[cut].ids
    table.append(same, [8])
    assert table[same].kv is block  # forced tokens are prefilled at the next decode


class Bare(TableRows):
    def __init__(self):
        self.rows = RowTable()


def engines(tok):
    from appo.models import load_model
    from appo.rollout.hf_engine import HFEngine

    lm = load_model("tiny-test", device="cpu")
    return {
        "bare": Bare(),
        "hf": HFEngine(lm.model, lm.tokenizer),
        "vllm": VLLMEngine(object(), tok),
        "openai": OpenAICompletionsEngine("http://127.0.0.1:9", tok, model="m",
                                          client=JsonClient()),
    }


def test_every_engine_keeps_its_rows_in_a_row_table():
    tok = tiny_tokenizer()
    seen = {}
    for name, eng in engines(tok).items():
        assert isinstance(eng.rows, RowTable), name
        root = eng.add_row([1, 2, 3])
        kids = eng.fork(root, 2)
        eng.append(kids[0], [4, 5])
        [late] = eng.fork(kids[0], at=4, segment_start=4)
        eng.release([kids[1]])
        seen[name] = ([eng.row_ids(r) for r in (root, kids[0], late)], eng.rows[late].seg_start,
                      eng.live_rows)
        with pytest.raises(AppoError, match="does not exist"):
            eng.row_ids(kids[1])
        if name != "bare":
            assert isinstance(eng, Engine)
    assert all(v == ([[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4]], 4, 3) for v in seen.values())
