"""What a request gets back: its choices' tokens from the scheduler, the
text made into messages (reasoning, tool calls), the response bodies, and
the one response path that sends them whole or as server-sent events.

  generation.py             the bridge to the scheduler: n choices per prompt, their deltas, abort on leave
  assembly.py               the one response path: content processors, SSE or whole, the client leaving
  sliced_json.py            a large whole body's JSON in short serializer calls (built off the loop)
  sse.py                    server-sent events as OpenAI clients read them
  content.py                ContentDelta, and the processor protocol a choice's text goes through
  reasoning.py              <think> into reasoning_content
  thinking.py               whether a chat output begins with a thought; its grammar deferred past it
  tools.py                  tool calling: the plan, the template's messages, each choice's parser
  tool_parsers/             one parser per model's call format (hermes, llama3_json, mistral, pythonic, qwen3_coder)
  logprobs.py               logprobs in OpenAI's two shapes
  prompt_logprobs.py        vLLM's prompt_logprobs field
  completion_bodies.py      the bodies of /v1/completions and /v1/chat/completions
  responses_api_bodies.py   the Responses API's response, output items and usage
  generate_bodies.py        SGLang's /generate bodies
  service_bodies.py         models, tokenizer, cache, server and worker info
"""
