"""What every process imports: the wire (`messages`, `schema`, `serial`), the option vocabulary
(`options`), the process configs and model facts (`config`, read from a model folder by
`model_folder/`), process plumbing (`runtime`, `staging`), the numpy side of pooling the frontend
shares (`vectors`) and what the caller can tell of the machine without torch (`devices`).
Imports nothing else of the project and never torch (tests/test_layers.py holds both)."""
