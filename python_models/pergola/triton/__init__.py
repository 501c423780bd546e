"""The Triton side: the server and its supervisor, admin API, repository builder, adapters' helpers, metrics."""
