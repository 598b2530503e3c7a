"""Result objects handed to the caller."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class EmbeddingOutput:
    request_id: str  # external id
    index: int  # position in the caller's input
    embedding: np.ndarray  # 1-D float32
    num_prompt_tokens: int  # after truncation, special tokens included
