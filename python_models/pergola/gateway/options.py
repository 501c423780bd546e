"""The gateway's options, declared once (pergola.config.options): flags of `pergola gateway`, also
`pergola serve --gateway-*`, each with its PERGOLA_GATEWAY_* / PERGOLA_* environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from pergola.config.options import option


@dataclass
class GatewayOptions:
    triton: str = option("127.0.0.1:8001", "Triton gRPC address(es) to spread requests over, comma-separated "
                                           "HOST:PORT; a name that resolves to several addresses (a Kubernetes "
                                           "headless Service) counts as one replica per address",
                         metavar="HOST:PORT[,...]")
    gateway_bind: str = option("0.0.0.0", "address the gateway listens on", metavar="ADDRESS")
    gateway_port: int = option(8080, "the gateway's HTTP port (OpenAI, Cohere/Jina and TEI routes); "
                                     "with `pergola serve`, 0 turns the gateway off")
    gateway_workers: int = option(1, "gateway worker processes (each one event loop)")
    api_key: str | None = option(None, "keys the gateway's routes (all but /health) require as "
                                       "`Authorization: Bearer KEY`, comma-separated; they stay in the gateway "
                                       "(`pergola serve` keeps Triton's ports on loopback behind it, and never "
                                       "puts a key on a command line)", metavar="KEY[,...]")
    api_key_file: str | None = option(None, "file of API keys, one per line (added to --api-key)", metavar="FILE")
    triton_admin_token_file: str | None = option(None, "admin token file of the Triton server(s): lets the "
                                                       "gateway list every served model (without it: `embed`, "
                                                       "`rerank` and --models)", metavar="FILE")
    triton_repository: str | None = option(None, "the model repository the Triton server loads, when the gateway "
                                                 "can read it (`pergola serve` sets it): short texts are then "
                                                 "tokenized in the gateway with the served version's files and "
                                                 "sent to NAME_encoder directly, one Triton hop fewer",
                                           metavar="FOLDER")
    gateway_tokenize_chars: int = option(16_384, "an embed, rerank or classify request of at most this many "
                                                 "characters in all is tokenized in the gateway (with "
                                                 "--triton-repository): up to 1,024 on its event loop, above "
                                                 "that on one of its tokenizing threads; a larger one goes "
                                                 "through Triton's tokenizer instances in chunks, spread over "
                                                 "the replicas; 0: always through Triton")
    triton_http_port: str = option("8000", "Triton's HTTP port, where inference goes (binary tensors over "
                                           "HTTP/1.1 keep-alive: less gateway CPU per call than gRPC); one port "
                                           "for every --triton host, or one per --triton entry in the same order; "
                                           "0: inference over gRPC too", metavar="PORT[,...]")
    triton_metrics_port: int = option(8002, "Triton's metrics port on each --triton host: GET /metrics/triton "
                                            "passes its text through, labelled by replica")
    models: str | None = option(None, "served model names to look for when the repository index is closed "
                                      "to the gateway, comma-separated", metavar="NAME[,...]")
    chunk_texts: int = option(32, "a request of more texts is cut into chunks of this many, sent to the "
                                  "replicas concurrently and put back together in order")
    chunk_chars: int = option(65_536, "...and a chunk holds at most this many characters (one text over it is "
                                      "a chunk of its own)")
    chunk_window: int = option(2, "...and at most this many chunks of one request are in flight at once per "
                                  "replica, the next sent as one is answered: a request does not fill the "
                                  "encoder's queue with its chunks, and when one fails (or the client leaves) "
                                  "those not sent never are")
    request_timeout_s: float = option(60.0, "seconds a request may take end to end; Triton is told, so work "
                                            "nobody waits for is dropped. A request larger than --queue-bound-s "
                                            "on its own is bounded by this, and refused with 413 when it would "
                                            "take longer even on an idle server")
    queue_bound_s: float = option(0.0, "a request is refused at once (429 + Retry-After, before any tokenizing) "
                                       "when the work accepted ahead of it for its model, with its own, would "
                                       "take longer than this at the throughput measured from answers "
                                       "(gateway/admission.py); 0: the model's max_queue_seconds (10 s by "
                                       "default), the encoder's own bound")
    max_body_bytes: int = option(32 << 20, "largest request body accepted (413 above it)")
    header_timeout_s: float = option(10.0, "seconds a client has to send a request's headers, counted from its "
                                           "connection's opening or from its next request's first byte; then "
                                           "the connection is closed (an idle or slowloris client holds a file "
                                           "for seconds, not for ever)")
    body_timeout_s: float = option(60.0, "seconds a request's whole body has to arrive once its headers have; "
                                         "then 408 and the connection is closed (one deadline for the body, not "
                                         "one per read, which a byte at a time would renew for ever)")
    keep_alive_timeout_s: float = option(30.0, "seconds an idle keep-alive connection is kept between requests")
    max_connections: int = option(0, "open client connections per gateway process; past it the connection "
                                     "idle longest is closed to make room (one never answered first, then "
                                     "a kept-alive one), and when every one has a request "
                                     "in flight the new one gets 503 + Retry-After; 0: the open-files limit "
                                     "(raised to its hard limit at start) less room for Triton connections "
                                     "and files (an eighth of it, at least 1,024)")
    batch_data: str = option("~/.local/share/pergola/batch", "folder of the Batch API's files (/v1/files uploads, "
                                                             "each job's output and error files); jobs resume "
                                                             "from it after a restart", metavar="DIR")
    batch_database: str | None = option(None, "SQLite database of the Batch API's files and jobs (default: "
                                              "BATCH_DATA/batch.sqlite3)", metavar="FILE")
    batch_max_file_bytes: int = option(200 << 20, "largest file POST /v1/files accepts (413 above it)")
    batch_max_lines: int = option(50_000, "most lines in one batch input file (413 above it)")
    batch_concurrency: int = option(4, "calls a batch job keeps in flight to the replicas; its other lines wait "
                                       "in the job, not in the encoders' queues")
    batch_call_chars: int = option(65_536, "a batch job packs lines of one model and one set of options into "
                                           "calls of about this many characters (within the model's max_texts "
                                           "and max_request_chars): large calls ride the encoders' bulk lane, "
                                           "behind every query")
    gateway_cpu_workers: int = option(2, "worker processes for the gateway's bulk CPU work, off its event loop: "
                                         "parsing bodies of 64 kB or more, rendering answers of 16,384 numbers "
                                         "or more, /tokenize; 0: all of it on the event loop")
    gateway_cpu_queue: int = option(64, "bulk requests that may wait for a CPU worker; one more gets 429 with "
                                        "Retry-After")
    max_tokenize_chars: int = option(1_000_000, "most characters in all of a /tokenize request's texts (413 "
                                                "above it): its answer, a JSON object per token, takes ~14 bytes "
                                                "a character of English text and up to ~64 for text of "
                                                "one-character tokens")
