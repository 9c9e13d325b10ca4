"""The wire protocols pagedllm speaks, each a dialect over one shared translation.

common/   what every dialect shares:
  errors.py   ApiError, the one refusal (each face renders it in its own error shape)
  context.py  ServingContext: what translation needs of the loaded model and its cache
  chat.py     the dialect-neutral chat seam: tool_plan -> chat_prompt (neutral messages to
              prompt ids, through tokenizer/chat.py's render_chat) -> constrain_to_tools;
              structured_spec; parse_answer / answer_stream_parser (the tool parser)
  call.py     Call: engine items (token ids, never text) + a streamer + the answer builder,
              driven alike by the HTTP face (server/generation.py) and the Runner (api.py)
  tokens.py   TokenText: single tokens' exact bytes, for logprobs
openai/   OpenAI's dialect (see its __init__ for its modules)

A new dialect writes one module that turns its request into neutral messages, tools and
SamplingParams, calls the seam in chat.py, and returns a Call whose streamer frames its own
events. Nothing here imports pagedllm.server: the server is only the HTTP face.
"""
