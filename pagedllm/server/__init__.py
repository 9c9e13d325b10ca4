"""The OpenAI-compatible HTTP server (`pagedllm serve`): protocol models, the threaded
engine wrapper, Prometheus metrics and the FastAPI app. Import `pagedllm.server.app`
for `create_app` / `run_server`; this package itself stays light."""
