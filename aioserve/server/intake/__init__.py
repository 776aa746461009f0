"""Reading a request: its body into a pydantic request model, every way that
can fail answered as an OpenAI-style 4xx, and the models themselves.

  request_body.py         read (413 over --max-request-bytes, 408 when stalled), check, validate
  upload_guard.py         413 on Content-Length alone, before any handler or the API-key check
  lingering_close.py      an answer sent before its body ended: the rest read and dropped (bounded), then closed
  request_model.py        the base of every request model: nulls, refused fields, ranges, logit_bias keys
  openai_requests.py      /v1/completions, /v1/chat/completions, /tokenize: the models, and SamplingParams
  generate_request.py     SGLang's /generate: its request model, and SGLang's names for a field
  responses_request.py    /v1/responses: its request model, turned into a chat request
  unhonoured_fields.py    fields other servers take and aioserve refuses by name
  structured.py           response_format, structured_outputs, guided_*: one constraint, checked, compiled
  generation_defaults.py  the model's sampling defaults (--generation-config) for unset fields

The ranges of the sampling fields are aioserve/sampling_limits.py's, one
table below the server that SamplingParams reads too.
"""
