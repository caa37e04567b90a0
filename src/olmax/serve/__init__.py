"""``olmax serve``: an OpenAI-compatible HTTP server over the generation engine.

protocol: the JSON contract (request validation into engine requests, responses, chunks, errors);
no HTTP. worker: the one seam to ``olmax.engine`` (the thread that steps the engine). app: the
Starlette application (routes, API key, streaming, disconnects). server: ``olmax serve`` itself
(loading a checkpoint as ``olmax generate`` does, uvicorn, SIGTERM). Nothing here is imported by
training or evaluation."""
