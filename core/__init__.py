"""Engine core: owns the model, admits a bounded window of requests, batches, runs and pools.

Importing this package is cheap: torch is only imported by the modules that run the model
(`model_runner`, `engine`), so the frontend and the render workers can use the
message definitions without paying for torch.
"""
