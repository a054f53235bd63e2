"""The rollout `Engine` protocol over an OpenAI-compatible completions endpoint (e.g. vLLM).

Each row is its token ids so far, kept locally (`appo.rollout.rows.RowTable`, as in every
engine); `decode` sends one `POST /v1/completions` per row (concurrently; the server
batches) with the row as the prompt, the tool closing tags as `stop`, the row's remaining
budget as `max_tokens`, and the sampling parameters (`top_k` / `repetition_penalty` are
vLLM extensions, sent only when not neutral).
`append` adds forced tokens (tool results) locally; the next request carries them. So the
tool loop and the strategies run unchanged on a remote model.

Token out: the request asks for the sampled token ids (`return_token_ids`, a vLLM
extension; `token_ids=False` leaves it out for strict servers). A server that returns them
(`choice.token_ids`) is taken at its word: the segment is exactly the sampled tokens, with
the server's per-token log-probs, and nothing is re-tokenised. vLLM keeps the token that
completed a stop string and the EOS token in those ids, as the hf engine does. A server
that returns only text falls back to tokenising the text with the local tokenizer (it must
be the served model's tokenizer: it also renders the chat template); the two can differ
where a text has several tokenisations. Prompts go out as token ids by default (exact: no
second BOS, no re-tokenisation of the prompt); `prompt_format="text"` sends the decoded text
for servers that only take strings.

Stop strings follow OpenAI semantics: the server strips the matched stop string from the
text. The segment keeps it, because the tool loop reads the closing tag (docs/algorithms.md
§1.3): the returned ids hold it already; returned text gets it put back (and ids that lack
it get its tokens, as if sampled). Which stop string matched: vLLM says so in `stop_reason`
(None or a token id for EOS); a server that echoes it (`include_stop_str_in_output`) shows
it at the end of the text; a plain OpenAI server says neither, and then an unclosed `<tag>`
in the segment names it, else it was EOS.

Log-probs and entropy are unknown over HTTP: recorded as 0 (with `logprobs=N`, the server's
sampled-token log-probs and the top-N entropy proxy are used: per returned token id, or, on
the text path, when the server's tokens line up with the local tokenisation). Tokens the
engine adds itself (a put-back stop string, an EOS the server did not return) get 0. A
request that fails (after `JsonClient` retries) ends its row with an empty segment of finish
"error" and the message (the loop records it as `Trajectory.error`): the run goes on and the
caller decides (the evaluator records the sample as failed and retries it on a rerun).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from appo.errors import AppoError
from appo.http import HttpError, JsonClient, endpoint, served_model
from appo.rollout.engine import SegmentOutput
from appo.rollout.records import EngineCounters
from appo.rollout.rows import Row, RowTable, TableRows

PROMPT_FORMATS = ("ids", "text")


@dataclass
class ServerRow(Row):
    """A row and the server that decodes it (forks inherit it: a group's rows and a
    parent's branches meet their shared prefix in that server's prefix cache)."""

    server: int = 0


class OpenAICompletionsEngine(TableRows):
    name = "openai"
    shared_by_ranks = True  # every training rank reaches the same servers

    def __init__(
        self,
        base_url: str | list[str],
        tokenizer: Any,
        model: str | None = None,
        timeout: float = 120.0,
        retries: int = 2,
        max_concurrency: int = 32,
        prompt_format: str = "ids",
        logprobs: int = 0,
        seed: int | None = None,
        client: JsonClient | None = None,
        token_ids: bool = True,
        weights_dir: str | None = None,
        weight_transfer: str = "auto",
    ):
        if prompt_format not in PROMPT_FORMATS:
            raise AppoError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls or not all(isinstance(u, str) and u for u in urls):
            raise AppoError(f"base_url must be a URL or a non-empty list of URLs, got "
                            f"{base_url!r}")
        self.base_urls = urls
        self.base_url = urls[0]
        self.urls = [endpoint(u, "completions") for u in urls]
        self.url = self.urls[0]
        self.tokenizer = tokenizer
        self.client = client or JsonClient(timeout=timeout, retries=retries)
        self.prompt_format = prompt_format
        self.logprobs = int(logprobs)
        self.token_ids = bool(token_ids)
        self.seed = seed
        self.max_concurrency = max(1, int(max_concurrency))
        self.model = model or served_model(self.client, self.base_url)
        self.counters = EngineCounters()
        self.stop_strings: list[str] = []
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_id = None if eos is None else int(eos)
        self.rows: RowTable[ServerRow] = RowTable(ServerRow)
        self._requests = 0
        self._roots = 0
        self.weights_dir = weights_dir  # where sync_weights saves the policy for the servers
        self.weight_transfer = weight_transfer  # rollout.weight_transfer: auto, file, group
        self.weight_sync: Any = None  # the ServerWeightSync, made at the first sync
        self.weight_syncs = 0

    # ------------------------------------------------------------------ rows
    def set_stop_strings(self, stop_strings: list[str]) -> None:
        self.stop_strings = [s for s in stop_strings if s]

    def add_row(self, prompt_ids: list[int]) -> int:
        """A root row, on the next server in turn."""
        rid = self.rows.add(prompt_ids)
        self.rows[rid].server = self._roots % len(self.urls)
        self._roots += 1
        return rid

    def sync_weights(self, model: Any) -> None:
        """Bring every server to `model`'s weights (`appo.rollout.server_sync`): broadcast
        through a process group with the server's workers where the server runs appo's
        worker extension (no file), else saved to `weights_dir` (safetensors, Hugging Face
        names) and reloaded by the server from there, which must then share this process's
        filesystem (`rollout.weight_transfer`). Then each server's prefix cache is reset."""
        from appo.rollout.server_sync import ServerWeightSync

        if self.weight_sync is None:
            self.weight_sync = ServerWeightSync(self.base_urls, self.weights_dir,
                                                self.weight_transfer)
        self.weight_sync.sync(model)
        self.weight_syncs += 1

    def close(self) -> None:
        """Leave the servers' weight-transfer groups, if any were joined."""
        if self.weight_sync is not None:
            self.weight_sync.close()

    def prefill(self, rows: list[int]) -> None:
        """Nothing to do: the server caches prefixes itself (vLLM prefix caching)."""
        self.rows.many(rows)  # unknown or released rows fail here, as in the other engines

    # ------------------------------------------------------------------ decode
    def _payload(self, row: Row, budget: int, params) -> dict[str, Any]:
        prompt: Any = row.ids
        if self.prompt_format == "text":
            prompt = self.tokenizer.decode(row.ids, skip_special_tokens=False)
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": int(budget),
            "temperature": max(0.0, float(params.temperature)),
            "top_p": float(params.top_p),
            "n": 1,
        }
        if self.stop_strings:
            payload["stop"] = list(self.stop_strings)
        if params.top_k and params.top_k > 0:
            payload["top_k"] = int(params.top_k)
        if params.repetition_penalty != 1.0:
            payload["repetition_penalty"] = float(params.repetition_penalty)
        if self.logprobs > 0:
            payload["logprobs"] = self.logprobs
        if self.token_ids:
            payload["return_token_ids"] = True
        if self.seed is not None:
            self._requests += 1
            payload["seed"] = int(self.seed) + self._requests
        return payload

    def reseed(self, seed: int) -> None:
        self.seed, self._requests = seed, 0

    def _stop_of(self, choice: dict[str, Any], text: str, row: Row) -> tuple[str, str | None]:
        """(finish, stop_string) of a finished choice; `text` is the returned text."""
        reason = choice.get("finish_reason")
        if reason == "length":
            return "length", None
        if reason != "stop":
            return "eos", None
        stop_reason = choice.get("stop_reason")
        if isinstance(stop_reason, str) and stop_reason in self.stop_strings:
            return "stop", stop_reason
        ends = [s for s in self.stop_strings if text.endswith(s)]
        if ends:
            return "stop", max(ends, key=len)
        if "stop_reason" in choice:  # vLLM: None / a token id means EOS
            return "eos", None
        # A plain OpenAI server does not say which stop matched: an unclosed tool tag in
        # this segment means the server stopped at its closing tag.
        seg_text = self.tokenizer.decode(row.ids[row.seg_start :], skip_special_tokens=True)
        seg_text += text
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            opener = "<" + stop[2:] if stop.startswith("</") else None
            if opener is None:
                continue
            at = seg_text.rfind(opener)
            if at >= 0 and seg_text.find(stop, at) < 0 and (best is None or at > best[0]):
                best = (at, stop)
        return ("stop", best[1]) if best else ("eos", None)

    def _server_ids(self, choice: dict[str, Any], url: str) -> list[int] | None:
        """The sampled token ids the server returned (vLLM `return_token_ids`), None when it
        returned none (the text path)."""
        ids = choice.get("token_ids")
        if ids is None or not self.token_ids:
            return None
        vocab = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else None
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                and (vocab is None or t < vocab) for t in ids):
            # Ids outside the local vocabulary mean the tokenizer is not the served model's.
            raise HttpError(f"{url} returned token_ids that are not ids of the local "
                            f"tokenizer: {str(ids)[:200]}")
        return ids

    def _stop_tail(self, ids: list[int], stop: str) -> list[int]:
        """Tokens to add so that `ids` show `stop` at their end: none when its last tokens
        already hold it (vLLM keeps the completing token), else the stop string's tokens."""
        window = ids[-(len(stop) + 1):]  # each token adds at least one character of it
        if stop in self.tokenizer.decode(window, skip_special_tokens=False):
            return []
        return list(self.tokenizer.encode(stop, add_special_tokens=False))

    def _logprobs_of(self, choice: dict[str, Any], count: int
                     ) -> tuple[list[float], list[float], list[float]]:
        """Per token: the sampled token's log-prob, the entropy lower bound from the top-N
        log-probs plus the rest as one bucket, and the top-10 proxy (as the vllm engine);
        zeros where the server sent none."""
        from appo.rollout.vllm_engine import entropy_from_top_logprobs

        lp = choice.get("logprobs") or {}
        tokens = lp.get("token_logprobs") or []
        top = lp.get("top_logprobs") or []
        if self.logprobs <= 0 or len(tokens) != count:
            return [0.0] * count, [0.0] * count, [0.0] * count
        logps = [float(v) if v is not None and math.isfinite(v) else 0.0 for v in tokens]
        ents, tops = [], []
        for entry in top if len(top) == count else [{}] * count:
            values = [v for v in (entry or {}).values() if v is not None and math.isfinite(v)]
            h, h10 = entropy_from_top_logprobs(values) if values else (0.0, 0.0)
            ents.append(h)
            tops.append(h10)
        return logps, ents, tops

    def _one(self, rid: int, budget: int, payload: dict[str, Any]
             ) -> tuple[SegmentOutput, int, int, str | None]:
        row = self.rows[rid]
        url = self.urls[row.server]
        try:
            data = self.client.call(url, payload)
            choices = data.get("choices")
            if not choices or not isinstance(choices[0], dict):
                raise HttpError(f"{url} returned no choices: {str(data)[:200]}")
            choice = choices[0]
            text = choice.get("text")
            if not isinstance(text, str):
                raise HttpError(f"{url} returned a choice without text: {str(choice)[:200]}")
            server_ids = self._server_ids(choice, url)
        except HttpError as e:
            return SegmentOutput([], [], [], "error", error=str(e)), 0, 0, str(e)
        finish, stop = self._stop_of(choice, text, row)
        if server_ids is not None:
            # Token out: the server's ids and their log-probs, position by position.
            ids = list(server_ids)
            logps, ents, topk = self._logprobs_of(choice, len(ids))
            extra = self._stop_tail(ids, stop) if stop is not None else []
            stop_id = choice.get("stop_reason")
            if finish == "eos" and self.eos_id is not None and not (
                    ids and (ids[-1] == self.eos_id or ids[-1] == stop_id)):
                extra = [self.eos_id]
        else:
            if stop is not None and not text.endswith(stop):
                text += stop
            ids = list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []
            logps, ents, topk = self._logprobs_of(choice, len(ids))
            extra = [self.eos_id] if finish == "eos" and self.eos_id is not None else []
        ids += extra
        logps += [0.0] * len(extra)
        ents += [0.0] * len(extra)
        topk += [0.0] * len(extra)
        if len(ids) > budget:
            ids, logps, ents, topk = ids[:budget], logps[:budget], ents[:budget], topk[:budget]
            finish, stop = "length", None
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or len(row.ids))
        out = SegmentOutput(ids, logps, ents, finish, stop, topk)
        return out, prompt_tokens, len(ids), None

    def decode(self, rows: list[int], max_new_tokens: list[int] | int,
               params) -> list[SegmentOutput]:
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(rows)
        if len(set(rows)) != len(rows):
            raise AppoError("decode got the same row twice")
        outputs = [SegmentOutput([], [], [], "length") for _ in rows]
        live = [i for i, b in enumerate(max_new_tokens) if b > 0]
        if not live:
            return outputs
        # Payloads are built here, in order, so per-request seeds do not depend on threads.
        payloads = [self._payload(self.rows[rows[i]], max_new_tokens[i], params) for i in live]
        workers = min(self.max_concurrency, len(live))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="appo-http") as pool:
            results = list(pool.map(lambda j: self._one(rows[live[j]], max_new_tokens[live[j]],
                                                        payloads[j]), range(len(live))))
        for i, (out, prompt_tokens, decoded, error) in zip(live, results, strict=True):
            rid = rows[i]
            outputs[i] = out
            self.counters.prefilled += prompt_tokens
            self.counters.decoded += decoded
            if error is not None:
                continue
            self.rows[rid].ids.extend(out.token_ids)
        return outputs
