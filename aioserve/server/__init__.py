"""HTTP only: the starlette app, OpenAI protocol models, SSE, errors, metrics."""
