"""The OpenAI-compatible HTTP server (`pagedllm serve`): the FastAPI app, auth, CORS, limits,
SSE framing, the threaded engine wrapper, Prometheus metrics and the chat page. The protocol
translation it serves is pagedllm/protocols. Import `pagedllm.server.app` for `create_app` /
`run_server`; this package itself stays light."""
