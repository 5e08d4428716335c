"""Wire formats, host-neutral: what clients send and receive (OpenAI's shapes, errors, /status), as pure
functions over the engine's own types. The HTTP server, the in-process client and the Dask path share them."""
