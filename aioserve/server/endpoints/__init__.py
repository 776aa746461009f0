"""The endpoints: the starlette app, the route table, and every handler,
each reading its body with intake/ and answering through output/.

  app.py            the app: routes, error handlers, CORS, the API-key check, the drain gate
  routes.py         the route table, read by the app and by the OpenAPI document
  completions.py    POST /v1/completions
  chat.py           POST /v1/chat/completions
  responses_api.py  POST /v1/responses: OpenAI's Responses API over the chat machinery
  generate.py       POST /generate: SGLang's native endpoint
  model_routes.py   GET /v1/models and /v1/models/{model}
  token_routes.py   POST /tokenize and /detokenize
  ops_routes.py     /health, /flush_cache, /server_info
  worker_routes.py  SGLang's worker endpoints that routers call
  metrics.py        GET /metrics: the scheduler's gauges and counters beside the request metrics
  page.py           GET /: the chat page, and its static/ files
"""
