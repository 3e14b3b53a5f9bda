"""The data plane: the OpenAI-compatible API in front of the router.

A lean ASGI app (no Django request cycle on the hot path). Per request: the key from an
in-process cache, one Redis admission, the router over in-memory state, the proxied stream,
one Redis settle. PostgreSQL is never touched per request.
"""
