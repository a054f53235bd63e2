"""Evaluation: benchmark runner with pass@k and tool statistics, LLM judge, rollout viewer.

- `runner`: `appo eval` (k samples per question through the shared tool loop, graded,
  resumable JSONL, summary); `summary` / `passk`: the metrics; `records`: sample records.
- `openai_engine`: the rollout `Engine` protocol over an OpenAI-compatible completions
  endpoint (vLLM, llama.cpp, ...), token out where the server returns ids; `http`: its
  small stdlib JSON client; `vllm_server`: server mode's control calls (wait for a server,
  reload its weights from a checkpoint dir).
- `judge`: LLM-as-judge with the original's Correct/Incorrect rule, verifier first, cached.
- `viewer`: `appo view`, rollout dumps as one static HTML page.

Importing this package is light; torch loads with the engines.
"""
