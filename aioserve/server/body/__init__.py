"""The raw JSON body: parsed and held to the per-request bounds before any
pydantic model sees it, off the event loop when it is large. Standard
library only: worker.py runs as a plain script beside checks.py, and
importing aioserve there would pull in torch.

  checks.py          the per-request bounds (prompts × n, messages, token ids, ...), lone surrogates, decode()
  cost.py            what the response may hold (logprob entries, tokens of text), estimated before any work
  parser_process.py  the worker process a large body goes to, one body at a time
  worker.py          that process: frames in on stdin, answers out on stdout
"""
