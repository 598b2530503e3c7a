"""Render workers: separate processes that turn RenderBatch (raw text, token ids, conversations) into
EngineInputBatch -- tokenized, truncated, in columns -- and send them straight to the engine core."""
