"""What every model family answers (see core/families/__init__.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pooling_pipeline.core.engine.columns import RowRule
    from pooling_pipeline.core.shared.config import EngineConfig, ModelSpec, PayloadSpec


class ModelFamily:
    name: str = ""
    # What its requests may be: "text" (texts, pairs, conversations, token ids), "image", "audio".
    modalities: frozenset[str] = frozenset({"text"})
    # A render worker loads the model's tokenizer.json as it is (ST's StaticEmbedding), not the
    # tokenizer transformers configures from the folder.
    tokenizer_from_json: bool = False
    # A model that takes images or audio: what opens and processes each such modality's inputs in a
    # render worker, "module:Class" under pooling_pipeline.workers (named, not imported: the workers
    # sit above the families). The class is built with (spec, draft=, max_pixels=) -- the caller's
    # image options, which a renderer of another modality ignores -- and `render(media)` gives
    # (its token count -- placeholder ids -- or its token ids, payloads) for a messages.MediaData.
    media_renderers: dict[str, str] = {}
    # ... and what reads the caller's inputs of those modalities in the frontend, "module:function"
    # under pooling_pipeline (above the families too): fn(prompt, index, spec) gives a
    # messages.MediaData, or None for a prompt that is not one (a text).
    media_input: str | None = None
    # A family whose texts its own processor renders (a page retriever's queries), "module:Class"
    # under pooling_pipeline.workers, built as a media renderer is; `render(text)` gives the ids. None: the
    # render worker's tokenizer renders texts, with their options.
    text_renderer: str | None = None
    # ... and what reads the caller's inputs of several parts in the frontend -- a text and an image
    # in one input, chat messages with images -- "module:function" under pooling_pipeline:
    # fn(prompt, index, spec) gives a list of messages.ChatTurn, or None for a prompt that is not
    # one (read as a text or media input). Its render worker's text renderer renders them
    # (`render_messages`). None: such inputs are not this family's.
    message_input: str | None = None
    # ... and what reads a cross-encoder's (query, document) pair whose sides may be images, the
    # same way: fn(query, document, index, spec) gives the pair's ChatTurns. None: a pair is two texts.
    pair_input: str | None = None
    # The call's prompt goes with every input, images included (a VLM embedder's system message),
    # not with texts only.
    prompt_on_every_input: bool = False

    def worker_imports(self) -> tuple[str, ...]:
        """What its media renderers import, kept importable in a render worker (which hides torch,
        PIL and others while it loads transformers: workers/render.py)."""
        return ()

    def takes(self, modality: str) -> bool:
        return modality in self.modalities

    # How many of its longest inputs one step's default token budget holds at least (the engine's
    # budget is max(its device's, this x longest_input)): 1 where a step of one long input already
    # keeps the device busy (a text model's budget holds many texts).
    longest_inputs_per_step: int = 1

    def longest_input(self, spec: ModelSpec) -> int:
        """The most tokens one request puts through a transformer: what a step's token budget must hold."""
        return spec.max_model_len

    def backend(self, backend: str, quantize: str | None, device: str, dtype: str) -> str:
        """The backend the engine cores are asked for, checked in the caller before any process
        starts: what cannot be honoured is a ValueError, never a silent change in the engine."""
        raise NotImplementedError

    def engine_environment(self, backend: str, device: str, spec: ModelSpec, environ: dict) -> dict[str, str]:
        """Variables the engine core's process starts with (set before torch is imported there)."""
        return {}

    def check_options(self, spec: ModelSpec, image_decode: str) -> None:
        """The caller's options that only some families take, refused where they do not apply."""
        if image_decode != "exact" and not self.takes("image"):
            raise ValueError(f"image_decode={image_decode!r} applies to a model that takes images (CLIP, SigLIP), and "
                             f"model {spec.path!r} takes none")

    def payloads(self, spec: ModelSpec) -> dict[str, PayloadSpec]:
        """The arrays its rows carry beyond their token ids (`messages.Payload`), by name: what the
        render workers make and the engine admits (a payload of another name, dtype, item shape or
        more items a row is refused, naming the request). None for a text model."""
        return {}

    def inflight_payloads(self, spec: ModelSpec) -> dict[str, PayloadSpec]:
        """The payloads a request in flight is counted at, where the caller bounds the requests in
        flight by bytes (pipeline/api.py, MEDIA_INFLIGHT_BYTES): its `payloads`, at their most."""
        return self.payloads(spec)

    def row_rules(self, spec: ModelSpec) -> tuple[RowRule, ...]:
        """The engine's rules for its rows beyond everyone's (core/engine/columns.py, `ROW_RULES`):
        how its modalities' rows and payloads fit together. Asked in the engine core only."""
        return ()

    def runner(self, cfg: EngineConfig, **device_steps: Any):
        """What the engine core runs steps through (a core.engine.step_runner.StepRunner). `device_steps`:
        the tests' switches of the accelerator path (core/engine/main.py's DEVICE_STEPS_ENV)."""
        raise NotImplementedError
