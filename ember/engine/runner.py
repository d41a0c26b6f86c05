"""ModelRunner: turns a scheduled step into one flattened forward pass.

It owns the model and the KV tensors. The scheduler has already reserved blocks
for every row; the runner builds the varlen batch, runs the model once, advances
each row's ``kv_len`` and returns logits for the rows that reached the end of their
history (a prefill chunk that stops short of it produces no logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.engine.request import Request
from ember.kv.blocks import KVStorage
from ember.models.attention import AttentionBatch, RowSpec
from ember.models.llama import LlamaModel


@dataclass
class ScheduledRow:
    request: Request
    num_tokens: int  # tokens of the request's history to run this step
    samples: bool = False  # does the row reach the end of the history (→ next token)?

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"scheduled row of {self.request.request_id} has no tokens")
        self.samples = self.request.kv_len + self.num_tokens == len(self.request.token_ids)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVStorage) -> None:
        self.model = model
        self.kv = kv

    def execute(self, rows: list[ScheduledRow]) -> torch.Tensor:
        """Run one step; return logits (n_sampling_rows, vocab) in row order."""
        specs, tokens, logit_rows, offset = [], [], [], 0
        for row in rows:
            req, start = row.request, row.request.kv_len
            end = start + row.num_tokens
            specs.append(RowSpec(req.block_table.slots(end), start, row.num_tokens))
            tokens.extend(req.token_ids[start:end])
            offset += row.num_tokens
            if row.samples:
                logit_rows.append(offset - 1)
        batch = AttentionBatch.build(specs)
        index = torch.tensor(logit_rows, dtype=torch.long)
        logits = self.model.forward(torch.tensor(tokens, dtype=torch.long), batch, self.kv, index)
        for row in rows:
            row.request.block_table.kv_len += row.num_tokens
        return logits
