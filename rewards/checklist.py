"""Checklist reward (Arena-T2I Hard style): a DAG of yes/no questions per prompt, judged by a VLM.

Why a DAG: "Is the cat red?" means nothing when there is no cat. Each prompt's
``metadata["checklist"]`` lists nodes ``{"id", "question", "category", "parents"}``; a node
only earns credit when every parent passed, so an image cannot collect attribute points for an
object it never drew. The schema is ``assets/schemas/checklist.schema.json``.

Scoring (pure functions `node_scores` / `aggregate`, testable without a model):
  * P(yes) per node from ONE batched VLM pass over every (image, node) pair of the batch;
  * nodes are visited in topological order; a node passes if P(yes) >= threshold;
  * a node with ANY parent that failed or was zeroed scores 0 (so zeroing is transitive);
  * otherwise it scores its P(yes) -- the soft score, which keeps a gradient of confidence for
    RL instead of a step -- or 1/0 with ``hard=True``;
  * reward = mean node score; "checklist/<category>" = mean over that category's nodes, NaN for
    a prompt without that category (sub-score keys are the union over the batch).
Images with NaN/inf pixels score NaN (could not score), never 0.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from flowrl.rewards_api import check_batch
from rewards.vlm_common import DEFAULT_VLM, images_to_pil, resolve_vlm, yes_probability

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "assets" / "schemas" / "checklist.schema.json"
ANNOTATIONS = {"$schema", "$id", "title", "description"}


def _quote(prompt: str, limit: int = 80) -> str:
    prompt = " ".join(str(prompt).split())
    return repr(prompt if len(prompt) <= limit else prompt[: limit - 3] + "...")


# ------------------------------------------------------------------------------------ schema

@lru_cache(maxsize=1)
def load_schema() -> dict:
    """The shipped JSON schema (read once)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


_TYPES = {"object": dict, "array": list, "string": str}


def hand_validate(data: Any, schema: Mapping[str, Any], path: tuple = ()) -> list[tuple[tuple, str]]:
    """A tiny JSON-Schema subset validator, used when `jsonschema` is not installed.

    Covers exactly the keywords the shipped schema uses (type, required, properties,
    additionalProperties: false, items, minItems, minLength, uniqueItems); any other keyword
    raises, so the schema cannot silently outgrow it. -> [(path, message)], empty when valid.
    """
    unknown = set(schema) - ANNOTATIONS - {"type", "required", "properties", "additionalProperties", "items",
                                           "minItems", "minLength", "uniqueItems"}
    if unknown:
        raise NotImplementedError(f"hand validator does not support schema keywords {sorted(unknown)}")
    if "type" in schema and not isinstance(data, _TYPES[schema["type"]]):
        return [(path, f"{json.dumps(data)[:60]} is not of type '{schema['type']}'")]
    errors: list[tuple[tuple, str]] = []
    if isinstance(data, str) and len(data) < schema.get("minLength", 0):
        errors.append((path, f"{json.dumps(data)} is shorter than {schema['minLength']} characters"))
    if isinstance(data, list):
        if len(data) < schema.get("minItems", 0):
            errors.append((path, f"{json.dumps(data)[:60]} should have at least {schema['minItems']} item(s)"))
        if schema.get("uniqueItems") and len({json.dumps(x, sort_keys=True) for x in data}) < len(data):
            errors.append((path, f"{json.dumps(data)[:60]} has non-unique elements"))
        for i, item in enumerate(data):
            errors += hand_validate(item, schema.get("items", {}), path + (i,))
    if isinstance(data, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in data:
                errors.append((path, f"'{key}' is a required property"))
        if schema.get("additionalProperties") is False:
            extra = sorted(k for k in data if k not in props)
            if extra:
                errors.append((path, f"additional properties are not allowed ({', '.join(map(repr, extra))} "
                                     f"unexpected; allowed: {', '.join(props)})"))
        for key, sub in props.items():
            if key in data:
                errors += hand_validate(data[key], sub, path + (key,))
    return errors


def _schema_errors(nodes: Any) -> list[tuple[tuple, str]]:
    """[(path, message)] from `jsonschema` when installed, else from `hand_validate`."""
    schema = load_schema()
    try:
        import jsonschema
    except ImportError:
        return hand_validate(nodes, schema)
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [(tuple(e.absolute_path), e.message) for e in sorted(validator.iter_errors(nodes), key=lambda e: e.path)]


def _where(nodes: Any, path: tuple) -> str:
    """Path -> "node 'id' field 'x'" (the node named by its id when it has one)."""
    if not path or not isinstance(path[0], int):
        return "checklist"
    node = nodes[path[0]]
    nid = node.get("id") if isinstance(node, dict) else None
    where = f"node {nid!r}" if isinstance(nid, str) and nid else f"node #{path[0]}"
    if len(path) > 1:
        where += f" field '{path[1]}'" + "".join(f"[{p}]" for p in path[2:])
    return where


def validate_checklist(nodes: Any, prompt: str = "") -> list[dict]:
    """Check one checklist against the schema, ids and parents -> nodes with "parents" filled in.

    Raises a one-line ValueError naming the prompt and the node. Cycles are caught by
    `topological_order`.
    """
    errors = _schema_errors(nodes)
    if errors:
        path, message = errors[0]
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        message = " ".join(str(message).split())
        message = message if len(message) <= 200 else message[:197] + "..."
        raise ValueError(f"checklist for prompt {_quote(prompt)}: {_where(nodes, path)}: {message}{more}")
    seen: set[str] = set()
    for node in nodes:
        if node["id"] in seen:
            raise ValueError(f"checklist for prompt {_quote(prompt)}: duplicate node id {node['id']!r}")
        seen.add(node["id"])
    out = [{**node, "parents": list(node.get("parents", []))} for node in nodes]
    topological_order(out, prompt)  # unknown parents and cycles, one line each
    return out


# ------------------------------------------------------------------------------------ DAG logic

def topological_order(nodes: Sequence[Mapping[str, Any]], prompt: str = "") -> list[int]:
    """Node indices, parents before children (ties keep list order). One-line ValueError on an
    unknown parent id or a cycle, naming a node on the cycle."""
    index = {node["id"]: i for i, node in enumerate(nodes)}
    children: list[list[int]] = [[] for _ in nodes]
    waiting = [0] * len(nodes)
    for i, node in enumerate(nodes):
        for parent in node.get("parents", []):
            if parent not in index:
                raise ValueError(f"checklist for prompt {_quote(prompt)}: node {node['id']!r} has unknown "
                                 f"parent {parent!r} (known ids: {', '.join(index)})")
            children[index[parent]].append(i)
            waiting[i] += 1
    ready = [i for i in range(len(nodes)) if waiting[i] == 0]
    order: list[int] = []
    while ready:
        i = ready.pop(0)
        order.append(i)
        for c in children[i]:
            waiting[c] -= 1
            if waiting[c] == 0:
                ready.append(c)
    if len(order) < len(nodes):
        # follow unresolved parents from any stuck node until one repeats: that one is on a cycle
        stuck = {i for i in range(len(nodes)) if waiting[i] > 0}
        i, visited = min(stuck), set()
        while i not in visited:
            visited.add(i)
            i = next(index[p] for p in nodes[i]["parents"] if index[p] in stuck)
        raise ValueError(f"checklist for prompt {_quote(prompt)} has a cycle through node {nodes[i]['id']!r}")
    return order


def node_scores(nodes: Sequence[Mapping[str, Any]], p_yes: Sequence[float] | torch.Tensor, *,
                threshold: float = 0.5, hard: bool = False, prompt: str = "") -> torch.Tensor:
    """Per-node scores [K] from P(yes) [K] (same order as ``nodes``).

    A node is zeroed when any parent failed (P < threshold) or was itself zeroed; otherwise it
    scores P(yes) (soft) or 1/0 (hard). A zeroed node counts as failed for its children.
    """
    p = torch.as_tensor(p_yes, dtype=torch.float32).flatten()  # [K]
    if p.numel() != len(nodes):
        raise ValueError(f"got {p.numel()} P(yes) values for {len(nodes)} checklist nodes")
    index = {node["id"]: i for i, node in enumerate(nodes)}
    scores = torch.zeros_like(p)
    ok = [False] * len(nodes)  # passed and not zeroed: children may score
    for i in topological_order(nodes, prompt):
        if all(ok[index[q]] for q in nodes[i].get("parents", [])):
            passed = bool(p[i] >= threshold)
            ok[i] = passed
            scores[i] = float(passed) if hard else p[i]
            if torch.isnan(p[i]):
                scores[i] = math.nan  # could not judge: keep NaN, never a silent 0
    return scores


def aggregate(nodes: Sequence[Mapping[str, Any]], scores: torch.Tensor) -> tuple[float, dict[str, float]]:
    """(mean over nodes, {category: mean over that category's nodes})."""
    cats: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        cats.setdefault(node["category"], []).append(i)
    return float(scores.mean()), {c: float(scores[idx].mean()) for c, idx in cats.items()}


# ------------------------------------------------------------------------------------ reward

Scorer = Callable[[list, list[str]], torch.Tensor]
"""(PIL images [M], questions [M]) -> P(yes) [M]: replaces the VLM (tests, an external judge)."""


class Checklist:
    """Reward protocol: Checklist()(images [N,3,H,W] in [0,1], prompts, metadata) -> {key: Tensor[N]}.

    Keys: "checklist" (mean node score) and "checklist/<category>". Every (image, node) pair of
    the batch goes through the VLM in chunks of ``batch_size`` pairs; the question is
    ``question_template.format(question=...)``. Each pair re-encodes its image (simple, and
    pairs of one image batch together; sharing vision features across questions is a possible
    speed-up). ``missing="nan"`` scores prompts without a checklist NaN instead of raising.
    ``scorer`` replaces the VLM with any (PIL images, questions) -> P(yes) [M] callable.
    """

    name = "checklist"

    def __init__(self, model: Any = DEFAULT_VLM, processor: Any = None, device: str = "auto",
                 dtype: str | None = None, batch_size: int = 16, threshold: float = 0.5, hard: bool = False,
                 missing: str = "raise", question_template: str = "{question} Answer Yes or No.",
                 yes_token: str = "Yes", no_token: str = "No", trust_remote_code: bool = False,
                 scorer: Scorer | None = None) -> None:
        if missing not in ("raise", "nan"):
            raise ValueError(f"missing must be 'raise' or 'nan', got {missing!r}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if "{question}" not in question_template:
            raise ValueError(f"question_template must contain '{{question}}', got {question_template!r}")
        self.threshold, self.hard, self.missing, self.batch_size = threshold, hard, missing, batch_size
        self.question_template, self.yes_token, self.no_token = question_template, yes_token, no_token
        self.scorer = scorer
        self.model = self.processor = None
        if scorer is None:
            self.model, self.processor = resolve_vlm(model, processor, device=device, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)

    def _checklist(self, prompt: str, meta: Mapping[str, Any] | None) -> list[dict] | None:
        nodes = (meta or {}).get("checklist")
        if nodes is None:
            if self.missing == "nan":
                return None
            raise ValueError(f"prompt {_quote(prompt)} has no checklist in metadata; add metadata['checklist'] "
                             f"(a list of {{id, question, category, parents}} nodes, see {SCHEMA_PATH.name}) "
                             "or build the reward with missing='nan'")
        return validate_checklist(nodes, prompt)

    def _p_yes(self, pils: list, questions: list[str]) -> torch.Tensor:
        if self.scorer is not None:
            p = torch.as_tensor(self.scorer(pils, questions), dtype=torch.float32).flatten()
        else:
            p = yes_probability(self.model, self.processor, pils, questions, self.batch_size,
                                self.yes_token, self.no_token)
        if p.shape != (len(questions),):
            raise ValueError(f"scorer returned {tuple(p.shape)} values for {len(questions)} questions")
        return p

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        n = check_batch(images, prompts, metadata)
        lists = [self._checklist(p, m) for p, m in zip(prompts, metadata)]  # validate all before the VLM
        pils, finite = images_to_pil(images)  # N PIL, [N]
        rows = [i for i in range(n) if lists[i] is not None and bool(finite[i])]
        pair_images = [pils[i] for i in rows for _ in lists[i]]
        questions = [self.question_template.format(question=node["question"]) for i in rows for node in lists[i]]
        p_all = self._p_yes(pair_images, questions) if questions else torch.zeros(0)  # [M]
        categories = sorted({node["category"] for nodes in lists if nodes for node in nodes})
        out = {self.name: torch.full((n,), math.nan)}
        out.update({f"{self.name}/{c}": torch.full((n,), math.nan) for c in categories})
        start = 0
        for i in rows:
            k = len(lists[i])
            scores = node_scores(lists[i], p_all[start:start + k], threshold=self.threshold, hard=self.hard,
                                 prompt=prompts[i])
            start += k
            total, per_cat = aggregate(lists[i], scores)
            out[self.name][i] = total
            for c, v in per_cat.items():
                out[f"{self.name}/{c}"][i] = v
        return out
