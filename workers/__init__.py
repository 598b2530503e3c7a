"""Render workers: tokenize and truncate RenderParams into PoolingEngineInput, in their own processes."""
