"""HTTP only: the starlette app, request and response models (OpenAI and
SGLang's /generate), the one response path, SSE, errors, metrics."""
