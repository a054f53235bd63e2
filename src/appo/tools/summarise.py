"""Summarising fetched pages for the current search: the deep-search step of the original.

The original's deep-search tool (ARPO/AEPO evaluation, `SerperSearchToolSDS`, after
Search-o1 / WebThinker) turned each search into one call to a separate summarisation model
served by vLLM:

1. for each result page, the part of the page around the sentence that best matches the
   result's snippet (word-set F1 above 0.2; `max_doc_len` = 3000 characters either side),
   or else its first `2 * max_doc_len` characters; a page that could not be fetched reads
   "Web Page content cannot fetch";
2. the pages as `**Web Page {i}:**` + a JSON record (id, title, url, snippet, context), the
   whole cut to `max_sequence_length` = 20,000 characters;
3. the `webpage_to_reasonchain` prompt below (previous reasoning, search query, pages), sent
   as one user message, sampled at temperature 0.6, top-p 0.95, at most 4096 new tokens;
4. the text after `**Final Information**` is the tool result.

The prompt text follows the original's `get_webpage_to_reasonchain_instruction` (the
Search-o1 / WebThinker prompt the ARPO evaluation code uses). Deviations: sentences are
split with a regular expression, not NLTK's `sent_tokenize`; the page records carry no
`site_name` and `date` (the search backends here do not return them); the request goes to
`/v1/chat/completions` (the server applies the chat template) rather than the original's
`/v1/completions` with the template applied client-side. `api: completions` sends the
prompt as is to `/v1/completions` (no chat template: for base models without one).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

from appo.errors import AppoError

WEBPAGE_TO_REASONCHAIN = """**Task Instruction:**

You are tasked with reading and analyzing web pages based on the following inputs: **Previous Reasoning Steps**, **Current Search Query**, and **Searched Web Pages**. Your objective is to extract relevant and helpful information for **Current Search Query** from the **Searched Web Pages** and seamlessly integrate this information into the **Previous Reasoning Steps** to continue reasoning for the original question.

**Guidelines:**

1. **Analyze the Searched Web Pages:**
- Carefully review the content of each searched web page.
- Identify factual information that is relevant to the **Current Search Query** and can aid in the reasoning process for the original question.

2. **Extract Relevant Information:**
- Select the information from the Searched Web Pages that directly contributes to advancing the **Previous Reasoning Steps**.
- Ensure that the extracted information is accurate and relevant.

3. **Output Format:**
- Present the helpful information for current search query: beginning with `**Final Information**` as shown below.
**Final Information**

[Helpful information]

**Inputs:**
- **Previous Reasoning Steps:**
{prev_reasoning}

- **Current Search Query:**
{search_query}

- **Searched Web Pages:**
{document}

Now you should analyze each web page and find helpful information based on the current search query "{search_query}" and previous reasoning steps.
"""  # noqa: E501 - the prompt's lines are the original's

PROMPTS = {"webpage_to_reasonchain": WEBPAGE_TO_REASONCHAIN}
PROMPT_FIELDS = ("prev_reasoning", "search_query", "document")
CANNOT_FETCH = "Web Page content cannot fetch"


def resolve_prompt(prompt: str) -> str:
    """A prompt name from `PROMPTS`, or a template text with the three fields."""
    if prompt in PROMPTS:
        return PROMPTS[prompt]
    missing = [f for f in PROMPT_FIELDS if "{" + f + "}" not in prompt]
    if missing:
        raise AppoError(f"pages.summariser.prompt is neither a known prompt "
                        f"({', '.join(PROMPTS)}) nor a template with the fields "
                        f"{', '.join('{' + f + '}' for f in missing)}")
    return prompt


def fill_prompt(template: str, prev_reasoning: str, search_query: str, document: str) -> str:
    # str.replace, not str.format: page texts are full of braces
    out = template
    for key, value in (("prev_reasoning", prev_reasoning), ("search_query", search_query),
                       ("document", document)):
        out = out.replace("{" + key + "}", value)
    return out


def truncate_prev_reasoning(steps: Sequence[str], tool_tag: str = "search") -> str:
    """The original's `get_truncated_prev_reasoning`: steps numbered `Step i: ...`; with more
    than 5 steps, keep the first, the last four, search calls and the results right after
    them, and mark each run of dropped steps with `...`."""
    numbered = [f"Step {i + 1}: {s}" for i, s in enumerate(steps)]
    if len(numbered) <= 5:
        return "\n\n".join(numbered).strip("\n")
    call = (f"<{tool_tag}>", f"</{tool_tag}>")
    out = ""
    for i, step in enumerate(numbered):
        keep = (i == 0 or i >= len(numbered) - 4 or (call[0] in step and call[1] in step)
                or ("<result>" in step and "</result>" in step
                    and call[0] in numbered[i - 1]))
        if keep:
            out += step + "\n\n"
        elif not out.endswith("\n\n...\n\n"):
            out += "...\n\n"
    return out.strip("\n")


_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_PUNCT = str.maketrans("", "", string.punctuation)


def _words(text: str) -> set[str]:
    return set(text.lower().translate(_PUNCT).split())


def snippet_context(full_text: str, snippet: str, context_chars: int) -> str | None:
    """The page text around its sentence most like the snippet (word-set F1 > 0.2),
    `context_chars` either side; None when no sentence is that close."""
    full_text = full_text[:50000]
    target = _words(snippet)
    best, best_f1 = None, 0.2
    for sentence in _SENTENCE.split(full_text):
        words = _words(sentence)
        common = len(target & words)
        if not common:
            continue
        p, r = common / len(words), common / len(target)
        f1 = 2 * p * r / (p + r)
        if f1 > best_f1:
            best, best_f1 = sentence, f1
    if best is None:
        return None
    start = full_text.find(best)
    return full_text[max(0, start - context_chars): start + len(best) + context_chars]


@dataclass
class PageDoc:
    """One result page going into the prompt."""

    title: str
    url: str
    snippet: str
    text: str | None  # None: the page could not be fetched


def format_documents(docs: Sequence[PageDoc], context_chars: int, max_chars: int,
                     for_summary: bool = True) -> str:
    """`**Web Page {i}:**` + JSON records, the whole cut to `max_chars` (+ "...").
    `for_summary=False` is the original's no-summary variant (the text goes to the model
    as is): no URL, and a page without a matching sentence is cut to `context_chars`."""
    out = ""
    for i, d in enumerate(docs, 1):
        snippet = d.snippet.replace("<b>", "").replace("</b>", "")
        if d.text is None:
            context = CANNOT_FETCH
        else:
            context = snippet_context(d.text, snippet, context_chars)
            if context is None and for_summary:
                context = d.text[: context_chars * 2]
            elif context is None:
                context = d.text if len(d.text) <= context_chars else \
                    d.text[:context_chars] + "..."
        record = {"id": i, "title": d.title, "url": d.url, "snippet": snippet,
                  "context": context}
        if not for_summary:
            record.pop("url")
        out += f"**Web Page {i}:**\n" + json.dumps(record, ensure_ascii=False, indent=2) + "\n"
    if len(out) > max_chars:
        out = out[:max_chars] + "..."
    return out


def extract_final_information(output: str) -> str:
    """The original's `extract_answer` for summaries: the text after the last
    `**Final Information**` (newlines removed), else after `**Modified Reasoning Steps**`,
    else the whole output."""
    info, steps = "**Final Information**", "**Modified Reasoning Steps**"
    if info in output:
        return output.split(info)[-1].replace("\n", "").strip("`").strip()
    if steps in output:
        return output.split(steps)[-1].strip("`").strip()
    return output


class SummariserError(Exception):
    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


APIS = ("chat", "completions")


class Summariser:
    """One completion per prompt on an OpenAI-compatible server (vLLM's): a chat request
    with the prompt as the user message (`api="chat"`), or the prompt as is
    (`api="completions"`)."""

    def __init__(self, base_url: str | None = None, model: str | None = None,
                 api_key_env: str = "OPENAI_API_KEY", temperature: float = 0.6,
                 top_p: float = 0.95, max_tokens: int = 4096, timeout: float = 300.0,
                 retries: int = 2, api: str = "chat"):
        import os

        from appo.http import JsonClient

        if api not in APIS:
            raise AppoError(f"bad pages.summariser.api {api!r} (choose from {', '.join(APIS)})")
        self.api = api

        if not base_url:
            raise AppoError("the page step's summariser needs pages.summariser.base_url (an "
                            "OpenAI-compatible server, e.g. http://127.0.0.1:8001/v1 from "
                            "`vllm serve`)")
        self.base_url = base_url
        self.model = model
        self.sampling = {"temperature": float(temperature), "top_p": float(top_p),
                         "max_tokens": int(max_tokens)}
        self.client = JsonClient(timeout=timeout, retries=retries,
                                 api_key=os.environ.get(api_key_env) or "")

    def model_name(self) -> str:
        if self.model is None:
            from appo.http import served_model

            self.model = served_model(self.client, self.base_url)
        return self.model

    def complete(self, prompt: str) -> str:
        from appo.http import HttpError, endpoint

        chat = self.api == "chat"
        payload = {"model": self.model_name(), **self.sampling}
        if chat:
            payload["messages"] = [{"role": "user", "content": prompt}]
        else:
            payload["prompt"] = prompt
        try:
            data = self.client.call(
                endpoint(self.base_url, "chat/completions" if chat else "completions"), payload)
        except HttpError as e:
            raise SummariserError(f"summariser failed: {e}", e.retryable) from None
        try:
            choice = data["choices"][0]
            return str((choice["message"]["content"] if chat else choice["text"]) or "")
        except (KeyError, IndexError, TypeError):
            where = "message.content" if chat else "text"
            raise SummariserError(f"summariser answered without choices[0].{where}",
                                  retryable=False) from None
