"""The gateway's options, declared once (pergola.options): flags of `pergola gateway`, also
`pergola serve --gateway-*`, each with its PERGOLA_GATEWAY_* / PERGOLA_* environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from pergola.options import option


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
    request_timeout_s: float = option(60.0, "seconds a request may take end to end; Triton is told, so work "
                                            "nobody waits for is dropped")
    max_body_bytes: int = option(32 << 20, "largest request body accepted (413 above it)")
