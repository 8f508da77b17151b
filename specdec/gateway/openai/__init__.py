"""The OpenAI-compatible HTTP front of the gateway (docs/openai.md).

`protocol` turns a request body into the gateway's `GenerateRequest` (with `fields`, the typed
reads, `generation_fields`, `messages` and `tool_fields`, each a part of the body), `responses`
turns the gateway's `GenerateResponse` messages into OpenAI's bodies and stream chunks (tool
calls read by `specdec.gateway.tools`), `errors` gives every failure OpenAI's error shape, and
`app` holds the aiohttp routes that join them on the gateway's own event loop.
"""
