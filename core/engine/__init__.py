"""The engine core process (`main.py`): it owns the model, admits a bounded window of requests
(`columns.py`), batches them (`scheduler.py`), runs steps through a runner (`model_runner.py`,
`static_runner.py`, `dual_encoder_runner.py`, the simulated device's `sim_runner.py`) and pools
(`pooling.py`). Imports `core.shared` and itself only (tests/test_layers.py)."""
