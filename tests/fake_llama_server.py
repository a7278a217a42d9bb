"""A stand-in for llama.cpp's `llama-server` in tests (the real one is built only on demand, ~11 min): takes its
command line (records it, one JSON line per start, in $FAKE_LLAMA_SERVER_ARGV), serves GET /health and
POST /completion in llama-server's streamed format (one chunk per token with `content`, `tokens`, `stop`;
a final chunk with `stop: true` and `tokens_predicted`), generating greedily with llama-cpp-python on `-m`
(so its tokens are those of the bench's `llama.cpp` peer on the same file and context). Stops on SIGINT.

    python tests/fake_llama_server.py -m MODEL.gguf --host 127.0.0.1 --port P -c CTX -t T [anything else]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("-tb", "-md", "-td", "-tbd", "-np", "--spec-type"):  # taken whole (not "-t b", "-m d")
        p.add_argument(flag)
    p.add_argument("-kvu", action="store_true")
    p.add_argument("-m")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-c", type=int, default=4096)
    p.add_argument("-t", type=int, default=1)
    args, _ = p.parse_known_args(argv)
    if os.environ.get("FAKE_LLAMA_SERVER_ARGV"):
        with open(os.environ["FAKE_LLAMA_SERVER_ARGV"], "a") as f:
            f.write(json.dumps(argv) + "\n")
    from llama_cpp import Llama

    llm = Llama(
        model_path=args.m, n_ctx=args.c, n_threads=args.t, n_threads_batch=args.t, n_gpu_layers=0, verbose=False
    )

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes

        def _send(self, obj) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/completion" and body["stream"] and body["temperature"] == 0, (self.path, body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            llm.reset()
            n, stop = 0, "limit"
            for tok in llm.generate(
                body["prompt"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True
            ):
                n += 1
                self._send(
                    {"content": llm.detokenize([tok]).decode("utf-8", "replace"), "tokens": [int(tok)], "stop": False}
                )
                if tok == llm.token_eos():
                    stop = "eos"
                    break
                if n >= body["n_predict"]:
                    break
            self._send({"content": "", "tokens": [], "stop": True, "stop_type": stop, "tokens_predicted": n})

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
