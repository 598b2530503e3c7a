"""The offline job runner (`pipeline-run`): inputs, resumable chunked outputs, fingerprints."""
