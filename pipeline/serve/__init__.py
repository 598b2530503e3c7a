"""`pipeline-serve`: the process group behind HTTP, in the request and response shapes of the servers
people already call (OpenAI / vLLM, text-embeddings-inference, Cohere / Jina rerank).

One module per job: `http.py` (the ASGI primitives: a bounded body, a JSON answer, the error bodies),
`admission.py` (the in-flight bound: wait, then 429), `metrics.py` (Prometheus text), `app.py` (routing,
authentication, disconnect-abort, what every request shares), one module per dialect's routes
(`openai_routes.py`, `tei_routes.py`, `rerank_routes.py`), `media.py` (images in a request) and
`cli.py` (the command). Every route reaches the model through the Pipeline's async API, so requests
from many clients share engine steps.
"""
