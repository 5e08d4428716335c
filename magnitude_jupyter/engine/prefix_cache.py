"""A KV prefix cache that keeps many prompts: a radix tree over tokens, whose leaves own sequences.

Notebooks and agents resend their whole history every turn. When a request ends, its tokens (prompt
and answer) stay in the KV cache as an entry; a later request that starts the same way copies the
longest cached match (`llama_memory_seq_cp`, which only tags cells in a unified cache) and computes
only the rest, as SGLang's RadixAttention does.

The tree is exact about cells. Each node is a span of tokens whose KV cells exist once; each leaf
owns one llama.cpp sequence id that holds every cell from the root to its end, so an inner node's
cells live as long as one leaf below it does. A running request that copied a prefix pins the nodes
on its path (the budget counts those cells once, here), so they are not evicted under it. Eviction
takes the least recently used unpinned leaf and frees its own span; what it shares with its
siblings stays. With a RAM tier the
evicted sequence's state is saved first (`llama_state_seq_get_data`), so a conversation that comes
back is restored instead of recomputed.

Sliding windows: on a model whose windowed layers see each sequence's last `window` tokens only,
llama.cpp reuses a sequence's older cells in those layers when it needs room, from the oldest up
(with `swa_full` too: only the cache's size differs), and a saved state leaves them out.
A request can go on from position p of an entry only if the entry's windowed layers still hold
the window before p. Each leaf knows from where its windowed cells were whole when it was made
(`window_floor`: a leaf built from the tree's cells and a request's has a gap where the request
had already dropped some), and llama.cpp says where they start now (`sequence_start`); a match
whose window is not there is reused only as far as a window checkpoint goes: with a RAM tier, each
request's windowed cells are saved as it finishes its prompt (ram_tier.py), and a match that stops
short of an entry's end (the next turn of a conversation, whose answer came back spelled or trimmed
otherwise) copies the tree's cells up to the longest checkpoint inside it and loads the checkpoint
over their windowed part. What is left is computed (counted in `window_missed_tokens`, shown in
/status). At its very end an entry always has its window.

This module only decides. It speaks to llama.cpp through the KV operations it returns (copy,
clear, save, restore), which the engine hands to the runner in order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ..config.engine import SPILL_AFTER_ROWS
from .kv_ops import (
    ClearSequence,
    CopyCells,
    KVOp,
    RestoreSequence,
    SaveSequence,
    SaveWindow,
    TakeTreeCells,
    TrimSequence,
)
from .ram_tier import RamTier, SavedState, common_prefix_len

RESPELL_WINDOW = 512  # prompt tokens after a match that a cached entry may spell differently

Pins = Sequence[tuple[Sequence[int], int]]  # (prompt tokens, cells copied from the tree) of running requests


@dataclass(eq=False)
class Node:
    tokens: list[int]
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    seq_id: int | None = None  # leaves only: the sequence holding every cell from the root to here
    window_floor: int = 0  # leaves only: its windowed layers' cells were whole from here to its end when made
    plan: int = 0  # PrefixCache.plan when it was made: llama.cpp has its cells from the next plan on
    last_used: int = 0
    used_at_row: int = 0  # PrefixCache.rows when it was last used

    @property
    def is_leaf(self) -> bool:
        return not self.children and self.parent is not None

    def any_leaf(self) -> Node:
        node = self
        while node.children:
            node = next(iter(node.children.values()))
        return node


@dataclass
class Match:
    length: int  # tokens matched
    path: list[Node]  # nodes from the root whose cells the match covers (the last one maybe in part)
    seq_id: int | None  # a sequence holding cells [0, length)
    window: SavedState | None = None  # a window checkpoint to load over its windowed cells after the copy


def _joined_floor(taken: int, upper: int, below: int) -> int:
    """The window floor of cells joined at `taken`: below it a sequence whole from `below`, from it on
    one whole from `upper`. Whole from `below` when both parts are (or nowhere below `taken`, if `upper`
    is above it)."""
    return min(below, taken) if upper <= taken else upper


def _spells(spell: Callable[[int], bytes], token: int, text: bytes | bytearray, at: int) -> bool:
    piece = spell(token)
    return bool(piece) and text.startswith(piece, at)


class PrefixCache:
    """The tree, its sequence ids, and the cells it holds (`cells`, counted once however shared)."""

    def __init__(
        self,
        seq_ids: Sequence[int],
        ram_bytes: int = 0,
        spill_after_rows: int = SPILL_AFTER_ROWS,
        window: int = 0,
        sequence_start: Callable[[int], int] | None = None,
        saved_bytes_per_token: float = 0.0,
    ) -> None:
        """`window`: the tokens a windowed layer keeps per sequence, and `sequence_start` where
        llama.cpp says a sequence's windowed cells start now (see "Sliding windows"); 0: all kept.
        `saved_bytes_per_token`: what the RAM tier holds per token of a saved entry, if known."""
        self.root = Node(tokens=[])
        self.window = window
        self.sequence_start = sequence_start
        self.plan = 0  # the scheduler's plans so far: a leaf made in this one has no cells in llama.cpp yet
        self.free_seq_ids = list(seq_ids)
        self.cells = 0
        self.ram = RamTier(ram_bytes, saved_bytes_per_token) if ram_bytes > 0 else None
        self.spill_after_rows = spill_after_rows  # 0: idle entries stay until their cells are needed
        self.spill_tails = True  # move the idle part of an entry running requests share in part (benchmarks/spill.py)
        self._clock = itertools.count(1)
        self.rows = 0  # rows llama_decode computed since the cache began: the clock of idle entries
        # counters for /status and /metrics
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.restored_tokens = 0
        self.respelled_tokens = 0  # cached tokens reused where the prompt spelled the same text otherwise
        self.spilled_entries = 0  # entries moved to the RAM tier for being idle (SPILL_AFTER_ROWS)
        self.window_missed_tokens = 0  # cached prompt tokens not reused: the window had moved past them (scheduler)
        self.window_checkpoint_tokens = 0  # cached prompt tokens reused through a window checkpoint (scheduler)

    # -- reading --------------------------------------------------------------------------------

    def leaves(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.is_leaf:
                yield node
            stack.extend(node.children.values())

    @property
    def entries(self) -> int:
        return sum(1 for _ in self.leaves())

    def match(self, tokens: Sequence[int], limit: int) -> Match:
        """The longest cached prefix of `tokens`, up to `limit` tokens."""
        node, matched, path = self.root, 0, []
        while matched < limit:
            child = node.children.get(tokens[matched]) if matched < len(tokens) else None
            if child is None:
                break
            n = common_prefix_len(child.tokens, tokens[matched:], limit - matched)
            if n == 0:
                break
            path.append(child)
            matched += n
            if n < len(child.tokens):
                break
            node = child
        seq_id = path[-1].any_leaf().seq_id if path else None
        return Match(matched, path, seq_id)

    def reachable(self, prompts: Iterable[Sequence[int]]) -> Pins:
        """Pins on what each of `prompts` could copy: where its match ends inside a node, every leaf
        below that node whole (its next turn may spell the answers otherwise: `respelled` walks on
        from there); else the match."""
        pins: list[tuple[Sequence[int], int]] = []
        for tokens in prompts:
            match = self.match(tokens, len(tokens))
            if not match.path:
                continue
            last = match.path[-1]
            if self._end(match.path) == match.length and not last.is_leaf:
                pins.append((tokens, match.length))
                continue
            stack = [last]
            while stack:
                node = stack.pop()
                if node.is_leaf:
                    path = self._path_tokens(node)
                    pins.append((path, len(path)))
                stack.extend(node.children.values())
        return pins

    def leaf_span(self, seq_id: int) -> tuple[int, int] | None:
        """The own span of the leaf on `seq_id`, as positions [start, end) of its path: below `start`
        the tree holds its cells without it (None: no leaf has that sequence)."""
        leaf = self._leaf_on(seq_id)
        if leaf is None:
            return None
        end = len(self._path_tokens(leaf))
        return end - len(leaf.tokens), end

    def _leaf_on(self, seq_id: int) -> Node | None:
        return next((leaf for leaf in self.leaves() if leaf.seq_id == seq_id), None)

    def window_start(self, length: int) -> int:
        """The first position whose windowed cells a request going on from `length` needs."""
        return max(0, length - self.window + 1)

    def _floor_now(self, leaf: Node) -> int:
        """From where a leaf's windowed cells are whole now: its floor, or higher where llama.cpp has
        taken its oldest cells since (known once its cells are there, after the plan that made it)."""
        if self.sequence_start is None or leaf.plan == self.plan or leaf.seq_id is None:
            return leaf.window_floor
        return max(leaf.window_floor, self.sequence_start(leaf.seq_id))

    def continuable(self, match: Match, tokens: Sequence[int]) -> Match:
        """`match` (of `tokens`) with a sequence a request can go on from at its end; else as far as
        the longest window checkpoint inside it, with the checkpoint; else no match (see "Sliding
        windows")."""
        if not self.window or not match.path:
            return match
        start = self.window_start(match.length)
        stack = [match.path[-1]]
        while stack:
            node = stack.pop()
            if node.is_leaf and self._floor_now(node) <= start:
                return Match(match.length, match.path, node.seq_id)
            stack.extend(node.children.values())
        found = self.ram.window_for(tokens, 0, match.length) if self.ram is not None else None
        if found is None:
            return Match(0, [], None)
        # Every leaf below the match holds its global layers' cells whole: the checkpoint brings the rest.
        return Match(found.length, match.path, match.seq_id, window=found.data)

    def take_window(self, seq_id: int, tokens: Sequence[int]) -> SaveWindow | None:
        """The operation that keeps a window checkpoint of `seq_id`, which holds the cells of `tokens`
        (a request that has just computed its prompt), where one is of use and none is kept yet."""
        if not self.window or self.ram is None or not tokens:
            return None
        key = tuple(tokens)
        return None if key in self.ram.windows else SaveWindow(seq_id, key)

    def _saved_floor(self, leaf: Node, length: int) -> int:
        """From where a leaf's saved state holds its windowed cells whole: llama.cpp leaves out the cells
        its end's window has passed when it saves a sequence (ggml-org/llama.cpp#25295)."""
        return max(self._floor_now(leaf), self.window_start(length)) if self.window else 0

    def _made_floor(self, taken: int, src_seq: int, below: int) -> int:
        """The window floor of an entry whose cells from `taken` on come from `src_seq` (a request's
        sequence, whole down to where llama.cpp says it starts), and below `taken` from an entry whose
        cells are whole from `below`."""
        if not self.window or self.sequence_start is None:
            return 0
        start = self.sequence_start(src_seq)
        return _joined_floor(taken, start, below)

    def respelled(
        self, tokens: Sequence[int], match: Match, spell: Callable[[int], bytes], window: int = RESPELL_WINDOW
    ) -> tuple[list[int], int] | None:
        """`tokens` with the part after `match` spelled as a cached entry spells the same text, and how
        many tokens of the result the cache holds; None when no entry goes further that way.

        A model's answer is not always made of the tokens its text tokenizes to (a grammar, or
        sampling, can pick `{` then `"` where the tokenizer writes `{"`), so the next turn, which
        sends that answer back as text, stops matching where the spellings part. Bytes decide here:
        the cached tokens are kept for as long as they spell exactly what the prompt says."""
        if not match.path:
            return None
        end = len(tokens) - 1  # the last prompt token is always computed
        ends: dict[int, int] = {}  # bytes of the prompt after the match -> tokens that spell them
        target = bytearray()
        for i in range(match.length, min(end, match.length + window)):
            piece = spell(tokens[i])
            if not piece:
                break
            target += piece
            ends[len(target)] = i + 1
        node = match.path[-1]
        offset = len(node.tokens) - (self._end(match.path) - match.length)
        walked: list[int] = []
        best: tuple[int, int] | None = None  # (cached tokens walked, prompt tokens they stand for)
        spelled = 0
        while spelled < len(target):
            if offset == len(node.tokens):
                child = next((c for c in node.children.values() if _spells(spell, c.tokens[0], target, spelled)), None)
                if child is None:
                    break
                node, offset = child, 0
            piece = spell(node.tokens[offset])
            if not piece or not target.startswith(piece, spelled):
                break
            walked.append(node.tokens[offset])
            spelled += len(piece)
            offset += 1
            if spelled in ends:
                best = (len(walked), ends[spelled])
        if best is None:  # (walked never starts as the prompt does: the match would have gone on)
            return None
        cached, used = best
        return [*tokens[: match.length], *walked[:cached], *tokens[used:]], match.length + cached

    # -- what requests do ---------------------------------------------------------------------------

    def touch(self, match: Match) -> None:
        now = next(self._clock)
        for node in match.path:
            node.last_used, node.used_at_row = now, self.rows
        if match.path:
            leaf = match.path[-1].any_leaf()
            leaf.last_used, leaf.used_at_row = now, self.rows

    def insert(
        self, tokens: Sequence[int], src_seq: int, ops: list[KVOp], pinned: Pins = (), adopt: bool = False
    ) -> bool:
        """Keep `tokens`, whose cells `src_seq` holds, as an entry (before `src_seq` is cleared).

        Only the part the tree lacks is taken from `src_seq`: what it already holds stays as it is,
        so a span of tokens never has its cells twice. The new cells come from the request that
        ends, whose reservation covered them, so inserting never overruns the budget.

        `adopt` (sequence ids shared with the request slots, see "Shared sequence ids"): the entry
        keeps `src_seq` itself, its cells below the match replaced by the tree's; True when it did
        (the caller then neither clears nor frees `src_seq`).
        """
        match = self.match(tokens, len(tokens))
        self.touch(match)
        if match.length == len(tokens):
            return False  # nothing new
        extends_leaf = bool(match.path) and match.path[-1].is_leaf and match.length == self._end(match.path)
        if not adopt and not extends_leaf and not self.free_seq_ids:
            # Free a sequence id first (its entry may fold nodes together), keeping this path.
            if not self._evict_leaf(ops, [*pinned, (tokens, match.length)]):
                return False  # every entry is pinned: nothing is kept this time
            match = self.match(tokens, len(tokens))
        parent = self._split_at(match)
        new = list(tokens[match.length :])
        now = next(self._clock)
        if parent.is_leaf and parent.seq_id is not None:
            # The request continued an entry (the next turn of a conversation): the entry grows.
            parent.window_floor = self._made_floor(match.length, src_seq, self._floor_now(parent))
            if adopt:
                ops.append(TakeTreeCells(src_seq, parent.seq_id, match.length))
                ops.append(ClearSequence(parent.seq_id))
                self.free_seq_ids.append(parent.seq_id)
                parent.seq_id, parent.plan = src_seq, self.plan
            else:
                ops.append(CopyCells(src_seq, parent.seq_id, match.length, len(tokens)))
            parent.tokens += new
            parent.last_used, parent.used_at_row = now, self.rows
            self.cells += len(new)
            return adopt
        holder = parent.any_leaf() if match.length else None
        # Below the match its cells are the holder's, whole from the holder's floor up to its end.
        floor = self._made_floor(match.length, src_seq, self._floor_now(holder) if holder else 0)
        if adopt:
            seq_id = src_seq
            if holder is not None:
                ops.append(TakeTreeCells(src_seq, self._holder(holder), match.length))
        else:
            seq_id = self.free_seq_ids.pop(0)
            if holder is not None:
                ops.append(CopyCells(self._holder(holder), seq_id, 0, match.length))
            ops.append(CopyCells(src_seq, seq_id, match.length, len(tokens)))
        parent.children[new[0]] = Node(
            tokens=new,
            parent=parent,
            seq_id=seq_id,
            last_used=now,
            used_at_row=self.rows,
            window_floor=floor,
            plan=self.plan,
        )
        self.cells += len(new)
        return adopt

    def hand_over(self, seq_id: int, length: int, ops: list[KVOp]) -> int:
        """A request about to go on from the first `length` tokens of the leaf whose sequence is `seq_id`
        takes that sequence (ids shared with the request slots): the leaf leaves the tree, saved to the
        RAM tier first when the request keeps only part of it, and the sequence is cut back to
        `length`. Returns how many of those tokens the tree still holds (the request shares them).
        Cells beyond `length` that running requests share stay theirs (`shared_beyond`)."""
        leaf = self._leaf_on(seq_id)
        assert leaf is not None
        end = len(self._path_tokens(leaf))
        below = end - len(leaf.tokens)  # where the leaf's own span starts
        self._drop(leaf, ops, save=length < end, clear=False)  # a taker of it all keeps it all
        ops.append(TrimSequence(seq_id, length))
        return min(below, length)

    def shared_beyond(self, seq_id: int, keep: int, pinned: Pins) -> list[int]:
        """Per pin, how many of the cells of the leaf on `seq_id` past position `keep` (and past where the
        tree holds its path without it) the pin shares: what stays in use when the leaf leaves."""
        leaf = self._leaf_on(seq_id)
        assert leaf is not None
        path = self._path_tokens(leaf)
        start = max(keep, len(path) - len(leaf.tokens))
        return [max(0, common_prefix_len(tokens, path, shared) - start) for tokens, shared in pinned]

    def least_recent_leaf(self) -> int | None:
        """The sequence of the least recently used entry (None: no entry)."""
        leaves = list(self.leaves())
        return min(leaves, key=lambda leaf: leaf.last_used).seq_id if leaves else None

    def drop_entry(self, seq_id: int, ops: list[KVOp]) -> None:
        """Move the entry on `seq_id` to the RAM tier, freeing its sequence id, whoever shares it."""
        leaf = self._leaf_on(seq_id)
        assert leaf is not None
        self._drop(leaf, ops)

    @staticmethod
    def _end(path: list[Node]) -> int:
        return sum(len(node.tokens) for node in path)

    def restore(
        self, tokens: tuple[int, ...], data: SavedState, ops: list[KVOp], pinned: Pins = (), window_floor: int = 0
    ) -> bool:
        """Bring a saved entry back from the RAM tier as a leaf; False if the tree holds it all already or
        no sequence id can be freed."""
        have = self.match(tokens, len(tokens)).length
        if have >= len(tokens):
            return False
        if not self.free_seq_ids and not self._evict_leaf(ops, [*pinned, (tokens, have)]):
            return False
        match = self.match(tokens, len(tokens))
        parent = self._split_at(match)
        seq_id = self.free_seq_ids.pop(0)
        holder = self._holder(parent) if match.length else None
        ops.append(RestoreSequence(seq_id, data, shared=match.length, shared_from=holder))
        new = list(tokens[match.length :])
        # The saved cells are whole from its floor (_saved_floor); below the match the tree's replace them.
        below = self._floor_now(parent.any_leaf()) if match.length else 0
        floor = _joined_floor(match.length, window_floor, below) if self.window else 0
        if parent.is_leaf:
            # The saved entry continues a leaf the tree has: one sequence holds the whole path now.
            assert parent.seq_id is not None
            ops.append(ClearSequence(parent.seq_id))
            self.free_seq_ids.append(parent.seq_id)
            parent.tokens += new
            parent.seq_id = seq_id
            parent.window_floor, parent.plan = floor, self.plan
            parent.last_used, parent.used_at_row = next(self._clock), self.rows
        else:
            parent.children[new[0]] = Node(
                tokens=new,
                parent=parent,
                seq_id=seq_id,
                last_used=next(self._clock),
                used_at_row=self.rows,
                window_floor=floor,
                plan=self.plan,
            )
        self.cells += len(new)
        self.restored_tokens += len(new)
        return True

    def _holder(self, node: Node) -> int:
        seq_id = node.any_leaf().seq_id
        assert seq_id is not None, "every subtree ends in leaves that own sequences"
        return seq_id

    def _split_at(self, match: Match) -> Node:
        """The node that ends exactly where the match ends, splitting a span if the match stops inside it."""
        if not match.path:
            return self.root
        node = match.path[-1]
        inside = len(node.tokens) - (self._end(match.path) - match.length)
        if inside == len(node.tokens):
            return node
        assert node.parent is not None
        # The upper part becomes an inner node; the leaves below (the same sequences) still hold it.
        top = Node(tokens=node.tokens[:inside], parent=node.parent, last_used=node.last_used)
        node.parent.children[top.tokens[0]] = top
        node.tokens = node.tokens[inside:]
        node.parent = top
        top.children[node.tokens[0]] = node
        return top

    # -- making room ------------------------------------------------------------------------------

    def pinned_nodes(self, pinned: Pins) -> set[int]:
        """Nodes whose cells running requests share: (their prompt, how much of it they copied)."""
        return set(self._shared_ends(pinned))

    def _shared_ends(self, pinned: Pins) -> dict[int, int]:
        """Per node running requests share, how many of its tokens they share at most (keyed by id)."""
        ends: dict[int, int] = {}
        for tokens, shared in pinned:
            match = self.match(tokens, shared)
            for node in match.path[:-1]:
                ends[id(node)] = len(node.tokens)
            if match.path:
                last = match.path[-1]
                inside = len(last.tokens) - (self._end(match.path) - match.length)
                ends[id(last)] = max(ends.get(id(last), 0), inside)
        return ends

    def evictable_cells(self, pinned: Pins = ()) -> int:
        """Cells eviction could give back now: every node no running request shares, and the part
        after what they share of the leaves they share in part."""
        shared = self._shared_ends(pinned)
        return sum(len(node.tokens) - shared.get(id(node), 0) for node in self._nodes())

    def _nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evict(self, cells_needed: int, ops: list[KVOp], pinned: Pins = ()) -> int:
        """Free at least `cells_needed` cells, least recently used unpinned leaves first; returns cells freed."""
        freed = 0
        while freed < cells_needed:
            before = self.cells
            if not self._evict_leaf(ops, pinned) and not self._trim_a_tail(
                self.leaves(), self._shared_ends(pinned), ops
            ):
                break
            freed += before - self.cells
        return freed

    def _trim_a_tail(self, leaves: Iterable[Node], shared: dict[int, int], ops: list[KVOp]) -> Node | None:
        """Trim the least recently used of `leaves` that running requests share only the start of
        (`shared`: from `_shared_ends`) and return it; None if none is."""
        tails = [leaf for leaf in leaves if shared.get(id(leaf), len(leaf.tokens)) < len(leaf.tokens)]
        if not tails:
            return None
        leaf = min(tails, key=lambda leaf: leaf.last_used)
        self._trim(leaf, shared[id(leaf)], ops)
        return leaf

    def spill_idle(self, rows: int, ops: list[KVOp], pinned: Pins | Callable[[], Pins] = ()) -> int:
        """Count `rows` more decoded, then move every entry idle for more than `spill_after_rows` rows
        to the RAM tier: whole, when no running request shares it; its tail, when running requests
        share only the start of it (a prompt asked again shares the prompt, not the old answer after
        it). Without a RAM tier, entries stay until needed, and so does one the RAM tier has no room
        for beside what it keeps (moved out, it or a saved one would be lost). Returns how many moved.
        `pinned` may be a function, called once an entry is idle: most steps find none, and pins
        cost a match each."""
        self.rows += rows
        moved = saving = 0  # entries, and the tokens of their states not in the RAM tier yet
        while self.ram is not None and self.spill_after_rows:
            idle = [leaf for leaf in self.leaves() if self.rows - leaf.used_at_row > self.spill_after_rows]
            sizes = {id(leaf): self._path_length(leaf) for leaf in idle}  # what each one's saved state holds
            idle = [leaf for leaf in idle if self.ram.has_room(sizes[id(leaf)], saving)]
            if not idle:
                break
            if callable(pinned):
                pinned = pinned()
            # Pins anew after each drop: a drop can fold a pinned node into the leaf that remains.
            shared = self._shared_ends(pinned)
            unshared = [leaf for leaf in idle if id(leaf) not in shared]
            if unshared:
                leaf = min(unshared, key=lambda leaf: leaf.last_used)
                saving += sizes[id(leaf)]
                self._drop(leaf, ops)
            elif self.spill_tails and (trimmed := self._trim_a_tail(idle, shared, ops)):
                saving += sizes[id(trimmed)]
            else:
                break
            moved += 1
        self.spilled_entries += moved
        return moved

    def _trim(self, leaf: Node, keep: int, ops: list[KVOp]) -> None:
        """Save a leaf's whole entry to the RAM tier (if there is one), then keep only its first `keep`
        tokens' cells."""
        assert leaf.seq_id is not None and 0 < keep < len(leaf.tokens)
        path = self._path_tokens(leaf)
        if self.ram is not None:
            ops.append(SaveSequence(leaf.seq_id, path, self._saved_floor(leaf, len(path))))
        cut = len(leaf.tokens) - keep
        ops.append(TrimSequence(leaf.seq_id, len(path) - cut))
        del leaf.tokens[keep:]
        self.cells -= cut

    def evict_one(self, pinned: Pins, ops: list[KVOp]) -> bool:
        """Evict the least recently used leaf nothing in `pinned` shares (saved to the RAM tier first),
        freeing its sequence id; False if every leaf is shared."""
        return self._evict_leaf(ops, pinned)

    def _evict_leaf(self, ops: list[KVOp], pinned: Pins) -> bool:
        held = self.pinned_nodes(pinned)
        candidates = [leaf for leaf in self.leaves() if id(leaf) not in held]
        if not candidates:
            return False
        self._drop(min(candidates, key=lambda leaf: leaf.last_used), ops)
        return True

    def _path_length(self, leaf: Node) -> int:
        n, node = 0, leaf
        while node.parent is not None:  # the root has no parent and no tokens
            n += len(node.tokens)
            node = node.parent
        return n

    def _path_tokens(self, leaf: Node) -> tuple[int, ...]:
        parts: list[list[int]] = []
        node: Node | None = leaf
        while node is not None and node is not self.root:
            parts.append(node.tokens)
            node = node.parent
        return tuple(itertools.chain.from_iterable(reversed(parts)))

    def _drop(self, leaf: Node, ops: list[KVOp], save: bool = True, clear: bool = True) -> None:
        """Take a leaf out of the tree (saved to the RAM tier first, unless not `save`); its sequence is
        cleared and its id freed, unless not `clear` (a request takes the sequence: `hand_over`)."""
        assert leaf.seq_id is not None and leaf.parent is not None
        if self.ram is not None and save:
            path = self._path_tokens(leaf)
            ops.append(SaveSequence(leaf.seq_id, path, self._saved_floor(leaf, len(path))))
        if clear:
            ops.append(ClearSequence(leaf.seq_id))
            self.free_seq_ids.append(leaf.seq_id)
        parent = leaf.parent
        del parent.children[leaf.tokens[0]]
        self.cells -= len(leaf.tokens)
        if parent is not self.root and len(parent.children) == 1:
            # An inner node with one child left: fold it into the child (the child's sequence holds it).
            (child,) = parent.children.values()
            grand = parent.parent
            assert grand is not None
            child.tokens = parent.tokens + child.tokens
            child.parent = grand
            grand.children[child.tokens[0]] = child

    def clear(self, ops: list[KVOp], save: bool = True) -> None:
        """Forget every entry (saving each to the RAM tier, unless `save` is False: after a failed
        operation, when llama.cpp's cells may not be what the tree says)."""
        for leaf in list(self.leaves()):
            self._drop(leaf, ops, save)

    def bring_back_one(self, cells_limit: int, ops: list[KVOp]) -> bool:
        """Restore the most recently saved entry that keeps the tree within `cells_limit` cells and
        finds a free sequence id, for an engine with nothing to run: idle cells cost nothing while
        nothing decodes, and the host memory the saved state held goes back. A saved entry the tree
        already holds in full is dropped. False when nothing more comes back."""
        if self.ram is None:
            return False
        for tokens in list(reversed(self.ram.entries)):
            have = self.match(tokens, len(tokens)).length
            if have >= len(tokens):
                self.ram.pop(tokens)
                return True
            if not self.free_seq_ids or self.cells + len(tokens) - have > cells_limit:
                continue
            floor = self.ram.floors[tokens]
            data = self.ram.pop(tokens)
            assert data is not None
            if self.restore(tokens, data, ops, window_floor=floor):
                return True
            self.ram.put(tokens, data, floor)
        return False
