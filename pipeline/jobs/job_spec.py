"""`JobSpec`: what a `pipeline-run` job was asked for, built once from the parsed command line and
handed to every part of the job (the launcher, `describe_job`, the local `Job`, `--ray`'s
`run_ray`); and `JobModel`, the job's model folder read once.

The command line's flags are the fields (one per argparse dest, under the same name), so the
parser and the spec cannot drift apart: `from_args` refuses a flag the spec does not name. This
module imports nothing heavy; the launcher and integrations/ray_job.py both read it, and neither
imports the other for it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.model_folder.load import load_model_spec
from pooling_pipeline.core.shared.model_folder.model_path import resolve_model_path

# The flags that set a Pipeline or a call option (argparse dest -> option): each one's default,
# type (choices, a positive int, a switch) and help come from the option's declaration
# (options.py); the launcher's `build_parser` gives only what the command line says differently.
PIPELINE_FLAGS = {"workers": "num_render_workers", "max_num_seqs": "max_num_seqs",
                  "max_num_batched_tokens": "max_num_batched_tokens",
                  "data_parallel_size": "data_parallel_size", "device": "device", "dtype": "dtype",
                  "backend": "backend", "quantize": "quantize",
                  "trust_remote_code": "trust_remote_code", "revision": "revision",
                  "image_decode": "image_decode", "max_image_pixels": "max_image_pixels"}
CALL_FLAGS = {"truncate": "truncate_prompt_tokens", "long_inputs": "long_inputs", "prompt_name": "prompt_name",
              "prompt": "prompt", "route": "route"}  # --errors is the launcher's own: the API always gets errors="return"


@dataclass(frozen=True)
class JobSpec:
    """One job's request, as the flags of the same names give it (see `pipeline-run --help` for
    each one's meaning and default)."""

    # what is read
    input: tuple[str, ...]
    input_format: str
    text_field: str
    pair_field: str | None
    image_field: str | None  # each record's image instead of a text (image_records.py)
    audio_field: str | None  # each record's audio clip instead of a text (image_records.py)
    id_field: str | None  # None: 'id' when the first record has one, else file:line (--ray: 'id')
    keep_fields: tuple[str, ...]
    shard: tuple[int, int]  # (I, N): the records whose index % N == I
    limit: int | None
    # the model and what is computed
    model: str | None
    revision: str | None
    trust_remote_code: bool
    task: str
    prompt_name: str | None
    prompt: str | None
    route: str | None
    truncate: int | None
    long_inputs: str
    errors: str
    # the Pipeline
    workers: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    data_parallel_size: int
    device: str
    dtype: str
    backend: str
    quantize: str | None
    image_decode: str
    max_image_pixels: int
    # what is written
    output: str
    precision: str
    int8_calibration_rows: int
    format: str
    chunk_rows: int
    resume: bool
    # what is said
    quiet: bool
    verbose: bool
    # Ray Data (--ray)
    ray: bool
    ray_address: str
    ray_actors: int | None
    ray_cpus_per_actor: int | None
    ray_batch_size: int
    ray_num_cpus: int | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> JobSpec:
        """The spec of the parsed command line; a flag the spec lacks is a bug (a new flag gets
        its field here)."""
        values = vars(args)
        names = {f.name for f in fields(cls)}
        if set(values) != names:
            raise TypeError(f"the command line and JobSpec disagree: flags without a field {sorted(set(values) - names)}, "
                            f"fields without a flag {sorted(names - set(values))} (this is a bug)")
        return cls(**{**values, "input": tuple(values["input"]), "keep_fields": tuple(values["keep_fields"]),
                      "shard": tuple(values["shard"])})

    def pipeline_options(self) -> dict:
        """The Pipeline's options as the flags set them (for Pipeline(...) and the Ray actors)."""
        return {name: getattr(self, dest) for dest, name in PIPELINE_FLAGS.items()}

    def call_options(self) -> dict:
        """The call's options as the flags set them."""
        return {name: getattr(self, dest) for dest, name in CALL_FLAGS.items()}


@dataclass(frozen=True)
class JobModel:
    """The job's model folder, read once: `describe_job` fingerprints it and checks the flags
    against it, and the local run's Pipeline takes the same spec instead of reading it again."""

    root: Path       # the whole model directory (a hub id resolved, and fetched, once)
    spec: ModelSpec  # what its files say

    @classmethod
    def read(cls, job: JobSpec) -> JobModel:
        root = resolve_model_path(job.model, job.revision)
        return cls(root=root, spec=load_model_spec(root, trust_remote_code=job.trust_remote_code))
