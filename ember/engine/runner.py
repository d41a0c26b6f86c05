"""ModelRunner: turns a scheduled step into one flattened forward pass, and only that.

It owns the model and the KV tensors. The scheduler has already reserved blocks for
every row. A row's query tokens are its uncomputed history (a prefill chunk, or the
one newest token of a decoding request) followed by any draft tokens; the runner
writes their K/V, and returns logits for the positions whose next token is wanted —
for a row that reaches the end of its history, the last history token and every
draft token. It changes no request state: the engine commits what was verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ember.engine.request import Request
from ember.kv.blocks import BlockAllocator, KVStorage
from ember.models.decoder import DecoderModel
from ember.models.layers.attention import AttentionBatch, RowSpec
from ember.models.lora import LoRABatch
from ember.spec.speculator import Proposal


@dataclass
class ScheduledRow:
    request: Request
    num_tokens: int  # tokens of the request's history to run this step
    draft: list[int] = field(default_factory=list)  # tokens proposed after the history
    proposal: Proposal | None = None  # where the draft came from (for feedback)
    # the first position it computes: the request's cached length when it was scheduled
    start: int = -1
    samples: bool = False  # does the row reach the end of the history (→ next token)?
    # prompt positions whose logits give prompt logprobs (the next prompt token's)
    prompt_positions: range = range(0)
    # hybrid models: (index of a history token, snapshot slot) to copy the state after
    snapshot: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"scheduled row of {self.request.request_id} has no tokens")
        req = self.request
        if self.start < 0:
            self.start = req.kv_len
        self.samples = self.start + self.num_tokens == len(req.token_ids)
        if req.wants_prompt_logprobs:
            first = max(self.start, len(req.prompt_logprobs) - 1)
            self.prompt_positions = range(first, min(self.start + self.num_tokens,
                                                     req.num_prompt - 1))
        if self.draft and not self.samples:
            raise ValueError(f"row of {self.request.request_id}: a draft needs the whole "
                             "history computed")

    @property
    def num_query(self) -> int:
        """Tokens the row sends through the model: history tokens and drafts."""
        return self.num_tokens + len(self.draft)

    @property
    def num_sampled(self) -> int:
        """Logits rows it samples from: one per draft token plus one, if it samples."""
        return 1 + len(self.draft) if self.samples else 0

    @property
    def num_logits(self) -> int:
        """Logits rows it gets back: its prompt positions', then those it samples from."""
        return len(self.prompt_positions) + self.num_sampled


class ModelRunner:
    def __init__(self, model: DecoderModel, kv: KVStorage) -> None:
        self.model = model
        self.kv = kv

    def zero_new_blocks(self, allocator: BlockAllocator) -> None:
        """Zero the blocks handed out since the last call, before anything reads them:
        never written, or another request's (another tenant's) keys and values."""
        blocks = allocator.take_unzeroed()
        if blocks:
            self.kv.zero_blocks(blocks)

    def execute(self, rows: list[ScheduledRow]) -> torch.Tensor:
        """Run one step; return logits (sum of num_logits, vocab) in row order."""
        specs, tokens, logit_rows, offset = [], [], [], 0
        for row in rows:
            req, start = row.request, row.start
            end = start + row.num_query
            state = -1 if req.state_slot is None else req.state_slot
            specs.append(RowSpec(req.block_table.block_ids(end), start, row.num_query, state,
                                 row.snapshot))
            tokens += req.token_ids[start:start + row.num_tokens] + row.draft
            logit_rows += [offset + p - start for p in row.prompt_positions]
            if row.samples:
                last = offset + row.num_tokens - 1
                logit_rows += range(last, last + 1 + len(row.draft))
            offset += row.num_query
        batch = AttentionBatch.build(specs, self.kv.block_size)
        batch.lora = LoRABatch.of_rows([row.request.lora for row in rows],
                                       [row.num_query for row in rows])
        index = torch.tensor(logit_rows, dtype=torch.long)
        return self.model.forward(torch.tensor(tokens, dtype=torch.long), batch, self.kv, index)


def record_timelines(rows: Sequence[ScheduledRow], began: float, ended: float) -> None:
    """Each row's part of a step, on its request's timeline: a chunk of positions it
    had not computed (prompt, or history after a preemption), or a decode step."""
    for row in rows:
        timeline = row.request.timeline
        if row.num_tokens > 1 or row.start < row.request.num_prompt:
            timeline.chunks.append((began, ended, row.start, row.num_tokens))
        else:
            timeline.decode_steps += 1
