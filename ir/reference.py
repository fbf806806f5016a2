"""`Reference`: a model you can prefill and decode with the interpreter, one step at a time."""

from __future__ import annotations

import torch

from tilertc.ir.build import build_graph
from tilertc.ir.interpreter import Interpreter
from tilertc.ir.weights import WeightSource, load_state_dict
from tilertc.model_specs.spec import ModelSpec


class Reference:
    """The interpreter wrapped as a decoder: `prefill(ids)` then `decode(token)` repeatedly."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: WeightSource,
        max_seq_len: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.spec = spec
        self.graph = build_graph(spec, max_seq_len)
        self.max_seq_len = self.graph.attrs["max_seq_len"]
        self.interp = Interpreter(self.graph, load_state_dict(weights), device, dtype)
        self.position = 0

    def _run(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        end = self.position + ids.numel()
        if end > self.max_seq_len:
            raise ValueError(
                f"context of {end} tokens exceeds the KV capacity of {self.max_seq_len}"
            )
        pos = torch.arange(self.position, end)
        env = self.interp.run(ids, pos)
        self.position = end
        return env

    def prefill(self, input_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Logits [T, vocab] for every position of `input_ids`, appended to the cache."""
        return self._run(torch.as_tensor(input_ids))["logits"]

    def decode(self, token_id: int | torch.Tensor) -> torch.Tensor:
        """Logits [vocab] of the next token after `token_id`."""
        return self._run(torch.as_tensor([int(token_id)]))["logits"][0]
