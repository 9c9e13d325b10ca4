"""The wire protocols pagedllm speaks, each a dialect over one shared translation.

`common/` is what every dialect shares: the refusal (`ApiError`), what a request needs to
know of the loaded model (`ServingContext`), the dialect-neutral chat seam (neutral
messages + tools -> prompt ids, tool plan, structured output), token spellings for
logprobs, and the `Call` the HTTP face or the `Runner` drives on the engine.
`openai/` is OpenAI's dialect (chat, completions, Responses, embeddings, tokenize).
Nothing here imports pagedllm.server: the server is only the HTTP face over these.
"""
