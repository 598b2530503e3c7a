"""The engine core and what every process shares, in three packages that only look down:

- `shared/`: what the frontend, the render workers and the engine core all import -- the wire
  (messages, their per-request columns, msgpack framing), the option vocabulary, the process configs
  and the model facts they carry (`config.py`, read from a model folder by `model_folder/`), ZeroMQ
  and process plumbing (`runtime.py`). It imports nothing else of the project and never torch.
- `engine/`: the engine core process itself (`main.py`): admission, the request table, the
  scheduler, the model runners, pooling and the device path. Imports `shared/` only.
- `families/`: what one kind of model is to each process, asked by the API, the render workers
  and the engine (which runner the engine builds, lazily, so that importing a family costs no torch).

Importing `shared/` and `families/` is cheap: torch is only imported by the engine's modules that
run the model, so the frontend and the render workers use the messages without paying for torch.
"""
