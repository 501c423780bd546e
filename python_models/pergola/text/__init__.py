"""Request text: tokenization, rerank and classify request logic, chunking, encodings, request errors."""
