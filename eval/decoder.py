"""Speculative decoding with an EAGLE-3 head: chain and EAGLE-2 dynamic tree, greedy and sampled.

One step of SpeculativeDecoder.decode, top to bottom:
  1. draft: the head first caches the positions accepted by the last step, recomputed from the target's
     features (the training semantics: position t reads fc(aux_t) and embed(token t+1) at RoPE position t
     and predicts token t+2); then it grows a tree from the root (the newest token, not yet through the
     target). A deeper node reads its parent's output hidden and the embedding of the parent's token at
     RoPE position + 1, attending to the cached prefix plus its tree ancestors. The `budget` most likely
     nodes are kept.
  2. verify: one target forward over the root and every kept node, through a tree attention mask.
  3. accept: the longest path the target agrees with (greedy: its argmax; sampled: recursive rejection
     sampling, eval/sampling.py), plus one token of the target's own after it.
  4. commit: the target's cache keeps the accepted path (eval/kv_cache.py), the sequence grows, and the
     stop rules (EOS, stop strings, max new tokens) may end the call.

PlainDecoder runs the target alone through the same TargetRunner (eval/target_runner.py: same cache, dtype and masks), so speed
ratios compare like with like.

A decoder holds only its models, settings and random generators (seeded once, so repeated calls draw fresh
samples); what one call builds (caches, sequence, stats) lives in that call's `Decoding`, so a decoder
object serves any number of calls.

Time accounting stays outside the algorithm: the loops run each phase through a SectionTimer
(eval/timing.py, synchronised on CUDA). time_target_s covers the target forwards (with their mask
construction), time_draft_s the head forwards with the tree growth and pruning around them, time_other_s
the rest (acceptance, cache gather/crop, stop checks): the decoder's own overhead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from eyas.data.config import TargetConfig
from eyas.data.model_config import text_config
from eyas.data.targets import aux_layer_ids_for
from eyas.eval import sampling
from eyas.eval.config import DecoderConfig
from eyas.eval.target_runner import TargetRunner
from eyas.eval.timing import SectionTimer
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


def eos_token_ids(target, tokenizer) -> set[int]:
    """Every end-of-sequence id of the generation config (and the tokenizer's)."""
    ids: set[int] = set()
    for source in (getattr(target, "generation_config", None), target.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids


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


class _Output:
    """One call's generated tokens and stop rules (EOS, stop strings, max new tokens)."""

    def __init__(self, tokenizer, cfg: DecoderConfig, eos_ids: set[int]):
        self.tokenizer, self.cfg, self.eos_ids = tokenizer, cfg, eos_ids
        self.start = time.perf_counter()
        self.stats = GenerationStats()
        # A new stop string ends in the last token, so decoding a short tail is enough to find it.
        self.stop_tail = max((len(s) for s in cfg.stop), default=0) + 8

    def add(self, tokens: list[int]) -> bool:
        """Append tokens until a stop rule fires; returns True when generation is over."""
        now = time.perf_counter() - self.start
        s = self.stats
        for token in tokens:
            s.tokens.append(token)
            s.token_times_s.append(now)
            if token in self.eos_ids:
                return self._stop("eos")
            if self.cfg.stop:
                tail = self.tokenizer.decode(s.tokens[-self.stop_tail:], skip_special_tokens=False)
                if any(stop in tail for stop in self.cfg.stop):
                    return self._stop("stop")
            if len(s.tokens) >= self.cfg.max_new_tokens:
                return self._stop("length")
        return False

    def _stop(self, reason: str) -> bool:
        self.stats.finish_reason = reason
        return True

    def finish(self, timer: SectionTimer, target_forwards: int) -> GenerationStats:
        s = self.stats
        s.text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
        s.ttft_s = s.token_times_s[0] if s.token_times_s else 0.0
        s.total_s = time.perf_counter() - self.start
        s.target_forwards = target_forwards
        s.time_target_s, s.time_draft_s = timer.seconds["target"], timer.seconds["draft"]
        s.time_other_s = max(s.total_s - s.time_target_s - s.time_draft_s, 0.0)
        return s


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

    def _input(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.to(self.device)
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"generate() takes input_ids of shape [1, T], got {tuple(ids.shape)}")
        return ids

    def _prefill(self, runner: TargetRunner, ids: torch.Tensor):
        """The prompt through the target: the first token [1] and the prompt's aux features (or None)."""
        logits, aux = runner.forward(ids, torch.arange(ids.shape[1], device=self.device)[None], last_only=True)
        return self.pick(logits), aux


class PlainDecoder(_Base):
    """The target alone, one token per forward: the baseline the speculative decoder must beat."""

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor) -> GenerationStats:
        out, timer = _Output(self.tokenizer, self.cfg, self.eos_ids), SectionTimer(self.device)
        runner = TargetRunner(self.target)
        token, _ = timer("target", self._prefill, runner, self._input(input_ids))
        while not out.add(token.tolist()):
            token = timer("target", self._step, runner, token)
        return out.finish(timer, runner.forwards)

    def _step(self, runner: TargetRunner, token: torch.Tensor) -> torch.Tensor:
        logits, _ = runner.forward(token[None], torch.tensor([[runner.length]], device=self.device))
        return self.pick(logits)


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


class Acceptance(NamedTuple):
    """What one verify step accepted."""

    rows: list[int]  # verify-input rows of the accepted drafts, root to leaf (row 0 is the root itself)
    bonus: int  # the target's own token after the accepted path
    path_has_child: list[bool]  # along the path from the root: whether each node had draft children


@dataclass
class Decoding:
    """Everything one generate() call builds; the decoder object keeps none of it."""

    target: TargetRunner  # the target's cache: every position before the root
    seq: torch.Tensor  # [root+1] prompt and generated tokens; seq[root], the newest, is not yet verified
    pending_aux: torch.Tensor  # [1,r,3H] target features of positions root-r..root-1, not yet in the head cache
    head_k: torch.Tensor  # [1,kv heads,root-r,head dim] the head's keys of positions 0..root-r-1
    head_v: torch.Tensor
    out: _Output

    @property
    def root(self) -> int:
        return self.seq.shape[0] - 1

    @property
    def stats(self) -> GenerationStats:
        return self.out.stats


class SpeculativeDecoder(_Base):
    def __init__(self, target, head: Eagle3Head, tokenizer, cfg: DecoderConfig):
        super().__init__(target, tokenizer, cfg)
        self.layer_ids = aux_layer_ids_for(target, TargetConfig(aux_layer_ids=list(head.config.aux_layer_ids)))
        if head.config.vocab_size != text_config(target.config).vocab_size:
            raise ValueError(f"the head was trained for a vocabulary of {head.config.vocab_size} tokens, the "
                             f"target has {text_config(target.config).vocab_size}")
        self.head = head.to(self.device).eval().requires_grad_(False)
        self.head_dtype = next(head.parameters()).dtype
        self.embedding = target.get_input_embeddings().weight
        if cfg.mode == "chain":
            self.depth, self.topk, self.budget = cfg.num_speculative_tokens, 1, cfg.num_speculative_tokens
        else:
            self.depth, self.topk, self.budget = cfg.depth, cfg.topk, cfg.budget
        # A chain under sampling proposes draws from q; tree children are the draft's top-k (one-hot proposals).
        self.sample_drafts = self.sampling and cfg.mode == "chain"

    def generate(self, input_ids: torch.Tensor) -> GenerationStats:
        return self.decode(input_ids).stats

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor) -> Decoding:
        """generate(), returning the call's whole state (its caches, for inspection) with the stats."""
        out, timer = _Output(self.tokenizer, self.cfg, self.eos_ids), SectionTimer(self.device)
        ids = self._input(input_ids)
        runner = TargetRunner(self.target, self.layer_ids)
        token, aux = timer("target", self._prefill, runner, ids)
        c = self.head.config
        empty = torch.empty(1, c.num_key_value_heads, 0, c.head_dim, dtype=self.head_dtype, device=self.device)
        d = Decoding(target=runner, seq=torch.cat([ids[0], token]), pending_aux=aux, head_k=empty,
                     head_v=empty.clone(), out=out)
        d.stats.accepted_per_position, d.stats.reached_per_position = [0] * self.depth, [0] * self.depth
        done = out.add(token.tolist())
        while not done:
            tree = timer("draft", self._draft, d)
            logits, aux = timer("target", self._verify, d, tree)
            done = out.add(self._commit(d, tree, logits, aux))
        out.finish(timer, runner.forwards)
        return d

    # ---- 1. draft -----------------------------------------------------------------------------------
    def _draft(self, d: Decoding) -> DraftTree | None:
        """The head caches the newly accepted positions, then grows and prunes the draft tree."""
        return self._grow_tree(d, self._cache_accepted(d))

    def _cache_accepted(self, d: Decoding) -> torch.Tensor:
        """Head k/v of positions m..root-1 from their target features; returns the head output at root-1."""
        m = d.head_k.shape[2]
        hidden = self.head.fuse(d.pending_aux.to(self.head_dtype))
        out, k, v = self._head_step(d, hidden, d.seq[m + 1:d.root + 1], torch.arange(m, d.root, device=self.device))
        d.head_k, d.head_v = torch.cat([d.head_k, k], 2), torch.cat([d.head_v, v], 2)
        return out[0, -1:]

    def _head_step(self, d: Decoding, hidden, token_ids, positions, tree_k=None, tree_v=None, tree_visible=None):
        """One head forward of q new rows over its prefix cache (plus tree k/v): (out hidden, k, v)."""
        h, prefix = self.head, d.head_k.shape[2]
        q, k, v, residual = h.qkv(hidden, embed(self.embedding, token_ids[None]), positions[None])
        keys = [d.head_k, k] if tree_k is None else [d.head_k, tree_k, k]
        values = [d.head_v, v] if tree_v is None else [d.head_v, tree_v, v]
        rows = q.shape[2]
        if tree_visible is None:  # causal over the new rows
            visible = torch.ones(rows, prefix + rows, dtype=torch.bool, device=self.device)
            visible[:, prefix:] = visible[:, prefix:].tril()
        else:
            visible = torch.cat([torch.ones(rows, prefix, dtype=torch.bool, device=self.device), tree_visible], 1)
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

    def _grow_tree(self, d: Decoding, root_hidden: torch.Tensor) -> DraftTree | None:
        """Expand the `topk` best nodes per depth from the root, then keep the `budget` best overall."""
        topk, floor, root = self.topk, self.cfg.min_draft_prob, d.root
        log_floor = torch.log(torch.tensor(floor)) if floor > 0 else None
        # Depth 1: children of the root, from the head output at position root-1.
        ids, logp, probs = self._children(root_hidden, topk)
        node_ids, node_score = ids[0], logp[0]
        node_parent = torch.full((topk,), -1, dtype=torch.long, device=self.device)
        node_depth = torch.ones(topk, dtype=torch.long, device=self.device)
        node_probs = [probs] if probs is not None else []
        if log_floor is not None:
            node_score = node_score.masked_fill(node_score < log_floor, float("-inf"))
        n_max = topk + (self.depth - 1) * topk * topk
        ancestors = torch.zeros(n_max, n_max, dtype=torch.bool, device=self.device)
        ancestors[:topk, :topk] = torch.eye(topk, dtype=torch.bool, device=self.device)
        frontier, frontier_hidden = torch.arange(topk, device=self.device), root_hidden.expand(topk, -1)
        expanded = torch.empty(0, dtype=torch.long, device=self.device)
        tree_k = tree_v = None
        for depth in range(2, self.depth + 1):
            if log_floor is not None and not torch.isfinite(node_score[frontier]).any():
                break  # nothing confident enough to expand: stop early, saving head forwards
            expanded = torch.cat([expanded, frontier])
            tokens = self.head.draft_to_target(node_ids[frontier])
            out, k, v = self._head_step(d, frontier_hidden[None], tokens, root - 1 + node_depth[frontier],
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

    # ---- 2. verify ----------------------------------------------------------------------------------
    def _verify(self, d: Decoding, tree: DraftTree | None):
        """One target forward over the root and the tree: logits [1+B,V] and aux features [1,1+B,3H]."""
        root = d.root
        if tree is None:  # the head is not confident: a plain target step
            return d.target.forward(d.seq[root:][None], torch.tensor([[root]], device=self.device))
        ids = torch.cat([d.seq[root:], tree.tokens])
        positions = torch.cat([torch.zeros(1, dtype=torch.long, device=self.device), tree.depth]) + root
        allowed = torch.zeros(tree.size + 1, tree.size + 1, dtype=torch.bool, device=self.device)
        allowed[:, 0] = True
        allowed[1:, 1:] = tree.ancestors
        return d.target.forward(ids[None], positions[None], allowed)

    # ---- 3. accept ----------------------------------------------------------------------------------
    def _accept_greedy(self, logits: torch.Tensor, tree: DraftTree) -> Acceptance:
        """The path whose every token is the target's argmax after its parent."""
        best = logits.argmax(-1)
        correct = tree.tokens == best[tree.parent_row]
        on_path = ~(tree.ancestors & ~correct[None, :]).any(-1)  # every ancestor-or-self matches
        has_child = torch.zeros(tree.size + 1, dtype=torch.bool, device=self.device)
        has_child[tree.parent_row] = True
        root = torch.ones(1, dtype=torch.bool, device=self.device)
        # One device-to-host copy per step: a [3, 1+B] table, each row indexed by verify row.
        table = torch.stack([torch.cat([root, on_path]).long(), best, has_child.long()])
        row_on_path, row_best, row_has_child = table.tolist()
        rows = [r for r in range(1, len(row_on_path)) if row_on_path[r]]
        return Acceptance(rows, row_best[rows[-1] if rows else 0], [bool(row_has_child[r]) for r in [0] + rows])

    def _accept_sampled(self, logits: torch.Tensor, tree: DraftTree) -> Acceptance:
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
                return Acceptance(rows, token, path_has_child)
            node = kids[picked]
            rows.append(node)

    # ---- 4. commit ----------------------------------------------------------------------------------
    def _commit(self, d: Decoding, tree: DraftTree | None, logits: torch.Tensor, aux: torch.Tensor) -> list[int]:
        """Accept, keep the accepted rows in the target's cache, extend the sequence; returns the new tokens."""
        if tree is None:
            accepted = Acceptance([], int(self.pick(logits).item()), [])
        else:
            accepted = (self._accept_sampled if self.sampling else self._accept_greedy)(logits, tree)
            _count_draft(d.stats, tree, accepted)
        kept = torch.tensor([0] + accepted.rows, device=self.device)
        d.target.keep(d.root, kept)
        d.pending_aux = aux[:, kept]
        new_tokens = ([] if tree is None else tree.tokens[kept[1:] - 1].tolist()) + [accepted.bonus]
        d.seq = torch.cat([d.seq, torch.tensor(new_tokens, device=self.device)])
        return new_tokens


def _count_draft(stats: GenerationStats, tree: DraftTree, accepted: Acceptance) -> None:
    stats.drafts += 1
    stats.draft_tokens += tree.size
    stats.accepted_tokens += len(accepted.rows)
    for depth in range(len(accepted.rows)):
        stats.accepted_per_position[depth] += 1
    for depth, reached in enumerate(accepted.path_has_child[:len(stats.reached_per_position)]):
        stats.reached_per_position[depth] += int(reached)
