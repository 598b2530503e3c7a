"""A checkpoint stored in half precision (bfloat16 / float16) and run in float32 on a CPU: which
one it is, and how far float32's results are from what the checkpoint's own dtype computes (what
sentence-transformers computes there: transformers 5 loads a checkpoint in its own dtype), measured
once at start-up and announced."""

from __future__ import annotations

import logging

import numpy as np
import torch

from pooling_pipeline.core.engine.columns import COL, Requests, probe_batch

log = logging.getLogger("engine")


def half_checkpoint_dtype(config_dtype: object) -> torch.dtype | None:
    """bfloat16 / float16 when config.json says the weights are stored so, else None."""
    name = str(config_dtype).removeprefix("torch.")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)



@torch.inference_mode()
def checkpoint_distance(runner, checkpoint: torch.dtype) -> dict:
    """The model's weights are stored in bfloat16 (float16) and run here in float32, where
    sentence-transformers (transformers 5 loads a checkpoint in its own dtype) computes in
    that dtype: how far the two are, measured once on a probe batch -- the float32 module cast
    to the checkpoint's dtype and back, restoring exactly every tensor that dtype does not hold
    (rotary frequencies and other buffers computed in float32, a weight kept in float32)."""
    rng = np.random.default_rng(0)
    rows, length = 4, min(48, runner.spec.max_model_len)
    batch = probe_batch(rows, length, 0, runner.spec.tasks[0])
    batch.token_ids[:] = rng.integers(min(1000, runner.spec.vocab_size - 1), runner.spec.vocab_size, rows * length)
    batch.cols[:, COL["lengths"]] = length - np.arange(rows) * (length // 8)  # rows of several lengths
    batch = Requests(batch.calls, batch.cols, batch.token_ids[: int(batch.cols[:, COL["lengths"]].sum())])

    def outputs() -> np.ndarray:
        results, _ = runner.run(batch)
        return np.concatenate([np.asarray(r[1] if isinstance(r, tuple) else r, np.float64).ravel()
                               for r in results])

    name = str(checkpoint).removeprefix("torch.")
    tensors = dict(runner.model.named_parameters())
    tensors.update(runner.model.named_buffers())
    kept = {key: t.detach().clone() for key, t in tensors.items()
            if t.is_floating_point() and not torch.equal(t, t.to(checkpoint).to(t.dtype))}
    try:
        exact = outputs()
        runner.model.to(checkpoint)
        try:
            half = outputs()
        finally:
            runner.model.to(torch.float32)
            tensors = dict(runner.model.named_parameters())
            tensors.update(runner.model.named_buffers())
            for key, value in kept.items():
                tensors[key].data.copy_(value)
    except Exception as e:  # (a model whose other parts stay float32, e.g. LogitScore's rows)
        log.warning("could not measure the %s checkpoint's distance to float32: %s", name, e)
        return {"checkpoint_dtype": name}
    if len(exact) != len(half):  # sparse outputs with other active dimensions
        return {"checkpoint_dtype": name}
    return {"checkpoint_dtype": name, "checkpoint_dtype_max_diff": float(np.abs(half - exact).max())}

