"""Speculative decoding with an EAGLE-3 head: chain and EAGLE-2 dynamic tree, greedy and sampled.

One target forward per step verifies every drafted branch through a tree attention mask; the target's
DynamicCache keeps the accepted path (its rows gathered into place, the rest cropped). The head keeps its
own k/v for the accepted prefix; each step's first head forward recomputes the newly accepted positions
from the target's features (the training semantics: position t reads fc(aux_t) and embed(token t+1),
RoPE position t, and predicts token t+2). Deeper drafts read the parent's output hidden and the
embedding of the parent's token at RoPE position + 1, attending to the prefix plus their tree ancestors.

PlainDecoder runs the target alone through the same forward function (same cache, dtype and masks),
so speed ratios compare like with like.

Time accounting in GenerationStats: time_target_s covers the target forwards (with their mask
construction), time_draft_s the head forwards together with the tree growth and pruning around them,
time_other_s the rest (acceptance, cache gather/crop, stop checks): the decoder's own overhead.
On CUDA every section is bracketed by a synchronise so the times are the GPU's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from eyas.data.config import TargetConfig
from eyas.data.targets import aux_layer_ids_for, capture_aux_hidden, text_config
from eyas.eval import sampling
from eyas.eval.config import DecoderConfig
from eyas.heads.eagle3 import Eagle3Head, embed


@dataclass
class GenerationStats:
    tokens: list[int] = field(default_factory=list)  # generated only
    text: str = ""
    finish_reason: str = "length"  # eos | stop | length
    ttft_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # wall time from start when each token was ready
    target_forwards: int = 0
    drafts: int = 0  # verify steps that carried a draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    reached_per_position: list[int] = field(default_factory=list)
    time_target_s: float = 0.0
    time_draft_s: float = 0.0
    time_other_s: float = 0.0
    total_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        """tau: tokens produced per verify step (1 + accepted / drafts when every step drafts)."""
        steps = max(self.target_forwards - 1, 1)  # the prefill produces the first token on its own
        return (len(self.tokens) - 1) / steps if self.tokens else 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def eos_token_ids(target, tokenizer) -> set[int]:
    """Every end-of-sequence id of the generation config (and the tokenizer's)."""
    ids: set[int] = set()
    for source in (getattr(target, "generation_config", None), target.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids


class _Output:
    """Collects generated tokens and applies the stop rules (EOS, stop strings, max new tokens)."""

    def __init__(self, tokenizer, cfg: DecoderConfig, eos_ids: set[int], start: float):
        self.tokenizer, self.cfg, self.eos_ids, self.start = tokenizer, cfg, eos_ids, start
        self.stats = GenerationStats()
        # A new stop string ends in the last token, so decoding a short tail is enough to find it.
        self.stop_tail = max((len(s) for s in cfg.stop), default=0) + 8
        self.done = False

    def add(self, tokens: list[int]) -> bool:
        """Append tokens until a stop rule fires; returns True when generation is over."""
        now = time.perf_counter() - self.start
        s = self.stats
        for token in tokens:
            s.tokens.append(token)
            s.token_times_s.append(now)
            if token in self.eos_ids:
                return self._finish("eos")
            if self.cfg.stop:
                tail = self.tokenizer.decode(s.tokens[-self.stop_tail:], skip_special_tokens=False)
                if any(stop in tail for stop in self.cfg.stop):
                    return self._finish("stop")
            if len(s.tokens) >= self.cfg.max_new_tokens:
                return self._finish("length")
        return False

    def _finish(self, reason: str) -> bool:
        self.stats.finish_reason = reason
        self.done = True
        return True

    def result(self) -> GenerationStats:
        s = self.stats
        s.text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
        s.ttft_s = s.token_times_s[0] if s.token_times_s else 0.0
        s.total_s = time.perf_counter() - self.start
        s.time_other_s = max(s.total_s - s.time_target_s - s.time_draft_s, 0.0)
        return s


class _Clock:
    """Accumulates wall time of a code section; on CUDA it synchronises so the time is the GPU's."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.elapsed = time.perf_counter() - self.t0


class TargetRunner:
    """The target with a DynamicCache whose entries are exactly positions 0..length-1 of the sequence."""

    def __init__(self, model, aux_layer_ids: list[int] | None = None):
        self.model = model
        self.aux_layer_ids = aux_layer_ids
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        tc = text_config(model.config)
        types = getattr(tc, "layer_types", None) or []
        self.sliding_window = getattr(tc, "sliding_window", None) if "sliding_attention" in types else None
        self.reset()

    def reset(self) -> None:
        # No config: every layer keeps all its keys, so rows can be gathered and cropped uniformly;
        # sliding-window layers get their window through the mask instead.
        self.cache = DynamicCache()
        self.length = 0

    def mask(self, positions: torch.Tensor, allowed: torch.Tensor | None):
        """Additive 4D mask [1,1,q,length+q]: the cached prefix plus `allowed` [q,q] among new tokens."""
        q = positions.shape[-1]
        if allowed is None:
            allowed = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
        visible = torch.cat([torch.ones(q, self.length, dtype=torch.bool, device=self.device), allowed], dim=1)
        full = self._additive(visible)
        if self.sliding_window is None:
            return full
        kv_pos = torch.cat([torch.arange(self.length, device=self.device), positions[0]])
        in_window = positions[0][:, None] - kv_pos[None, :] < self.sliding_window
        return {"full_attention": full, "sliding_attention": self._additive(visible & in_window)}

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        blocked = torch.tensor(torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        return torch.where(visible, zero, blocked)[None, None]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None = None,
                last_only: bool = False):
        """Logits [q,V] (or [1,V] with last_only) and, when capturing, the aux features [1,q,3H]."""
        kwargs = dict(input_ids=ids, position_ids=positions, attention_mask=self.mask(positions, allowed),
                      past_key_values=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        if self.aux_layer_ids is None:
            out, aux = self.model(**kwargs), None
        else:
            with capture_aux_hidden(self.model, self.aux_layer_ids) as captured:
                out = self.model(**kwargs)
            aux = torch.cat(captured, dim=-1)
        self.length += ids.shape[1]
        return out.logits[0], aux

    def keep(self, start: int, rows: torch.Tensor) -> None:
        """Keep the new entries `rows` (indices from `start`, ascending) at start, start+1, ...; drop the rest."""
        end = start + rows.shape[0]
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t[:, :, start:end] = t[:, :, start + rows]
                setattr(layer, name, t[:, :, :end])
        self.length = end


def check_decoder_config(cfg: DecoderConfig) -> None:
    """Refuse settings that cannot decode, naming the field."""
    if cfg.mode not in ("chain", "tree"):
        raise ValueError(f"decoder.mode must be 'chain' or 'tree', got {cfg.mode!r}")
    for name in ("num_speculative_tokens", "depth", "topk", "budget", "max_new_tokens"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"decoder.{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1 or cfg.top_k < 0 or not 0 <= cfg.min_draft_prob < 1:
        raise ValueError(f"decoder sampling settings out of range: temperature={cfg.temperature} (>= 0), "
                         f"top_p={cfg.top_p} (0, 1], top_k={cfg.top_k} (>= 0), "
                         f"min_draft_prob={cfg.min_draft_prob} [0, 1)")


class _Base:
    def __init__(self, target, tokenizer, cfg: DecoderConfig):
        check_decoder_config(cfg)
        self.target, self.tokenizer, self.cfg = target, tokenizer, cfg
        self.device = next(target.parameters()).device
        self.eos_ids = eos_token_ids(target, tokenizer)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.cpu_generator = torch.Generator().manual_seed(cfg.seed)

    @property
    def sampling(self) -> bool:
        return self.cfg.temperature > 0

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token from target logits [1,V] -> [1] (argmax, or a draw from the warped distribution)."""
        if not self.sampling:
            return logits.argmax(-1)
        c = self.cfg
        return sampling.sample(sampling.warp_probs(logits, c.temperature, c.top_k, c.top_p), self.generator)

    def _prefill(self, runner: TargetRunner, input_ids: torch.Tensor, out: _Output):
        ids = input_ids.to(self.device)
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"generate() takes input_ids of shape [1, T], got {tuple(ids.shape)}")
        runner.reset()
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        with _Clock(self.device) as clock:
            logits, aux = runner.forward(ids, positions, last_only=True)
            token = self.pick(logits)
        out.stats.time_target_s += clock.elapsed
        out.stats.target_forwards += 1
        return ids, token, aux


class PlainDecoder(_Base):
    """The target alone, one token per forward: the baseline the speculative decoder must beat."""

    def __init__(self, target, tokenizer, cfg: DecoderConfig):
        super().__init__(target, tokenizer, cfg)
        self.runner = TargetRunner(target)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor) -> GenerationStats:
        out = _Output(self.tokenizer, self.cfg, self.eos_ids, time.perf_counter())
        ids, token, _ = self._prefill(self.runner, input_ids, out)
        position = ids.shape[1]
        while not out.add(token.tolist()):
            with _Clock(self.device) as clock:
                logits, _ = self.runner.forward(token[None], torch.tensor([[position]], device=self.device))
                token = self.pick(logits)
            out.stats.time_target_s += clock.elapsed
            out.stats.target_forwards += 1
            position += 1
        return out.result()


@dataclass
class DraftTree:
    """Draft tokens in node order (parents before children), ready for one verify forward."""

    tokens: torch.Tensor  # [B] target ids
    depth: torch.Tensor  # [B] 1-based
    parent_row: torch.Tensor  # [B] row of the parent in the verify input (0 = the root token)
    ancestors: torch.Tensor  # [B,B] bool, ancestor-or-self
    proposals: torch.Tensor | None  # [B,Vd] draft probabilities of sampled nodes (chain sampling), else None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


class SpeculativeDecoder(_Base):
    def __init__(self, target, head: Eagle3Head, tokenizer, cfg: DecoderConfig):
        super().__init__(target, tokenizer, cfg)
        layer_ids = aux_layer_ids_for(target, TargetConfig(aux_layer_ids=list(head.config.aux_layer_ids)))
        if head.config.vocab_size != text_config(target.config).vocab_size:
            raise ValueError(f"the head was trained for a vocabulary of {head.config.vocab_size} tokens, the "
                             f"target has {text_config(target.config).vocab_size}")
        self.head = head.to(self.device).eval().requires_grad_(False)
        self.head_dtype = next(head.parameters()).dtype
        self.runner = TargetRunner(target, layer_ids)
        self.embedding = target.get_input_embeddings().weight
        if cfg.mode == "chain":
            self.depth, self.topk, self.budget = cfg.num_speculative_tokens, 1, cfg.num_speculative_tokens
        else:
            self.depth, self.topk, self.budget = cfg.depth, cfg.topk, cfg.budget
        # A chain under sampling proposes draws from q; tree children are the draft's top-k (one-hot proposals).
        self.sample_drafts = self.sampling and cfg.mode == "chain"

    # ---- the head ---------------------------------------------------------------------------------
    def _head_step(self, hidden, token_ids, positions, tree_k=None, tree_v=None, tree_visible=None):
        """One head forward of q new rows over its prefix cache (plus tree k/v): (out hidden, k, v)."""
        h = self.head
        q, k, v, residual = h.qkv(hidden, embed(self.embedding, token_ids[None]), positions[None])
        keys = [self.head_k, k] if tree_k is None else [self.head_k, tree_k, k]
        values = [self.head_v, v] if tree_v is None else [self.head_v, tree_v, v]
        rows = q.shape[2]
        if tree_visible is None:  # causal over the new rows
            visible = torch.ones(rows, self.head_k.shape[2] + rows, dtype=torch.bool, device=self.device)
            visible[:, self.head_k.shape[2]:] = visible[:, self.head_k.shape[2]:].tril()
        else:
            prefix = torch.ones(rows, self.head_k.shape[2], dtype=torch.bool, device=self.device)
            visible = torch.cat([prefix, tree_visible], dim=1)
        out = h.finish(h.attend(q, torch.cat(keys, 2), torch.cat(values, 2), visible[None, None]), residual)
        return out, k, v

    def _children(self, hidden_out: torch.Tensor, k: int):
        """Per row of head output [f,H]: k children's draft ids, log-probs used for ranking, proposals."""
        logits = self.head.logits(hidden_out).float()
        if self.sample_drafts:
            c = self.cfg
            probs = sampling.warp_probs(logits, c.temperature, c.top_k, c.top_p)
            ids = sampling.sample(probs, self.generator)[:, None]
            # Rank by the distribution's confidence, not the drawn token, so which depths are kept never
            # depends on the drawn value (that would bias the accepted tokens).
            return ids, probs.max(-1, keepdim=True).values.log(), probs
        values, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
        return ids, values, None

    def _draft(self, seq: torch.Tensor, pending_aux: torch.Tensor) -> DraftTree | None:
        """Update the head cache with the newly accepted positions, then grow and prune the draft tree."""
        n = seq.shape[0] - 1  # positions the target has processed; seq[n] is the root (not yet verified)
        m = self.head_k.shape[2]
        hidden = self.head.fuse(pending_aux.to(self.head_dtype))
        out, k, v = self._head_step(hidden, seq[m + 1:n + 1], torch.arange(m, n, device=self.device))
        self.head_k, self.head_v = torch.cat([self.head_k, k], 2), torch.cat([self.head_v, v], 2)

        topk, floor = self.topk, self.cfg.min_draft_prob
        log_floor = torch.log(torch.tensor(floor)) if floor > 0 else None
        # Depth 1: children of the root, from the head output at position n-1.
        ids, logp, probs = self._children(out[0, -1:], topk)
        node_ids, node_score = ids[0], logp[0]
        node_parent = torch.full((topk,), -1, dtype=torch.long, device=self.device)
        node_depth = torch.ones(topk, dtype=torch.long, device=self.device)
        node_probs = [probs] if probs is not None else []
        if log_floor is not None:
            node_score = node_score.masked_fill(node_score < log_floor, float("-inf"))
        n_max = topk + (self.depth - 1) * topk * topk
        ancestors = torch.zeros(n_max, n_max, dtype=torch.bool, device=self.device)
        ancestors[:topk, :topk] = torch.eye(topk, dtype=torch.bool, device=self.device)
        frontier, frontier_hidden = torch.arange(topk, device=self.device), out[0, -1:].expand(topk, -1)
        expanded = torch.empty(0, dtype=torch.long, device=self.device)
        tree_k = tree_v = None
        for depth in range(2, self.depth + 1):
            if log_floor is not None and not torch.isfinite(node_score[frontier]).any():
                break  # nothing confident enough to expand: stop early, saving head forwards
            expanded = torch.cat([expanded, frontier])
            tokens = self.head.draft_to_target(node_ids[frontier])
            out, k, v = self._head_step(frontier_hidden[None], tokens, n - 1 + node_depth[frontier],
                                        tree_k, tree_v, ancestors[frontier][:, expanded])
            tree_k = k if tree_k is None else torch.cat([tree_k, k], 2)
            tree_v = v if tree_v is None else torch.cat([tree_v, v], 2)
            ids, logp, probs = self._children(out[0], topk)
            score = node_score[frontier][:, None] + logp  # [f, topk] cumulative log-prob
            if log_floor is not None:
                score = score.masked_fill(score < log_floor, float("-inf"))
            first = node_ids.shape[0]
            new = torch.arange(first, first + score.numel(), device=self.device)
            parents = frontier.repeat_interleave(topk)
            node_ids = torch.cat([node_ids, ids.flatten()])
            node_score = torch.cat([node_score, score.flatten()])
            node_parent = torch.cat([node_parent, parents])
            node_depth = torch.cat([node_depth, torch.full_like(new, depth)])
            if probs is not None:
                node_probs.append(probs)
            ancestors[new] = ancestors[parents]
            ancestors[new, new] = True
            best = score.flatten().topk(min(topk, score.numel())).indices
            frontier, frontier_hidden = new[best], out[0][best // topk]

        # Keep the `budget` most likely nodes; a child never outranks its parent (log q <= 0, stable sort).
        order = torch.sort(node_score, descending=True, stable=True).indices[:self.budget]
        keep = order[torch.isfinite(node_score[order])].sort().values
        if keep.numel() == 0:
            return None
        row = torch.zeros(node_ids.shape[0], dtype=torch.long, device=self.device)
        row[keep] = torch.arange(1, keep.numel() + 1, device=self.device)
        parent = node_parent[keep]
        return DraftTree(
            tokens=self.head.draft_to_target(node_ids[keep]),
            depth=node_depth[keep],
            parent_row=torch.where(parent < 0, 0, row[parent.clamp_min(0)]),
            ancestors=ancestors[keep][:, keep],
            proposals=torch.cat(node_probs)[keep] if node_probs else None,
        )

    # ---- verification -------------------------------------------------------------------------------
    def _accept_greedy(self, logits: torch.Tensor, tree: DraftTree):
        """Rows on the accepted path and the target's next token, by comparing with the target argmax."""
        best = logits.argmax(-1)
        correct = tree.tokens == best[tree.parent_row]
        on_path = ~(tree.ancestors & ~correct[None, :]).any(-1)  # every ancestor-or-self matches
        has_child = torch.zeros(tree.size + 1, dtype=torch.bool, device=self.device)
        has_child[tree.parent_row] = True
        flat = torch.cat([on_path.long(), best, has_child.long()]).tolist()  # one sync per step
        b = tree.size
        rows = [i + 1 for i in range(b) if flat[i]]
        bonus = flat[b + (rows[-1] if rows else 0)]
        path_has_child = [flat[b + b + 1 + r] for r in [0] + rows]
        return rows, bonus, path_has_child

    def _accept_sampled(self, logits: torch.Tensor, tree: DraftTree):
        """Recursive rejection sampling from the root down (siblings tried in rank order)."""
        c = self.cfg
        p = sampling.warp_probs(logits, c.temperature, c.top_k, c.top_p).cpu()
        tokens, parent_row = tree.tokens.tolist(), tree.parent_row.tolist()
        proposals = None
        if tree.proposals is not None:  # draft-vocab probabilities placed on target ids
            proposals = torch.zeros(tree.size, p.shape[1])
            proposals[:, self.head.draft_target_ids().cpu()] = tree.proposals.float().cpu()
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parent_row):
            children.setdefault(parent, []).append(i + 1)
        rows, path_has_child, node = [], [], 0
        while True:
            kids = children.get(node, [])
            path_has_child.append(bool(kids))
            props = [proposals[r - 1] if proposals is not None else None for r in kids]
            picked, token = sampling.verify_node(p[node], [tokens[r - 1] for r in kids], props, self.cpu_generator)
            if picked < 0:
                return rows, token, path_has_child
            node = kids[picked]
            rows.append(node)

    # ---- generation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor) -> GenerationStats:
        out = _Output(self.tokenizer, self.cfg, self.eos_ids, time.perf_counter())
        stats = out.stats
        stats.accepted_per_position = [0] * self.depth
        stats.reached_per_position = [0] * self.depth
        ids, token, pending_aux = self._prefill(self.runner, input_ids, out)
        seq = torch.cat([ids[0], token])
        c = self.head.config
        self.head_k = torch.empty(1, c.num_key_value_heads, 0, c.head_dim, dtype=self.head_dtype, device=self.device)
        self.head_v = self.head_k.clone()
        if out.add(token.tolist()):
            return out.result()
        while True:
            n = seq.shape[0] - 1
            with _Clock(self.device) as clock:
                tree = self._draft(seq, pending_aux)
            stats.time_draft_s += clock.elapsed
            with _Clock(self.device) as clock:
                if tree is None:  # the head is not confident: a plain target step
                    verify_ids, positions, allowed = seq[n:], torch.tensor([n], device=self.device), None
                else:
                    verify_ids = torch.cat([seq[n:], tree.tokens])
                    positions = torch.cat([torch.zeros(1, dtype=torch.long, device=self.device), tree.depth]) + n
                    allowed = torch.zeros(tree.size + 1, tree.size + 1, dtype=torch.bool, device=self.device)
                    allowed[:, 0] = True
                    allowed[1:, 1:] = tree.ancestors
                logits, aux = self.runner.forward(verify_ids[None], positions[None], allowed)
            stats.time_target_s += clock.elapsed
            stats.target_forwards += 1
            if tree is None:
                rows, bonus = [], int(self.pick(logits).item())
            else:
                stats.drafts += 1
                stats.draft_tokens += tree.size
                accept = self._accept_sampled if self.sampling else self._accept_greedy
                rows, bonus, path_has_child = accept(logits, tree)
                stats.accepted_tokens += len(rows)
                for d in range(len(rows)):
                    stats.accepted_per_position[d] += 1
                for d, reached in enumerate(path_has_child[:self.depth]):
                    stats.reached_per_position[d] += int(reached)
            kept = torch.tensor([0] + rows, device=self.device)
            self.runner.keep(n, kept)
            pending_aux = aux[:, kept]
            new_tokens = ([] if tree is None else tree.tokens[kept[1:] - 1].tolist()) + [bonus]
            seq = torch.cat([seq, torch.tensor(new_tokens, device=self.device)])
            if out.add(new_tokens):
                return out.result()


# ---- auto-tune --------------------------------------------------------------------------------------
# A GPU verifies dozens of tokens for the price of one, so wide trees pay there. On a CPU every verified
# row costs (a 4-token verify of SmolLM2 ~1.0-1.2 plain steps with data/linear_kernels.py, ~1.7 without),
# so only short chains and small trees are worth timing.
GPU_SHAPES = (
    {"mode": "chain", "num_speculative_tokens": 2},
    {"mode": "chain", "num_speculative_tokens": 3},
    {"mode": "chain", "num_speculative_tokens": 5},
    {"mode": "tree", "depth": 3, "topk": 2, "budget": 6},
    {"mode": "tree", "depth": 4, "topk": 4, "budget": 8},
    {"mode": "tree", "depth": 5, "topk": 4, "budget": 16},
    {"mode": "tree", "depth": 6, "topk": 8, "budget": 32},
)
CPU_SHAPES = (
    {"mode": "chain", "num_speculative_tokens": 2},
    {"mode": "chain", "num_speculative_tokens": 3},
    {"mode": "chain", "num_speculative_tokens": 4},
    {"mode": "tree", "depth": 3, "topk": 2, "budget": 3},
    {"mode": "tree", "depth": 4, "topk": 2, "budget": 4},
    {"mode": "tree", "depth": 4, "topk": 4, "budget": 6},
)


# Tokens generated by a warm-up run: enough to reach every kernel and cache path of the shape.
WARMUP_TOKENS = 16


def default_shapes(device: torch.device) -> tuple[dict, ...]:
    return CPU_SHAPES if device.type == "cpu" else GPU_SHAPES


def _as_input_ids(prompt, tokenizer, device) -> torch.Tensor:
    if isinstance(prompt, torch.Tensor):
        return prompt.to(device)
    return tokenizer(prompt, return_tensors="pt").input_ids.to(device)


def autotune(target, head, tokenizer, prompts, base_cfg: DecoderConfig, shapes=None,
             max_new_tokens: int | None = 64, repeats: int = 1) -> tuple[DecoderConfig, list[dict]]:
    """Measure tokens/s of each draft shape on a few prompts and return the fastest config and the table.

    The best tree depends on the hardware (a CPU pays for every verified token, a GPU hardly does), so
    the choice is measured, not assumed. Each shape runs once unmeasured first (warm-up). The plain
    decoder is measured too, as the table's reference row.
    """
    from tqdm.auto import tqdm

    device = next(target.parameters()).device
    shapes = default_shapes(device) if shapes is None else shapes
    ids = [_as_input_ids(p, tokenizer, device) for p in prompts]
    if not ids:
        raise ValueError("autotune needs at least one prompt")
    limit = {"max_new_tokens": max_new_tokens} if max_new_tokens else {}
    plain_cfg = dataclasses.replace(base_cfg, **limit)

    def measure(make, cfg: DecoderConfig) -> dict:
        make(dataclasses.replace(cfg, max_new_tokens=WARMUP_TOKENS)).generate(ids[0])  # warm-up, short
        decoder = make(cfg)
        runs = [decoder.generate(x) for _ in range(repeats) for x in ids]
        tokens, seconds = sum(len(r.tokens) for r in runs), sum(r.total_s for r in runs)
        forwards = sum(r.target_forwards - 1 for r in runs)
        return {"tokens_per_s": tokens / seconds if seconds else 0.0, "tokens": tokens, "seconds": seconds,
                "tokens_per_step": (tokens - len(runs)) / forwards if forwards else 1.0}

    table = [{"shape": {"mode": "plain"}, **measure(lambda c: PlainDecoder(target, tokenizer, c), plain_cfg)}]
    for shape in tqdm(shapes, desc="autotune", leave=False):
        cfg = dataclasses.replace(base_cfg, **limit, **shape)
        table.append({"shape": dict(shape), **measure(lambda c: SpeculativeDecoder(target, head, tokenizer, c), cfg)})
    best = max(table[1:], key=lambda row: row["tokens_per_s"])
    for row in table:
        row["speedup"] = row["tokens_per_s"] / table[0]["tokens_per_s"] if table[0]["tokens_per_s"] else None
        row["chosen"] = row is best
    return dataclasses.replace(base_cfg, **best["shape"]), table
