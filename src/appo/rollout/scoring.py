"""APPO Branching Score and branch-point selection (docs/algorithms.md §2.4 appo.2, appo.3).

Per initial trajectory, over its sampled tokens (`mask`):

    lr_k  = logp_current_k - logp_rollout_k
    FV_t  = clamp(exp(clamp(sum_{k>=t} gamma^(k-t) lr_k mask_k, -20, 20)), 1-eps, 1+eps)
    BS_t  = z(H)_t * z(FV)_t          (z-scores per row, population std, + 1e-6)

Candidates have z(H) > 0, z(FV) > 0, BS > 0 and a token that is not whitespace only (the
original's rule; with `rollout.appo_skip_punctuation`, not punctuation only either); per prompt the top `B = n - initial_rollouts` by BS are branched, filled if short from
all eligible tokens by BS with ties broken by entropy.

Zero-variance FV (on-policy: the scorer and the engine are the same model, so `lr` is only
float noise): a row whose log-ratios all lie within `lr_noise_tol` of 0 has FV = 1 up to
noise, so it gets `z(FV) = 0`: BS is 0 and the ranking degrades to entropy, never to NaN
or to ranking by recompute noise. The test is on `lr`, not on FV's spread, because FV sums
`lr` over the rest of the row: its noise grows with the response length, while each `lr`'s
noise is bounded by the precision. `rollout.lr_noise_tol` (None) defaults to
`LR_NOISE_TOL` of the scoring model's dtype, well above the largest on-policy `|lr|`
measured in that dtype (`benchmarks/RESULTS.md`); an optimizer step moves some tokens'
log-probs by far more.

Eligibility, beyond the original's rule (docs/algorithms.md §2.4 appo.3, §9 D8): the last token of a model segment is never a split
point (a continuation after a stop tag, EOS or the length limit has nothing to sample), and
if a prompt has no eligible token, the excluded whitespace (and punctuation) tokens are
allowed; if it has fewer split points than `B`, the ranking is reused cyclically, then
branches fall back to the prompt (`split = -1`).
"""

from __future__ import annotations

import string
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from appo.errors import AppoError
from appo.rollout.records import Trajectory
from appo.rollout.sampling import SamplingParams, sampling_log_probs

Z_EPS = 1e-6
# Default lr_noise_tol by the scoring model's dtype (see module docstring): several times the
# largest on-policy |lr| `benchmarks/appo_lr_noise.py` measured in each dtype (figures in
# benchmarks/RESULTS.md). In 16 bits the noise is as large as a real policy change, so there
# FV counts only when a token moved by more.
LR_NOISE_TOL = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 0.25,
                torch.bfloat16: 2.0}


def default_lr_noise_tol(dtype: torch.dtype | None) -> float:
    return LR_NOISE_TOL.get(dtype, LR_NOISE_TOL[torch.float32])


def noisiest(*dtypes: torch.dtype | None) -> torch.dtype | None:
    """Of the scorer's and the engine's matmul dtypes (None: unknown), the one with the
    largest default tolerance: a float32 scorer of a rollout decoded on bfloat16 weights
    (`rollout.cpu_weights`) sees bfloat16-sized noise."""
    known = [d for d in dtypes if d is not None]
    return max(known, key=default_lr_noise_tol) if known else None


def zscore(x: Tensor, mask: Tensor) -> Tensor:
    """`(x - mean) / (std + 1e-6)` over `mask` (population std); 0 outside the mask."""
    m = mask.to(x.dtype)
    count = m.sum().clamp(min=1)
    mean = (x * m).sum() / count
    var = (((x - mean) * m) ** 2).sum() / count
    return (x - mean) / (var.sqrt() + Z_EPS) * m


def future_value(lr: Tensor, mask: Tensor, gamma: float, eps: float) -> Tensor:
    """FV_t (see module docstring), for every position of a 1D row.

    Positions outside `mask` (tool results) count 0 whatever their value, and a token the
    current policy's top-k/top-p excludes (`lr = -inf`) counts as a large finite negative:
    FV is then 1 - eps where it is covered, as exp(-inf) would give, and no NaN arises."""
    x = torch.where(mask.bool(), lr.double(), 0.0).nan_to_num(nan=0.0, posinf=1e6,
                                                                neginf=-1e6)
    acc = torch.zeros((), dtype=torch.float64)
    out = torch.empty_like(x)
    for t in range(x.shape[0] - 1, -1, -1):  # reverse discounted cumulative sum
        acc = x[t] + gamma * acc
        out[t] = acc
    return torch.exp(out.clamp(-20, 20)).clamp(1 - eps, 1 + eps).to(lr.dtype)


@dataclass
class BranchScores:
    z_h: Tensor
    z_fv: Tensor
    bs: Tensor
    fv: Tensor


def branching_scores(
    entropy: Tensor,
    logp_current: Tensor,
    logp_rollout: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    eps: float = 0.2,
    lr_noise_tol: float = 1e-3,
) -> BranchScores:
    """z(H), z(FV), BS and FV of one row (1D tensors of equal length)."""
    entropy, logp_current, logp_rollout = (
        t.to(torch.float32) for t in (entropy, logp_current, logp_rollout)
    )
    mask = mask.bool()
    lr = logp_current - logp_rollout
    fv = future_value(lr, mask, gamma, eps)
    z_h = zscore(entropy, mask)
    valid = lr[mask]
    # NaN / inf compare False: a row with an excluded token is never taken as on-policy.
    on_policy = valid.numel() == 0 or bool((valid.abs() <= lr_noise_tol).all())
    z_fv = torch.zeros_like(fv) if on_policy else zscore(fv, mask)
    return BranchScores(z_h, z_fv, z_h * z_fv, fv)


def is_space(text: str) -> bool:
    """True for text made only of whitespace (or empty): the original's excluded tokens."""
    return not text.strip()


def is_punct_or_space(text: str) -> bool:
    """True for text made only of whitespace and punctuation (incl. symbols such as + =)."""
    return all(
        ch.isspace() or ch in string.punctuation or unicodedata.category(ch)[0] in "PZ"
        for ch in text
    )


@dataclass
class BranchChoice:
    row: int  # index into the list of initial trajectories
    split: int  # branch = prompt + response[:split+1]; -1 = the prompt only
    score: float
    entropy: float


def _segment_last_tokens(traj: Trajectory) -> set[int]:
    return {seg.end - 1 for seg in traj.segments if seg.is_model and seg.end > seg.start}


def _rank(entries: list[tuple[float, float, int, int]]) -> list[tuple[float, float, int, int]]:
    # BS descending, ties by entropy descending, then by position for determinism.
    return sorted(entries, key=lambda e: (-e[0], -e[1], e[2], e[3]))


def plan_branches(
    trajs: Sequence[Trajectory],
    logp_current: Sequence[Tensor],
    budget: dict[str, int],
    settings,
    tokenizer,
    score_dtype: torch.dtype | None = None,
) -> list[BranchChoice]:
    """Choose every prompt's `budget[uid]` split points (see module docstring).
    `score_dtype`: the scoring model's dtype, for the default `lr_noise_tol`."""
    lr_noise_tol = settings.lr_noise_tol
    if lr_noise_tol is None:
        lr_noise_tol = default_lr_noise_tol(score_dtype)
    by_uid: dict[str, list[int]] = {}
    for i, traj in enumerate(trajs):
        by_uid.setdefault(traj.uid, []).append(i)
    plan: list[BranchChoice] = []
    for uid, rows in by_uid.items():
        want = budget.get(uid, 0)
        if want <= 0:
            continue
        candidates: list[tuple[float, float, int, int]] = []
        eligible: list[tuple[float, float, int, int]] = []
        relaxed: list[tuple[float, float, int, int]] = []
        for i in rows:
            traj = trajs[i]
            size = len(traj.response_ids)
            if size == 0:
                continue
            current = torch.as_tensor(logp_current[i], dtype=torch.float32).reshape(-1)
            if current.numel() != size:
                raise AppoError(f"score_fn returned {current.numel()} log-probs for trajectory "
                                f"{traj.traj_id}, which has {size} response tokens")
            sampled = torch.tensor(traj.sampled_mask(), dtype=torch.bool)
            scores = branching_scores(
                torch.tensor(traj.entropy),
                current,
                torch.tensor(traj.logp_rollout),
                sampled,
                settings.appo_gamma,
                settings.future_value_clip,
                lr_noise_tol,
            )
            ends = _segment_last_tokens(traj)
            excluded = is_punct_or_space if settings.appo_skip_punctuation else is_space
            bs, z_h, z_fv = scores.bs.tolist(), scores.z_h.tolist(), scores.z_fv.tolist()
            for t in range(size):
                if not sampled[t] or t in ends:
                    continue
                entry = (bs[t], traj.entropy[t], i, t)
                relaxed.append(entry)
                if excluded(tokenizer.decode([traj.response_ids[t]])):
                    continue
                eligible.append(entry)
                if z_h[t] > 0 and z_fv[t] > 0 and bs[t] > 0:
                    candidates.append(entry)

        chosen = _rank(candidates)[:want]
        taken = {(e[2], e[3]) for e in chosen}
        if len(chosen) < want:
            chosen += [e for e in _rank(eligible) if (e[2], e[3]) not in taken][
                : want - len(chosen)
            ]
        if not chosen:  # no eligible token at all: allow the excluded tokens
            chosen = _rank(relaxed)[:want]
        pool = list(chosen)
        k = 0
        while len(chosen) < want and pool:  # fewer split points than B: reuse the selection
            chosen.append(pool[k % len(pool)])
            k += 1
        while len(chosen) < want:  # nothing to split at: branch from the prompt
            i = rows[len(chosen) % len(rows)]
            chosen.append((0.0, 0.0, i, -1))
        for score, ent, i, t in chosen:
            plan.append(BranchChoice(row=i, split=t, score=float(score), entropy=float(ent)))
    return plan


class HFScorer:
    """A score_fn from a transformers causal LM: one full forward per trajectory.

    Each response token's log-prob is taken under the same sampling transform the engine
    recorded `logp_rollout` with (repetition penalty over the context so far, temperature,
    top-k, top-p: `sampling.sampling_log_probs`), so for an on-policy rollout `lr` is 0 up to
    float noise and FV measures only how the current policy differs from the behaviour
    one. (verl recomputes at the temperature only; with top-k/top-p that leaves the
    truncated mass in every `lr`.) Positions are processed `chunk` at a time. `dtype` (the
    model's) picks the default `rollout.lr_noise_tol`.
    """

    def __init__(self, model, sampling: SamplingParams | None = None, chunk: int = 256):
        sampling = sampling if sampling is not None else SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise AppoError(f"hf_score_fn takes SamplingParams, got {type(sampling).__name__}")
        self.model, self.sampling, self.chunk = model, sampling, chunk
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype

    @torch.inference_mode()
    def __call__(self, trajs: list[Trajectory]) -> list[Tensor]:
        return [self._one(traj) for traj in trajs]

    def _one(self, traj: Trajectory) -> Tensor:
        size, device, sampling = len(traj.response_ids), self.device, self.sampling
        if size == 0:
            return torch.zeros(0)
        ids = torch.tensor(traj.prompt_ids + traj.response_ids, device=device)
        logits = self.model(input_ids=ids[None], logits_to_keep=size + 1).logits[0, :-1]
        first_seen = None
        if sampling.repetition_penalty != 1.0:  # where each vocabulary id first occurs
            first_seen = torch.full((logits.shape[-1],), ids.numel(), device=device)
            first_seen.scatter_reduce_(0, ids, torch.arange(ids.numel(), device=device), "amin")
        prompt_len = len(traj.prompt_ids)
        values = []
        for lo in range(0, size, self.chunk):
            hi = min(size, lo + self.chunk)
            seen = None
            if first_seen is not None:  # context of response token i: ids[:prompt_len+i]
                context_end = prompt_len + torch.arange(lo, hi, device=device)
                seen = first_seen[None, :] < context_end[:, None]
            logp = sampling_log_probs(logits[lo:hi].float(), sampling, seen)
            values.append(logp.gather(1, ids[prompt_len + lo : prompt_len + hi, None]))
        return torch.cat(values).squeeze(1).cpu()


def hf_score_fn(model, sampling: SamplingParams | None = None, chunk: int = 256) -> HFScorer:
    """`HFScorer(model, sampling, chunk)`: the appo strategy's score_fn for a local model."""
    return HFScorer(model, sampling, chunk)
