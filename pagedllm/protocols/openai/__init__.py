"""OpenAI's dialect.

models.py      request/response models (chat, completions, chunks, errors, model cards)
translate.py   requests -> engine inputs: checks, sampling parameters, chat messages to the
               neutral chat seam, completion prompts tokenized once
calls.py       `chat_call` / `completion_call` (a `Call` for the HTTP face or the Runner) and
               the whole answers
stream.py      streamed chunks (ChatStreamer, CompletionStreamer) and their SSE lines
logprobs.py    logprobs in both shapes, usage figures
responses.py   the Responses API's translation onto chat (store, items, typed events)
embeddings.py  /v1/embeddings shapes
tokenize.py    vLLM's /tokenize and /detokenize
"""
