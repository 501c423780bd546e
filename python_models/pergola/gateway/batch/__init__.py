"""OpenAI's Batch API on the gateway: files and jobs of /v1/embeddings and /v1/rerank lines.

    api.py       the routes (/v1/files, /v1/batches), as the openai SDK speaks them
    store.py     files and jobs in SQLite, contents under --batch-data (durable across restarts)
    runner.py    each process drives the jobs it can lock: validate, run in waves, resume, cancel
    coalesce.py  a wave's lines through their routes' handlers, packed into large calls (bulk lane)
    lines.py     input lines checked; output and error records as OpenAI writes them
"""

from pergola.gateway.batch.api import BatchAPI

__all__ = ["BatchAPI"]
