"""Evaluation: benchmark runner with pass@k and tool statistics, LLM judge, rollout viewer.

- `runner`: `appo eval` (k samples per question through the shared tool loop, graded,
  resumable JSONL, summary); `summary` / `passk`: the metrics; `records`: sample records.
- The engine for `--base-url` (an OpenAI-compatible server) is
  `appo.rollout.openai_engine`, shared with training in server mode; its JSON client is
  `appo.http`.
- `judge`: LLM-as-judge with the original's Correct/Incorrect rule, verifier first, cached.
- `viewer`: `appo view`, rollout dumps as one static HTML page.

Importing this package is light; torch loads with the engines.
"""
