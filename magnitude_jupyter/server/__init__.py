"""HTTP hosts for the engine: the Jupyter server extension and `magnitude serve`."""
