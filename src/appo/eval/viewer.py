"""`appo view`: a rollout dump (JSON Lines of `Trajectory`) as one static HTML page.

Per prompt, the tree of trajectories (roots, and branches under the trajectory they were
copied from); per trajectory its reward, advantage (`extra["advantage"]`, the mean over its
trained tokens, written by the trainer; "-" when absent), finish reason and tool calls; its
tokens shaded by entropy, the branch point marked, the prefix it shares with its parent
folded away, and every tool call and result collapsible.

The page is self-contained (inline CSS and a few lines of inline JS, no external assets, no
server). Everything from the dump is model output and is escaped: nothing from the file ends
up inside a script or an unescaped attribute, so a completion cannot inject markup or code.

Token text comes from the dump (`extra["token_text"]`, one string per response token, as
the evaluator writes) or, failing that, from a tokenizer: the model the dump records
(`recorded_models`), or `--model`. A `--model` other than the recorded one is refused
(`check_view_model`), since another tokenizer would render other text from the same ids.
"""

from __future__ import annotations

import html
import json
import math
import os
import stat
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from appo.errors import AppoError
from appo.eval.tokens import token_texts
from appo.jsonl import iter_lines
from appo.outdir import write_output
from appo.rollout.records import Trajectory, model_record

SHADE_RGB = (235, 110, 20)


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


# ---------------------------------------------------------------- loading
def _expand(paths: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.rglob("*.jsonl"))
            if not found:
                raise AppoError(f"{p}: directory holds no .jsonl rollout dumps")
            files += found
        elif p.is_file():
            files.append(p)
        elif p.exists():  # /dev/zero, a FIFO, a socket: reading it would never end
            raise AppoError(f"{p} is {_kind(p)}, not a rollout file (JSONL of trajectories)")
        else:
            raise AppoError(f"rollout file not found: {p}")
    return files


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_view_output(out: str | Path, paths: Sequence[str | Path]) -> None:
    """Refuse an output that is one of the inputs (it would replace the rollout dump with
    the page) or a directory; one line naming it."""
    out = Path(out)
    if out.is_dir():
        raise AppoError(f"output {out} is a directory: give the HTML file to write "
                        f"(e.g. -o {out / 'report.html'})")
    target = out.resolve()
    for p in _expand(paths):
        if p.resolve() == target or (out.exists() and os.path.samefile(p, out)):
            raise AppoError(f"output {out} is the input {p}: writing the page would replace "
                            "the rollout dump; choose another -o")


def load_trajectories(paths: Sequence[str | Path]) -> list[Trajectory]:
    """Trajectories from JSONL files or directories of them.

    Tolerant of dumps written by newer code: fields a `Trajectory` does not know are kept in
    `extra` rather than rejected. A line that is not a trajectory is an error naming it.
    """
    known = {f.name for f in fields(Trajectory)}
    out: list[Trajectory] = []
    for path in _expand(paths):
        for lineno, line in iter_lines(path):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if not isinstance(data, dict) or "traj_id" not in data:
                    raise TypeError("no traj_id")
                unknown = {k: data.pop(k) for k in list(data) if k not in known}
                traj = Trajectory.from_dict(data)
                traj.extra.update(unknown)
            except (json.JSONDecodeError, TypeError, AppoError) as e:
                raise AppoError(f"{path}:{lineno}: not a trajectory record ({e}); "
                                "appo view reads rollout dumps (JSONL of trajectories)"
                                ) from None
            out.append(traj)
    if not out:
        raise AppoError(f"no trajectories in {', '.join(map(str, paths))}")
    return out


def recorded_models(trajs: Sequence[Trajectory], paths: Sequence[str | Path]) -> list[str]:
    """The model specs that wrote the dumps, sorted: each line's `extra["model"]` (trainer
    dumps, `appo rollout -o`), and for an eval's `<out>/<benchmark>/trajectories.jsonl` the
    `model.path` its output directory records (`<out>/eval.json`)."""
    from appo.eval.runner import IDENTITY_FILE
    from appo.rollout.records import MODEL_KEY

    models = {t.extra[MODEL_KEY] for t in trajs if isinstance(t.extra.get(MODEL_KEY), str)}
    for path in _expand(paths):
        sidecar = path.parent.parent / IDENTITY_FILE
        if path.name == "trajectories.jsonl" and sidecar.is_file():
            try:
                spec = json.loads(sidecar.read_text(encoding="utf-8")).get("model.path")
            except (OSError, ValueError, AttributeError):
                spec = None
            if isinstance(spec, str):
                models.add(model_record(spec))
    return sorted(models)


def check_view_model(recorded: Sequence[str], model: str | None, force: bool,
                     needs_tokenizer: bool) -> str | None:
    """The model whose tokenizer reads the dumps (None: none needed); one line refusing a
    `--model` other than the recorded one (unless `force`), dumps of several models, or a
    dump that records neither its model nor its token text when no `--model` is given."""
    if len(recorded) > 1 and not (model and force):
        raise AppoError(f"the dumps were written by different models ({', '.join(recorded)}): "
                        "view them one model at a time")
    if model is not None and recorded and model_record(model) not in recorded and not force:
        raise AppoError(f"--model {model} is not the model that wrote the dump "
                        f"({recorded[0]}), whose tokenizer renders its tokens: drop --model, "
                        "or add --force-model to read it with this one anyway")
    if model is None and recorded:
        model = recorded[0]
    if model is None and needs_tokenizer:
        raise AppoError("the dump holds no token text and does not record the model that "
                        "wrote it: give --model (that model, whose tokenizer reads its ids)")
    return model


# ---------------------------------------------------------------- rendering
class _Page:
    def __init__(self, trajs: list[Trajectory], tokenizer=None):
        self.trajs = trajs
        self.tokenizer = tokenizer
        # DOM ids by position: trajectory ids from different dumps may repeat.
        self.dom_id = {id(t): f"t{i}" for i, t in enumerate(trajs)}
        self.rendered: set[int] = set()
        sampled = [h for t in trajs for h, m in zip(t.entropy, t.sampled_mask(), strict=False)
                   if m and math.isfinite(h)]
        ordered = sorted(sampled)
        # 95th percentile: one very flat distribution should not wash out the rest.
        self.scale = ordered[int(0.95 * (len(ordered) - 1))] if ordered else 0.0

    def texts(self, traj: Trajectory) -> list[str]:
        given = traj.extra.get("token_text")
        if isinstance(given, list) and len(given) == len(traj.response_ids):
            return [str(t) for t in given]
        if self.tokenizer is None:
            raise AppoError(
                f"trajectory {traj.traj_id} carries no token text; give the model whose "
                "tokenizer wrote it: appo view FILE --model SPEC"
            )
        return token_texts(self.tokenizer, traj.response_ids)

    def prompt_text(self, traj: Trajectory) -> str:
        if isinstance(traj.extra.get("prompt_text"), str):
            return traj.extra["prompt_text"]
        if self.tokenizer is not None:
            return self.tokenizer.decode(traj.prompt_ids)
        question = traj.extra.get("question")
        return str(question) if question is not None else f"({len(traj.prompt_ids)} tokens)"

    def shade(self, h: float) -> str:
        if self.scale <= 0 or not math.isfinite(h):
            return ""
        a = min(1.0, max(0.0, h / self.scale)) * 0.85
        r, g, b = SHADE_RGB
        return f' style="background:rgba({r},{g},{b},{a:.2f})"'

    # -- tokens and segments
    def tokens(self, traj: Trajectory, texts: list[str], lo: int, hi: int,
               marks: dict[int, list[Trajectory]], sampled: bool = True) -> str:
        """Token spans; sampled tokens kept out of the loss (appo branches) are underlined."""
        out = []
        for i in range(lo, hi):
            h = traj.entropy[i] if i < len(traj.entropy) else 0.0
            lp = traj.logp_rollout[i] if i < len(traj.logp_rollout) else 0.0
            untrained = sampled and traj.loss_mask[i : i + 1] == [0]
            cls = "t nomask" if untrained else "t"
            out.append(f'<span class="{cls}" title="#{i} H={h:.3f} logp={lp:.3f}"'
                       f"{self.shade(h)}>{_esc(texts[i])}</span>")
            for child in marks.get(i, []):
                out.append(f'<a class="child-mark" href="#{self.dom_id[id(child)]}" '
                           f'title="branch {_esc(child.traj_id)} continues from here">&#x21B3; '
                           f"{_esc(child.traj_id)}</a>")
        return "".join(out)

    def segments(self, traj: Trajectory, texts: list[str], lo: int, hi: int,
                 marks: dict[int, list[Trajectory]]) -> str:
        # The calls a forced segment answers (hermes: parallel calls share one tool turn).
        calls: dict[int, list[tuple[int, Any]]] = {}
        for n, c in enumerate(traj.tool_calls, 1):
            calls.setdefault(c.result_start, []).append((n, c))
        out = []
        segs = traj.segments or [_whole(traj)]
        for seg in segs:
            a, b = max(seg.start, lo), min(seg.end, hi)
            if a >= b:
                continue
            if seg.is_model:
                out.append(f'<span class="seg">{self.tokens(traj, texts, a, b, marks)}</span>')
                continue
            found = calls.get(seg.start)
            forced = self.tokens(traj, texts, a, b, marks, sampled=False)
            if found is None:
                out.append(f'<span class="forced">{forced}</span>')
                continue
            heads, bodies = [], []
            for n, call in found:
                status = "ok" if call.ok else (call.error_kind or "error")
                preview = " ".join(call.content.split())[:80]
                heads.append(f"{_esc(call.tool)} call {n} [{_esc(status)}, "
                             f"{call.latency_s * 1000:.0f} ms{', cached' if call.cached else ''}]"
                             f" <code>{_esc(preview)}</code>")
                bodies.append(f'<div class="lbl">call</div><pre>{_esc(call.content)}</pre>'
                              f'<div class="lbl">result</div><pre>{_esc(call.result)}</pre>')
            ok = all(call.ok for _, call in found)
            out.append(
                f'<details class="tool {"ok" if ok else "err"}"><summary>{"; ".join(heads)}'
                f'</summary><div class="call">{"".join(bodies)}'
                f'<div class="lbl">forced tokens</div><div class="forced">{forced}</div>'
                "</div></details>"
            )
        return "".join(out)

    # -- one trajectory card
    def card(self, traj: Trajectory, children: dict[int | None, list[Trajectory]],
             parent: Trajectory | None) -> str:
        self.rendered.add(id(traj))
        texts = self.texts(traj)
        size = len(traj.response_ids)
        # A corrupt dump could link trajectories in a cycle: never render one twice.
        kids = [c for c in children.get(id(traj), []) if id(c) not in self.rendered]
        marks: dict[int, list[Trajectory]] = {}
        for child in kids:
            at = child.branch_token_index if child.branch_token_index is not None else -1
            marks.setdefault(min(at, size - 1), []).append(child)
        adv = traj.extra.get("advantage")
        adv_text = f"{float(adv):.3f}" if isinstance(adv, int | float) else "-"
        reward = "-" if traj.reward is None else f"{traj.reward:.3f}"
        kind = "branch" if traj.parent_id else "root"
        head = [f'<span class="tid">{_esc(traj.traj_id)}</span>',
                f'<span class="badge {kind}">{kind}</span>',
                f'<span class="kv">reward <b class="reward">{_esc(reward)}</b></span>',
                f'<span class="kv">advantage <b class="adv">{_esc(adv_text)}</b></span>',
                f'<span class="kv">finish <b>{_esc(traj.finish_reason or "-")}</b>'
                f'{" (truncated)" if traj.truncated else ""}</span>',
                f'<span class="kv">{size} tokens, {sum(traj.loss_mask)} trained</span>',
                f'<span class="kv">{len(traj.tool_calls)} tool calls</span>']
        if "correct" in traj.extra:
            ok = bool(traj.extra["correct"])
            head.append(f'<span class="badge {"good" if ok else "bad"}">'
                        f'{"correct" if ok else "wrong"}</span>')
        if traj.extra.get("answer") is not None:
            head.append(f'<span class="kv">answer <code>{_esc(traj.extra["answer"])}</code></span>')
        body = []
        start = 0
        if traj.parent_id is not None:
            split = traj.branch_token_index if traj.branch_token_index is not None else -1
            start = max(0, min(split + 1, size))
            link = (f'<a href="#{self.dom_id[id(parent)]}">{_esc(traj.parent_id)}</a>'
                    if parent is not None else _esc(traj.parent_id) + " (not in this dump)")
            head.append(f'<span class="kv">branched from {link} after token {split}</span>')
            if start > 0:
                body.append(f'<details class="shared"><summary>prefix shared with the parent '
                            f"({start} tokens)</summary>"
                            f"{self.segments(traj, texts, 0, start, {})}</details>")
            body.append('<span class="branch-point" title="the branch continues from here">'
                        "&#x21B3; branch</span>")
        body.append(self.segments(traj, texts, start, size, marks))
        inner = "".join(self.card(c, children, traj) for c in kids)
        sub = f'<ul class="tree">{inner}</ul>' if kids else ""
        return (f'<li><div class="traj" id="{self.dom_id[id(traj)]}" '
                f'data-traj-id="{_esc(traj.traj_id)}"><div class="head">{" ".join(head)}</div>'
                f'<div class="body">{"".join(body)}</div></div>{sub}</li>')

    def group(self, n: int, uid: str, group: list[Trajectory]) -> str:
        first_of: dict[str, Trajectory] = {}
        for t in group:
            first_of.setdefault(t.traj_id, t)
        children: dict[int | None, list[Trajectory]] = {}
        for t in group:
            parent = first_of.get(t.parent_id) if t.parent_id is not None else None
            if parent is t:
                parent = None
            children.setdefault(None if parent is None else id(parent), []).append(t)
        rewards = [t.reward for t in group if t.reward is not None]
        mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
        first = group[0]
        truth = first.extra.get("ground_truth")
        info = [f"{len(group)} trajectories", f"mean reward {mean}",
                f"{sum(1 for t in group if t.parent_id)} branches"]
        truth_html = (f'<div class="truth">ground truth: <code>{_esc(truth)}</code></div>'
                      if truth is not None else "")
        roots = "".join(self.card(t, children, None) for t in children.get(None, []))
        # Whatever a broken parent chain left unreachable is still shown.
        roots += "".join(self.card(t, children, first_of.get(t.parent_id or ""))
                         for t in group if id(t) not in self.rendered)
        return (f'<section class="group" id="g{n}"><h2>prompt <span class="uid">{_esc(uid)}'
                f'</span> <small>{" &middot; ".join(info)}</small></h2>'
                f'<details class="prompt"><summary>prompt ({len(first.prompt_ids)} tokens)'
                f"</summary><pre>{_esc(self.prompt_text(first))}</pre></details>{truth_html}"
                f'<ul class="tree">{roots}</ul></section>')


def _whole(traj: Trajectory):
    from appo.rollout.records import Segment

    return Segment(0, len(traj.response_ids), True)


CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;padding:16px 24px;color:#222;background:#fafafa}
header{position:sticky;top:0;background:#fafafa;padding:6px 0;border-bottom:1px solid #ddd;
z-index:2}
h1{font-size:18px;margin:0 0 4px}h2{font-size:15px;margin:0 0 6px}
h2 small{font-weight:normal;color:#666}
button{font:inherit;margin-right:6px;padding:2px 10px}
.legend{display:inline-block;margin-left:12px;color:#555}
.legend span{padding:0 6px}
.group{background:#fff;border:1px solid #ddd;border-radius:6px;margin:14px 0;padding:10px 14px}
.tree{list-style:none;padding-left:22px;margin:6px 0;border-left:2px solid #e3e3e3}
.group>.tree{padding-left:0;border-left:none}
.traj{border:1px solid #ccd;border-radius:5px;margin:6px 0;background:#fff}
.traj:target{outline:3px solid #4a7bd0}
.head{background:#f1f3f8;padding:4px 8px;border-bottom:1px solid #dde;font-size:13px}
.head .kv{margin-left:10px;color:#444}.tid{font-weight:bold;font-family:monospace}
.badge{display:inline-block;border-radius:3px;padding:0 5px;margin-left:6px;font-size:12px}
.badge.root{background:#dfe9ff}.badge.branch{background:#ffe7c7}
.badge.good{background:#d3f2d3}.badge.bad{background:#f7d4d4}
.body{padding:6px 8px;font-family:ui-monospace,monospace;font-size:12.5px;white-space:pre-wrap;
word-break:break-word}
.t{border-radius:2px}.t.nomask{text-decoration:underline dotted #888}
body.noshade .t{background:none!important}
.forced{color:#225;background:#eef2ff}
details.tool{display:block;margin:4px 0;border:1px dashed #99a;border-radius:4px;
background:#f6f8ff}
details.tool.err{border-color:#c88;background:#fff4f4}
details.tool summary{cursor:pointer;padding:2px 6px;font-family:system-ui,sans-serif}
.call{padding:4px 8px}.call pre{margin:2px 0 6px;background:#fff;border:1px solid #e4e4ee;
padding:4px;white-space:pre-wrap}
.lbl{font:11px system-ui,sans-serif;color:#777;text-transform:uppercase}
details.shared{display:block;color:#777;margin-bottom:4px}
details.shared summary{cursor:pointer;font-family:system-ui,sans-serif}
.branch-point,.child-mark{color:#c25400;font-weight:bold;padding:0 3px;
border:1px solid #e9a25d;border-radius:3px;background:#fff3e6;text-decoration:none}
.truth{margin:4px 0;color:#333}
details.prompt pre{white-space:pre-wrap;background:#f7f7f7;padding:6px;font-size:12px}
"""

JS = """
(function(){
  function setAll(open){
    var items=document.querySelectorAll('details');
    for(var i=0;i<items.length;i++){items[i].open=open;}
  }
  document.getElementById('expand').addEventListener('click',function(){setAll(true);});
  document.getElementById('collapse').addEventListener('click',function(){setAll(false);});
  document.getElementById('shade').addEventListener('click',function(){
    document.body.classList.toggle('noshade');
  });
})();
"""


def render_html(trajs: list[Trajectory], tokenizer=None, title: str = "rollouts",
                max_prompts: int | None = None) -> str:
    """The whole page (see module docstring)."""
    page = _Page(trajs, tokenizer)
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.uid, []).append(t)
    items = list(groups.items())
    if max_prompts is not None:
        items = items[:max_prompts]
    shown = sum(len(g) for _, g in items)
    sections = "".join(page.group(n, uid, g) for n, (uid, g) in enumerate(items))
    if page.scale > 0:
        r, g, b = SHADE_RGB
        steps = "".join(f'<span style="background:rgba({r},{g},{b},{0.85 * f:.2f})">'
                        f"{page.scale * f:.2f}</span>" for f in (0.0, 0.25, 0.5, 0.75, 1.0))
        legend = f'<span class="legend">token entropy (nats): {steps}</span>'
    else:
        legend = '<span class="legend">token entropy not recorded in this dump</span>'
    counts = (f"{len(items)} of {len(groups)} prompts, {shown} of {len(trajs)} trajectories, "
              f"{sum(1 for _, grp in items for t in grp if t.parent_id)} branches")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{_esc(title)}</title><style>{CSS}</style></head><body>"
        f"<header><h1>{_esc(title)}</h1><div>{_esc(counts)}</div>"
        '<button id="expand" type="button">expand all</button>'
        '<button id="collapse" type="button">collapse all</button>'
        f'<button id="shade" type="button">toggle shading</button>{legend}</header>'
        f"<main>{sections}</main><script>{JS}</script></body></html>\n"
    )


def write_report(paths: Sequence[str | Path], out: str | Path, tokenizer=None,
                 max_prompts: int | None = None, title: str | None = None) -> tuple[Path, int]:
    """Render rollout dumps to `out`; returns (path, trajectories shown)."""
    trajs = load_trajectories(paths)
    title = title or ", ".join(Path(p).name for p in paths)
    text = render_html(trajs, tokenizer, title=title, max_prompts=max_prompts)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_output(out, text)  # atomic; a failed write is one line naming the file
    return out, text.count('class="traj"')
