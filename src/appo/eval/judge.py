"""LLM-as-judge over an OpenAI-compatible chat endpoint, behind a verifier check
(docs/algorithms.md §8.3).

The original evaluation graded with a large instruct model (Qwen2.5-72B-Instruct behind
vLLM) asked whether the predicted answer is equivalent to the labelled one, replying
"Correct" or "Incorrect". Its rule, kept here: a prediction the rule-based check (the
benchmark's reward, then the `math-verify` equivalence) already accepts is correct without
asking; otherwise the judge decides. A reply counts as Correct only if, once any
`<think>...</think>` is dropped and punctuation/markup stripped, it is the word "correct"
or it says "correct" without "incorrect" / "not correct" / "wrong" anywhere.

Verdicts are cached (`appo.tools.search_cache.SearchCache`, backend `judge:<model>`,
keyed by a hash of the prompt version, question, gold and prediction), so re-running an
evaluation or re-grading the same predictions asks the judge once. A failed request is
recorded as an error verdict (the sample stays rule-graded) and is not cached.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from appo.http import HttpError, JsonClient, endpoint, served_model

PROMPT_VERSION = 1
JUDGE_PROMPT = """You are an evaluation assistant. Please determine if the predicted answer \
is equivalent to the labeled answer.

Question: {question}

Labeled Answer: {gold}

Predicted Answer: {prediction}

Are these answers equivalent? Please respond with "Correct" if they are equivalent, or \
"Incorrect" if they are not equivalent. Do not include any other text."""

CORRECT, INCORRECT = "Correct", "Incorrect"
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL | re.IGNORECASE)
_NEGATIVE = ("incorrect", "not correct", "wrong", "not equivalent")


def parse_verdict(reply: str) -> str:
    """"Correct" or "Incorrect" from a judge's reply (see module docstring)."""
    text = _THINK.sub(" ", reply).lower()
    words = re.sub(r"[^a-z ]+", " ", text).split()
    if words == ["correct"]:
        return CORRECT
    flat = " ".join(words)
    if "correct" in words and not any(neg in flat for neg in _NEGATIVE):
        return CORRECT
    return INCORRECT


@dataclass
class JudgeRequest:
    question: str
    gold: str | list[str]
    prediction: str


@dataclass
class JudgeVerdict:
    verdict: str | None  # Correct / Incorrect; None when the request failed
    reply: str = ""
    cached: bool = False
    error: str | None = None


def _gold_text(gold: str | list[str]) -> str:
    return gold if isinstance(gold, str) else " / ".join(str(g) for g in gold)


class Judge:
    """`judge(requests) -> verdicts` through `POST {base_url}/v1/chat/completions`."""

    def __init__(
        self,
        base_url: str,
        model: str | None,
        cache_path: str | Path | None = None,
        timeout: float = 120.0,
        retries: int = 2,
        max_concurrency: int = 16,
        max_tokens: int = 512,
        use_cache: bool = True,
        client: JsonClient | None = None,
    ):
        self.url = endpoint(base_url, "chat/completions")
        self.client = client or JsonClient(timeout=timeout, retries=retries)
        self.model = model or served_model(self.client, base_url)
        self.max_concurrency = max(1, int(max_concurrency))
        self.max_tokens = int(max_tokens)
        self.cache = None
        if use_cache:
            from appo.tools.search_cache import SearchCache

            path = cache_path
            if path is None:
                from appo.paths import cache_dir

                path = cache_dir("judge") / "cache.sqlite"
            self.cache = SearchCache(path)
        self.calls = 0
        self.cache_hits = 0
        self.errors = 0

    @property
    def backend(self) -> str:
        return f"judge:{self.model}"

    @staticmethod
    def key(request: JudgeRequest) -> str:
        data = [PROMPT_VERSION, request.question, request.gold, request.prediction]
        return hashlib.sha256(json.dumps(data, ensure_ascii=False).encode()).hexdigest()

    def prompt(self, request: JudgeRequest) -> str:
        return JUDGE_PROMPT.format(question=request.question, gold=_gold_text(request.gold),
                                   prediction=request.prediction)

    def _ask(self, request: JudgeRequest) -> JudgeVerdict:
        key = self.key(request)
        if self.cache is not None:
            reply = self.cache.get(self.backend, None, key)
            if reply is not None:
                return JudgeVerdict(parse_verdict(reply), reply, cached=True)
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompt(request)}],
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
        }
        try:
            data = self.client.call(self.url, payload)
            reply = data["choices"][0]["message"]["content"]
            if not isinstance(reply, str):
                raise TypeError("content is not a string")
        except HttpError as e:
            return JudgeVerdict(None, error=str(e))
        except (KeyError, IndexError, TypeError) as e:
            return JudgeVerdict(None, error=f"{self.url} returned an unexpected reply ({e})")
        if self.cache is not None:
            self.cache.put(self.backend, None, key, reply)
        return JudgeVerdict(parse_verdict(reply), reply)

    def __call__(self, requests: Sequence[JudgeRequest]) -> list[JudgeVerdict]:
        if not requests:
            return []
        workers = min(self.max_concurrency, len(requests))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="appo-judge") as pool:
            verdicts = list(pool.map(self._ask, requests))
        for v in verdicts:
            self.cache_hits += v.cached
            self.calls += not v.cached and v.error is None
            self.errors += v.error is not None
        return verdicts

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
