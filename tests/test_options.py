"""Options declared once: every API method's signature, its async twin's and pipeline-run's flags
come from `pipeline/options.py` (no process group is started here)."""

import inspect

import pytest

from pooling_pipeline import Pipeline
from pooling_pipeline.jobs.launcher import build_parser
from pooling_pipeline.options import CALL_OPTIONS, CallOptions, PipelineOptions, declared, defaults

METHODS = {"embed": "embed", "embed_stream": "embed", "classify": "classify", "encode": "encode",
           "encode_stream": "encode", "score": "score"}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_each_method_and_its_async_twin_show_the_declared_options(name):
    declared_options = declared(CallOptions)
    for method in (getattr(Pipeline, name), getattr(Pipeline, "a" + name)):
        params = inspect.signature(method).parameters
        for option in CALL_OPTIONS[METHODS[name]]:
            assert option in params, (method.__name__, option)
            default = params[option].default
            if option == "use_tqdm":  # streams and async calls show no bar by default
                assert default in (True, False)
            else:
                assert default == declared_options[option].default, (method.__name__, option)
        assert option in (method.__doc__ or "")  # the docstring lists them too


def test_the_constructor_shows_every_pipeline_option_with_its_default():
    params = inspect.signature(Pipeline.__init__).parameters
    for name, default in defaults(PipelineOptions).items():
        assert params[name].default == default, name


def test_an_unknown_keyword_is_a_type_error_naming_it():
    pipe = Pipeline.__new__(Pipeline)  # (never started: binding fails before any work)
    with pytest.raises(TypeError, match="no_such_option"):
        pipe.embed(["a"], no_such_option=1)


def test_pipeline_run_flags_take_the_declared_defaults():
    args = build_parser().parse_args([])
    assert args.long_inputs == defaults(CallOptions)["long_inputs"]
    assert args.max_num_seqs == defaults(PipelineOptions)["max_num_seqs"]


def test_a_per_request_option_is_declared_once():
    """Each per-request option of `core.shared.options.REQUEST_OPTIONS` is a call option with its declared
    description; one with a column is also a RenderOptions field and an engine column, with one
    default (issue 36, item 1)."""
    from pooling_pipeline.core.shared.messages import RenderOptions
    from pooling_pipeline.core.shared.options import REQUEST_OPTIONS
    from pooling_pipeline.core.shared.schema import DEFAULTS, OPTION_COLUMNS

    call_options = declared(CallOptions)
    render_defaults = dict(zip(RenderOptions.__struct_fields__[-len(RenderOptions.__struct_defaults__):],
                               RenderOptions.__struct_defaults__))
    for option in REQUEST_OPTIONS:
        assert call_options[option.name].description == option.doc
        assert call_options[option.name].default is None
        if option.column is not None:
            assert render_defaults[option.name] == DEFAULTS[option.name] == option.column
            assert option.name in OPTION_COLUMNS


@pytest.mark.parametrize("name", ["encode", "encode_stream"])
def test_encode_names_every_task_it_runs(name):
    """`encode(task=...)` takes every task of the vocabulary but a cross-encoder's pairs (score() /
    rank()): its docstring (and the stub's, generated from it) names each one (issue 50, item 8)."""
    from pooling_pipeline.core.shared.options import TASKS

    doc = getattr(Pipeline, name).__doc__
    for task in [t for t in TASKS if t != "score"] + ["plugin"]:
        assert f'"{task}"' in doc, (name, task)
