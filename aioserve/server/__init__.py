"""HTTP only: the starlette app, the request and response models (OpenAI's
and SGLang's /generate), the one response path, SSE, errors, metrics.

In rooms, each importing only the ones below it (tests/test_server_rooms.py):

  endpoints/          the app, the route table and every handler
  openapi/            the OpenAPI document of the route table, and Swagger UI
  output/             what a request gets back: generation, content processing, response bodies, SSE
  intake/             reading a request: the body into the request models, their ranges and checks
  context.py          what every handler needs: scheduler, tokenizer, served name, the server's state
  request_metrics.py  the latency histograms and counters the HTTP side observes
  errors.py           OpenAI-style error bodies, and the handlers that answer with them
  wire.py             the base of every response model: JSON as clients read it
  body/               the raw JSON body, standard library only (its worker process imports no aioserve)
"""
